"""The rows of a running decode batch, which finished requests leave and new ones join.

:class:`KVSlots` holds a batch's KV cache (an HF ``DynamicCache`` of full-attention layers),
its attention mask and any per-row tensors the engine keeps beside them (seed, step, position,
the last token...), and keeps all of them aligned row by row:

* every row is *left-padded*: its real tokens end in the last column, and the mask is 0 over
  the padding on its left. A decode step appends one column to every row, so rows stay
  right-aligned whatever they joined with;
* :meth:`KVSlots.keep` drops rows (index selection of every layer's keys and values) and then
  trims leading columns that are padding in every remaining row, so a long request that left
  does not make the others attend over its width;
* :meth:`KVSlots.join` appends the rows of another batch (the newcomers' prefill), first
  left-padding the narrower side's keys, values and mask with masked zeros so widths match.

Positions are not derived from column indices: the engine feeds each row's own position
(the count of its real tokens), so padding never shifts RoPE, and masked columns contribute
nothing to attention, so a row's logits do not depend on who it shares the batch with beyond
floating-point rounding.

Only caches whose layers are all plain ``DynamicLayer`` (full attention, every token kept)
can be cut and glued this way; sliding-window, quantized, linear-attention or static caches
keep state that is not one key and one value per column, and :class:`UnsupportedCache` says so.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from transformers.cache_utils import DynamicLayer


class UnsupportedCache(TypeError):
    """The model's KV cache is not one that rows can leave or join (see the module docstring)."""


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if not layers:
        raise UnsupportedCache(f"{type(cache).__name__} has no per-layer keys/values to splice")
    for layer in layers:
        if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys is None:
            raise UnsupportedCache(
                f"cache layer {type(layer).__name__} is not a filled full-attention DynamicLayer; "
                "use scheduling='static' for this model"
            )
    return layers


class KVSlots:
    """A left-padded batch: ``cache`` (updated in place by each forward), ``mask`` [B, L] and
    per-row tensors ``rows[name]`` [B, ...], all on one device and in one row order."""

    def __init__(self, cache: Any, mask: torch.Tensor, rows: dict[str, torch.Tensor]):
        _layers(cache)
        for name, value in rows.items():
            if value.shape[0] != mask.shape[0]:
                raise ValueError(f"rows[{name!r}] has {value.shape[0]} rows, the mask {mask.shape[0]}")
        self.cache, self.mask, self.rows = cache, mask, dict(rows)

    def __len__(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        """Columns of the cache and the mask (padding included)."""
        return self.mask.shape[1]

    def grow(self) -> torch.Tensor:
        """The mask for the next decode forward: one more real column for every row. The cache
        gets its column from the forward itself."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        return self.mask

    def keep(self, index: torch.Tensor, real: int | None = None) -> None:
        """Keep only rows ``index`` (in that order), then drop leading all-padding columns.

        ``real``, the most real tokens of any kept row, spares a device sync when the caller
        knows it; otherwise it is read from the mask.
        """
        index = index.to(self.mask.device)
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.mask = self.mask[index]
        self.rows = {k: v[index] for k, v in self.rows.items()}
        if len(self) == 0:
            return
        if real is None:
            real = int(self.mask.sum(1).max())
        self._trim(self.width - real)

    def join(self, other: "KVSlots") -> None:
        """Append ``other``'s rows after this batch's, left-padding the narrower one."""
        if set(other.rows) != set(self.rows):
            raise ValueError(f"row tensors differ: {sorted(self.rows)} and {sorted(other.rows)}")
        width = max(self.width, other.width)
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if len(mine) != len(theirs):
            raise ValueError(f"{len(mine)} cache layers joined with {len(theirs)}")
        for a, b in zip(mine, theirs):
            a.keys = torch.cat([_left_pad(a.keys, width, -2), _left_pad(b.keys, width, -2)])
            a.values = torch.cat([_left_pad(a.values, width, -2), _left_pad(b.values, width, -2)])
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(other.mask, width, -1)])
        self.rows = {k: torch.cat([v, other.rows[k]]) for k, v in self.rows.items()}

    def _trim(self, columns: int) -> None:
        if columns <= 0:
            return
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[..., columns:, :], layer.values[..., columns:, :]
        self.mask = self.mask[:, columns:]


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with zeros prepended along ``dim`` (a negative index) up to ``width``."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (-dim - 1) + [missing, 0]  # F.pad lists (left, right) from the last dim backwards
    return F.pad(x, pad)
