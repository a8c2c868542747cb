"""Int8 all-reduce over real gloo process groups (spawned processes on 127.0.0.1).

Each test spawns its ranks once and runs several cases on the same group, to keep
process start-up (~1.5 s of CPU each on a 2-core box) off the critical path.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import os
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from intellect.diloco import transport
from intellect.diloco.allreduce import AllReduceError, all_reduce_mean
from intellect.diloco.plan import chunk_bounds, payload_bytes
from intellect.diloco.quantize import values_nbytes, wire_nbytes

from benchmarks import prime_allreduce  # PRIME's baseline lives with the benchmarks (pythonpath: pyproject)

# (37, 29) and (1000,): several chunks per rank; (5,): chunks of 1-2 values; (0,): no chunk;
# scales spread over 1e-3..1e1, so a shared codebook would fail the error bound.
SHAPES = [(37, 29), (1000,), (5,), (0,), (2, 3, 4)]
SCALES = [1e-3, 1.0, 10.0, 1.0, 0.1]
# Chunks of a few hundred values stay raw under codec="zstd" (coding saves nothing);
# cases with "big": True use these, whose chunks are coded (0.8-0.9x the raw size).
BIG_SHAPES = [(40_000,), (7, 300), (3,)]
BIG_SCALES = [1.0, 1e-2, 1.0]


def case_shapes(case) -> dict:
    return {"shapes": BIG_SHAPES, "scales": BIG_SCALES} if case.get("big") else {}


def inputs(worker: int, seed: int, shapes=SHAPES, scales=SCALES) -> list[torch.Tensor]:
    """Shared signal + worker-specific noise of equal power, per-tensor scale."""
    out = []
    for i, (shape, scale) in enumerate(zip(shapes, scales)):
        sig = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + i))
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + i + 7919 * (worker + 1)))
        out.append((sig + noise) * scale)
    return out


def exact_mean(workers, seed, **kw) -> list[torch.Tensor]:
    per = [inputs(w, seed, **kw) for w in workers]
    return [torch.stack([p[i].double() for p in per]).mean(0) for i in range(len(per[0]))]


def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def rel_err(out, ref) -> float:
    num = sum(float((o.double() - r).pow(2).sum()) for o, r in zip(out, ref))
    return math.sqrt(num / sum(float(r.pow(2).sum()) for r in ref))


def formula_bytes(numels, world, pos, algorithm, compression="int8") -> int:
    """Payload bytes of ring position ``pos``, all contributing, restated independently."""
    total = 0
    size = wire_nbytes if compression == "int8" else values_nbytes
    for n in numels:
        w = [size(e - s) if e > s else 0 for s, e in chunk_bounds(n, world)]
        gather = sum(w) - w[(pos + 1) % world]  # ring all-gather: all but the chunk next owns
        if algorithm == "ring-owner":  # hop s relays s+1 contributions of chunk pos-s-1
            total += sum((s + 1) * w[(pos - s - 1) % world] for s in range(world - 1)) + gather
        elif algorithm == "ring-residual" and compression == "int8":  # one partial sum per hop + int8 residual
            total += 2 * (sum(w) - w[pos]) + gather
        elif algorithm == "direct":  # own chunk to every other rank, own result to every other rank
            total += sum(w) - w[pos] + (world - 1) * w[pos]
        else:  # ring, prime, fp32 residual (nothing missed): each chunk but the own one, once
            total += sum(w) - w[pos] + gather
    return total


# ------------------------------------------------------------------ the spawned ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(worker, local, world, nlocal, port, cases, out_dir, timeout):
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{worker}_{local}.pt")
    res = {}
    try:
        # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, world * nlocal, worker == 0 and local == 0, timeout=datetime.timedelta(seconds=30)
        )
        group = transport.shard_group(store, "test", worker, world, local, timeout=timeout, hostname="127.0.0.1")
        for case in cases:
            ts = inputs(worker, case["seed"], **case_shapes(case))
            if nlocal > 1:  # this rank holds shard `local` of the flattened "model"
                flat = torch.cat([t.reshape(-1) for t in ts])
                s, e = chunk_bounds(flat.numel(), nlocal)[local]
                ts = [flat[s:e].clone()]
            if worker in case.get("liar", ()):  # far from the others: robust aggregation must flag it
                ts = [t * 100.0 for t in ts]
            if worker in case.get("nan", ()):
                ts[-1].view(-1)[3] = float("nan")
            if worker in case.get("die", ()):
                _die_after_sends(case["die_after"], case["how"])
            if worker in case.get("corrupt", ()):
                _corrupt_coded_sends()
            keys = ("algorithm", "relay", "buckets", "window", "codec", "compression", "mac_key", "outlier_clip")
            kw = {k: case[k] for k in keys if k in case}
            kw.update(case.get("per_rank", {}).get(worker, {}))
            order = case.get("order")
            if isinstance(order, dict):
                order = order[local]
            t0 = time.monotonic()
            run = all_reduce_mean
            if kw.get("algorithm") == prime_allreduce.NAME:
                run, _ = prime_allreduce.prime_all_reduce_mean, kw.pop("algorithm")
            try:
                stats = run(ts, group, order=order, contribute=worker not in case.get("off", ()), **kw)
                res[case["name"]] = {"out": ts, "stats": dataclasses.asdict(stats)}
            except AllReduceError as e:
                res[case["name"]] = {"error": str(e), "elapsed": time.monotonic() - t0}
                break  # the group is unusable now
    except BaseException:  # noqa: BLE001 - any crash goes back to the parent, which fails the test
        res["crash"] = traceback.format_exc()
    torch.save(res, path)


def _die_after_sends(n: int, how: str) -> None:
    """Make this rank exit (or go silent) after ``n`` payload sends, mid-all-reduce."""
    orig = transport.Channel.isend
    count = [0]

    def isend(self, t, dst, tag, kind):
        if kind == "payload":
            count[0] += 1
            if count[0] > n:
                if how == "exit":
                    os._exit(17)
                time.sleep(3600)
        return orig(self, t, dst, tag, kind)

    transport.Channel.isend = isend


def _corrupt_coded_sends() -> None:
    """Flip the last byte of every entropy-coded payload message this rank sends."""
    orig = transport.Channel.isend

    def isend(self, t, dst, tag, kind):
        if kind == "payload" and t.numel() > 4 and int(t[3]) == 2:  # wire format version 2: coded
            t = t.clone()
            t[-1] ^= 0x5A
        return orig(self, t, dst, tag, kind)

    transport.Channel.isend = isend


def run_ranks(tmp_path, world, cases, nlocal=1, timeout=20.0, deadline=60.0, killed=()):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = {}
    for w in range(world):
        for m in range(nlocal):
            p = ctx.Process(target=_rank_main, args=(w, m, world, nlocal, port, cases, str(tmp_path), timeout))
            p.start()
            procs[w, m] = p
    end = time.monotonic() + deadline
    for key, p in procs.items():
        p.join(max(0.1, end - time.monotonic()) if key[0] not in killed else 0.1)
    hung = [k for k, p in procs.items() if p.is_alive() and k[0] not in killed]
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {deadline}s"
    results = {}
    for (w, m) in procs:
        path = tmp_path / f"{w}_{m}.pt"
        if path.exists():
            results[w, m] = torch.load(path)
            assert "crash" not in results[w, m], results[w, m]["crash"]
    return results


def check_case(results, case, world, keys=None, bound=0.03):
    """Bit-identical, close to the exact mean over contributors, bytes and peers as planned."""
    keys = keys or [(w, 0) for w in range(world)]
    outs = {k: results[k][case["name"]] for k in keys}
    excluded = set(case.get("nan", ())) | set(case.get("off", ()))
    contributors = [w for w in range(world) if w not in excluded]
    for k, r in outs.items():
        assert "error" not in r, (k, r)
        assert list(r["stats"]["contributors"]) == contributors
    if case.get("algorithm") != "prime":
        assert len({digest(r["out"]) for r in outs.values()}) == 1, "ranks disagree"
    for r in outs.values():
        if contributors:
            err = rel_err(r["out"], exact_mean(contributors, case["seed"], **case_shapes(case)))
            assert err < case.get("bound", bound), (case["name"], err)
            print(f"{case['name']}: rel err {err:.4f}")
        else:
            assert all(not t.any() for t in r["out"])
    order = case.get("order") or list(range(world))
    algo = case.get("algorithm", "direct")
    for (w, _), r in outs.items():
        st, pos = r["stats"], order.index(w)
        # (per_rank: ranks differ in codec, so their bytes differ: values only)
        if not excluded and not {"relay", "buckets", "per_rank", "mac_key"} & set(case):
            numels = [math.prod(s) for s in case_shapes(case).get("shapes", SHAPES)]
            comp = case.get("compression", "int8")
            raw = formula_bytes(numels, world, pos, algo, comp)
            plan_algo = prime_allreduce.PLAN if algo == "prime" else algo
            assert raw == payload_bytes(numels, world, pos, plan_algo, compression=comp)
            if case.get("codec") == "none" or comp == "fp32":  # fp32 values are never coded
                assert st["payload_bytes"] == raw
            elif case.get("big"):  # coded: 0.8-0.9x the raw bytes (N(0,1): ~7 bits per index)
                assert 0.75 * raw < st["payload_bytes"] < 0.95 * raw, (st["payload_bytes"], raw)
            else:  # chunks too small to code: raw
                assert st["payload_bytes"] == raw
            assert st["control_bytes"] == (world - 1) * (world + 1) * 8
        peers = set(st["bytes_by_peer"])
        if algo != "direct":  # ring neighbours only
            assert peers == {order[(pos + 1) % world]}
        else:  # straight to each owner, then owner -> all
            assert peers == set(range(world)) - {w}
    return outs


# ------------------------------------------------------------------ tests

W2_CASES = [
    {"name": "default", "seed": 1},
    {"name": "ring", "seed": 2, "algorithm": "ring"},
    {"name": "off-by-flag", "seed": 3, "off": (1,), "algorithm": "ring-owner"},
    {"name": "none", "seed": 4, "off": (0, 1), "algorithm": "ring-residual"},
]


def test_two_workers_and_plan_mismatch(tmp_path):
    mismatch = {"name": "mismatch", "seed": 5, "per_rank": {1: {"algorithm": "ring"}}}
    res = run_ranks(tmp_path, 2, W2_CASES + [mismatch])
    for case in W2_CASES:
        check_case(res, case, 2, bound=0.06 if case.get("algorithm") == "ring" else 0.03)
    for w in range(2):  # caught by the plan digest before any payload moves
        assert "different plan" in res[w, 0]["mismatch"]["error"]


W3_CASES = [
    {"name": "owner", "seed": 10, "algorithm": "ring-owner"},
    {"name": "ring-order", "seed": 11, "algorithm": "ring", "order": [2, 0, 1]},
    # merged buckets share a codebook across 1e-3..10 scales: error is worse
    {"name": "owner-order", "seed": 12, "algorithm": "ring-owner", "order": [1, 2, 0], "buckets": [[0, 4], [1, 2, 3]],
     "bound": 0.05},
    {"name": "direct-order", "seed": 13, "order": [0, 2, 1], "window": 1, "codec": "none"},
    {"name": "direct-big", "seed": 18, "big": True},
    {"name": "owner-big", "seed": 19, "algorithm": "ring-owner", "big": True},
    {"name": "residual-big", "seed": 9, "algorithm": "ring-residual", "big": True, "order": [2, 1, 0]},
    # ranks may differ in codec: headers carry each message's length and format
    {"name": "mixed-codec", "seed": 8, "algorithm": "ring", "big": True, "per_rank": {1: {"codec": "none"}},
     "bound": 0.06},
    {"name": "residual", "seed": 14, "algorithm": "ring-residual", "nan": (1,)},
    {"name": "nan-ring", "seed": 15, "nan": (0,), "algorithm": "ring", "order": [0, 2, 1]},
    {"name": "off-direct", "seed": 16, "off": (2,)},
    {"name": "prime", "seed": 17, "algorithm": "prime"},
]


def test_three_workers(tmp_path):
    res = run_ranks(tmp_path, 3, W3_CASES)
    for case in W3_CASES:
        check_case(res, case, 3, bound={"ring": 0.06, "prime": 0.08}.get(case.get("algorithm"), 0.03))
    # a rank with a NaN still receives the mean
    assert torch.isfinite(res[1, 0]["residual"]["out"][-1]).all()


FP32 = {"compression": "fp32", "bound": 1e-6}
FP32_CASES = [
    {"name": "fp32-direct", "seed": 50, "off": (0,), **FP32},
    {"name": "fp32-direct-big", "seed": 51, "big": True, **FP32},
    {"name": "fp32-owner", "seed": 52, "algorithm": "ring-owner", "order": [2, 0, 1], "big": True, **FP32},
    {"name": "fp32-residual", "seed": 53, "algorithm": "ring-residual", "big": True, **FP32},
    {"name": "fp32-ring", "seed": 54, "algorithm": "ring", "nan": (1,), "mac_key": b"k" * 32, **FP32},
    {"name": "fp32-ring-big", "seed": 55, "algorithm": "ring", "order": [0, 2, 1], "big": True, **FP32},
]


def test_fp32_wire_is_exact_for_every_algorithm(tmp_path):
    """compression="fp32": for every algorithm (flags, MACs and robust clipping included) the
    mean is the exact one up to fp32 summation order, bit-identical on every rank, for about
    4x int8's bytes; a rank with another compression fails the plan digest before any payload."""
    clip = {"name": "fp32-clip", "seed": 56, "outlier_clip": 4.0, "liar": (2,), "big": True, **FP32}
    mismatch = {"name": "fp32-mismatch", "seed": 57, "per_rank": {1: {"compression": "int8"}}, **FP32}
    res = run_ranks(tmp_path, 3, FP32_CASES + [clip, mismatch])
    for case in FP32_CASES:
        outs = check_case(res, case, 3)
        contributors = [w for w in range(3) if w not in set(case.get("nan", ())) | set(case.get("off", ()))]
        ref = exact_mean(contributors, case["seed"], **case_shapes(case))
        for r in outs.values():  # each tensor on its own scale, not only the whole
            assert all(rel_err([o], [e]) < 1e-6 for o, e in zip(r["out"], ref) if e.numel()), case["name"]
        if case.get("big") and "order" not in case:  # 4x the values' bytes, less int8's 1 KiB codebook a chunk
            numels = [math.prod(s) for s in BIG_SHAPES]
            algo = {"ring-residual": "ring"}.get(case.get("algorithm", "direct"), case.get("algorithm", "direct"))
            ratio = outs[0, 0]["stats"]["payload_bytes"] / payload_bytes(numels, 3, 0, algo)  # fp32: no residual
            print(f"{case['name']}: {ratio:.2f}x int8's raw bytes")
            assert 3.0 < ratio < 4.0, (case["name"], ratio)
    # robust clipping reads fp32 contributions as sent: the liar (100x) is flagged on every
    # owner and left out, so the large tensors get the honest mean exactly
    outs = [res[w, 0]["fp32-clip"] for w in range(3)]
    assert len({digest(r["out"]) for r in outs}) == 1
    assert all(r["stats"]["outliers"].get(2, 0) > 0.5 for r in outs), [r["stats"]["outliers"] for r in outs]
    honest = exact_mean([0, 1], clip["seed"], **case_shapes(clip))
    assert all(rel_err([o], [e]) < 1e-6 for o, e in list(zip(outs[0]["out"], honest))[:2])
    errors = [res[w, 0]["fp32-mismatch"].get("error", "") for w in range(3)]
    assert all(errors) and any("different plan" in e for e in errors), errors


@pytest.mark.slow
def test_four_workers_all_algorithms(tmp_path):
    cases = [
        {"name": "owner", "seed": 20, "algorithm": "ring-owner", "order": [3, 1, 0, 2]},
        {"name": "ring", "seed": 21, "algorithm": "ring", "order": [3, 1, 0, 2]},
        {"name": "relay2", "seed": 22, "algorithm": "ring", "relay": 2, "nan": (2,)},
        {"name": "residual", "seed": 23, "algorithm": "ring-residual", "order": [1, 0, 3, 2], "window": 2},
        {"name": "direct", "seed": 24, "order": [1, 0, 3, 2]},
        {"name": "direct-off", "seed": 25, "off": (0,)},
    ]
    res = run_ranks(tmp_path, 4, cases)
    for case in cases:
        check_case(res, case, 4, bound=0.06 if case.get("algorithm") == "ring" else 0.03)


def test_two_local_ranks_per_worker_reduce_their_own_shard(tmp_path):
    """W=2 workers x M=2 local ranks: 2 independent groups on one TCPStore; shard m
    reduces only with shard m of the other worker, each with its own ring order."""
    cases = [
        {"name": "owner", "seed": 30, "order": {0: [0, 1], 1: [1, 0]}},
        {"name": "ring-nan", "seed": 31, "algorithm": "ring", "nan": (1,)},
        # fp32: sharding changes the layout, not the math: each shard is the unsharded mean's slice
        {"name": "fp32", "seed": 32, "algorithm": "ring-owner", "compression": "fp32"},
    ]
    res = run_ranks(tmp_path, 2, cases, nlocal=2)
    for case in cases:
        contributors = [w for w in range(2) if w not in case.get("nan", ())]
        full = torch.cat([t.reshape(-1) for t in exact_mean(contributors, case["seed"])])
        for m in range(2):
            s, e = chunk_bounds(full.numel(), 2)[m]
            outs = [res[w, m][case["name"]] for w in range(2)]
            assert len({digest(r["out"]) for r in outs}) == 1
            assert rel_err(outs[0]["out"], [full[s:e]]) < (1e-6 if "compression" in case else 0.06)
            assert all(list(r["stats"]["contributors"]) == contributors for r in outs)
            order = case["order"][m] if "order" in case else [0, 1]
            for w in range(2):  # shard m only ever sent to shard m of the other worker
                assert set(outs[w]["stats"]["bytes_by_peer"]) == {order[(order.index(w) + 1) % 2]}


@pytest.mark.parametrize("algorithm", ["direct", "ring-owner"])
def test_corrupt_coded_payload_raises(tmp_path, algorithm):
    """Rank 1 flips a byte in every coded message it sends: its receivers fail the
    checksum and raise AllReduceError (no crash, no hang); the rest follow at once
    when their sockets close; a later case on the same ranks is not attempted."""
    case = {"name": "corrupt", "seed": 41, "corrupt": (1,), "big": True, "algorithm": algorithm}
    res = run_ranks(tmp_path, 3, [case, {"name": "after", "seed": 42}], timeout=30.0, deadline=60.0)
    errors = [res[w, 0]["corrupt"].get("error", "") for w in range(3)]
    assert all(errors), errors
    assert any("checksum mismatch" in e for e in errors), errors
    assert all("after" not in res[w, 0] for w in range(3))


@pytest.mark.parametrize(
    "how, timeout",
    [("exit", 30.0), pytest.param("silent", 3.0, marks=pytest.mark.slow)],
)
def test_dead_peer_raises_within_timeout(tmp_path, how, timeout):
    """Rank 2 exits (or stops responding) mid-all-reduce: ranks 0 and 1 raise
    AllReduceError; a closed socket fails at once (well before the 30 s timeout),
    silence after the 3 s timeout."""
    case = {"name": "die", "seed": 40, "die": (2,), "die_after": 2, "how": how, "window": 1}
    res = run_ranks(tmp_path, 3, [case], timeout=timeout, deadline=60.0, killed=(2,))
    for w in (0, 1):
        r = res[w, 0]["die"]
        assert "error" in r, r
        assert r["elapsed"] < (10.0 if how == "exit" else timeout + 10.0), r
    assert (2, 0) not in res
