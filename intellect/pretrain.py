"""Single-machine pretraining (the synthetic task or a text corpus), with checkpoints in run storage.

The smoke run's steps, each a plain function over run storage so that a Prefect task, a script or a
test can call it: build and publish the initial checkpoint (training the corpus's BPE tokenizer first
when a text run needs one), train from a checkpoint on the configured device and precision, evaluate
a checkpoint (held-out loss and perplexity; for arithmetic also greedy accuracy), and measure pass@k
rates on held-out prompts (arithmetic). Checkpoints are those of :mod:`intellect.checkpoints`,
always published from the CPU in the precision's weight dtype (fp32, or bf16 for ``bf16``). Each
training step writes one row of the JSONL series :data:`METRICS_SERIES` (:class:`~intellect.metrics.MetricsLog`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import PretrainedConfig

from intellect.checkpoints import CHECKPOINTS, TRAIN_REPORT, fetch, publish
from intellect.config import SmokeConfig
from intellect.data.arithmetic import documents, heldout_problems
from intellect.data.text import PackedStream, heldout_batches
from intellect.device import prepare_model, resolve_device
from intellect.metrics import MetricsLog, flops_per_token, mfu, peak_flops
from intellect.model.bpe import ensure_tokenizer
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage
from intellect.train import Batch, evaluate, heldout_loss, pass_counts, perplexity, train

METRICS_SERIES = "metrics/pretrain.jsonl"  # one row per logged step, in run storage


def init_checkpoint(cfg: SmokeConfig, storage: RunStorage) -> int:
    """Build the configured model and publish it as step 0 (kept if already there). A text run whose
    ``model.tokenizer`` folder does not exist yet trains it on the corpus first."""
    if not storage.is_stable(0, CHECKPOINTS):
        if cfg.data.kind == "text" and cfg.model.tokenizer and not Path(cfg.model.tokenizer).is_dir():
            ensure_tokenizer(cfg.model.tokenizer, cfg.data, cfg.model.tokenizer_vocab)
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
    mfu: float | None = None  # model FLOPs utilization of the whole run (None: not measured)
    device: str = ""
    precision: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def training_batches(cfg: SmokeConfig, tokenizer) -> Iterator[Batch]:
    """Endless training batches of ``cfg.train.batch_size`` rows: lists of arithmetic texts, or packed
    batch dicts of the text corpus's train split."""
    n = cfg.train.batch_size
    if cfg.data.kind == "text":
        stream = PackedStream(cfg.data, tokenizer)
        return iter(lambda: stream.next_batch(n), None)
    docs = documents(cfg.data)
    return iter(lambda: [next(docs) for _ in range(n)], None)


class StepMetrics:
    """Per-step throughput of a run (tokens/s, MFU) on top of the trainer's log, and its totals.

    Model FLOPs per token depend on the sequence length: the packed length for text, and for the
    padded arithmetic batches the mean target tokens per row (padding is not work)."""

    def __init__(self, config: PretrainedConfig, cfg: SmokeConfig, peak: float):
        self.config, self.cfg, self.peak = config, cfg, peak
        self._per_token: dict[int, float] = {}
        self.flops = 0.0

    def seq_len(self, tokens: int) -> int:
        if self.cfg.data.kind == "text":
            return self.cfg.data.text.seq_len
        return max(1, round(tokens / self.cfg.train.batch_size) + 1)  # + 1: the first token is no target

    def per_token(self, seq_len: int) -> float:
        if seq_len not in self._per_token:
            self._per_token[seq_len] = flops_per_token(self.config, seq_len)
        return self._per_token[seq_len]

    def row(self, log: dict) -> dict:
        tokens, seconds = int(log["tokens"]), float(log["seconds"])
        flops = tokens * self.per_token(self.seq_len(tokens))
        self.flops += flops
        tps = tokens / seconds if seconds > 0 else 0.0
        util = mfu(tps, self.per_token(self.seq_len(tokens)), self.peak)
        return {"loss": log["loss"], "lr": log["lr"], "grad_norm": log["grad_norm"], "tokens": tokens,
                "tokens_per_s": tps, "mfu": util, "seconds": seconds}


def pretrain(
    cfg: SmokeConfig,
    storage: RunStorage,
    from_step: int,
    on_step: Callable[[int, dict], None] | None = None,
) -> PretrainOutcome:
    """Train ``cfg.train.steps`` steps from checkpoint ``from_step``; publish the result.

    ``on_step(step, row)`` gets the trainer's 1-based step count and the metrics row of that step
    (loss, lr, grad_norm, tokens, tokens_per_s, mfu, seconds), which also goes to
    :data:`METRICS_SERIES` every ``logging.every`` steps (and at the last step) under the run's
    global step. Idempotent: when the target checkpoint is already complete (a retried task, a rerun
    of the same run) it is reused and its saved report returned.
    """
    step = from_step + cfg.train.steps
    if storage.is_stable(step, CHECKPOINTS):
        saved = json.loads(storage.read_text(f"{storage.step_path(step, CHECKPOINTS)}/{TRAIN_REPORT}"))
        return PretrainOutcome(**{**saved, "resumed": True})
    device = resolve_device(cfg.compute.device)
    model, tok = fetch(storage, from_step)
    if cfg.data.kind == "text" and cfg.data.text.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"data.text.seq_len ({cfg.data.text.seq_len}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    prepare_model(model, cfg.compute, device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # before the CPU's peak is measured with that many
    metrics = StepMetrics(model.config, cfg, peak_flops(device, cfg.compute.precision, cfg.compute.peak_tflops))
    with MetricsLog(storage, METRICS_SERIES, cfg.logging) as series:
        def record(n: int, log: dict) -> None:
            row = metrics.row(log)
            series.log(from_step + n, row, force=n == cfg.train.steps)
            if on_step:
                on_step(n, row)

        result = train(model, tok, cfg.train, training_batches(cfg, tok), record, cfg.compute)
    outcome = PretrainOutcome(
        step=step,
        seconds=result.seconds,
        tokens=result.tokens,
        first_loss=result.history[0]["loss"],
        final_loss=result.history[-1]["loss"],
        mfu=mfu(result.tokens / result.seconds, metrics.flops / max(result.tokens, 1), metrics.peak)
        if result.seconds > 0 else 0.0,
        device=str(device),
        precision=cfg.compute.precision,
    )
    prepare_model(model, cfg.compute, torch.device("cpu"), train=False)  # published in the weight dtype
    publish(model.eval(), tok, storage, step, {TRAIN_REPORT: asdict(outcome)})
    return outcome


def _placed(cfg: SmokeConfig, storage: RunStorage, step: int):
    """Checkpoint ``step``'s model on the configured device for inference, and its tokenizer."""
    model, tok = fetch(storage, step)
    return prepare_model(model, cfg.compute, resolve_device(cfg.compute.device), train=False), tok


def heldout_eval(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Held-out loss and perplexity of checkpoint ``step`` (``tokens`` target tokens over ``n``
    sequences or problems); for arithmetic also greedy exact-match ``accuracy`` (None for text)."""
    model, tok = _placed(cfg, storage, step)
    t0 = time.perf_counter()
    if cfg.data.kind == "text":
        res = heldout_loss(model, heldout_batches(cfg.data, tok))
        return {"step": step, "loss": res.loss, "perplexity": res.perplexity, "accuracy": None,
                "n": res.sequences, "tokens": res.tokens, "seconds": time.perf_counter() - t0}
    ev = evaluate(model, tok, heldout_problems(cfg.data, cfg.train.eval_size))
    return {"step": step, "loss": ev.loss, "perplexity": perplexity(ev.loss), "accuracy": ev.accuracy,
            "n": ev.n, "tokens": ev.tokens, "seconds": time.perf_counter() - t0}


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
    """Sample ``k`` answers per held-out prompt and report how the pass counts spread (arithmetic only:
    a text corpus has no answers to check)."""
    if cfg.data.kind != "arithmetic":
        raise ValueError(f"pass rates need the arithmetic task (data.kind = {cfg.data.kind!r})")
    k = cfg.pass_at_k_samples
    model, tok = _placed(cfg, storage, step)
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
