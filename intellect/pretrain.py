"""Single-machine pretraining (the synthetic task or a text corpus), with checkpoints in run storage.

The smoke run's steps, each a plain function over run storage so that a Prefect task, a script or a
test can call it: build and publish the initial checkpoint (training the corpus's BPE tokenizer first
when a text run needs one), train from a checkpoint on the configured device and precision, evaluate
a checkpoint (held-out loss and perplexity; for arithmetic also greedy accuracy), and measure pass@k
rates on held-out prompts (arithmetic). Checkpoints are those of :mod:`intellect.checkpoints`, in the
precision's weight dtype (fp32, or bf16 for ``bf16``); mid-phase ones (``checkpoint_every``) also hold
the AdamW state and the data stream's position (:mod:`intellect.data.stream`), so a killed phase
resumes exactly. Each training step writes one row of the JSONL series :data:`METRICS_SERIES`
(:class:`~intellect.metrics.MetricsLog`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PretrainedConfig

from intellect.checkpoints import (CHECKPOINTS, DATA_STATE, OPTIMIZER, PHASE, TRAIN_REPORT, fetch, publish,
                                   verified_copy)
from intellect.config import SmokeConfig
from intellect.data.arithmetic import heldout_problems
from intellect.data.stream import open_stream, resume_stream
from intellect.data.text import heldout_batches
from intellect.device import prepare_model, resolve_device, resolve_precision
from intellect.metrics import MetricsLog, Peak, flops_per_token, mfu
from intellect.model.bpe import ensure_tokenizer
from intellect.model.checkpoint import build_model, load_checkpoint_copy
from intellect.progress import Progress
from intellect.prompts import chat_tasks
from intellect.storage import STABLE, RunStorage
from intellect.train import Trainer, evaluate, heldout_loss, pass_counts, perplexity

METRICS_SERIES = "metrics/pretrain.jsonl"  # one row per logged step, in run storage


def init_checkpoint(cfg: SmokeConfig, storage: RunStorage) -> int:
    """Build the configured model and publish it as step 0 (kept if already there). A text or chat run
    whose ``model.tokenizer`` folder does not exist yet trains it on its documents first."""
    if not storage.is_stable(0, CHECKPOINTS):
        if (cfg.data.kind == "text" or cfg.data.chat) and cfg.model.tokenizer and not Path(cfg.model.tokenizer).is_dir():
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


class StepMetrics:
    """Per-step throughput of a run (tokens/s, MFU) on top of the trainer's log, and its totals.

    Model FLOPs per token depend on the sequence length: the packed length for text, and for the
    padded arithmetic batches the mean target tokens per row (padding is not work)."""

    def __init__(self, config: PretrainedConfig, cfg: SmokeConfig, peak: Peak):
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
        util = self.peak.mfu(tps, self.per_token(self.seq_len(tokens)))
        return {"loss": log["loss"], "lr": log["lr"], "grad_norm": log["grad_norm"], "tokens": tokens,
                "tokens_per_s": tps, "mfu": util, "seconds": seconds}


class PhaseProgress(BaseModel):
    """The :data:`~intellect.checkpoints.PHASE` sidecar of a mid-phase checkpoint: which phase it belongs
    to (its start step and a fingerprint of the settings that decide the batches and the updates) and
    the phase's totals so far, so a resumed phase reports the whole phase."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_step: int = Field(ge=0, description="Checkpoint the phase started from.")
    steps: int = Field(ge=1, description="Training steps of the whole phase.")
    done: int = Field(ge=1, description="Training steps done when this checkpoint was written.")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="phase_fingerprint() of the run's settings.")
    tokens: int = Field(ge=0, description="Target tokens trained on so far.")
    seconds: float = Field(ge=0, description="Training seconds so far.")
    flops: float = Field(ge=0, description="Model FLOPs so far.")
    first_loss: float = Field(description="Loss of the phase's first step.")


def phase_fingerprint(cfg: SmokeConfig) -> str:
    """sha256 of what must not change for a resumed phase to equal an unkilled one: the training and
    data settings and the precision (the device may change: a CPU phase can resume on a GPU)."""
    parts = [cfg.train.model_dump(mode="json"), cfg.data.model_dump(mode="json"), cfg.compute.precision]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _mid_phase(storage: RunStorage, from_step: int, steps: int, fingerprint: str) -> tuple[int, PhaseProgress] | None:
    """The newest complete checkpoint strictly inside the phase and its progress, if there is one. A
    checkpoint there that this phase did not write is an error: publishing over it is impossible."""
    for s in reversed(storage.complete_steps(CHECKPOINTS)):
        if not from_step < s < from_step + steps:
            continue
        where = storage.uri(storage.step_path(s, CHECKPOINTS))
        rel = f"{storage.step_path(s, CHECKPOINTS)}/{PHASE}"
        if not storage.exists(rel):
            raise ValueError(f"checkpoint {where} lies inside the phase {from_step}..{from_step + steps} but is no "
                             "mid-phase checkpoint of it: delete it or use another run_name")
        progress = PhaseProgress.model_validate_json(storage.read_bytes(rel))
        if (progress.from_step, progress.steps, progress.done) != (from_step, steps, s - from_step):
            raise ValueError(f"checkpoint {where} belongs to another phase (from step {progress.from_step}, "
                             f"{progress.steps} steps): delete it or use another run_name")
        if progress.fingerprint != fingerprint:
            raise ValueError(f"checkpoint {where} was written with other train, data or precision settings: "
                             "resume with those, or delete it or use another run_name")
        return s, progress
    return None


def _json_or_none(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _drop(storage: RunStorage, steps: list[int]) -> None:
    """Delete complete checkpoints: ``STABLE`` first, so no reader takes a half-deleted one."""
    for s in steps:
        rel = storage.step_path(s, CHECKPOINTS)
        storage.delete(f"{rel}/{STABLE}")
        storage.delete(rel, recursive=True)


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

    With ``cfg.checkpoint_every`` every that many steps a mid-phase checkpoint is published (weights,
    AdamW state with the step count and the generator, the data stream's position, the phase's
    totals; only the newest is kept, and none once the phase is done). A phase killed at any point
    resumes from the newest one: the same next batches and, in fp32 on the CPU, the same weights.
    The phase's own checkpoint keeps the stream's position too, so a next phase from it reads on
    (unless it reads other data: then from the start).
    """
    steps, step = cfg.train.steps, from_step + cfg.train.steps
    if storage.is_stable(step, CHECKPOINTS):
        saved = json.loads(storage.read_text(f"{storage.step_path(step, CHECKPOINTS)}/{TRAIN_REPORT}"))
        return PretrainOutcome(**{**saved, "resumed": True})
    fingerprint = phase_fingerprint(cfg)
    resume = _mid_phase(storage, from_step, steps, fingerprint)
    bar = Progress("pretrain", steps, start=resume[1].done if resume else 0, interval=cfg.logging.progress_seconds,
                   every=cfg.logging.progress_steps, heartbeat=True)
    bar.begin(f"{steps} steps from checkpoint {from_step}" + (f", resuming after step {resume[1].done}" if resume else "")
              + f" (device {cfg.compute.device}, precision {cfg.compute.precision}); loading the model and the data")
    with bar:
        return _train_phase(cfg, storage, from_step, on_step, resume, bar)


def _train_phase(cfg: SmokeConfig, storage: RunStorage, from_step: int, on_step: Callable[[int, dict], None] | None,
                 resume: tuple[int, PhaseProgress] | None, bar: Progress) -> PretrainOutcome:
    """The body of :func:`pretrain` once the phase's position is known, reporting to ``bar``."""
    steps, step, fingerprint = cfg.train.steps, from_step + cfg.train.steps, phase_fingerprint(cfg)
    device = resolve_device(cfg.compute.device)
    with verified_copy(storage, resume[0] if resume else from_step) as folder:
        model, tok = load_checkpoint_copy(folder)
        if cfg.data.kind == "text" and cfg.data.text.seq_len > model.config.max_position_embeddings:
            raise ValueError(f"data.text.seq_len ({cfg.data.text.seq_len}) exceeds the model's "
                             f"max_position_embeddings ({model.config.max_position_embeddings})")
        prepare_model(model, cfg.compute, device)
        trainer = Trainer(model, tok, cfg.train, cfg.compute)
        stream = open_stream(cfg.data, tok)
        if resume:
            trainer.load_state_bytes((folder / OPTIMIZER).read_bytes())
            stream.load_state_dict(json.loads((folder / DATA_STATE).read_text()))
        elif from_step and (folder / DATA_STATE).is_file():
            # a next phase reads on where the previous one stopped, unless it reads other data
            stream = resume_stream(stream, _json_or_none(folder / DATA_STATE), lambda: open_stream(cfg.data, tok))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # before the CPU's peak is measured with that many
    if not resume:
        torch.manual_seed(cfg.train.seed)
    bar.waiting("measuring the peak FLOP/s")
    metrics = StepMetrics(model.config, cfg, Peak.of(device, cfg.compute.precision, cfg.compute.peak_tflops))
    done = resume[1] if resume else None
    tokens, seconds = (done.tokens, done.seconds) if done else (0, 0.0)
    first_loss, metrics.flops = (done.first_loss, done.flops) if done else (math.nan, 0.0)
    mids = [resume[0]] if resume else []
    last_loss = math.nan
    with MetricsLog(storage, METRICS_SERIES, cfg.logging) as series:
        while trainer.step < steps:
            log = trainer.train_step(stream.next_batch(cfg.train.batch_size))
            n = trainer.step
            row = metrics.row(log)
            tokens, seconds = tokens + int(log["tokens"]), seconds + float(log["seconds"])
            last_loss, first_loss = log["loss"], log["loss"] if n == 1 else first_loss
            series.log(from_step + n, row, force=n == steps or (cfg.checkpoint_every > 0 and n % cfg.checkpoint_every == 0))
            bar.update(n, tokens=int(log["tokens"]), loss=log["loss"])
            if on_step:
                on_step(n, row)
            if cfg.checkpoint_every and n % cfg.checkpoint_every == 0 and n < steps:
                bar.waiting(f"publishing checkpoint {from_step + n}")
                series.flush()  # the series up to the checkpoint survives a kill right after it
                progress = PhaseProgress(from_step=from_step, steps=steps, done=n, fingerprint=fingerprint,
                                         tokens=tokens, seconds=seconds, flops=metrics.flops, first_loss=first_loss)
                publish(model, tok, storage, from_step + n, {OPTIMIZER: trainer.state_bytes(),
                                                             DATA_STATE: stream.state_dict(), PHASE: progress})
                _drop(storage, mids)
                mids = [from_step + n]
    bar.waiting("measuring the peak FLOP/s")
    peak = metrics.peak.remeasure()
    outcome = PretrainOutcome(
        step=step,
        seconds=seconds,
        tokens=tokens,
        first_loss=first_loss,
        final_loss=last_loss,
        mfu=min(1.0, mfu(tokens / seconds, metrics.flops / max(tokens, 1), peak)) if seconds > 0 else 0.0,
        device=str(device),
        precision=resolve_precision(cfg.compute.precision, device),
    )
    bar.waiting(f"publishing checkpoint {step}")
    prepare_model(model, cfg.compute, torch.device("cpu"), train=False)  # published in the weight dtype
    # the data position goes with the phase's result, so that a next phase reads on instead of re-reading
    publish(model.eval(), tok, storage, step, {TRAIN_REPORT: asdict(outcome), DATA_STATE: stream.state_dict()})
    _drop(storage, mids)
    return outcome


def _placed(cfg: SmokeConfig, storage: RunStorage, step: int):
    """Checkpoint ``step``'s model on the configured device for inference, and its tokenizer."""
    model, tok = fetch(storage, step)
    return prepare_model(model, cfg.compute, resolve_device(cfg.compute.device), train=False), tok


def _heldout(cfg: SmokeConfig, tok, n: int) -> list:
    """The first ``n`` held-out problems, as one-turn chats with ``data.chat``."""
    problems = heldout_problems(cfg.data, n)
    return chat_tasks(tok, problems) if cfg.data.chat else problems


def heldout_eval(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Held-out loss and perplexity of checkpoint ``step`` (``tokens`` target tokens over ``n``
    sequences or problems); for arithmetic also greedy exact-match ``accuracy`` (None for text)."""
    text = cfg.data.kind == "text"
    size = cfg.data.text.eval_sequences if text else 2 * cfg.train.eval_size
    bar = Progress(f"held-out eval of checkpoint {step}", size, unit="sequence" if text else "item",
                   interval=cfg.logging.progress_seconds, heartbeat=True)
    bar.begin(f"loading the model; then {cfg.data.text.eval_sequences} held-out sequences of the corpus" if text
              else f"loading the model; then loss and greedy answers on {cfg.train.eval_size} held-out problems")
    with bar:
        model, tok = _placed(cfg, storage, step)
        t0 = time.perf_counter()
        if text:
            bar.waiting("reading the held-out split of the corpus")
            res = heldout_loss(model, heldout_batches(cfg.data, tok), bar)
            return {"step": step, "loss": res.loss, "perplexity": res.perplexity, "accuracy": None,
                    "n": res.sequences, "tokens": res.tokens, "seconds": time.perf_counter() - t0}
        ev = evaluate(model, tok, _heldout(cfg, tok, cfg.train.eval_size), progress=bar)
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
    tasks = _heldout(cfg, tok, cfg.pass_at_k_prompts)
    t0 = time.perf_counter()
    with (torch.random.fork_rng(devices=[]),
          Progress(f"pass@{k} of checkpoint {step}", k * len(tasks), unit="sample",
                   interval=cfg.logging.progress_seconds, heartbeat=True) as bar):
        counts = pass_counts(model, tok, tasks, k=k, temperature=cfg.temperature, seed=cfg.data.seed, progress=bar)
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
