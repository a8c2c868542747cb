"""Throughput metrics (model FLOPs per token, the device's peak, MFU) and the per-step metrics log.

MFU is the model FLOPs a run achieves over what the device could do:
``mfu(tokens_per_second, flops_per_token(config, seq_len), peak_flops(device, precision))``, never above 1
when a :class:`Peak` keeps the peak. Model FLOPs are counted, not hardware FLOPs: activation
recomputation and padding are overhead, not work.

:class:`MetricsLog` writes one row per step to a JSONL time series in run storage (any DuckDB,
pandas or ``jq`` reads it), and optionally to TensorBoard event files.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import time
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import torch
from transformers import PretrainedConfig

from intellect.config import LoggingConfig
from intellect.device import Precision, PrecisionSetting, autocast_dtype, measure_matmul_flops, param_dtype, resolve_precision
from intellect.model.arch import meta_model
from intellect.storage import RunStorage, normalize_rel

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------- FLOPs


def flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a model of ``config`` on ``seq_len``-token
    sequences, by PaLM's convention (Chowdhery et al. 2022, appendix B; Chinchilla's count up to its
    small softmax and embedding terms): ``6 * N + 12 * L * H * S``.

    ``N`` is every parameter outside the embedding tables (a lookup does no matmul) plus the LM head,
    counted even when it shares its weight with the input embedding, since its matmul is done either
    way. ``12 * L * H * S`` is attention's two matmuls, ``Q K^T`` and ``A V`` (2 FLOPs per
    multiply-add, 3 for forward and backward), with ``L`` layers and ``H`` = query heads x head
    width (the hidden size for most families; grouped KV heads do not shrink it). The causal mask
    is not halved out: published MFU figures (PaLM, Chinchilla, nanoGPT, torchtitan) count the full
    ``S x S`` matrix, and halving would make ours look worse than theirs for the same speed. It is
    also an upper bound where attention sees less (sliding windows, document masks) and for MoE
    families, whose ``N`` here counts every expert.

    The default tiny Llama (vocabulary 51, 4 layers of width 128, MLP 384, tied embeddings) at 64
    tokens: ``N`` = 853,120 in the blocks and final norm + 6,528 for the head = 859,648, so
    ``6 N`` = 5,157,888, plus ``12 * 4 * 128 * 64`` = 393,216:

    >>> from transformers import LlamaConfig
    >>> tiny = LlamaConfig(vocab_size=51, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    ...                    num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    >>> flops_per_token(tiny, 64)
    5551104.0
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    model = meta_model(config)
    in_tables = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    unique = {id(p): p for p in model.parameters()}
    n = sum(p.numel() for key, p in unique.items() if key not in in_tables)
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and id(weight) in in_tables:
        n += weight.numel()
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return float(6 * n + 12 * text.num_hidden_layers * heads * head_dim * seq_len)


# --------------------------------------------------------------------- peak


# Dense (no structured sparsity) peak TFLOP/s by GPU, from NVIDIA's datasheets: bf16 on tensor cores
# with fp32 accumulation, and fp32 on CUDA cores (what torch runs fp32 matmuls on unless TF32 is
# enabled). Patterns are searched in torch.cuda.get_device_name(), most specific first.
GPU_PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    (r"H100.*PCIe", 756.5, 51.2),
    (r"H100.*NVL", 835.5, 60.0),
    (r"H100", 989.4, 66.9),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"H200.*NVL", 835.5, 60.0),
    (r"H200", 989.4, 66.9),  # SXM
    (r"A100", 312.0, 19.5),
    (r"A10G", 70.0, 31.2),
    (r"L40S", 362.05, 91.6),
    (r"\bL4\b", 121.0, 30.3),
    (r"RTX 4090", 165.2, 82.6),
    (r"RTX 3090", 71.0, 35.6),
)


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype matmuls run in at ``precision``."""
    return autocast_dtype(precision) or param_dtype(precision)


def gpu_peak_flops(name: str, precision: Precision) -> float | None:
    """The table's dense peak FLOP/s of the GPU called ``name`` at ``precision``, None if unknown.

    >>> gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed"), gpu_peak_flops("NVIDIA L4", "fp32")
    (989400000000000.0, 30300000000000.0)
    >>> gpu_peak_flops("NVIDIA L40", "bf16") is None   # the L40 is not the L40S, nor the L4
    True
    """
    for pattern, bf16, fp32 in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            return (fp32 if compute_dtype(precision) == torch.float32 else bf16) * 1e12
    return None


# GPUs reach their peak only on large matmuls; a CPU may peak at any size from L2-sized to large ones,
# so it tries several, each bounded in time: where bf16 is emulated one 2048 matmul takes many seconds.
_BENCH_SIZES = {"cuda": (8192,), "cpu": (256, 512, 1024, 2048)}
_BENCH_SECONDS = {"cuda": 1.0, "cpu": 0.25}


def _measure_peak(device: torch.device, dtype: torch.dtype, fresh: bool = False) -> float:
    """The best matmul rate over the device's benchmark sizes; a size whose one matmul would take
    over a second at the rate measured so far is skipped. ``fresh`` measures again (not cached)."""
    seconds = _BENCH_SECONDS.get(device.type, 1.0)
    best = 0.0
    for size in _BENCH_SIZES.get(device.type, (2048,)):
        if best and 2.0 * size**3 / best > 1.0:
            break
        measure = measure_matmul_flops.__wrapped__ if fresh else measure_matmul_flops
        best = max(best, measure(device, dtype, size, seconds))
    return best


def peak_flops(device: torch.device, precision: PrecisionSetting, configured_tflops: float = 0.0, *,
               remeasure: bool = False) -> float:
    """Peak FLOP/s of one ``device`` at ``precision`` (``auto`` as the device decides it):
    ``configured_tflops`` when > 0 (``compute.peak_tflops``), else the table's figure for a known GPU,
    else (the CPU, an unknown GPU) a matmul benchmark in the precision's compute dtype, measured once
    per process. With ``remeasure`` the benchmark runs again and the best of all its runs counts: a
    peak measured while other processes held the cores is too low (an MFU over 100%), and a run
    re-measures at its end for the figure it reports."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    concrete = resolve_precision(precision, device)
    if device.type == "cuda":
        known = gpu_peak_flops(torch.cuda.get_device_name(device), concrete)
        if known is not None:
            return known
    key = (device, compute_dtype(concrete))
    first = _measure_peak(*key)
    if not remeasure:
        return max(first, _MEASURED.get(key, 0.0))
    _MEASURED[key] = best = max(first, _measure_peak(*key, fresh=True), _MEASURED.get(key, 0.0))
    return best


_MEASURED: dict[tuple, float] = {}  # the best re-measured peak per device and dtype, this process


class Peak:
    """A device's peak FLOP/s for MFU, which no achieved rate may exceed.

    A peak below what a run achieves is a measurement error (measured while other work held the
    cores, or at matmul sizes slower than the model's): the first time, it is logged, measured again,
    and replaced by the larger of the new measurement and the achieved rate, so :meth:`mfu` is always
    in [0, 1].

    >>> peak = Peak(1e12)
    >>> peak.mfu(tokens_per_second=100.0, flops_per_token=5e9)
    0.5
    >>> peak.mfu(tokens_per_second=400.0, flops_per_token=5e9), peak.flops   # 2e12 achieved > 1e12
    (1.0, 2000000000000.0)
    """

    def __init__(self, flops: float, device: torch.device | None = None, precision: PrecisionSetting = "fp32",
                 configured: bool = False):
        if not flops > 0:
            raise ValueError(f"peak FLOP/s must be > 0, got {flops}")
        self.flops, self.device, self.configured = flops, device, configured
        self.precision: PrecisionSetting = precision
        self.corrected = False

    @classmethod
    def of(cls, device: torch.device, precision: PrecisionSetting, configured_tflops: float = 0.0) -> Peak:
        """:func:`peak_flops` of ``device`` at ``precision``, kept honest."""
        return cls(peak_flops(device, precision, configured_tflops), device, precision, configured_tflops > 0)

    def remeasure(self) -> float:
        """Measure again (``peak_flops(..., remeasure=True)``); the peak only grows."""
        if self.device is not None and not self.configured:
            self.flops = max(self.flops, peak_flops(self.device, self.precision, remeasure=True))
        return self.flops

    def mfu(self, tokens_per_second: float, flops_per_token: float) -> float:
        achieved = tokens_per_second * flops_per_token
        if achieved > self.flops:
            before = self.flops
            if not self.corrected:
                self.corrected = True
                self.remeasure()
                _log.warning(
                    "MFU: the %s peak of %.4g FLOP/s is below the %.4g FLOP/s this run achieved, a "
                    "measurement error (%s); the peak is now %.4g FLOP/s",
                    "configured" if self.configured else "measured", before, achieved,
                    "compute.peak_tflops is too low" if self.configured
                    else "measured while other work held the device, or at slower matmul sizes than the model's",
                    max(self.flops, achieved))
            self.flops = max(self.flops, achieved)
        return mfu(tokens_per_second, flops_per_token, self.flops)


def mfu(tokens_per_second: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilization: the FLOP/s achieved over the peak.

    >>> mfu(tokens_per_second=1000.0, flops_per_token=6e9, peak=1e13)
    0.6
    """
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    return tokens_per_second * flops_per_token / peak


# --------------------------------------------------------------------- the log

TENSORBOARD_EXTRA = "pip install 'intellect[tensorboard]'"


def _json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON (non-finite floats become null: JSON has no NaN, and DuckDB rejects it)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"metric {where}: {type(value).__name__} is not a number, string, list or dict "
                    "(a tensor: pass .item())")


def _step_of(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class MetricsLog:
    """One row per logged step, appended to the JSONL time series ``name`` of ``storage``.

    Each row is ``{"step", "time" (Unix seconds), **row}``, written when ``step`` is a multiple of
    ``logging.every`` (or ``force``). Rows are buffered and written every ``flush_every`` rows and
    at :meth:`close`. On local storage they are appended, whole lines in one ``write``, fsynced; S3
    has no append, so the whole object is rewritten (one atomic PUT): a long S3 run pays for its
    series on every flush, which ``logging.every`` and ``flush_every`` bound.

    A resumed run logs again the steps after its checkpoint: the first row logged drops every
    stored row of that step or later (and a line a crash cut short), so the series has each step once.

    With ``logging.tensorboard`` numeric values also go to TensorBoard event files in
    ``tensorboard_dir`` (default: ``tensorboard/<name>`` in a local run's folder; S3 runs name a
    local one), which needs the ``tensorboard`` extra.

        with MetricsLog(storage, "metrics/smoke.jsonl", cfg.logging) as log:
            log.log(step, {"loss": loss, "tokens_per_s": tps})
    """

    def __init__(self, storage: RunStorage, name: str, logging: LoggingConfig | None = None, *,
                 tensorboard_dir: str | os.PathLike | None = None, flush_every: int = 50) -> None:
        self.name = normalize_rel(name)
        if not self.name.endswith(".jsonl"):
            raise ValueError(f"metrics log {name!r} must end in .jsonl")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.storage, self.logging, self.flush_every = storage, logging or LoggingConfig(), flush_every
        self._local = storage.local_path(self.name)
        self._pending: list[bytes] = []
        self._content = bytearray()  # S3: the whole series, rewritten at each flush
        self._resumed = False
        self._closed = False
        self._tb = self._open_tensorboard(tensorboard_dir) if self.logging.tensorboard else None

    def _open_tensorboard(self, folder: str | os.PathLike | None) -> Any:
        if folder is None:
            root = self.storage.local_path("")
            if root is None:
                raise ValueError(f"logging.tensorboard on S3 storage ({self.storage.url}) needs a local "
                                 "tensorboard_dir for the event files")
            folder = root / "tensorboard" / PurePosixPath(self.name).with_suffix("")
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - an optional extra
        except ImportError as e:
            raise ImportError(f"logging.tensorboard = true needs the tensorboard package: {TENSORBOARD_EXTRA} "
                              f"({e})") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        return SummaryWriter(log_dir=str(folder))

    def due(self, step: int) -> bool:
        """Whether ``step`` gets a row (a multiple of ``logging.every``)."""
        return step % self.logging.every == 0

    def log(self, step: int, row: Mapping[str, Any], *, force: bool = False) -> bool:
        """Record ``row`` for ``step`` if it is due (or ``force``); returns whether it was recorded."""
        if self._closed:
            raise RuntimeError(f"metrics log {self.name} is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not (force or self.due(step)):
            return False
        if row.get("step", step) != step:
            raise ValueError(f"row step {row['step']!r} differs from the logged step {step}")
        if "time" in row:
            raise ValueError("'time' is written by the log itself")
        values = {str(k): _json_value(v, str(k)) for k, v in row.items() if k != "step"}
        if not self._resumed:
            self._resume(step)
        record = {"step": step, "time": time.time(), **values}
        self._pending.append(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        if self._tb is not None:
            for key, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(key, v, global_step=step)
        if len(self._pending) >= self.flush_every:
            self.flush()
        return True

    def _resume(self, first_step: int) -> None:
        """Keep the stored rows before ``first_step``; rewrite the series if anything was dropped."""
        self._resumed = True
        try:
            old = self.storage.read_bytes(self.name)
        except FileNotFoundError:
            return
        lines = old.split(b"\n")
        complete = lines[:-1]  # the last piece is b"" after a final newline, else a torn line
        kept = [ln + b"\n" for ln in complete if (s := _step_of(ln)) is not None and s < first_step]
        self._content = bytearray(b"".join(kept))
        if len(kept) != len(complete) or lines[-1]:
            self.storage.write_bytes(self.name, bytes(self._content))
        if self._local is not None:
            self._content = bytearray()

    def flush(self) -> None:
        """Write the buffered rows (and flush TensorBoard)."""
        if self._pending:
            data = b"".join(self._pending)
            if self._local is not None:
                self._local.parent.mkdir(parents=True, exist_ok=True)
                with open(self._local, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                content = self._content + data
                self.storage.write_bytes(self.name, bytes(content))
                self._content = content
            self._pending = []
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close; a second call does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
