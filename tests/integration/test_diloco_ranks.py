"""DiLoCo workers of several ranks (``diloco.ranks_per_worker``) as real processes: FSDP2 inside each
worker over gloo, one ring per local rank across workers, and one fate per worker.

Each worker's first process starts its other ranks (:mod:`intellect.diloco.worker_ranks`); the tests
read the run back from the rendezvous, the workers' logs and run storage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import pytest
import torch
from diloco_faults import FaultPlan, faulty_launcher
from diloco_runs import digests, logs
from diloco_runs import run_cfg as arithmetic_cfg
from test_diloco_text import write_corpus
from transformers import AutoModelForCausalLM

from intellect.checkpoints import SHARDS_STATE, fetch
from intellect.data.arithmetic import Problem
from intellect.config import load_config
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_BANNED, EXIT_DONE, EXIT_FAILED, Coordinator, worker_launcher
from intellect.diloco.report import metrics_series
from intellect.diloco.worker_state import state_kind
from intellect.ledger import Ledger
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.setup import ledger_path, run_storage, seed_checkpoint
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

OUTER = 3


def run_cfg(tmp_path, name: str, ranks: int, lr: float = 1e-2, **over) -> DilocoRunConfig:
    base = {
        "storage.url": f"file://{tmp_path}/runs", "run_name": name,
        "data.kind": '"text"', "data.text.files": f'["{tmp_path}/corpus"]', "data.text.seq_len": 32,
        "data.text.eval_sequences": 8, "data.heldout_percent": 20,
        "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
        "model.intermediate_size": 64, "model.max_position_embeddings": 64,
        "train.batch_size": 4, "train.lr": lr, "train.warmup_steps": 1,
        "compute.device": "cpu", "compute.peak_tflops": 1.0,
        "diloco.workers": 2, "diloco.inner_steps": 3, "diloco.outer_steps": OUTER,
        "diloco.ranks_per_worker": ranks,
        "diloco.heartbeat_interval": 0.3, "diloco.heartbeat_timeout": 2.5,
        "diloco.collective_timeout": 6, "diloco.boundary_timeout": 30,
    }
    base.update(over)
    return load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in base.items()], environ={})


def run(cfg: DilocoRunConfig, log_dir) -> dict[int, str]:
    """Run to the end; the members' common digest of each step (asserted equal across members)."""
    c = Coordinator(cfg, worker_launcher(log_dir))
    try:
        c.start()
        codes = c.watch(timeout=300)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(log_dir.parent)
        out = {}
        for t in range(cfg.diloco.outer_steps):
            d = digests(c, t)
            assert set(d) == {"w0", "w1"} and len(set(d.values())) == 1, f"replicas differ at step {t}: {d}"
            out[t] = next(iter(d.values()))
        return out
    finally:
        c.close()


def test_two_workers_of_two_ranks_take_the_steps_of_two_workers_of_one(tmp_path):
    """Sharding changes the layout, not the math: the same run as 2x2 and as 2x1 (fp32 on the wire,
    so no quantizer sees the layout) publishes the same checkpoints."""
    write_corpus(tmp_path / "corpus")
    # lr 1e-3: float rounding that differs with the layout (FSDP's reduce-scatter, each rank's half batch)
    # grows with the learning rate over the inner steps, past 1e-5 at the configs' 1e-2 on some data
    one = run_cfg(tmp_path, "one", 1, lr=1e-3, **{"diloco.compression": "fp32"})
    two = run_cfg(tmp_path, "two", 2, lr=1e-3, **{"diloco.compression": "fp32"})
    run(one, tmp_path / "logs-one")
    run(two, tmp_path / "logs-two")
    a, b = (RunStorage.from_config(c.storage, c.run_name) for c in (one, two))
    assert b.complete_steps("checkpoints") == list(range(OUTER + 1))
    for n in range(1, OUTER + 1):
        ma, _ = fetch(a, n)
        mb, _ = fetch(b, n)
        for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
            rel = ((p - q).norm() / p.norm()).item()
            assert rel < 1e-5, f"checkpoint {n} {name}: relative difference {rel:.2e}"
    # each worker's two ranks, one device each, two rings: the leader speaks for the worker
    text = (tmp_path / "logs-two" / "w1.log").read_text()
    assert "rank 1 of 2 in the worker" in text and "local rank 3" in text, text[-3000:]
    rows = [json.loads(line) for line in b.read_text(metrics_series("w0")).splitlines()]
    assert [r["step"] for r in rows] == list(range(OUTER)) and all(r["committed"] for r in rows)
    # the worker's figures, not its leader's: every rank's tokens, both rings' bytes
    assert all(r["tokens"] == 3 * 4 * 31 and r["bytes_sent"] > 0 for r in rows)
    # the export loads in transformers as it is and computes what the run's model computes
    folder = b.local_path(b.step_path(OUTER, "checkpoints"))
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours, _ = fetch(b, OUTER)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours.eval()(ids).logits, atol=1e-6)
    # and RL starts from it, as `intellect rl` does with init.from_run: checkpoint 0 is the export, one step trains
    rl = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{tmp_path}/runs"}, "init": {"from_run": "two"},
        "submission": {"prompts_per_submission": 2, "group_size": 4, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1}, "toploc": {"k": 16},
    })
    storage = run_storage(rl)
    with Ledger(ledger_path(rl)) as ledger:
        assert seed_checkpoint(rl, storage, ledger) == b.uri(b.step_path(OUTER, "checkpoints"))
        start, _ = fetch(storage, 0)
        assert all(torch.equal(p, q) for p, q in zip(start.parameters(), ours.parameters()))
        tasks = [Problem(a, "+", c).to_task() for a in range(4) for c in range(3)]
        report = run_rl_step(rl, storage, ledger, 0, ["alice"], tasks, reward_fn=_parity)
    assert report.committed and report.trained and (report.accepted, report.rejected) == (8, 0)
    assert storage.is_stable(1, "checkpoints")


def _parity(completion, task):  # noqa: ARG001 - the reward signature
    # a reward the untrained model hits about half the time, so every group has a signal to train on
    return float(sum(map(ord, completion)) % 2)


def _followers(log_file) -> list[int]:
    found = re.findall(r"started followers \[([0-9, ]+)\]", log_file.read_text())
    return [int(p) for p in found[-1].split(",")] if found else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its parent's wait
        return f.read().split(") ")[-1][:1] != "Z"


@pytest.mark.parametrize("onboarding", ["blocking", "non_blocking"])
def test_a_killed_rank_takes_its_worker_out_and_the_worker_rejoins(tmp_path, onboarding):
    """kill -9 of one local rank mid inner phase: its worker stops at once (deathrattle), the other
    commits alone, the worker restarts, is onboarded rank to rank (blocking: a broadcast at the
    boundary; non-blocking: in the background during a step it sits out), and every digest agrees
    again."""
    # the arithmetic tasks: each worker's own seeded stream, so the test is about the ranks, not the reader
    cfg = arithmetic_cfg(tmp_path, **{"diloco.ranks_per_worker": 2, "diloco.outer_steps": 40,
                                      "diloco.inner_steps": 60, "diloco.checkpoint_every": 100,
                                      "diloco.onboarding": onboarding})
    c = Coordinator(cfg, worker_launcher(tmp_path / "logs"))
    try:
        c.start()
        deadline = time.monotonic() + 120
        while (c.progress() or 0) < 1:
            assert time.monotonic() < deadline and all(h.poll() is None for h in c.handles.values()), logs(tmp_path)
            time.sleep(0.1)
        victim = _followers(tmp_path / "logs" / "w1.log")
        assert len(victim) == 1
        killed_at = c.progress() or 0
        os.kill(victim[0], signal.SIGKILL)
        t0 = time.monotonic()
        while c.handles["w1"].poll() is None:
            assert time.monotonic() - t0 < 20, "the worker outlived its killed rank"
            time.sleep(0.1)
        assert c.handles["w1"].poll() == EXIT_FAILED, logs(tmp_path)
        assert c.store.check(["dead/w1"]), "no deathrattle"
        c.start_worker("w1")  # the worker restarts, with both its ranks
        codes = c.watch(timeout=240)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
        # w0 went on alone while w1 was down; w1 rejoined, onboarded rank to rank, to the end
        storage = RunStorage.from_config(cfg.storage, cfg.run_name)
        rows = {w: {r["step"]: r for r in map(json.loads, storage.read_text(metrics_series(w)).splitlines())}
                for w in ("w0", "w1")}
        alone = [t for t, r in rows["w0"].items() if r["members"] == ["w0"]]
        assert alone and alone[0] >= killed_at, rows["w0"]
        back = sorted(t for t in rows["w1"] if t > alone[-1])
        assert back and back[-1] == cfg.diloco.outer_steps - 1 and rows["w1"][back[0]]["onboarded"], logs(tmp_path)
        for t in back:
            assert rows["w0"][t]["digest"] == rows["w1"][t]["digest"], f"replicas differ at step {t}"
        if onboarding == "non_blocking":  # it sat out its first step, then contributed
            assert [rows["w0"][t]["contributors"] for t in back[:2]] == [1, 2], [rows["w0"][t] for t in back[:2]]
        text = (tmp_path / "logs" / "w1.log").read_text()
        assert f"worker rank 1 (pid {victim[0]}) exited with code -9" in text
    finally:
        c.close()


def _saved(storage: RunStorage, worker: str, n: int) -> dict:
    """The data position and members a sharded worker saved for checkpoint ``n``."""
    doc = json.loads(storage.read_bytes(f"{storage.step_path(n, state_kind(worker))}/{SHARDS_STATE}"))
    return doc["extra"]


@pytest.mark.parametrize(("ranks", "resumed_as"), [(2, (1, 4)), (1, (2,))])
def test_a_run_resumes_on_another_number_of_ranks(tmp_path, ranks, resumed_as):
    """A 2x2 run stopped after a checkpoint resumes as 2x1 and as 2x4 from its sharded worker states, and
    a 2x1 run as 2x2 from its one-rank files (the AdamW state resharded, the data position as it was);
    each ends where the run never stopped."""
    write_corpus(tmp_path / "corpus")
    over = {"diloco.compression": "fp32", "diloco.outer_steps": 6, "diloco.checkpoint_every": 2, "lr": 1e-3}
    ref = run_cfg(tmp_path, "ref", ranks, **over)
    run(ref, tmp_path / "logs-ref")
    ref_storage = RunStorage.from_config(ref.storage, ref.run_name)

    cfg = run_cfg(tmp_path, "stopped", ranks, **over)
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    c = Coordinator(cfg, worker_launcher(tmp_path / "logs-stopped"))
    try:
        c.start()
        deadline = time.monotonic() + 120
        while (storage.latest_step("checkpoints") or 0) < 2:
            assert time.monotonic() < deadline, logs(tmp_path)
            time.sleep(0.05)
    finally:
        c.close()  # stops the workers, whatever they were doing
    n = storage.latest_step("checkpoints")
    assert n is not None and 2 <= n < 6
    if ranks > 1:
        for w in ("w0", "w1"):
            assert _saved(storage, w, n) == _saved(ref_storage, w, n)
    for m in resumed_as:
        name = f"as{m}"
        shutil.copytree(storage.local_path(""), tmp_path / "runs" / name)
        resumed = run_cfg(tmp_path, name, m, **over)
        c = Coordinator(resumed, worker_launcher(tmp_path / f"logs-{name}"))
        try:
            c.start()
            codes = c.watch(timeout=300)
            assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
        finally:
            c.close()
        got = RunStorage.from_config(resumed.storage, resumed.run_name)
        text = (tmp_path / f"logs-{name}" / "w0.log").read_text()
        assert f"resuming with its inner state and data position of checkpoint {n}" in text, text[-3000:]
        want, have = fetch(ref_storage, 6)[0], fetch(got, 6)[0]
        for (key, p), q in zip(want.named_parameters(), have.parameters()):
            rel = ((p - q).norm() / p.norm()).item()
            assert rel < 1e-5, f"{name}: {key} differs by {rel:.2e}"


def test_workers_of_two_ranks_reduce_top_k_pseudo_gradients_shard_by_shard(tmp_path):
    """diloco.compression = "topk" on workers of two ranks: each rank's ring sends the top-k of its own
    shard (with its own error-feedback residual, saved with the worker's sharded state), the replicas
    stay bit-identical, and the bytes are a small fraction of int8's."""
    write_corpus(tmp_path / "corpus")
    sparse = run_cfg(tmp_path, "topk", 2, **{"diloco.compression": '"topk"', "diloco.topk_chunk": 256,
                                             "diloco.topk_k": 4, "diloco.checkpoint_every": 1})
    dense = run_cfg(tmp_path, "int8", 2)
    run(sparse, tmp_path / "logs-topk")  # digests agree at every step
    run(dense, tmp_path / "logs-int8")
    sent = {}
    for cfg in (sparse, dense):
        storage = RunStorage.from_config(cfg.storage, cfg.run_name)
        rows = [json.loads(line) for line in storage.read_text(metrics_series("w0")).splitlines()]
        assert [r["step"] for r in rows] == list(range(OUTER)) and all(r["committed"] for r in rows)
        sent[cfg.run_name] = sum(r["bytes_sent"] for r in rows)
    assert 0 < sent["topk"] < sent["int8"] / 4, sent
    storage = RunStorage.from_config(sparse.storage, sparse.run_name)
    assert _saved(storage, "w0", OUTER) is not None  # the sharded state, residual included, for the last step


def test_a_worker_whose_shards_lie_is_clipped_flagged_and_banned(tmp_path):
    """Four workers of two ranks, one lying (1e6 everywhere) on both its shards: each ring's owners
    clip and flag it, the leaders report it, a majority bans it, and the honest replicas agree."""
    cfg = arithmetic_cfg(tmp_path, **{"run_name": "liar", "train.threads": 1, "diloco.bandwidth_probe_bytes": 0,
                                      "diloco.ranks_per_worker": 2, "diloco.workers": 4, "diloco.outer_steps": 3,
                                      "diloco.inner_steps": 4})
    c = Coordinator(cfg, faulty_launcher(tmp_path / "logs", FaultPlan(lie_worker="w3", lie="const")))
    try:
        c.start()
        codes = c.watch(timeout=300)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE, "w2": EXIT_DONE, "w3": EXIT_BANNED}, logs(tmp_path)
        steps = [json.loads(c.store.get(f"metrics/{t}/w0")) for t in range(3)]
        assert steps[0]["flagged"] == steps[1]["flagged"] == ["w3"], steps
        assert steps[1]["banned"] == ["w3"] and c.store.check(["banned/w3"])
        assert steps[2]["members"] == ["w0", "w1", "w2"]
        for t in range(3):
            d = digests(c, t)
            assert len({d[w] for w in ("w0", "w1", "w2")}) == 1, (t, d)
    finally:
        c.close()
    # the liar moved nothing far: every weight of the last checkpoint is of an honest run's size
    model, _ = fetch(RunStorage.from_config(cfg.storage, cfg.run_name))
    assert max(p.abs().max().item() for p in model.parameters()) < 10


def test_one_failed_ring_rolls_back_every_shard_and_the_retry_commits_what_a_clean_run_does(tmp_path):
    """w1's local rank 1 fails its ring in step 1's first attempt while both rank-0 rings succeed: both
    workers vote fail, nobody applies an averaged shard beside a local one, and the retry commits the
    very weights of a run without the fault."""
    over = {"diloco.ranks_per_worker": 2, "diloco.outer_steps": 3, "diloco.inner_steps": 4}
    checkpoints = {}
    for name, plan in (("clean", None), ("faulty", FaultPlan(fail_ring=[1, 0, "w1", 1]))):
        cfg = arithmetic_cfg(tmp_path, **{"run_name": name, **over})
        c = Coordinator(cfg, faulty_launcher(tmp_path / "logs", plan))
        try:
            c.start()
            codes = c.watch(timeout=300)
            assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
            steps = [json.loads(c.store.get(f"metrics/{t}/w0")) for t in range(3)]
            assert [s["attempts"] for s in steps] == ([1, 1, 1] if plan is None else [1, 2, 1]), steps
            for t in range(3):
                assert len(set(digests(c, t).values())) == 1
        finally:
            c.close()
        checkpoints[name] = fetch(RunStorage.from_config(cfg.storage, cfg.run_name))[0].state_dict()
    assert all(torch.equal(checkpoints["clean"][k], checkpoints["faulty"][k]) for k in checkpoints["clean"])
    assert "injected: w1's ring 1 fails at step 1 attempt 0" in (tmp_path / "logs" / "w1.log").read_text()
