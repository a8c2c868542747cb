"""The tiny DiLoCo run that the reliability and attack tests share (test_diloco_elastic.py,
test_diloco_attacks.py, test_rendezvous_scopes.py), and what they read back from it."""

from __future__ import annotations

from intellect.config import load_config
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import Coordinator


def run_cfg(tmp_path, **over) -> DilocoRunConfig:
    base = {
        "storage.url": f"file://{tmp_path}/runs",
        "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
        "model.intermediate_size": 64, "train.batch_size": 8, "train.warmup_steps": 2,
        "diloco.workers": 2, "diloco.inner_steps": 4, "diloco.outer_steps": 3,
        "diloco.heartbeat_interval": 0.3, "diloco.heartbeat_timeout": 2.5,
        "diloco.collective_timeout": 6, "diloco.boundary_timeout": 30,
    }
    base.update(over)
    return load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in base.items()], environ={})


def digests(coord: Coordinator, step: int) -> dict[str, str]:
    out = {}
    for w in coord.handles:
        key = f"digest/{step}/{w}"
        if coord.store.check([key]):
            out[w] = coord.store.get(key).decode()
    return out


def logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
