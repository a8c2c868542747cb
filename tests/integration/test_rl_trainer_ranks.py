"""The sharded GRPO trainer (``trainer.ranks``) in real processes over gloo: the same loss and weights as
the single-process trainer, and a killed trainer that resumes from its sharded state on other ranks.

Rank 0 is this file run as a script (``leader``): it starts its followers as the run would
(:meth:`~intellect.rl.trainer.ranks.ShardedTrainer.start`), trains, publishes the consolidated
checkpoint and saves the sharded state of every step. The single-process reference runs in the test
process from the same checkpoint and samples. The model is a 2-block llama of hidden size 36, MLP
width 60; each mini-batch packs into 3 or 4 rows, so on 2 or 3 ranks one rank runs a dummy pass.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from intellect.checkpoints import fetch, publish
from intellect.config import ComputeConfig, ModelConfig, StorageConfig
from intellect.model.checkpoint import build_model
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample
from intellect.rl.trainer.loss import GRPOLossConfig
from intellect.rl.trainer.ranks import ShardedTrainer, TrainerSpec
from intellect.rl.trainer.state import TRAINER_STATE, load_state
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

RUN = "ranks"
# llama: no attention biases, whose gradient (the key's exactly 0) is rounding noise that AdamW scales up
MODEL = ModelConfig(arch="llama", num_layers=2, hidden_size=36, num_heads=3, num_kv_heads=3, intermediate_size=60)
TRAINER = RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=16, logit_chunk_tokens=5)
# the other normalization, the engine's log-probs as the ratio's denominator, the entropy bonus's gradient
OTHER_LOSS = GRPOLossConfig(normalization="token", old_logprobs="behaviour", entropy_coef=0.01)
TOL = dict(rtol=0, atol=1e-6)


def samples_of(step: int, n: int = 10) -> list[Sample]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(n):
        p = torch.randint(4, 40, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        o = torch.randint(4, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        behaviour = (-torch.rand(len(o), generator=g) * 3 - 2).tolist()  # near the untrained model's
        out.append(Sample(p, o, float(torch.randn(1, generator=g)), behaviour))
    return out


def leader(spec_path: str, steps: int, hang_after: int) -> None:
    """Rank 0: train and publish steps ``spec.checkpoint .. steps - 1``, saving the state of each; after
    saving checkpoint ``hang_after`` wait to be killed."""
    spec = TrainerSpec.model_validate_json(Path(spec_path).read_text())
    st = ShardedTrainer.start(spec)
    try:
        for step in range(spec.checkpoint, steps):
            stats = st.train_step(samples_of(step))
            st.publish(st.storage, step + 1)
            st.save_state(step + 1)
            print(json.dumps({"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm}), flush=True)
            if step + 1 == hang_after:
                time.sleep(3600)
    finally:
        st.close()


def _spec(tmp_path: Path, ranks: int, checkpoint: int = 0, trainer: RLTrainerConfig = TRAINER) -> Path:
    spec = TrainerSpec(run_name=RUN, storage=StorageConfig(url=f"file://{tmp_path}"),
                       trainer=trainer.model_copy(update={"ranks": ranks}), compute=ComputeConfig(device="cpu"),
                       checkpoint=checkpoint, threads=1)
    path = tmp_path / f"spec_{ranks}_{checkpoint}.json"
    path.write_text(spec.model_dump_json())
    return path


def _start(spec: Path, steps: int, hang_after: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "leader", str(spec), str(steps), str(hang_after)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def _stats(out: str, key: str) -> list[float]:
    return [json.loads(line)[key] for line in out.splitlines() if line.startswith("{")]


@pytest.fixture()
def storage(tmp_path) -> RunStorage:
    storage = RunStorage.from_config(StorageConfig(url=f"file://{tmp_path}"), RUN)
    torch.manual_seed(0)
    model, tok = build_model(MODEL)
    publish(model, tok, storage, 0)
    return storage


def reference(storage: RunStorage, steps: int, trainer: RLTrainerConfig = TRAINER,
              ) -> tuple[list[tuple[float, float]], list[list[torch.Tensor]]]:
    """The single-process trainer from checkpoint 0: each step's (loss, gradient norm) and weights after it."""
    model, tok = fetch(storage, 0)
    t = GRPOTrainer(model, tok, trainer, ref_model=fetch(storage, 0)[0] if trainer.loss.kl_coef > 0 else None)
    stats, weights = [], []
    for step in range(steps):
        st = t.train_step(samples_of(step))
        stats.append((st.loss, st.grad_norm))
        weights.append([p.detach().clone() for p in t.model.parameters()])
    return stats, weights


def _assert_weights(storage: RunStorage, step: int, expected: list[torch.Tensor]) -> None:
    model, _ = fetch(storage, step)
    for (name, p), q in zip(model.named_parameters(), expected, strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=name)


@pytest.mark.parametrize("trainer", [TRAINER, TRAINER.model_copy(update={"loss": OTHER_LOSS}),
                                     TRAINER.model_copy(update={"loss": GRPOLossConfig(kl_coef=0.5)})],
                         ids=["constant", "token-behaviour-entropy", "kl"])
def test_two_ranks_train_as_one_process(storage, tmp_path, trainer):
    proc = _start(_spec(tmp_path, 2, trainer=trainer), steps=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    ref, ref_weights = reference(storage, 1, trainer)
    assert _stats(out, "loss") == pytest.approx([r[0] for r in ref], abs=1e-6)
    # the gradients summed over the ranks, not averaged (AdamW alone would hardly tell)
    assert _stats(out, "grad_norm") == pytest.approx([r[1] for r in ref], abs=1e-6)
    _assert_weights(storage, 1, ref_weights[0])
    assert storage.is_stable(1, TRAINER_STATE)


def test_killed_trainer_resumes_on_other_ranks(storage, tmp_path):
    """2 ranks train step 0 and save, then are killed; 1 process and then 3 ranks resume from that
    sharded state: step 1's weights are the uninterrupted run's."""
    proc = _start(_spec(tmp_path, 2), steps=2, hang_after=1)
    try:
        deadline = time.monotonic() + 300
        while not storage.is_stable(1, TRAINER_STATE):
            assert proc.poll() is None and time.monotonic() < deadline, "rank 0 ended before saving step 1"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0; its followers die with it
    finally:
        proc.wait(30)
    assert not storage.is_stable(2, "checkpoints")
    ref, ref_weights = reference(storage, 2)

    model, tok = fetch(storage, 1)  # one process: the sharded state read as whole tensors
    t = GRPOTrainer(model, tok, TRAINER)
    assert load_state(storage, 1, t) == 2 and t.step == TRAINER.steps_per_rollout
    assert t.train_step(samples_of(1)).loss == pytest.approx(ref[1][0], abs=1e-6)
    for p, q in zip(t.model.parameters(), ref_weights[1], strict=True):
        torch.testing.assert_close(p.detach(), q, **TOL)

    proc = _start(_spec(tmp_path, 3, checkpoint=1), steps=2)  # three ranks
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert _stats(out, "loss") == pytest.approx([ref[1][0]], abs=1e-6)
    _assert_weights(storage, 2, ref_weights[1])


if __name__ == "__main__" and sys.argv[1] == "leader":
    leader(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
