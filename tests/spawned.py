"""Spawned test processes (real ranks on 127.0.0.1): start them, wait up to a deadline, kill the hung."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def run_spawned(target: Callable[..., None], args: Sequence[tuple[Any, ...]], deadline: float) -> None:
    """Run ``target(*a)`` for each ``a`` of ``args`` in its own spawned process; fail if any is still
    running ``deadline`` seconds after the start (it is killed first, so none outlives the test)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"processes {hung} still running after {deadline}s"
