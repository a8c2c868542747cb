"""PRIME's all-reduce (the INTELLECT-1 baseline), for benchmarks and tests to compare against.

PRIME's data path is ``"ring"`` (requantize the fp32 partial sum at every reduce-scatter hop)
plus requantization at every all-gather hop: each rank decodes the chunk it receives and
forwards its own requantization of it, so ranks may end with different values. It runs on the
production executor (``allreduce.all_reduce_mean``) with :class:`PrimeRun` as its schedule;
only what an all-gather hop forwards differs (``schedules.Run._forwarded``), so the messages,
their sizes and the peers are ``"ring"``'s (``PLAN``). It uses this project's quantizer
(mean +- c sigma, bucket means), not PRIME's +-3 RMS codebook, so only the data path differs.

    from prime_allreduce import prime_all_reduce_mean   # with benchmarks/ on sys.path
    stats = prime_all_reduce_mean(tensors, group)        # stats.algorithm == "prime"
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.diloco.allreduce import AllReduceStats, all_reduce_mean  # noqa: E402
from intellect.diloco.schedules import Run, decode, encode  # noqa: E402

__all__ = ["NAME", "PLAN", "PrimeRun", "prime_all_reduce_mean"]

NAME = "prime"
PLAN = "ring"  # the production algorithm whose messages PRIME sends: plan its bytes and links as this


class PrimeRun(Run):
    """``"ring"``'s schedules, but each all-gather hop forwards a requantization of what it decoded."""

    def _forwarded(self, msg: torch.Tensor, numel: int) -> torch.Tensor:
        return encode(self.quantize(decode(msg, numel)), self.codec)


def prime_all_reduce_mean(tensors: Sequence[torch.Tensor], group, **kw) -> AllReduceStats:
    """``all_reduce_mean`` with PRIME's data path; ``kw`` as there, without ``algorithm``
    (always ``PLAN``) or ``schedule``. Every rank must run this one (the plan digest checks)."""
    stats = all_reduce_mean(tensors, group, algorithm=PLAN, schedule=PrimeRun, **kw)
    return dataclasses.replace(stats, algorithm=NAME)
