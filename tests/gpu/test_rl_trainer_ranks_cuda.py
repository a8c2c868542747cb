"""A bf16-mixed step of the sharded GRPO trainer on CUDA (``gpu``: skipped without a device).

One GPU: the trainer's FSDP2 path over a mesh of one rank in this process (NCCL), against the
one-process trainer under autocast. The two cast differently (FSDP casts the gathered weights to bf16,
autocast casts per op), so the figures agree to bf16's precision, not bit for bit. The weights stay
fp32 shards (master weights) and the consolidated checkpoint loads. Two ranks on two GPUs are the CPU
tests' code path with NCCL for gloo (``tests/integration/test_rl_trainer_ranks.py`` with
``compute.device = "cuda"``).
"""

from __future__ import annotations

import copy
import datetime
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from intellect.checkpoints import fetch
from intellect.config import ComputeConfig, ModelConfig
from intellect.diloco.mesh import WorkerMesh
from intellect.model.checkpoint import build_model
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample
from intellect.storage import RunStorage

pytestmark = [pytest.mark.gpu]

MODEL = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, intermediate_size=128)
TRAINER = RLTrainerConfig(lr=1e-3, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=64)


def _samples(n: int = 12) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [Sample(torch.randint(4, 40, (6,), generator=g).tolist(), torch.randint(4, 40, (10,), generator=g).tolist(),
                   float(torch.randn(1, generator=g))) for _ in range(n)]


def bf16_step(device: str, tmp_path) -> None:
    """The check, on ``device`` (``cuda:0``; ``cpu`` runs it over gloo where there is no GPU)."""
    torch.manual_seed(0)
    model, tok = build_model(MODEL)
    compute = ComputeConfig(device=device, precision="bf16-mixed")
    one = GRPOTrainer(copy.deepcopy(model), tok, TRAINER, compute=compute)
    store = dist.TCPStore("127.0.0.1", 0, 1, True,  # pyright: ignore[reportPrivateImportUsage]
                          timeout=datetime.timedelta(seconds=60))
    mesh = WorkerMesh.create(torch.device(device), 0, 1, store=store)
    try:
        sharded = GRPOTrainer(model, tok, TRAINER, compute=compute, mesh=mesh)
        a, b = one.train_step(_samples()), sharded.train_step(_samples())
        assert math.isfinite(b.loss) and math.isfinite(b.grad_norm)
        assert b.loss == pytest.approx(a.loss, rel=2e-2, abs=2e-3)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=5e-2)
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in sharded.model.parameters())
        storage = RunStorage(f"file://{tmp_path}")
        sharded.publish(storage, 1)
        loaded, _ = fetch(storage, 1)
        for p, q in zip(loaded.parameters(), sharded.model.parameters(), strict=True):
            assert isinstance(q, DTensor) and torch.equal(p, q.full_tensor().cpu())
    finally:
        mesh.close()


def test_bf16_mixed_step_of_the_sharded_trainer(tmp_path):
    bf16_step("cuda:0", tmp_path)
