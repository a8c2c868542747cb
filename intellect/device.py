"""Device and precision, decided in one place for every process that computes.

The smoke run, the DiLoCo worker, the DDP baseline, the RL trainer, the inference engine and the
validator's prefill all resolve :class:`~intellect.config.ComputeConfig` here, so ``device`` and
``precision`` mean the same everywhere. ``precision = "auto"`` (the default) is decided per device
by :func:`resolve_precision` (the table in :func:`decide_precision`): bf16-mixed where the device
computes bf16 fast, fp32 elsewhere. Once decided it is a concrete precision:

========== ================ ======================= =====================
precision  weights (master) optimizer state         forward/backward
========== ================ ======================= =====================
fp32       fp32             fp32                    fp32
bf16-mixed fp32             fp32                    bf16 autocast
bf16       bf16             bf16                    bf16
========== ================ ======================= =====================

Whatever the precision, DiLoCo keeps its synced copy, pseudo-gradients and outer state in fp32 on
the CPU, and TOPLOC commits to bf16 final hidden states (:mod:`intellect.toploc.proofs`).

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> fast = Bf16Support(device="cuda:0", fast=True, detail="NVIDIA H100, compute capability 9.0")
    >>> decide_precision("auto", fast)[0], decide_precision("fp32", fast)[0]
    ('bf16-mixed', 'fp32')
    >>> param_dtype("bf16-mixed"), param_dtype("bf16")
    (torch.float32, torch.bfloat16)
    >>> with autocast(torch.device("cpu"), "bf16-mixed"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from intellect.config import ComputeConfig

Precision = Literal["fp32", "bf16-mixed", "bf16"]
PrecisionSetting = Literal["auto", "fp32", "bf16-mixed", "bf16"]  # compute.precision, before auto is decided

log = logging.getLogger(__name__)


# Set by torchrun, and by the DiLoCo coordinator for the workers it starts.
LOCAL_RANK_ENV = "LOCAL_RANK"


class DeviceError(RuntimeError):
    """A configured device this machine does not have; the message says what it has."""


def local_rank(environ: os._Environ[str] | dict[str, str] | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``, set by torchrun and by the DiLoCo
    coordinator for the workers it starts); 0 when unset."""
    env = os.environ if environ is None else environ
    try:
        return max(0, int(env.get(LOCAL_RANK_ENV, "0")))
    except ValueError:
        return 0


def resolve_device(spec: str = "auto", rank: int | None = None) -> torch.device:
    """The ``torch.device`` a config's ``compute.device`` names on this machine.

    ``auto`` is CUDA when present, else the CPU; ``auto`` and ``cuda`` take the GPU of the local
    rank among the visible ones (``CUDA_VISIBLE_DEVICES`` already narrows what is visible), so
    workers on one node spread over its GPUs. ``cuda`` or ``cuda:N`` on a machine without that
    GPU is an error, never a silent fall back to the CPU.
    """
    if spec == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto" and count == 0:
        return torch.device("cpu")
    if count == 0:
        raise DeviceError(f"compute.device = {spec!r} but this machine has no CUDA device (use 'auto' or 'cpu')")
    if spec in ("auto", "cuda"):
        index = (local_rank() if rank is None else rank) % count
    else:
        index = int(spec.split(":", 1)[1])
        if index >= count:
            raise DeviceError(f"compute.device = {spec!r} but only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


# --------------------------------------------------------------------- precision

# bf16 autocast pays for its casts and its rounding: below this speed-up of bf16 matmuls over fp32 ones
# it is not chosen. A CPU with AMX or AVX512-BF16 is several times faster in bf16; one without
# emulates bf16 tens of times slower than fp32; an NVIDIA GPU of compute capability 8.0 or more has
# bf16 tensor cores.
BF16_MIN_SPEEDUP = 1.5
# the CPU probe's matmul: about the width of the smallest model the speed matters for (llama-20m)
PROBE_SIZE = 512
PROBE_SECONDS = 0.1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 1.0) -> float:
    """FLOP/s of ``size x size`` matmuls in ``dtype`` on ``device``, with torch's current thread
    count: the best rate over batches of matmuls run for about ``seconds`` (the best, not the mean,
    so other processes sharing the machine count less), or over the first two when one matmul alone
    takes longer. Measured once per process per arguments."""
    if size < 1 or not seconds > 0:
        raise ValueError(f"need size >= 1 and seconds > 0, got {size}, {seconds}")
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)  # warm-up: first-call dispatch and allocation
    _sync(device)
    t0 = time.perf_counter()
    torch.matmul(a, b, out=out)
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-9)
    best = 2.0 * size**3 / once
    batch = max(1, int(seconds / 20 / once))  # ~20 timed batches: one clock read per batch, not per matmul
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        _sync(device)
        best = max(best, 2.0 * size**3 * batch / max(time.perf_counter() - t0, 1e-9))
    return best


@dataclass(frozen=True)
class Bf16Support:
    """Whether a device computes bf16 fast enough for bf16-mixed, and the evidence, for the log.

    ``slowdown``: how many times slower its bf16 matmuls are than fp32 ones (None: not measured, or
    not slower)."""

    device: str
    fast: bool
    detail: str
    slowdown: float | None = None


def decide_precision(setting: PrecisionSetting, support: Bf16Support) -> tuple[Precision, str]:
    """The precision a process computes in, and why: ``auto`` becomes bf16-mixed where ``support``
    says bf16 is fast and fp32 elsewhere; an explicit setting is kept, and where bf16 is slow the
    reason says by how much (the caller logs it as a warning).

    ============ =========================== ==================================== ==================
    setting      CUDA, compute capability     CUDA, compute capability < 8.0       CPU
                 >= 8.0 (A100, H100, L4...)   (V100, T4)
    ============ =========================== ==================================== ==================
    auto         bf16-mixed                   fp32                                 bf16-mixed when bf16
                                                                                   matmuls are >= 1.5x
                                                                                   fp32's (AMX,
                                                                                   AVX512-BF16), else
                                                                                   fp32
    fp32         fp32                         fp32                                 fp32
    bf16-mixed   bf16-mixed                   bf16-mixed, with a warning           bf16-mixed, warning
                                                                                   where bf16 is slow
    bf16         bf16                         bf16, with a warning                 bf16, warning ditto
    ============ =========================== ==================================== ==================

    >>> avx2 = Bf16Support(device="cpu", fast=False, detail="AVX2; bf16 matmuls 2.4 GFLOP/s, fp32 256 GFLOP/s",
    ...                    slowdown=107.0)
    >>> decide_precision("auto", avx2)
    ('fp32', 'auto on cpu: bf16 is slow here (AVX2; bf16 matmuls 2.4 GFLOP/s, fp32 256 GFLOP/s)')
    >>> decide_precision("bf16-mixed", avx2)[1]
    "bf16-mixed on cpu computes matmuls 107x slower than fp32 (AVX2; bf16 matmuls 2.4 GFLOP/s, fp32 256 GFLOP/s): 'auto' would choose fp32"
    """
    if setting == "auto":
        if support.fast:
            return "bf16-mixed", f"auto on {support.device}: bf16 is fast here ({support.detail})"
        return "fp32", f"auto on {support.device}: bf16 is slow here ({support.detail})"
    if setting == "fp32" or support.fast:
        return setting, ""
    slower = f" computes matmuls {support.slowdown:.0f}x slower than fp32" if support.slowdown else " is slow"
    return setting, f"{setting} on {support.device}{slower} ({support.detail}): 'auto' would choose fp32"


@functools.cache
def bf16_support(device: torch.device) -> Bf16Support:
    """What ``device`` says about bf16: a CUDA GPU by its compute capability, the CPU by a short
    measured probe (``PROBE_SIZE`` matmuls in bf16 and fp32, well under a second even where bf16 is
    emulated), since torch's reported capability (``AVX512``) does not tell AVX512-BF16 or AMX
    apart from plain AVX-512. Once per process and device."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return Bf16Support(str(device), (major, minor) >= (8, 0), f"{name}, compute capability {major}.{minor}")
    fp32 = measure_matmul_flops(device, torch.float32, PROBE_SIZE, PROBE_SECONDS)
    bf16 = measure_matmul_flops(device, torch.bfloat16, PROBE_SIZE, PROBE_SECONDS)
    # a second look at what a busy machine may have measured low: fp32 (fast to measure) always, bf16
    # unless it was far slower (emulated bf16 is tens of times slower, and slow to measure)
    again = measure_matmul_flops.__wrapped__
    fp32 = max(fp32, again(device, torch.float32, PROBE_SIZE, PROBE_SECONDS))
    if bf16 * 4 > fp32:
        bf16 = max(bf16, again(device, torch.bfloat16, PROBE_SIZE, PROBE_SECONDS))
    detail = (f"{torch.backends.cpu.get_cpu_capability()}; bf16 matmuls {bf16 / 1e9:,.1f} GFLOP/s, "
              f"fp32 {fp32 / 1e9:,.1f} GFLOP/s")
    return Bf16Support(str(device), bf16 >= BF16_MIN_SPEEDUP * fp32, detail, fp32 / bf16 if bf16 < fp32 else None)


@functools.cache
def resolve_precision(setting: PrecisionSetting, device: torch.device) -> Precision:
    """The concrete precision ``setting`` means on ``device`` (:func:`decide_precision`), decided and
    logged once per process: ``auto`` says what it chose and why; an explicit bf16 setting on a device
    where bf16 is slow logs one warning with the measured slowdown. fp32 asks the device nothing."""
    if setting == "fp32":
        return "fp32"
    if setting not in ("auto", "bf16-mixed", "bf16"):
        raise ValueError(f"unknown precision {setting!r}")
    precision, why = decide_precision(setting, bf16_support(device))
    if why and setting == "auto":
        log.info("precision %s", why.replace("auto on", "auto -> " + precision + " on", 1))
    elif why:
        log.warning("compute.precision = %s", why)
    return precision


def param_dtype(precision: PrecisionSetting) -> torch.dtype:
    """dtype of the trained weights (and so of gradients and AdamW state); ``auto`` never chooses
    bf16 weights, so its weights are fp32 wherever it runs."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """dtype that matmuls run in under :func:`autocast` (None: no autocast)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


@contextlib.contextmanager
def autocast(device: torch.device, precision: PrecisionSetting) -> Iterator[None]:
    """bf16 autocast for ``bf16-mixed`` on ``device``; a no-op for ``fp32`` and ``bf16``; ``auto`` as
    :func:`resolve_precision` decides it on ``device``."""
    dtype = autocast_dtype(resolve_precision(precision, device))
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def prepare_model(model: torch.nn.Module, compute: ComputeConfig, device: torch.device,
                  train: bool = True) -> torch.nn.Module:
    """Move ``model`` to ``device`` in the precision's weight dtype; for training, turn on activation
    checkpointing and ``torch.compile`` as configured. Returns the same module (compiled in place,
    so its ``state_dict`` keys and ``config`` are unchanged). A model shared by several ranks is
    prepared by :func:`intellect.parallel.parallelize` instead (its weights stay fp32)."""
    model.to(device=device)
    dtype = param_dtype(compute.precision)
    if train:
        resolve_precision(compute.precision, device)  # decided, and said in the log, before training starts
    # parameters only: floating buffers such as RoPE's inverse frequencies keep fp32, which long
    # positions need (bf16 holds 8 bits of mantissa)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if train and compute.activation_checkpointing:
        enable_activation_checkpointing(model)
    if train and compute.compile:
        model.compile()
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block's activations in the backward pass (``transformers``' own
    per-layer checkpointing), here and under FSDP (:func:`intellect.parallel.parallelize`)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TypeError(f"{type(model).__name__} has no gradient_checkpointing_enable()")
    # non-reentrant: works under autocast, with FSDP2's hooks and with inputs that need no grad
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in page-locked host memory when it will travel to or from a CUDA device (faster,
    asynchronous copies); unchanged for the CPU."""
    return tensor.pin_memory() if device.type == "cuda" and not tensor.is_pinned() else tensor


def dist_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend of a group whose tensors live on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
