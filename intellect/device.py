"""Device and precision, decided in one place for every process that computes.

The smoke run, the DiLoCo worker, the DDP baseline, the RL trainer, the inference engine and the
validator's prefill all resolve :class:`~intellect.config.ComputeConfig` here, so ``device`` and
``precision`` mean the same everywhere:

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
    >>> param_dtype("bf16-mixed"), param_dtype("bf16")
    (torch.float32, torch.bfloat16)
    >>> with autocast(torch.device("cpu"), "bf16-mixed"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Literal

import torch

from intellect.config import ComputeConfig

Precision = Literal["fp32", "bf16-mixed", "bf16"]


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


def param_dtype(precision: Precision) -> torch.dtype:
    """dtype of the trained weights (and so of gradients and AdamW state)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """dtype that matmuls run in under :func:`autocast` (None: no autocast)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


@contextlib.contextmanager
def autocast(device: torch.device, precision: Precision) -> Iterator[None]:
    """bf16 autocast for ``bf16-mixed`` on ``device``; a no-op for ``fp32`` and ``bf16``."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def prepare_model(model: torch.nn.Module, compute: ComputeConfig, device: torch.device,
                  train: bool = True) -> torch.nn.Module:
    """Move ``model`` to ``device`` in the precision's weight dtype; for training, turn on activation
    checkpointing and ``torch.compile`` as configured. Returns the same module (compiled in place,
    so its ``state_dict`` keys and ``config`` are unchanged)."""
    model.to(device=device)
    dtype = param_dtype(compute.precision)
    # parameters only: floating buffers such as RoPE's inverse frequencies keep fp32, which long
    # positions need (bf16 holds 8 bits of mantissa)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if train and compute.activation_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise TypeError(f"{type(model).__name__} has no gradient_checkpointing_enable()")
        # non-reentrant: works under autocast and with inputs that need no grad
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if train and compute.compile:
        model.compile()
    return model


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in page-locked host memory when it will travel to or from a CUDA device (faster,
    asynchronous copies); unchanged for the CPU."""
    return tensor.pin_memory() if device.type == "cuda" and not tensor.is_pinned() else tensor


def dist_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend of a group whose tensors live on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
