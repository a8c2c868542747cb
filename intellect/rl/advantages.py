"""Group-relative advantages for GRPO, and the zero-signal filter.

Each prompt is sampled k times; a completion's advantage is its reward relative
to its own group::

    A = (r - mean(group)) / (std(group) + eps)     std_normalize=True  (GRPO, INTELLECT-2)
    A =  r - mean(group)                           std_normalize=False (Dr. GRPO)

``std`` is the sample std (``ddof=1``, Bessel-corrected), as in prime-rl I2
(``inference/rewards.py``) and TRL (``trl.trainer.utils.nanstd``, with
``scale_rewards="group"``). ``eps`` is 1e-6 as in I2; TRL adds 1e-4, so pass
``eps=1e-4`` to reproduce TRL (benchmarks/grpo_loss_parity.py checks it). A group
of one has no spread: its std is taken as 0 (TRL would give NaN).

Rewards come either as a ``[groups, k]`` tensor or flat with one group id per
row (groups of any size, ids in any order)::

    >>> import torch
    >>> r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    >>> group_advantages(r, std_normalize=False)
    tensor([[ 0.5000, -0.5000, -0.5000,  0.5000],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> group_advantages(r).round(decimals=4)       # std(ddof=1) of [1, 0, 0, 1] is 0.5774
    tensor([[ 0.8660, -0.8660, -0.8660,  0.8660],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> flat = torch.tensor([1.0, 5.0, 0.0, 7.0])
    >>> group_advantages(flat, torch.tensor([0, 9, 0, 9]), std_normalize=False)
    tensor([ 0.5000, -1.0000, -0.5000,  1.0000])

Groups whose rewards are all equal have zero advantage everywhere and carry no
gradient; INTELLECT-2 drops them and refills the batch (online filtering)::

    >>> nonzero_signal(r)
    tensor([ True, False])
    >>> nonzero_signal(flat, torch.tensor([0, 9, 0, 9]))   # flat: one flag per row
    tensor([True, True, True, True])
"""

from __future__ import annotations

import torch


def _flat_groups(rewards: torch.Tensor, group_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rewards as a flat float tensor, each row's dense group index, and the number of groups."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards without group_ids must be [groups, k], got shape {tuple(rewards.shape)}")
        g, k = rewards.shape
        return rewards.reshape(-1), torch.arange(g, device=rewards.device).repeat_interleave(k), g
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"flat rewards and group_ids must both be [n], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return rewards, inverse, uniq.numel()


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    ddof: int = 1,
) -> torch.Tensor:
    """Advantages of the same shape as ``rewards`` (``[groups, k]``, or ``[n]`` with ``group_ids``).

    Integer or bool rewards are promoted to float32; float rewards keep their dtype.
    """
    if not rewards.is_floating_point():
        rewards = rewards.float()
    flat, idx, n_groups = _flat_groups(rewards, group_ids)
    counts = torch.zeros(n_groups, dtype=flat.dtype, device=flat.device).index_add_(0, idx, torch.ones_like(flat))
    mean = torch.zeros_like(counts).index_add_(0, idx, flat) / counts
    dev = flat - mean[idx]
    if std_normalize:
        # A group of one has dev == 0, so clamping its denominator to 1 makes its std 0, not NaN.
        var = torch.zeros_like(counts).index_add_(0, idx, dev * dev) / (counts - ddof).clamp(min=1)
        dev = dev / (var.sqrt()[idx] + eps)
    return dev.reshape(rewards.shape)


def nonzero_signal(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which groups have rewards that are not all equal.

    For ``[groups, k]`` rewards, one bool per group; for flat rewards with
    ``group_ids``, one bool per row (its group's flag), so ``rewards[mask]``
    keeps exactly the rows worth training on.
    """
    flat, idx, n_groups = _flat_groups(rewards, group_ids)
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64, device=flat.device)
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64, device=flat.device)
    vals = flat.to(torch.float64)
    lo = lo.scatter_reduce(0, idx, vals, reduce="amin")
    hi = hi.scatter_reduce(0, idx, vals, reduce="amax")
    signal = hi > lo
    return signal if group_ids is None else signal[idx]
