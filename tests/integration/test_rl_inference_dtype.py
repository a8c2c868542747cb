"""A trainer that publishes bf16 checkpoints (``trainer.inference_dtype = "bf16"``): every checkpoint is
its fp32 master weights rounded to bf16, and the masters themselves (with AdamW's state) live in the
trainer-only ``trainer_state/step_<n>``, so a trainer rebuilt from storage at every step publishes, bit
for bit, what one kept in memory does; a trainer of 2 ranks resumes from a one-process trainer's masters."""

import hashlib
import zlib

import pytest
import torch
from safetensors.torch import load_file

from intellect.checkpoints import OPTIMIZER, publish, record, recorded_digest, verified_copy
from intellect.config import ModelConfig, StorageConfig
from intellect.data.arithmetic import Problem
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.state import TRAINER_STATE
from intellect.rl.trainer.step import load_trainer
from intellect.rl.worker.submission import SubmissionConfig
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=96)
POOL = [Problem(a, "*", b).to_task() for a in range(3) for b in range(4)]


def odd_reward(completion, task):  # noqa: ARG001 - the reward signature
    return float(zlib.crc32(completion.encode()) % 2)  # about half the samples: groups have signal


def _config(tmp_path, name: str, ranks: int = 1) -> RLRunConfig:
    return RLRunConfig(
        run_name=name, storage=StorageConfig(url=f"file://{tmp_path}"),
        submission=SubmissionConfig(prompts_per_submission=2, group_size=4, max_tokens=4),
        trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=16, ranks=ranks,
                                inference_dtype="bf16"),
        toploc=None, trusted_workers=True, trainer_threads=1,
    )


def _run(tmp_path, name: str, ranks_by_step: tuple[int, ...], keep: bool = False):
    """Steps 0.. of a run from the same bf16 checkpoint 0, step n on ``ranks_by_step[n]`` ranks; with
    ``keep`` one trainer stays in memory throughout, else one is built from storage at every step. The
    weights file's hash of each checkpoint, the last checkpoint's masters (a trainer loaded from storage) and the storage."""
    model, tok = build_model(MODEL)
    cfg = _config(tmp_path, name)
    storage = RunStorage.from_config(cfg.storage, name)
    with Ledger(tmp_path / f"{name}.duckdb") as ledger:
        publish(model, tok, storage, 0, dtype=cfg.trainer.published_dtype)
        record(storage, ledger, 0)
        trainer = load_trainer(cfg, storage, ledger, 0) if keep else None
        for n, ranks in enumerate(ranks_by_step):
            report = run_rl_step(_config(tmp_path, name, ranks), storage, ledger, n, ["alice"], POOL,
                                 reward_fn=odd_reward, trainer=trainer)
            assert report.committed and report.trained and report.trained_samples > 0
        last = len(ranks_by_step)
        weights = []  # (the digest covers the step report too, whose timings differ from run to run)
        for n in range(last + 1):
            with verified_copy(storage, n, sha256=recorded_digest(ledger, n)) as folder:
                weights.append(hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest())
        resumed = load_trainer(cfg, storage, ledger, last)
        assert isinstance(resumed, GRPOTrainer)  # one process
        masters = dict(resumed.model.named_parameters())
    return weights, {k: v.detach().clone() for k, v in masters.items()}, storage


def test_bf16_checkpoints_hold_the_rounded_masters_and_a_rebuilt_trainer_resumes_them_exactly(tmp_path):
    kept, kept_masters, _ = _run(tmp_path, "kept", (1, 1, 1), keep=True)
    rebuilt, masters, storage = _run(tmp_path, "rebuilt", (1, 1, 1))
    assert rebuilt == kept  # every checkpoint, bit for bit
    for name, p in masters.items():
        assert p.dtype == torch.float32 and torch.equal(p, kept_masters[name]), name
    # the masters carry bits that bf16 drops: a trainer resumed from the checkpoint alone would lose them
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in masters.values())
    for n in (1, 2, 3):
        assert storage.is_stable(n, TRAINER_STATE)
    with verified_copy(storage, 3) as folder:
        assert not (folder / OPTIMIZER).exists()
        published = load_file(str(folder / "model.safetensors"))
    assert published and all(t.dtype == torch.bfloat16 for t in published.values())
    for name, t in published.items():
        assert torch.equal(t, masters[name].to(torch.bfloat16)), name


def test_a_two_rank_trainer_resumes_from_a_one_process_trainer_s_bf16_run(tmp_path):
    one, one_masters, _ = _run(tmp_path, "one", (1, 1))
    switch, masters, storage = _run(tmp_path, "switch", (1, 2))
    assert switch[:2] == one[:2]  # step 0 alike
    assert storage.is_stable(2, TRAINER_STATE)
    for name, p in masters.items():  # saved as 2 ranks' shards, read by one process
        torch.testing.assert_close(p, one_masters[name], rtol=0, atol=1e-6)
    with verified_copy(storage, 2) as folder:
        published = load_file(str(folder / "model.safetensors"))
    for name, t in published.items():
        assert torch.equal(t, masters[name].to(torch.bfloat16)), name
