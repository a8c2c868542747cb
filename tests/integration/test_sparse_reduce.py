"""The top-k all-reduce (intellect/diloco/topk_reduce.py) over real gloo process groups: spawned
processes on 127.0.0.1, several cases per spawn to keep process start-up off the critical path.

The parent recomputes every rank's contribution (``sparse.compress`` is pure and the inputs are
seeded), so each case is checked against the reference average of the decoded contributions,
bit for bit, on every rank."""

from __future__ import annotations

import datetime
import doctest
import hashlib
import os
import traceback

import pytest
import torch

from intellect.diloco import topk_reduce, transport
from intellect.diloco.allreduce import AllReduceError
from intellect.diloco.coordinator import free_port
from intellect.diloco.sparse import Sparse, TopK, aggregate, compress, densify, encode, wire_nbytes
from intellect.diloco.topk_reduce import ErrorFeedback, topk_all_reduce_mean

from spawned import run_spawned

CFG = TopK(chunk=4096, k=64)
SHAPES = [(3, 4096), (100,), (17, 33)]  # 12,949 values: 4 chunks, the last a short one
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
KEY = b"k" * 32


def pseudo_gradient(rank: int, seed: int) -> list[torch.Tensor]:
    """A direction shared by the members plus this rank's noise, as successive pseudo-gradients."""
    out = []
    for i, shape in enumerate(SHAPES):
        base = torch.randn(shape, generator=torch.Generator().manual_seed(7 + i))
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1000 + 31 * rank + i))
        out.append((0.5 * base + noise) * 1e-2)
    return out


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def digest(ts) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in ts)).hexdigest()


# ------------------------------------------------------------------ hostile senders (in the liar's process)


_ENCODE = topk_reduce.encode


def _lie(how: str) -> None:
    """Make this rank's message hostile: ``topk_reduce.encode`` is what seals its contribution."""
    real = _ENCODE

    def encode(s: Sparse, cfg: TopK) -> bytes:
        idx, val = s.indices.clone(), s.values.clone()
        if how == "range":  # the last chunk holds 661 values: an index past its end
            idx[-1] = (NUMEL - 1) // cfg.chunk * cfg.chunk + cfg.chunk - 1
        elif how == "duplicate":
            idx[1] = idx[0]
        elif how == "nan":
            val[0] = float("nan")
        elif how == "huge":  # well-formed, within max_scale, 1000x an honest member
            val = val * 1000.0
        data = real(Sparse(s.numel, idx, val), cfg)
        return data[:-1] if how == "short" else data

    topk_reduce.encode = encode  # pyright: ignore[reportAttributeAccessIssue]


def _equivocate(victim: int) -> None:
    """Send ``victim`` a different (well-formed, sealed) payload than every other peer."""
    orig = transport.Channel.isend

    def isend(self, t, dst, tag, kind):
        if kind == "payload" and dst == victim:
            t = t.clone()
            t[-1] ^= 0x01  # the last packed index bit: still a valid message, another contribution
        return orig(self, t, dst, tag, kind)

    transport.Channel.isend = isend


# ------------------------------------------------------------------ the spawned ranks


def _rank_main(rank, world, port, cases, out_dir):
    torch.set_num_threads(1)
    res = {}
    try:
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
        group = transport.new_group(store, "topk", rank, world, timeout=20.0, hostname="127.0.0.1")
        for case in cases:
            topk_reduce.encode = _ENCODE  # pyright: ignore[reportAttributeAccessIssue]
            if rank in case.get("liar", ()):
                _lie(case["how"])
            if rank in case.get("equivocate", ()):
                _equivocate(case["victim"])
            cfg = case.get("per_rank", {}).get(rank, CFG)
            fb = ErrorFeedback(NUMEL, cfg)
            outs, stats = [], []
            try:
                for step in range(case.get("steps", 1)):
                    ts = pseudo_gradient(rank, case["seed"] + step)
                    if rank in case.get("nan", ()):
                        ts[1][3] = float("nan")
                    st = topk_all_reduce_mean(ts, group, fb, contribute=rank not in case.get("off", ()),
                                              mac_key=case.get("mac_key"), outlier_clip=case.get("clip", 0.0))
                    fb.commit()
                    outs.append(flat(ts))
                    stats.append(st)
                res[case["name"]] = {"out": outs, "stats": stats, "residual": fb.state_dict()["residual"]}
            except AllReduceError as e:
                res[case["name"]] = {"error": str(e)}
    except BaseException:  # noqa: BLE001 - any crash goes back to the parent, which fails the test
        res["crash"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


def run_ranks(tmp_path, world, cases, deadline=90.0):
    for _ in range(3):  # a port found free may be taken by another test's process before rank 0 binds it
        port = free_port()
        run_spawned(_rank_main, [(r, world, port, cases, str(tmp_path)) for r in range(world)], deadline)
        results = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]
        if not any("EADDRINUSE" in r.get("crash", "") for r in results):
            break
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def contribution(rank: int, seed: int) -> Sparse:
    return compress(torch.zeros(NUMEL), flat(pseudo_gradient(rank, seed)), CFG)[0]


def reference(ranks, seed) -> torch.Tensor:
    """The average of the decoded contributions, as every rank must compute it (same order, same ops)."""
    return aggregate([contribution(r, seed) for r in ranks], NUMEL)[0]


def expected_bytes(world: int, sealed: bool, rank: int, seed: int | None) -> tuple[int, int]:
    """(payload, control) bytes ``rank`` hands the transport: to each peer a header, its payload
    (a contributor, ``seed`` not None: its Rice-coded message, shorter than the bound) and the echo
    of W message digests."""
    seal = transport.SEAL_BYTES if sealed else 0
    payload = 0
    if seed is not None:
        message = encode(contribution(rank, seed), CFG)
        assert message[3] == 2 and len(message) < wire_nbytes(NUMEL, CFG)
        payload = (world - 1) * (seal + len(message))
    return payload, (world - 1) * (2 * seal + topk_reduce.HEADER_BYTES + 16 * world)


# ------------------------------------------------------------------ tests


def test_three_ranks_average_bit_identical_hostile_senders_refused(tmp_path):
    """3 ranks: the mean equals the reference average of the decoded contributions bit for bit on
    every rank, with and without MACs and with a non-contributor; bytes as counted by hand; a
    hostile sender's message (index out of its chunk, duplicate index, NaN scale, truncated) is
    refused on every rank with the reason and the others' average is unchanged; a well-formed
    1000x contribution is clipped; an equivocating sender fails the attempt on every rank."""
    cases = [
        {"name": "plain", "seed": 1, "mac_key": KEY},
        {"name": "unsealed", "seed": 2},
        {"name": "off", "seed": 3, "off": (1,), "mac_key": KEY},
        {"name": "clip-honest", "seed": 4, "clip": 4.0, "mac_key": KEY},  # nobody flagged: the plain mean
        {"name": "nan-pg", "seed": 5, "nan": (0,)},  # a non-finite pseudo-gradient: receive only
        *({"name": how, "seed": 10 + i, "liar": (2,), "how": how, "mac_key": KEY}
          for i, how in enumerate(("range", "duplicate", "nan", "short"))),
        {"name": "huge", "seed": 20, "liar": (2,), "how": "huge", "clip": 4.0, "mac_key": KEY},
        {"name": "equivocate", "seed": 30, "equivocate": (2,), "victim": 0, "mac_key": KEY},
    ]
    res = run_ranks(tmp_path, 3, cases)
    for case in cases[:5]:
        ranks = [r for r in range(3) if r not in case.get("off", ()) + case.get("nan", ())]
        want = reference(ranks, case["seed"])
        for r in range(3):
            got = res[r][case["name"]]
            st = got["stats"][0]
            assert torch.equal(got["out"][0], want), (case["name"], r)
            assert st.contributors == tuple(ranks) and st.refused == {} and st.outliers == {}
            assert (st.payload_bytes, st.control_bytes) == expected_bytes(
                3, "mac_key" in case, r, case["seed"] if r in ranks else None)
        dense = torch.stack([densify(contribution(r, case["seed"])).double() for r in ranks]).mean(0)
        assert torch.allclose(want.double(), dense, rtol=1e-6, atol=1e-12)  # and it is the per-index mean
    assert not res[0]["nan-pg"]["residual"].any()  # nothing staged, nothing committed
    reasons = {"range": "index: out of range", "duplicate": "index: duplicate", "nan": "scale: NaN",
               "short": "index:"}  # a Rice-coded message cut short: its last unary code is missing
    for how, reason in reasons.items():
        want = reference([0, 1], next(c["seed"] for c in cases if c["name"] == how))
        for r in range(3):
            st = res[r][how]["stats"][0]
            assert st.contributors == (0, 1) and st.refused[2].startswith(reason), (how, st.refused)
            assert st.outliers == {2: 1.0}
            assert torch.equal(res[r][how]["out"][0], want), how
    outs = [res[r]["huge"] for r in range(3)]
    assert len({digest(o["out"]) for o in outs}) == 1
    assert all(o["stats"][0].outliers.get(2, 0) > 0.5 for o in outs), [o["stats"][0].outliers for o in outs]
    honest = reference([0, 1], 20)
    assert torch.allclose(outs[0]["out"][0], honest, rtol=1e-6, atol=1e-9)  # the flagged liar is left out
    for r in range(3):
        assert "different bytes" in res[r]["equivocate"].get("error", ""), res[r]["equivocate"]


def test_two_ranks_error_feedback_converges_and_plan_mismatch(tmp_path):
    """2 ranks, 40 committed steps: at every step the average is the reference one bit for bit on
    both ranks, and the sum of the averages converges to the sum of the dense means (what was not
    sent waits in the residuals: sum of dense means = sum of averages + mean residual); a rank with
    another geometry fails the plan digest before anything is averaged."""
    steps = 200
    mismatch = {"name": "mismatch", "seed": 90, "per_rank": {1: TopK(chunk=4096, k=32)}}
    res = run_ranks(tmp_path, 2, [{"name": "ef", "seed": 100, "steps": steps, "mac_key": KEY}, mismatch])
    outs = [res[r]["ef"]["out"] for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    residual = [torch.zeros(NUMEL), torch.zeros(NUMEL)]
    sent, dense, gaps = torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL, dtype=torch.float64), []
    for t in range(steps):
        contribs = []
        for r in range(2):
            s, residual[r] = compress(residual[r], flat(pseudo_gradient(r, 100 + t)), CFG)
            contribs.append(s)
        assert torch.equal(outs[0][t], aggregate(contribs, NUMEL)[0]), t
        sent += outs[0][t].double()
        dense += torch.stack([flat(pseudo_gradient(r, 100 + t)).double() for r in range(2)]).mean(0)
        gaps.append(float((dense - sent).norm() / dense.norm()))
    kept = (res[0]["ef"]["residual"].double() + res[1]["ef"]["residual"].double()) / 2
    assert torch.allclose(dense, sent + kept, rtol=0, atol=1e-5)
    print(f"EF: |sum dense - sum sent| / |sum dense| after 1, 50, {steps} steps: "
          f"{gaps[0]:.3f} {gaps[49]:.3f} {gaps[-1]:.3f}")
    assert gaps[0] > 0.8 and gaps[-1] < 0.5 * gaps[49] and gaps[-1] < 0.2, gaps[::10]
    for r in range(2):
        assert "different plan" in res[r]["mismatch"].get("error", ""), res[r]["mismatch"]


def test_error_feedback_state_round_trip_and_refusals():
    fb = ErrorFeedback(NUMEL, CFG)
    fb.stage(flat(pseudo_gradient(0, 1)))
    assert not fb.residual.any()  # staged, not committed
    fb.commit()
    state = fb.state_dict()
    other = ErrorFeedback(NUMEL, CFG)
    other.load_state_dict(state)
    assert torch.equal(other.residual, fb.residual) and other.residual.any()
    bad = state["residual"].clone()
    bad[0] = float("nan")
    for wrong in (bad, torch.zeros(NUMEL + 1), torch.zeros(NUMEL, dtype=torch.int64)):
        try:
            other.load_state_dict({"residual": wrong})
        except ValueError:
            continue
        raise AssertionError("a bad residual was loaded")
    ahead = fb.state_dict_after(flat(pseudo_gradient(0, 2)))  # what a checkpoint written before the step holds
    fb.stage(flat(pseudo_gradient(0, 2)))
    fb.commit()
    assert torch.equal(ahead["residual"], fb.residual)
    fb.load_state_dict(state)
    nan = flat(pseudo_gradient(0, 3))
    nan[0] = float("nan")
    assert torch.equal(fb.state_dict_after(nan)["residual"], fb.residual)  # no contribution: unchanged
    fb.stage(flat(pseudo_gradient(0, 2)))
    fb.discard()
    fb.commit()  # nothing pending: the residual stays
    assert torch.equal(fb.residual, other.residual)


def test_docstring_examples():
    failed, attempted = doctest.testmod(topk_reduce)
    assert attempted > 0 and failed == 0


@pytest.mark.slow  # four spawned interpreters: 20-45 s on two shared cores under load
def test_four_ranks_bit_identical_and_a_liar_clipped(tmp_path):
    """4 ranks: the reference average bit for bit on every rank with the clip on and nobody flagged;
    a 1000x member is flagged on every rank and left out (the crowd's tighter multiple applies)."""
    cases = [{"name": "clip-honest", "seed": 40, "clip": 4.0, "mac_key": KEY},
             {"name": "huge", "seed": 41, "liar": (3,), "how": "huge", "clip": 4.0, "mac_key": KEY}]
    res = run_ranks(tmp_path, 4, cases)
    want = reference(range(4), 40)
    for r in range(4):
        st = res[r]["clip-honest"]["stats"][0]
        assert torch.equal(res[r]["clip-honest"]["out"][0], want) and st.outliers == {}
        assert (st.payload_bytes, st.control_bytes) == expected_bytes(4, True, r, 40)
    outs = [res[r]["huge"] for r in range(4)]
    assert len({digest(o["out"]) for o in outs}) == 1
    assert all(o["stats"][0].outliers.get(3, 0) > 0.5 and len(o["stats"][0].outliers) == 1 for o in outs)
    assert torch.allclose(outs[0]["out"][0], reference(range(3), 41), rtol=1e-6, atol=1e-9)


def test_one_rank_gets_its_own_decoded_contribution():
    """W=1 (a run down to one member): nothing is sent; the mean is this rank's decoded top-k, and
    the residual keeps the rest."""
    store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        "127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    group = transport.new_group(store, "one", 0, 1, timeout=5.0, hostname="127.0.0.1")
    ts, fb = pseudo_gradient(0, 7), ErrorFeedback(NUMEL, CFG)
    x = flat(ts)
    st = topk_all_reduce_mean(ts, group, fb, mac_key=KEY)
    fb.commit()
    assert torch.equal(flat(ts), densify(contribution(0, 7))) and st.contributors == (0,)
    assert st.bytes_sent == 0 and st.messages == 0
    assert torch.allclose(flat(ts) + fb.residual, x, rtol=0, atol=1e-7)
