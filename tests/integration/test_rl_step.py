"""Local RL steps end to end on the tiny model: generate, validate, record, train, publish, commit,
and resume after a crash without counting anything twice."""

import pytest

from intellect.checkpoints import CHECKPOINTS, STEP_REPORT, CheckpointMismatch, digest, fetch_recorded, publish, record
from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.wire.rollouts import list_submissions, write_submission
from intellect.rl.trainer.local_step import run_rl_step
from intellect.inference.torch_engine import TorchEngine
from intellect.rl.worker.submission import SubmissionConfig, generate_submission
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig
from intellect.storage import RunStorage
from intellect.toploc.proofs import ToplocConfig

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
TASKS = [Problem(a, "+", b).to_task() for a in range(4) for b in range(3)]
WORKERS = ["alice", "bob"]
CFG = RLRunConfig(
    run_name="t",
    submission=SubmissionConfig(prompts_per_submission=2, group_size=4, max_tokens=4),
    trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2),
    toploc=None, trusted_workers=True,
)
PER_STEP = len(WORKERS) * 2 * 4


def parity_reward(completion, task):  # noqa: ARG001 - the reward signature
    # the untrained tiny model never solves a sum: a reward it hits about half the time gives every group signal
    return float(sum(map(ord, completion)) % 2)


@pytest.fixture
def run(tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    model, tok = build_model(TINY)
    uri = publish(model, tok, storage, 0)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        assert record(storage, ledger, 0) == uri  # as the run's seeding does
        yield storage, ledger


def step(storage, ledger, n, **kw):
    return run_rl_step(CFG, storage, ledger, n, WORKERS, TASKS, reward_fn=parity_reward, **kw)


def test_two_steps_end_to_end(run):
    storage, ledger = run
    for n in (0, 1):
        report = step(storage, ledger, n)
        assert report.policy_step == n and report.committed and report.trained
        assert report.files == list_submissions(storage, n) and len(report.files) == len(WORKERS)
        assert sorted(report.generated) == report.files
        assert (report.accepted, report.rejected) == (PER_STEP, 0)
        assert 0 < report.trained_samples <= PER_STEP and report.loss is not None
        assert storage.is_stable(n + 1, CHECKPOINTS)
        assert ledger.checkpoint(n + 1)[0] == report.checkpoint
        row = ledger.get_step(n)
        assert (row["accepted"], row["trained_samples"]) == (PER_STEP, report.trained_samples)
    assert storage.complete_steps(CHECKPOINTS) == [0, 1, 2]
    assert len({ledger.checkpoint(n)[1] for n in (1, 2)}) == 2  # training moved the weights
    # a committed step is not run again
    again = step(storage, ledger, 1)
    assert not again.committed and not again.trained and again.generated == []
    assert len(ledger.accepted(1)) == PER_STEP


def test_crash_rerun_counts_each_sample_once(run, monkeypatch):
    storage, ledger = run

    def crash(self, samples):  # noqa: ARG001 - replaces GRPOTrainer.train_step
        raise RuntimeError("trainer died")

    with monkeypatch.context() as m:  # crash after the verdicts are recorded, before training
        m.setattr(GRPOTrainer, "train_step", crash)
        with pytest.raises(RuntimeError, match="trainer died"):
            step(storage, ledger, 0)
    assert len(ledger.accepted(0)) == PER_STEP and ledger.get_step(0) is None
    assert not storage.is_stable(1, CHECKPOINTS)

    with monkeypatch.context() as m:  # crash after publishing, before the commit
        m.setattr(Ledger, "commit_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            step(storage, ledger, 0)
    assert storage.is_stable(1, CHECKPOINTS) and ledger.get_step(0) is None

    report = step(storage, ledger, 0)
    assert report.generated == [] and not report.trained and report.committed
    accepted = ledger.accepted(0)
    assert len(accepted) == PER_STEP == report.accepted
    assert len({(a["file"], a["row_index"]) for a in accepted}) == PER_STEP
    assert len({a["content_hash"] for a in accepted}) == PER_STEP
    assert ledger.get_step(0)["trained_samples"] == report.trained_samples > 0
    assert step(storage, ledger, 1).committed  # and the run goes on


def test_steps_with_toploc_accept_honest_workers_and_reject_a_forger(run):
    """With ``toploc`` on, workers attach proofs, the validator prefills each claimed checkpoint; a
    worker that samples with other weights but claims the policy is rejected, row by row."""
    storage, ledger = run
    cfg = CFG.model_copy(update={"toploc": ToplocConfig.model_validate({"k": 16})})  # hidden 32: one token holds 32 values
    forged, _ = build_model(TINY.model_copy(update={"init_seed": TINY.init_seed + 7}))
    for n in (0, 1):
        report = run_rl_step(cfg, storage, ledger, n, WORKERS, TASKS, reward_fn=parity_reward)
        assert (report.accepted, report.rejected) == (PER_STEP, 0) and report.trained
    rows = ledger.accepted(1)
    assert rows and all(r["policy_step"] == 1 for r in rows)
    # a forger: same prompts and seeds, another model's tokens and hidden states, the honest policy claimed
    _, tok = build_model(TINY)
    forger = TorchEngine.for_tokenizer(forged, tok, capture_hidden=True)
    fake = generate_submission(forger, tok, TASKS, "mallory", 2, 0, 2, cfg.submission, run=cfg.run_name,
                               reward_fn=parity_reward, proofs=cfg.toploc)
    write_submission(storage, 2, "mallory", 0, fake)
    report = run_rl_step(cfg, storage, ledger, 2, WORKERS, TASKS, reward_fn=parity_reward)
    reasons = {r["reason"] for r in ledger.summary() if r["step"] == 2 and r["status"] == "rejected"}
    assert report.accepted == PER_STEP and report.rejected == len(fake)
    assert reasons and all(x.startswith("toploc_") for x in reasons)


def test_the_trainer_adopts_only_checkpoints_it_recorded(run):
    """A ``STABLE`` checkpoint ``step + 1`` that the ledger does not hold (published by someone else, or
    by a crash between publish and record) is deleted and trained again; readers verify digests."""
    storage, ledger = run
    forged, tok = build_model(TINY.model_copy(update={"init_seed": TINY.init_seed + 3}))
    publish(forged, tok, storage, 1, {STEP_REPORT: {"policy_step": 0, "trained_samples": 999,
                                                    "loss": -1e6, "clip_fraction": 0.0}})
    report = step(storage, ledger, 0)
    assert report.trained and report.trained_samples != 999
    assert digest(storage, 1) == ledger.checkpoint(1)[1]

    # a crash between publishing checkpoint 2 and recording it: the rerun retrains, it does not adopt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Ledger, "record_checkpoint", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            step(storage, ledger, 1)
    assert storage.is_stable(2, CHECKPOINTS) and ledger.checkpoint(2) is None
    assert step(storage, ledger, 1).trained
    # a recorded checkpoint rewritten in place is refused by every reader
    rel = f"{storage.step_path(1, CHECKPOINTS)}/model.safetensors"
    storage.write_bytes(rel, storage.read_bytes(rel)[:-4] + b"\0\0\0\0")
    with pytest.raises(CheckpointMismatch):
        fetch_recorded(storage, ledger, 1)
