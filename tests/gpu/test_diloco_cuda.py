"""DiLoCo on CUDA: a bf16 inner copy on the GPU, the fp32 outer state in pinned host memory, and a
2-worker run over gloo with ``compute.device = "cuda"`` and ``precision = "bf16-mixed"``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from intellect.checkpoints import CHECKPOINTS, fetch
from intellect.config import ComputeConfig, ModelConfig, TrainConfig, load_config
from intellect.device import prepare_model
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher, worker_log_dir
from intellect.diloco.outer import OuterState, host_model
from intellect.diloco.report import metrics_series
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage
from intellect.train import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


def test_outer_state_of_a_bf16_cuda_model_is_pinned_fp32_on_the_host():
    cuda = torch.device("cuda")
    model, tok = build_model(TINY)
    outer = OuterState(model, device=cuda)
    compute = ComputeConfig(device="cuda", precision="bf16")
    prepare_model(model, compute, cuda)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_pinned() for p in outer.params)
    trainer = Trainer(model, tok, TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=0), compute=compute)
    trainer.train_steps(3, iter(lambda: ["12+3=15", "7*8=56", "40-2=38", "9+9=18"], None))
    pseudo = outer.pseudo_gradient(model)
    for s, g, p in zip(outer.params, pseudo, model.parameters()):
        assert g.device.type == "cpu" and g.dtype == torch.float32
        assert torch.equal(g, s - p.detach().float().cpu())
    outer.step(pseudo)
    outer.load_into(model)
    for s, p in zip(outer.params, model.parameters()):
        assert p.is_cuda and p.dtype == torch.bfloat16 and torch.equal(p.detach().cpu(), s.to(torch.bfloat16))
    host = host_model(model)
    outer.load_into(host)
    assert all(torch.equal(h.detach(), s) for h, s in zip(host.parameters(), outer.params))


def _run(tmp_path, name: str, workers: int, **over) -> tuple[RunStorage, Path, list[set[str]]]:
    """A bf16-mixed CUDA run of ``workers`` to its end: its storage, its logs and each step's digests."""
    base = {
        "storage.url": f"file://{tmp_path}/runs", "run_name": name,
        "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 4,
        "model.intermediate_size": 128, "train.batch_size": 16, "train.warmup_steps": 2,
        "compute.device": "cuda", "compute.precision": "bf16-mixed",
        "diloco.workers": workers, "diloco.inner_steps": 10, "diloco.outer_steps": 3,
        "diloco.heartbeat_interval": 0.5, "diloco.heartbeat_timeout": 5,
        "diloco.collective_timeout": 30, "diloco.boundary_timeout": 120, **over,
    }
    cfg = load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in base.items()], environ={})
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    logs = worker_log_dir(storage)
    assert logs is not None
    c = Coordinator(cfg, worker_launcher(logs))
    names = [f"w{i}" for i in range(workers)]
    try:
        c.start()
        codes = c.watch(timeout=400)
        assert codes == dict.fromkeys(names, EXIT_DONE), "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
        digests = [{c.store.get(f"digest/{t}/{w}").decode() for w in names} for t in range(3)]
    finally:
        c.close()
    return storage, logs, digests


def test_two_cuda_workers_in_bf16_mixed_commit_identical_fp32_checkpoints(tmp_path):
    storage, logs, digests = _run(tmp_path, "cuda", 2)
    assert all(len(d) == 1 for d in digests), digests
    count = torch.cuda.device_count()
    for rank, w in enumerate(("w0", "w1")):
        assert f"device cuda:{rank % count}" in (logs / f"{w}.log").read_text()
    assert storage.complete_steps(CHECKPOINTS) == [0, 1, 2, 3]
    model, _ = fetch(storage, 3)
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}
    for w in ("w0", "w1"):
        rows = [json.loads(line) for line in storage.read_text(metrics_series(w)).splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(r["tokens"] > 0 and 0 < r["mfu"] < 1 and 0 < r["compute_utilization"] <= 1 for r in rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks of a worker need a GPU each (NCCL refuses two "
                    "ranks on one device)")
def test_workers_of_two_cuda_ranks_shard_the_model_and_commit_identical_checkpoints(tmp_path):
    """FSDP2 over NCCL inside each worker, one gloo ring per local rank across workers: as many workers
    of two ranks as the GPUs hold (one of two GPUs: a single worker, its rings alone)."""
    workers = min(2, torch.cuda.device_count() // 2)
    storage, logs, digests = _run(tmp_path, "fsdp", workers, **{"diloco.ranks_per_worker": 2})
    names = [f"w{i}" for i in range(workers)]
    assert all(len(d) == 1 for d in digests), digests
    for i, w in enumerate(names):  # worker i's ranks on GPUs 2i and 2i+1
        text = (logs / f"{w}.log").read_text()
        assert f"device cuda:{2 * i}" in text and f"device cuda:{2 * i + 1}" in text, text[-3000:]
    model, _ = fetch(storage, 3)
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}
    rows = [json.loads(line) for line in storage.read_text(metrics_series("w0")).splitlines()]
    for r in rows:
        print(f"fsdp worker w0 step {r['step']}: {r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.4f}, "
              f"peak GPU memory {r['device_memory_mb']:.0f} MiB")
    assert all(r["tokens"] > 0 and 0 < r["mfu"] < 1 and r["device_memory_mb"] > 0 for r in rows)
