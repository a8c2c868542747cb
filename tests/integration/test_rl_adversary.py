"""Issue 17's worker attacks, end to end: ``rl-train`` with two honest ``intellect worker`` processes and
one adversarial worker process (``tests/rl_adversary.py``) that tries every move, against the same run
without it.

The run is synchronous (``async_level = 0``), so both runs train on exactly the accepted samples of
their step, in the canonical order: the checkpoints' weights must be bit-identical, the ledger must hold
each honest sample exactly once and nothing of the adversary's, and each adversarial move must have a
reason, the service's refusal or the ledger's verdict. Two runs without the adversary are compared
first, so that a difference can only come from it.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.rl import rl_train
from intellect.config import ModelConfig
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.checkpoints import CHECKPOINTS, CheckpointMismatch, digest, fetch_recorded, publish
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.setup import ledger_path, local_run_dir, run_storage, trainer_dir
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from tasks.rl import worker_key_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
PROMPTS, GROUP, STEPS = 2, 4, 3
HONEST = {"alice": SigningKey.from_seed(b"a" * 32), "bob": SigningKey.from_seed(b"b" * 32)}
MALLORY = SigningKey.from_seed(b"m" * 32)
MAX_BODY = 1 << 20
SECRET = bytes(range(32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_run(root: Path, *, adversary: bool) -> RLRunConfig:
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{root}/base"), 0)
    cfg = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{root}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": STEPS, "async_level": 0,
        "workers": {"names": list(HONEST), "poll_interval": 0.02, "submission_timeout": 300,
                    "checkpoint_timeout": 300, "max_submissions": 8,
                    "remote": [MALLORY.public.id] if adversary else []},
        "submission": {"prompts_per_submission": PROMPTS, "group_size": GROUP, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 2}, "trainer_threads": 1,
        "eval": {"every": 0, "size": 8}, "toploc": {"k": 16},
        "service": {"port": free_port(), "max_body_bytes": MAX_BODY},
    })
    for name, key in HONEST.items():  # the same honest identities in every run: same prompts, same seeds
        key.save(worker_key_file(cfg, name))
    # ... and the same run secret, which keys the salts the service gives them
    trainer_dir(cfg).mkdir(parents=True, exist_ok=True)
    (trainer_dir(cfg) / "secret").write_text(SECRET.hex())
    (trainer_dir(cfg) / "secret").chmod(0o600)
    return cfg


def weights(cfg: RLRunConfig) -> list[str]:
    storage = run_storage(cfg)
    return [hashlib.sha256(storage.read_bytes(f"{storage.step_path(n, CHECKPOINTS)}/model.safetensors")).hexdigest()
            for n in range(STEPS + 1)]


def accepted(cfg: RLRunConfig) -> dict[int, list[tuple]]:
    with Ledger(ledger_path(cfg)) as ledger:
        return {n: sorted((a["content_hash"], a["worker"], a["reward"], a["advantage"]) for a in ledger.accepted(n))
                for n in range(STEPS)}


@pytest.mark.usefixtures("prefect_harness")
def test_an_adversarial_worker_changes_nothing(tmp_path):
    runs = {}
    for name in ("plain", "again"):
        cfg = make_run(tmp_path / name, adversary=False)
        assert rl_train(cfg).worker_exit_codes == {"alice": 0, "bob": 0}
        runs[name] = cfg
    assert weights(runs["plain"]) == weights(runs["again"]), "the run is not deterministic without an adversary"
    assert accepted(runs["plain"]) == accepted(runs["again"])

    cfg = make_run(tmp_path / "attacked", adversary=True)
    MALLORY.save(tmp_path / "mallory.key")
    args = {"url": f"http://127.0.0.1:{cfg.service.port}", "key": str(tmp_path / "mallory.key"),
            "run_dir": str(local_run_dir(cfg)), "honest": [k.public.hex for k in HONEST.values()],
            "steps": STEPS, "max_body_bytes": MAX_BODY, "log": str(tmp_path / "mallory.jsonl"),
            "submission": cfg.submission.model_dump()}
    (tmp_path / "mallory.json").write_text(json.dumps(args))
    with open(tmp_path / "mallory.log", "wb") as out:
        mallory = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rl_adversary.py"),
                                    str(tmp_path / "mallory.json")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        report = rl_train(cfg)
        assert mallory.wait(timeout=120) == 0, (tmp_path / "mallory.log").read_text()[-3000:]
    finally:
        if mallory.poll() is None:
            mallory.kill()
            mallory.wait(10)
    assert report.worker_exit_codes == {"alice": 0, "bob": 0}

    # the model is the one the honest workers alone would have trained
    assert weights(cfg) == weights(runs["plain"])
    # each honest sample once, nothing of the adversary's
    got = accepted(cfg)
    assert got == accepted(runs["plain"])
    honest_ids = {k.public.id for k in HONEST.values()}
    for n in range(STEPS):
        assert len(got[n]) == len(HONEST) * PROMPTS * GROUP == len({a[0] for a in got[n]})
        assert {a[1] for a in got[n]} == honest_ids

    # every move has a reason: the service's refusal, or the ledger's verdict on what it stored
    moves = [json.loads(line) for line in (tmp_path / "mallory.jsonl").read_text().splitlines()]
    with Ledger(ledger_path(cfg)) as ledger:
        verdicts = ledger._query("SELECT file, status, reason FROM rollouts WHERE worker = ?", [MALLORY.public.id])
        storage = run_storage(cfg)
        for n in range(STEPS + 1):  # every checkpoint is the trainer's: its recorded digest holds
            assert digest(storage, n) == ledger.checkpoint(n)[1]
        reasons_by_file: dict[str, set] = {}
        for v in verdicts:
            assert v["status"] == "rejected" and v["reason"], v
            reasons_by_file.setdefault(v["file"], set()).add(v["reason"])
        # a checkpoint rewritten after it was recorded is refused by every reader
        rel = f"{storage.step_path(1, CHECKPOINTS)}/model.safetensors"
        storage.write_bytes(rel, storage.read_bytes(rel)[:-8] + b"\0" * 8)
        with pytest.raises(CheckpointMismatch):
            fetch_recorded(storage, ledger, 1)
    by_attack: dict[str, set] = {}
    for m in moves:
        assert "accepted" not in m or m["attack"] in ("capture",), m  # only the one honest request to replay
        if "stored" in m:
            assert m["stored"] in reasons_by_file, f"stored {m} has no verdict"
            by_attack.setdefault(m["attack"], set()).update(reasons_by_file[m["stored"]])
        elif "refused" in m:
            assert m["refused"], m
            by_attack.setdefault(m["attack"], set()).add(m["refused"])
    assert by_attack["replay"] == {"replay"} and by_attack["impersonate"] == {"bad_signature"}
    assert by_attack["other_audience"] == {"bad_signature"}
    assert by_attack["replay_other_path"] <= {"bad_signature", "replay"}
    assert by_attack["unsigned"] == {"unsigned"} and by_attack["oversized"] == {"too_large"}
    assert by_attack["overwrite_own"] == {"exists"} and by_attack["too_far_ahead"] == {"too_far_ahead"}
    assert by_attack["copy_as_is"] == {"identity"} and by_attack["copy_claimed"] == {"assignment"}
    assert by_attack["too_long"] == {"too_long"}
    assert all(r.startswith("toploc_") for r in by_attack["handwritten"]), by_attack["handwritten"]
    assert by_attack["malformed"] and by_attack["parquet_bomb"] and by_attack["four_bytes"]
    assert {a for a in by_attack if a.startswith("route:")} == {m["attack"] for m in moves
                                                                if m["attack"].startswith("route:")}
    assert len([m for m in moves if m["attack"] == "prepublish_checkpoint" and "wrote" in m]) == STEPS
