"""The GRPO trainer over M ranks (``trainer.ranks``): FSDP2 through :func:`intellect.parallel.parallelize`.

Every rank holds the step's samples and packs each mini-batch into the same rows; rank *r* runs rows
``r, r + M, ...`` (:func:`rank_rows`). The normalizers of the loss (the mini-batch's samples, tokens and
longest completion) are those of the whole mini-batch, so each rank's micro-batch losses are exactly
the terms the single-process trainer sums, and the gradient reduction sums them (FSDP's division by
M is turned off: :func:`shard_model`). FSDP's collectives need every rank to run the same number of
forward and backward passes: a rank short of rows runs a one-token dummy row whose loss is scaled
by 0. Statistics are summed (token-weighted means) or min/maxed over the ranks
(:func:`reduce_stats`), so every rank reports the loss the single-process trainer reports.

The chunked log-probs (:mod:`intellect.rl.trainer.logprobs`) run the base model and the LM head
separately, outside the causal LM's ``forward``: :func:`shard_model` registers that path
(``row_logprobs``) as a forward method of the root FSDP module, so its parameters (embeddings, final
norm, head) are gathered before it and their gradients reduced after it, as for ``forward``.

    >>> [len(rank_rows(list(range(5)), r, 2)) for r in range(2)]   # 5 rows on 2 ranks: 3 passes each
    [3, 3]
    >>> rank_rows(list(range(5)), 1, 2)                              # None: a dummy pass
    [1, 3, None]
"""

from __future__ import annotations

import math
from types import MethodType
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from intellect.config import ComputeConfig
from intellect.parallel import parallelize
from intellect.rl.trainer.logprobs import row_logprobs

__all__ = ["LOGPROBS_METHOD", "full_value", "rank_rows", "reduce_stats", "shard_model"]

LOGPROBS_METHOD = "row_logprobs"  # the root module's forward method that computes a row's log-probs
T = TypeVar("T")

_SUMMED = ("loss", "clip_fraction", "ratio_mean", "kl", "entropy")


def _row_logprobs(self: torch.nn.Module, row, temperature: float, **kw: Any):
    return row_logprobs(self, row, temperature, **kw)


def shard_model(model: torch.nn.Module, mesh, compute: ComputeConfig) -> torch.nn.Module:
    """Shard ``model`` (fp32) over ``mesh`` (a 1-D device mesh of the trainer's ranks) with
    :func:`~intellect.parallel.parallelize`, reduce gradients as a sum over the ranks, and give it the
    ``row_logprobs(row, temperature, **kw)`` forward method (:func:`~intellect.rl.trainer.logprobs.row_logprobs`
    inside FSDP's hooks). Returns the same module."""
    parallelize(model, mesh, compute)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # each rank's loss terms are already the whole mini-batch's: the reduction sums them (as
            # plain sums: gloo has no pre-multiplied ones)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    setattr(model, LOGPROBS_METHOD, MethodType(_row_logprobs, model))
    register_fsdp_forward_method(model, LOGPROBS_METHOD)
    return model


def rank_rows(rows: Sequence[T], rank: int, size: int) -> list[T | None]:
    """Rank ``rank``'s rows of ``rows`` (every ``size``-th from ``rank``), padded with None (a dummy
    pass) to ``ceil(len(rows) / size)``, the passes every rank runs."""
    mine: list[T | None] = list(rows[rank::size])
    return mine + [None] * (math.ceil(len(rows) / size) - len(mine))


def reduce_stats(acc: dict[str, Any], lo: float, hi: float, group: dist.ProcessGroup) -> tuple[float, float]:
    """Sum ``acc``'s loss and token-weighted sums over ``group`` in place (float64); the min of ``lo``
    and the max of ``hi`` over it."""
    sums = torch.tensor([float(acc.get(k, 0.0)) for k in _SUMMED], dtype=torch.float64)
    ext = torch.tensor([lo, -hi], dtype=torch.float64)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    if dev is not None:
        sums, ext = sums.to(dev), ext.to(dev)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(ext, op=dist.ReduceOp.MIN, group=group)
    for k, v in zip(_SUMMED, sums.tolist()):
        acc[k] = v
    lo_all, neg_hi = ext.tolist()
    return lo_all, -neg_hi


def full_value(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (a norm over sharded gradients) as a float."""
    return float(t.full_tensor() if isinstance(t, DTensor) else t)
