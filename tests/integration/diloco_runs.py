"""The tiny DiLoCo run that the reliability and attack tests share (test_diloco_elastic.py,
test_diloco_attacks.py, test_rendezvous_scopes.py), and what they read back from it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from diloco_faults import FaultPlan, stall_marker

from intellect.config import load_config
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, Coordinator


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


def wait_progress(coord: Coordinator, at_least: int, timeout: float = 120) -> None:
    """Until the run committed ``at_least`` outer steps (while some worker still runs)."""
    deadline = time.monotonic() + timeout
    while (coord.progress() or 0) < at_least:
        assert time.monotonic() < deadline, f"no progress to {at_least} (now {coord.progress()})"
        assert any(h.poll() is None for h in coord.handles.values()), "every worker exited"
        time.sleep(0.1)


def wait_for(marker: Path, tmp_path, timeout: float = 120) -> None:
    """Until ``marker`` exists (a scripted fault's: ``diloco_faults.stall_marker``)."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.05)


def killed_in_reduction(coordinator: Callable[..., Coordinator], cfg: DilocoRunConfig, tmp_path, step: int = 1,
                        worker: str = "w2") -> tuple[Coordinator, dict]:
    """Run ``cfg`` (through the test's ``coordinator(cfg, faults=...)``) with ``worker`` stalled inside step
    ``step``'s all-reduce, every member ready, SIGKILL it there, and wait until the others finish: the
    coordinator, and w0's report of that step."""
    c = coordinator(cfg, faults=FaultPlan(stall_step=step, stall_worker=worker, stall_marker=str(tmp_path)))
    c.start()
    wait_for(stall_marker(tmp_path, step, worker), tmp_path)
    c.handles[worker].kill()  # SIGKILL
    codes = c.watch(timeout=180)
    assert all(code == EXIT_DONE for w, code in codes.items() if w != worker), logs(tmp_path)
    return c, json.loads(c.store.get(f"metrics/{step}/w0"))
