"""Batched generation with a KV cache for any HF causal LM (greedy or sampled).

Prompts of different lengths are left-padded; positions come from the
attention mask so padding never shifts RoPE. Sampling draws from one
``torch.Generator`` for the batch: reproducible for a fixed batch, which is
all evaluation needs (per-request seeds are the inference engine's job).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # generated ids, EOS excluded
    finished: bool  # True when EOS ended it, False when max_new_tokens did


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged prompts, padding on the left.

    >>> ids, mask = left_pad([[1, 5], [1, 5, 6]], pad_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[0, 1, 5], [1, 5, 6]], [[0, 1, 1], [1, 1, 1]])
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.2x renamed ``past_key_values`` to ``cache``; vLLM-era 4.x still uses the old name.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out) -> object:
    return out.cache if hasattr(out, "cache") else out.past_key_values


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[Generation]:
    """Continue every prompt until EOS or ``max_new_tokens``; ``temperature=0`` is greedy.

    ``pad_id`` fills the left padding (masked out, so any valid id works): None pads with ``eos_id``,
    for tokenizers without a pad token (or with id 0 when ``eos_id`` is negative, i.e. never stops).
    """
    if pad_id is None:
        pad_id = eos_id if eos_id >= 0 else 0
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (BOS)")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_kw = _cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = _cache_of(out)
    logits = out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1
    batch = len(prompts)
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        newly_done = (nxt == eos_id) & ~done
        lengths[newly_done] = t
        done |= newly_done
        tokens[:, t] = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos,
            use_cache=True, **{cache_kw: cache},
        )
        cache, logits, next_pos = _cache_of(out), out.logits[:, -1, :], next_pos + 1
    tokens, lengths, done = tokens.cpu(), lengths.cpu(), done.cpu()
    return [
        Generation(tokens=tokens[i, : int(lengths[i])].tolist(), finished=bool(done[i]))
        for i in range(batch)
    ]
