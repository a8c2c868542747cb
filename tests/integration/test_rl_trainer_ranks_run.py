"""An RL run whose trainer is 2 processes (``trainer.ranks = 2``, gloo): the step trains and publishes what
the one-process trainer does, the next step's trainer resumes from the sharded state it saved, and a run
that goes from 1 rank to 2 between steps keeps its AdamW state."""

import pytest
import torch

from intellect.checkpoints import OPTIMIZER, fetch_recorded, publish, record, verified_copy
from intellect.config import ModelConfig, StorageConfig
from intellect.data.arithmetic import Problem
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.grpo import RLTrainerConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.state import TRAINER_STATE
from intellect.rl.worker.submission import SubmissionConfig
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
TASKS = [Problem(a, "+", b).to_task() for a in range(4) for b in range(3)]


def parity_reward(completion, task):  # noqa: ARG001 - the reward signature
    return float(sum(map(ord, completion)) % 2)  # about half the samples: every group has signal


def _config(tmp_path, name: str, ranks: int, kl: float = 0.0) -> RLRunConfig:
    return RLRunConfig(
        run_name=name, storage=StorageConfig(url=f"file://{tmp_path}"),
        submission=SubmissionConfig(prompts_per_submission=2, group_size=4, max_tokens=4),
        trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=16, ranks=ranks,
                                loss={"kl_coef": kl}),
        toploc=None, trusted_workers=True, trainer_threads=1,
    )


def _run(tmp_path, model, tok, name: str, ranks_by_step: tuple[int, ...], kl: float = 0.0) -> tuple[list, RunStorage]:
    """Steps 0.. of a run, step n trained on ``ranks_by_step[n]`` ranks; each step's loss and the weights
    of the checkpoint it published."""
    storage = RunStorage.from_config(_config(tmp_path, name, 1).storage, name)
    publish(model, tok, storage, 0)
    out = []
    with Ledger(tmp_path / f"{name}.duckdb") as ledger:
        record(storage, ledger, 0)
        for n, ranks in enumerate(ranks_by_step):
            report = run_rl_step(_config(tmp_path, name, ranks, kl), storage, ledger, n, ["alice"], TASKS,
                                 reward_fn=parity_reward)
            assert report.committed and report.trained and report.trained_samples > 0
            trained, _ = fetch_recorded(storage, ledger, n + 1)
            out.append((report.loss, [p.detach().clone() for p in trained.parameters()]))
    return out, storage


def _assert_same(a, b) -> None:
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    for p, q in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_run_with_a_two_rank_trainer(tmp_path):
    model, tok = build_model(TINY)
    one, _ = _run(tmp_path, model, tok, "one", (1, 1))
    two, storage = _run(tmp_path, model, tok, "two", (2, 2))
    # the optimizer state as shards beside each checkpoint, no one-process sidecar
    assert storage.is_stable(1, TRAINER_STATE) and storage.is_stable(2, TRAINER_STATE)
    with verified_copy(storage, 2) as folder:
        assert not (folder / OPTIMIZER).exists()
    _assert_same(two[0], one[0])
    switch, _ = _run(tmp_path, model, tok, "switch", (1, 2))  # step 1 reads step 0's one-process sidecar
    _assert_same(switch[1], one[1])


def test_a_two_rank_trainer_with_a_kl_term_resumes_toward_checkpoint_0(tmp_path):
    """Each step's trainer is built anew on 2 ranks and loads checkpoint 0, by its recorded digest, as the
    reference: the same losses and weights as the one-process trainer's run (whose reference is that
    checkpoint too, ``test_rl_reference.py``)."""
    model, tok = build_model(TINY)
    one, _ = _run(tmp_path, model, tok, "one-kl", (1, 1), kl=0.5)
    two, _ = _run(tmp_path, model, tok, "two-kl", (2, 2), kl=0.5)
    for a, b in zip(two, one, strict=True):
        _assert_same(a, b)
