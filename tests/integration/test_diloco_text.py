"""DiLoCo on a text corpus: two worker processes over gloo, each reading its own shard.

The test writes a small corpus, runs a coordinator in this process with the production launcher
(logs in the run folder), and checks that the held-out loss falls, that the workers' reads are
disjoint (the ``data_sketch`` of every metrics row, hashes of the sequences actually trained on),
and that each step's metrics row carries the compute-utilization figures.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from intellect.checkpoints import fetch
from intellect.config import load_config
from intellect.data.text import heldout_batches
from intellect.diloco import worker_state
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher, worker_log_dir
from intellect.diloco.data import SKETCH_SIZE
from intellect.diloco.report import metrics_series
from intellect.storage import RunStorage
from intellect.train import heldout_loss

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "mat", "log", "and", "a", "big", "red", "box", "of", "six"]
WORKERS, OUTER, INNER, BATCH, SEQ = 2, 3, 5, 4, 32


def write_corpus(folder, docs: int = 60) -> None:
    """Documents of lower-case words and digits, all in the character tokenizer's alphabet, each one different."""
    folder.mkdir()
    for i in range(docs):
        rng = random.Random(i)
        words = [rng.choice(WORDS) for _ in range(rng.randint(50, 80))]
        (folder / f"doc{i:03d}.txt").write_text(f"doc {i}: " + " ".join(words) + ".\n")


def run_cfg(tmp_path) -> DilocoRunConfig:
    over = {
        "storage.url": f"file://{tmp_path}/runs", "run_name": "text",
        "data.kind": '"text"', "data.text.files": f'["{tmp_path}/corpus"]', "data.text.seq_len": SEQ,
        "data.text.eval_sequences": 8, "data.heldout_percent": 20,
        "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
        "model.intermediate_size": 64, "model.max_position_embeddings": 64,
        "train.batch_size": BATCH, "train.lr": 1e-2, "train.warmup_steps": 1,
        "compute.device": "cpu", "compute.peak_tflops": 1.0,
        "diloco.workers": WORKERS, "diloco.inner_steps": INNER, "diloco.outer_steps": OUTER,
        "diloco.heartbeat_interval": 0.3, "diloco.heartbeat_timeout": 2.5,
        "diloco.collective_timeout": 6, "diloco.boundary_timeout": 30,
    }
    return load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in over.items()], environ={})


def test_two_workers_read_disjoint_shards_and_the_heldout_loss_falls(tmp_path):
    write_corpus(tmp_path / "corpus")
    cfg = run_cfg(tmp_path)
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    logs = worker_log_dir(storage)
    assert logs is not None and logs.parent == storage.local_path("")
    c = Coordinator(cfg, worker_launcher(logs))
    try:
        c.start()
        codes = c.watch(timeout=240)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
        digests = [{c.store.get(f"digest/{t}/{w}").decode() for w in ("w0", "w1")} for t in range(OUTER)]
    finally:
        c.close()
    assert all(len(d) == 1 for d in digests), f"replicas differ: {digests}"

    # the workers' output stays in the run folder, each with the device of its local rank
    for rank, w in enumerate(("w0", "w1")):
        text = (logs / f"{w}.log").read_text()
        assert f"local rank {rank}" in text and "device cpu" in text, text[-2000:]

    rows = {w: [json.loads(line) for line in storage.read_text(metrics_series(w)).splitlines()]
            for w in ("w0", "w1")}
    for w, series in rows.items():
        assert [r["step"] for r in series] == list(range(OUTER)), series
        for r in series:
            assert r["committed"] and r["members"] == ["w0", "w1"]
            assert r["tokens"] == INNER * BATCH * (SEQ - 1)  # every packed token but the first is a target
            assert 0 < r["compute_utilization"] <= 1 and r["outer_seconds"] >= r["inner_seconds"] > 0
            assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
            assert r["allreduce_seconds"] > 0
    # member i of 2 reads shard i: nothing one worker trained on did the other
    assert {tuple(r["shard"]) for r in rows["w0"]} == {(0, 2)}
    assert {tuple(r["shard"]) for r in rows["w1"]} == {(1, 2)}
    seen = {w: {h for r in series for h in r["data_sketch"]} for w, series in rows.items()}
    assert all(len(s) >= SKETCH_SIZE for s in seen.values())
    assert seen["w0"].isdisjoint(seen["w1"])
    # and each step's reads were new to the worker
    for series in rows.values():
        sketches = [set(r["data_sketch"]) for r in series]
        assert all(a.isdisjoint(b) for i, a in enumerate(sketches) for b in sketches[i + 1:])

    first, _ = fetch(storage, 0)
    last, tok = fetch(storage, OUTER)
    held = heldout_batches(cfg.data, tok, batch_size=8)
    before, after = heldout_loss(first, held).loss, heldout_loss(last, held).loss
    assert after < before - 0.3, (before, after)


def write_sequence_corpus(folder, docs: int) -> None:
    """One JSONL file of distinct documents of exactly one packed sequence each (SEQ - 1 characters and
    EOS, one token a character): a sequence is a document, so equal reads hash equal in every sketch."""
    folder.mkdir()
    rows = []
    for i in range(docs):
        rng = random.Random(i)
        text = (f"doc {i:05d}: " + " ".join(rng.choice(WORDS) for _ in range(8)))[:SEQ - 1]
        rows.append(json.dumps({"text": text.ljust(SEQ - 1, ".")}) + "\n")
    (folder / "docs.jsonl").write_text("".join(rows))


def test_a_killed_worker_rejoins_with_its_saved_position_and_reads_only_its_shard(tmp_path):
    outer, inner = 14, 100
    # every sequence read is a new document: no epoch ends before the run does
    write_sequence_corpus(tmp_path / "corpus", docs=outer * inner * BATCH * WORKERS * 2)
    cfg = run_cfg(tmp_path).model_copy(deep=True)
    # steps long enough that the restarted worker (seconds of imports) is back before the run ends
    cfg.diloco.outer_steps, cfg.diloco.inner_steps = outer, inner
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    logs = worker_log_dir(storage)
    assert logs is not None
    c = Coordinator(cfg, worker_launcher(logs))
    try:
        c.start()
        deadline = time.monotonic() + 120
        # killed once it saved its state for checkpoint 2, at step 1's all-reduce: it never claims its
        # position at the boundary of step 2, where w0 reads on alone (the claim it made as its inner phase
        # ended is all w0 has to read on past what it read)
        while 2 not in storage.complete_steps(worker_state.state_kind("w1")):
            assert time.monotonic() < deadline, "w1 saved no state for checkpoint 2"
            time.sleep(0.02)
        c.handles["w1"].kill()  # SIGKILL
        while c.handles["w1"].poll() is None:
            time.sleep(0.05)
        c.start_worker("w1")  # the same worker again: its keys, its saved state
        codes = c.watch(timeout=240)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
    finally:
        c.close()
    text = (logs / "w1.log").read_text()
    assert "resuming with its inner state and data position of checkpoint" in text, text[-3000:]

    rows = {w: {r["step"]: r for r in map(json.loads, storage.read_text(metrics_series(w)).splitlines())}
            for w in ("w0", "w1")}
    assert set(rows["w0"]) == set(range(outer))
    rejoined = [t for t in rows["w1"] if t >= 2]
    assert rejoined and max(rejoined) == outer - 1, rows["w1"].keys()
    for t in range(outer):
        members = rows["w0"][t]["members"]
        live = [rows[w][t] for w in members if t in rows[w]]
        # every live member read the shard its place among the step's members gives it (the members agreed
        # at the boundary: a step whose all-reduce lost a member commits with fewer), and no two the same data
        shards = [tuple(r["shard"]) for r in live]
        assert len(set(shards)) == len(shards) and len({n for _, n in shards}) == 1, live
        if len(members) == shards[0][1]:
            assert all(s == (members.index(r["worker"]), len(members)) for s, r in zip(shards, live)), live
        sketches = [set(r["data_sketch"]) for r in live]
        assert all(a.isdisjoint(b) for i, a in enumerate(sketches) for b in sketches[i + 1:]), (t, sketches)
    assert any(rows["w0"][t]["members"] == ["w0", "w1"] and t in rows["w1"] for t in rejoined)
    # and never, at any step, a document the other read: w0 read every document while w1 was away, from
    # further on than w1's saved position, and w1 read on from there when it came back
    assert "reading on from the members' furthest position" in text, text[-3000:]
    seen = {w: {h for r in series.values() for h in r["data_sketch"]} for w, series in rows.items()}
    assert seen["w0"].isdisjoint(seen["w1"]), seen["w0"] & seen["w1"]
