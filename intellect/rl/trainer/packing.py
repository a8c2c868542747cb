"""Sequence packing for the GRPO trainer: samples -> rows of at most a token budget.

A sample is ``prompt + output``; its output token ``j`` is predicted at position ``P - 1 + j`` of its
sequence (a prompt of ``P`` tokens). A row concatenates whole samples, and its ``position_ids``
restart at 0 at each sample: a transformers causal LM called with ``attention_mask=None`` and no KV
cache turns those restarts into a block-diagonal causal mask (``masking_utils``
``find_packed_sequence_indices``), so a token never attends to another sample of its row. That is
the model's side of the contract: :func:`intellect.rl.trainer.logprobs.packing_isolates` checks it. Only the
positions that predict an output token carry a target, so the token after a sample's last one (the
next sample's first) is never a target of it.

Rows are filled first-fit-decreasing by length. A sample longer than the budget gets a row of its
own, which nothing else joins.

    >>> rows = pack([([1, 2], [3, 4]), ([5], [6, 7, 8, 8]), ([9], [7])], budget=6)
    >>> [r.members for r in rows]        # lengths 4, 5, 2: samples 0 and 2 share the second row
    [(1,), (0, 2)]
    >>> rows[1].ids.tolist(), rows[1].position_ids.tolist()
    ([1, 2, 3, 4, 9, 7], [0, 1, 2, 3, 0, 1])
    >>> rows[1].predict.tolist(), rows[1].targets.tolist(), rows[1].sample.tolist(), rows[1].offset.tolist()
    ([1, 2, 4], [3, 4, 7], [0, 0, 1], [0, 1, 0])
    >>> unpack(torch.tensor([-1.0, -2.0, -3.0]), rows[1])     # [members, longest output]
    tensor([[-1., -2.],
            [-3.,  0.]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class HasTokens(Protocol):
    """What packing reads of a sample (the trainer's ``Sample`` is one)."""

    @property
    def prompt_tokens(self) -> Sequence[int]: ...

    @property
    def output_tokens(self) -> Sequence[int]: ...


TokenPair = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class PackedRow:
    """One row of packed samples; the last five fields have one entry per output token of the row,
    in row order."""

    members: tuple[int, ...]  # indices (into the packed list) of the row's samples, in row order
    ids: torch.Tensor  # [L] long: the members' prompt + output tokens, concatenated
    position_ids: torch.Tensor  # [L] long: 0 .. len - 1 within each member
    mask: torch.Tensor  # [L] bool: position predicts an output token
    predict: torch.Tensor  # [N] long: the positions where mask is True
    targets: torch.Tensor  # [N] long: the output token each of them predicts
    sample: torch.Tensor  # [N] long: which member (0 .. len(members) - 1) the token belongs to
    offset: torch.Tensor  # [N] long: its index within that member's output
    output_lengths: tuple[int, ...]  # output tokens of each member

    @property
    def tokens(self) -> int:
        """Output tokens of the row (the loss's tokens)."""
        return int(self.predict.numel())

    def to(self, device: torch.device) -> PackedRow:
        move = {k: getattr(self, k).to(device, non_blocking=True)
                for k in ("ids", "position_ids", "mask", "predict", "targets", "sample", "offset")}
        return PackedRow(members=self.members, output_lengths=self.output_lengths, **move)


def _pair(s: HasTokens | TokenPair) -> TokenPair:
    return (s[0], s[1]) if isinstance(s, tuple) else (s.prompt_tokens, s.output_tokens)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most ``budget``: items longest first (ties by index),
    each into the first bin it fits. An item over the budget gets a bin of its own.

    >>> first_fit_decreasing([3, 5, 2, 4, 9], budget=7)
    [[4], [1, 2], [3, 0]]
    """
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max(budget - n, 0))
    return bins


def pack_row(samples: Sequence[HasTokens | TokenPair], members: Sequence[int]) -> PackedRow:
    """``samples[members]`` concatenated into one row."""
    ids: list[int] = []
    pos: list[int] = []
    predict: list[int] = []
    sample: list[int] = []
    offset: list[int] = []
    outs: list[int] = []
    for k, i in enumerate(members):
        prompt, output = _pair(samples[i])
        if len(prompt) == 0:
            raise ValueError("a sample needs at least one prompt token to predict its first output token")
        start = len(ids)
        ids.extend(prompt)
        ids.extend(output)
        pos.extend(range(len(prompt) + len(output)))
        predict.extend(range(start + len(prompt) - 1, start + len(prompt) - 1 + len(output)))
        sample.extend([k] * len(output))
        offset.extend(range(len(output)))
        outs.append(len(output))
    predict_t = torch.tensor(predict, dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[predict_t] = True
    ids_t = torch.tensor(ids, dtype=torch.long)
    return PackedRow(
        members=tuple(members), ids=ids_t, position_ids=torch.tensor(pos, dtype=torch.long), mask=mask,
        predict=predict_t, targets=ids_t[predict_t + 1], sample=torch.tensor(sample, dtype=torch.long),
        offset=torch.tensor(offset, dtype=torch.long), output_lengths=tuple(outs),
    )


def pack(samples: Sequence[HasTokens | TokenPair], budget: int, *, one_per_row: bool = False) -> list[PackedRow]:
    """Rows of at most ``budget`` tokens (a longer sample alone in its row), first-fit-decreasing;
    ``one_per_row`` puts every sample in a row of its own (a model that cannot isolate packed
    samples), longest first. Every sample is in exactly one row."""
    lengths = [len(p) + len(o) for p, o in map(_pair, samples)]
    bins = [[i] for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))] if one_per_row \
        else first_fit_decreasing(lengths, budget)
    return [pack_row(samples, b) for b in bins]


def unpack(flat: torch.Tensor, row: PackedRow, fill: float = 0.0) -> torch.Tensor:
    """Per-token values of ``row`` (``[N, ...]``, row order) as ``[members, T, ...]``, ``T`` the longest
    output (at least 1), ``fill`` off the outputs. Differentiable in ``flat``."""
    width = max(max(row.output_lengths, default=0), 1)
    out = flat.new_full((len(row.members), width, *flat.shape[1:]), fill)
    return out.index_put((row.sample, row.offset), flat)


def output_mask(row: PackedRow) -> torch.Tensor:
    """``[members, T]`` bool: True on each member's output tokens (the layout of :func:`unpack`)."""
    return unpack(torch.ones(row.tokens, dtype=torch.bool, device=row.ids.device), row, fill=False)
