"""The KL term of an RL run (``trainer.loss.kl_coef > 0``): the trainer holds the run's first
checkpoint as its reference, whatever step it is built at, so a trainer rebuilt from storage at every
step trains exactly as one kept in memory; the KL it reports grows from 0 as the policy leaves the
reference, and the term changes the weights."""

import hashlib
import math
import zlib

import pytest
import torch

from intellect.checkpoints import load_step_report, publish, record, recorded_digest, verified_copy
from intellect.config import ModelConfig, StorageConfig
from intellect.data.arithmetic import Problem
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.step import load_trainer
from intellect.rl.worker.submission import SubmissionConfig
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=96)
POOL = [Problem(a, "*", b).to_task() for a in range(3) for b in range(4)]


def odd_reward(completion, task):  # noqa: ARG001 - the reward signature
    return float(zlib.crc32(completion.encode()) % 2)  # about half the samples: groups have signal


def _config(tmp_path, name: str, kl: float) -> RLRunConfig:
    return RLRunConfig(
        run_name=name, storage=StorageConfig(url=f"file://{tmp_path}"),
        submission=SubmissionConfig(prompts_per_submission=2, group_size=4, max_tokens=4),
        trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=16,
                                inference_dtype="bf16", loss={"kl_coef": kl}),
        toploc=None, trusted_workers=True, trainer_threads=1,
    )


def _run(tmp_path, name: str, kl: float, keep: bool, steps: int = 3):
    """Each checkpoint's weights hash and each step's reported KL, from one checkpoint 0."""
    model, tok = build_model(MODEL)
    cfg = _config(tmp_path, name, kl)
    storage = RunStorage.from_config(cfg.storage, name)
    with Ledger(tmp_path / f"{name}.duckdb") as ledger:
        publish(model, tok, storage, 0, dtype=cfg.trainer.published_dtype)
        record(storage, ledger, 0)
        trainer = load_trainer(cfg, storage, ledger, 0) if keep else None
        for n in range(steps):
            report = run_rl_step(cfg, storage, ledger, n, ["alice"], POOL, reward_fn=odd_reward, trainer=trainer)
            assert report.committed and report.trained and report.trained_samples > 0
        weights, kls = [], []
        for n in range(steps + 1):
            with verified_copy(storage, n, sha256=recorded_digest(ledger, n)) as folder:
                weights.append(hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest())
                if n:
                    kls.append(load_step_report(folder).kl)
        resumed = load_trainer(cfg, storage, ledger, steps)
        assert isinstance(resumed, GRPOTrainer) and (resumed.ref_model is not None) == (kl > 0)
        start = dict(model.named_parameters())
        for k, p in resumed.ref_model.named_parameters() if resumed.ref_model is not None else ():
            # checkpoint 0 as published (bf16), not the step the trainer resumed at
            assert torch.equal(p.float(), start[k].detach().bfloat16().float()), k
    return weights, kls


def test_the_reference_is_the_first_checkpoint_for_a_kept_and_a_rebuilt_trainer(tmp_path):
    kept, kept_kl = _run(tmp_path, "kept", 0.5, keep=True)
    rebuilt, rebuilt_kl = _run(tmp_path, "rebuilt", 0.5, keep=False)
    assert rebuilt == kept and rebuilt_kl == kept_kl  # bit for bit: the same reference at every step
    assert all(k is not None and math.isfinite(k) for k in kept_kl)
    assert 0 < kept_kl[0] < kept_kl[-1], kept_kl  # the policy leaves the reference (step 0: its second mini-step)
    plain, plain_kl = _run(tmp_path, "plain", 0.0, keep=False)
    assert plain_kl == [None, None, None] and plain[0] == kept[0] and plain[-1] != kept[-1]  # the term acts

