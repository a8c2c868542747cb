"""An inference worker of an RL run: a process that turns published checkpoints into submissions.

For each step ``n`` from ``first`` to ``cfg.steps - 1`` the worker waits until a checkpoint the lag
rule allows for ``n`` is complete (in run storage, or on the SHARDCAST relays when ``cfg.shardcast``
is set: :mod:`intellect.rl.weights`) (:func:`~intellect.rl.lag.policy_for`: the newest of
``n - async_level .. n``), loads it if it is newer than the one it holds, and writes its
submissions and done marker (:func:`~intellect.rl.step.worker_step`). With ``async_level = 2`` the
worker runs up to two steps ahead of the trainer; with 0 it waits for every update. A step whose
done marker exists is skipped, so a restarted worker resumes where it stopped.

It talks to the trainer only through run storage, as an untrusted machine would: nothing it writes
is believed before the validator has checked it.

    python -m intellect.rl.worker --config run.json --worker worker-a --first 0

exits 0 after the last step, 3 when no fresh checkpoint appears within
``workers.checkpoint_timeout``, 4 when the relays cannot deliver one, and on its own when the process that started it dies (so a killed
flow leaves no generator behind).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from intellect.rl.assignment import canonical_worker
from intellect.rl.config import RLRunConfig
from intellect.rl.lag import policy_for
from intellect.rl.rollouts import RolloutLimits
from intellect.rl.setup import local_run_dir, run_storage, task_pool
from intellect.rl.step import EngineFactory, done_marker, worker_engines, worker_step
from intellect.rl.submission import RewardFn, math_task_reward
from intellect.rl.weights import WeightSource, weight_source
from intellect.shardcast.client import ShardcastError

log = logging.getLogger("intellect.rl.worker")

EXIT_NO_CHECKPOINT = 3
EXIT_NO_WEIGHTS = 4


class CheckpointTimeout(TimeoutError):
    pass


def wait_for_policy(weights: WeightSource, step: int, async_level: int, timeout: float, poll: float,
                    stop: Callable[[], bool] = lambda: False) -> int | None:
    """The checkpoint to generate ``step`` with, once one is complete (None when ``stop()`` says so)."""
    deadline = time.monotonic() + timeout
    while True:
        policy = policy_for(step, async_level, weights.complete_steps())
        if policy is not None:
            return policy
        if stop():
            return None
        if time.monotonic() > deadline:
            raise CheckpointTimeout(f"no checkpoint within {async_level} of step {step} after {timeout:.0f} s")
        time.sleep(poll)


def run_worker(
    cfg: RLRunConfig,
    worker: str,
    first: int = 0,
    *,
    engine_factory: EngineFactory | None = None,
    reward_fn: RewardFn = math_task_reward,
    stop: Callable[[], bool] = lambda: False,
) -> list[dict]:
    """Generate steps ``first .. cfg.steps - 1`` as ``worker``; returns one record per step it generated."""
    storage = run_storage(cfg)
    tasks = task_pool(cfg.tasks, storage)
    weights = weight_source(cfg, storage, local_run_dir(cfg) / "weights" / canonical_worker(worker))
    held, engine, tok, limits = None, None, None, None
    out = []
    try:
        for step in range(first, cfg.steps):
            if stop():
                break
            if storage.exists(done_marker(step, worker)):
                continue
            t0 = time.perf_counter()
            policy = wait_for_policy(weights, step, cfg.async_level, cfg.workers.checkpoint_timeout,
                                     cfg.workers.poll_interval, stop)
            if policy is None:
                break
            waited = time.perf_counter() - t0
            loaded = 0.0
            if policy != held:
                t = time.perf_counter()
                model, tok = weights.load(policy)
                loaded = time.perf_counter() - t
                engine, held = (engine_factory or worker_engines(cfg))(model, tok), policy
                limits = cfg.limits or RolloutLimits(vocab_size=len(tok))
            t1 = time.perf_counter()
            files, written = worker_step(cfg, storage, step, worker, tasks, engine, tok, policy, limits=limits,
                                         reward_fn=reward_fn)
            rec = {"step": step, "policy_step": policy, "files": len(files), "written": len(written),
                   "waited": round(waited, 3), "load_seconds": round(loaded, 3),
                   "seconds": round(time.perf_counter() - t1, 3)}
            log.info("worker %s %s", worker, rec)
            out.append(rec)
    finally:
        weights.close()
    return out


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)  # orphaned: the flow that started us is gone

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intellect.rl.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="RLRunConfig as JSON (written by the flow).")
    ap.add_argument("--worker", required=True)
    ap.add_argument("--first", type=int, default=0, help="First step to generate.")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per shard request otherwise
    _exit_with_parent()
    cfg = RLRunConfig.model_validate_json(Path(args.config).read_text())
    torch.set_num_threads(cfg.workers.threads)
    try:
        run_worker(cfg, args.worker, args.first)
    except CheckpointTimeout as e:
        log.error("worker %s: %s", args.worker, e)
        return EXIT_NO_CHECKPOINT
    except ShardcastError as e:
        log.error("worker %s: %s", args.worker, e)
        return EXIT_NO_WEIGHTS
    return 0


if __name__ == "__main__":
    sys.exit(main())
