"""Single-machine pretraining on the synthetic task, with checkpoints in run storage.

The smoke run's steps, each a plain function over run storage so that a Prefect task, a script or a
test can call it: build and publish the initial checkpoint, train from a checkpoint, evaluate a
checkpoint, and measure pass@k rates on held-out prompts. Checkpoints are those of
:mod:`intellect.checkpoints`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from intellect.checkpoints import CHECKPOINTS, TRAIN_REPORT, fetch, publish
from intellect.config import SmokeConfig
from intellect.data.arithmetic import documents, heldout_problems
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage
from intellect.train import evaluate, pass_counts, train


def init_checkpoint(cfg: SmokeConfig, storage: RunStorage) -> int:
    """Build the configured model and publish it as step 0 (kept if already there)."""
    if not storage.is_stable(0, CHECKPOINTS):
        model, tok = build_model(cfg.model)
        publish(model, tok, storage, 0)
    return 0


@dataclass(frozen=True)
class PretrainOutcome:
    step: int
    seconds: float
    tokens: int
    first_loss: float
    final_loss: float
    resumed: bool = False  # True when the target checkpoint already existed and was reused

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pretrain(
    cfg: SmokeConfig,
    storage: RunStorage,
    from_step: int,
    on_step: Callable[[int, dict], None] | None = None,
) -> PretrainOutcome:
    """Train ``cfg.train.steps`` steps from checkpoint ``from_step``; publish the result.

    Idempotent: when the target checkpoint is already complete (a retried task,
    a rerun of the same run) it is reused and its saved report returned.
    """
    step = from_step + cfg.train.steps
    if storage.is_stable(step, CHECKPOINTS):
        saved = json.loads(storage.read_text(f"{storage.step_path(step, CHECKPOINTS)}/{TRAIN_REPORT}"))
        return PretrainOutcome(**{**saved, "resumed": True})
    model, tok = fetch(storage, from_step)
    docs = documents(cfg.data)
    batches = iter(lambda: [next(docs) for _ in range(cfg.train.batch_size)], None)
    result = train(model, tok, cfg.train, batches, on_step)
    outcome = PretrainOutcome(
        step=step,
        seconds=result.seconds,
        tokens=result.tokens,
        first_loss=result.history[0]["loss"],
        final_loss=result.history[-1]["loss"],
    )
    publish(model.eval(), tok, storage, step, {TRAIN_REPORT: asdict(outcome)})
    return outcome


def heldout_eval(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Held-out loss and greedy exact-match accuracy of checkpoint ``step``."""
    model, tok = fetch(storage, step)
    t0 = time.perf_counter()
    res = evaluate(model, tok, heldout_problems(cfg.data, cfg.train.eval_size))
    return {"step": step, "loss": res.loss, "accuracy": res.accuracy, "n": res.n,
            "seconds": time.perf_counter() - t0}


def pass_rate_window(counts: list[int], low: int = 1, high: int = 4) -> float:
    """Share of prompts whose pass count (solves among their samples) is between ``low`` and ``high``.

    The RL stage learns only from such prompts (the pass@k filter of INTELLECT-2).

    >>> pass_rate_window([0, 1, 4, 5, 8, 2])
    0.5
    """
    if not counts:
        return 0.0
    return sum(low <= c <= high for c in counts) / len(counts)


def pass_rate_report(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Sample ``k`` answers per held-out prompt and report how the pass counts spread."""
    k = cfg.pass_at_k_samples
    model, tok = fetch(storage, step)
    tasks = heldout_problems(cfg.data, cfg.pass_at_k_prompts)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        counts = pass_counts(model, tok, tasks, k=k, temperature=cfg.temperature, seed=cfg.data.seed)
    histogram = [counts.count(c) for c in range(k + 1)]
    return {
        "step": step,
        "k": k,
        "prompts": len(tasks),
        "temperature": cfg.temperature,
        "histogram": histogram,
        "share_in_window": pass_rate_window(counts, 1, k // 2),
        "mean_pass_rate": sum(counts) / (k * len(tasks)),
        "seconds": time.perf_counter() - t0,
    }
