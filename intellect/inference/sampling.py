"""Seeded, batch-independent sampling that a validator can recompute token by token.

The rule, for generated position ``t`` (0 for the first generated token) of a
request with seed ``s``, given that position's logits ``l`` (a vocab row):

1. ``temperature == 0``: the token is ``argmax(l)`` (lowest id on ties).
2. otherwise ``z = float32(l) / temperature``. If ``top_p < 1``, sort the
   float64 probabilities ``softmax(z)`` in descending order (stable, so
   equal probabilities keep id order) and keep a token iff the mass of the
   tokens ranked strictly above it, ``cumsum(p) - p``, is ``< top_p``; the
   top token is always kept. Dropped tokens get ``z = -inf``.
3. the token is ``argmax(z + g)`` with Gumbel noise ``g = -log(-log(u))``
   and ``u = uniforms(s, t, vocab)`` (Gumbel-max: an exact draw from
   ``softmax(z)`` over the kept set).

``u`` comes from a counter-based integer hash of ``(seed, position, token
id)``, not from a stateful generator: it is the same on every device and for
every batch size, order or padding, and a validator can produce the noise of
any single position without replaying the ones before it. Only the float
steps (logits, ``log``) can differ between machines, so a recomputed choice
disagrees only when two candidates are within rounding of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from intellect.config import StrictModel

MAX_SEED = (1 << 63) - 1  # seeds live in int64 tensors
_M32 = 0xFFFFFFFF
_SALT = (0x9E3779B9, 0x85EBCA6B)


class SamplingParams(StrictModel):
    """How one request is decoded."""

    temperature: float = Field(default=1.0, ge=0, le=100, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus mass kept before sampling; 1 keeps every token.")
    max_tokens: int = Field(default=16, ge=1, le=1 << 20, description="Most tokens generated, EOS included.")
    stop_at_eos: bool = Field(default=True, description="End the completion when an EOS token is sampled.")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2**32 in 16-bit halves, so no int64 product overflows (overflow is UB in C++ kernels)
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" (C. Wellons): a bijection on uint32 with near-ideal avalanche
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed, position, vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Uniform(0, 1) float32 noise of shape ``broadcast(seed, position) + (vocab,)``.

    A pure function of ``(seed, position, token id)`` for seeds in [0, 2**63)
    and positions in [0, 2**32); values are multiples of 2**-24 offset by
    2**-25, so never 0 or 1.

    >>> u = uniforms(7, 3, 5)
    >>> u.shape, bool(((0 < u) & (u < 1)).all())
    (torch.Size([5]), True)
    >>> torch.equal(uniforms([7, 8], [3, 0], 5)[0], u), torch.equal(uniforms(7, 3, 9)[:5], u)
    (True, True)
    """
    if not isinstance(seed, torch.Tensor) and min(torch.tensor(seed).view(-1).tolist(), default=0) < 0:
        raise ValueError("seeds must be in [0, 2**63)")  # tensors are trusted: checking would sync a GPU every step
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device)
    position = torch.as_tensor(position, dtype=torch.int64, device=seed.device)
    lo, hi = seed & _M32, seed >> 32
    # two 32-bit keys so distinct (seed, position) pairs share noise only with probability 2**-64
    k1 = _mix32(_mix32(_mix32(lo ^ _SALT[0]) ^ hi) ^ position)[..., None]
    k2 = _mix32(_mix32(_mix32(hi ^ _SALT[1]) ^ lo) ^ position)[..., None]
    h = _mix32(_mix32(k1 ^ torch.arange(vocab, device=seed.device)) ^ k2)
    return ((h >> 8).float() + 0.5) * 2.0**-24


def top_p_mask(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``z`` [B, V] with tokens outside each row's nucleus set to ``-inf`` (rule 2 above).

    Probabilities are float64 so that the cut differs between devices only
    for masses within ~1e-16 of ``top_p``.

    >>> top_p_mask(torch.tensor([[0.0, 1.0, 2.0, 0.0]]), torch.tensor([0.7])).tolist()
    [[-inf, 1.0, 2.0, -inf]]
    """
    top_p = top_p.to(z.device, torch.float64)[:, None]
    p, order = torch.softmax(z.double(), -1).sort(stable=True, dim=-1, descending=True)
    drop = ((p.cumsum(-1) - p) >= top_p) & (top_p < 1)
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor | None
) -> torch.Tensor:
    """Tokens [B] for logits [B, V], per-row temperature and top_p [B], noise ``u`` [B, V].

    ``u`` may be None when every row is greedy.
    """
    return scores(logits, temperature, top_p, u).argmax(-1)


def scores(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor | None
           ) -> torch.Tensor:
    """What :func:`sample` takes the argmax of, float32 [B, V]: the Gumbel-max scores ``z + g`` of a
    sampled row (``z``: the logits over the temperature, outside the nucleus -inf), the raw logits of a
    greedy one (whose ``u`` is unused)."""
    logits = logits.float()
    temperature = temperature.to(logits.device, torch.float32)
    hot = temperature > 0
    if not bool(hot.any()):
        return logits
    z = logits / torch.where(hot, temperature, 1.0)[:, None]
    if bool((top_p < 1).any()):  # the sort is the costly part; rule 2 skips it at top_p == 1 anyway
        z = top_p_mask(z, top_p)
    assert u is not None, "u is needed when a row samples (temperature > 0)"
    return torch.where(hot[:, None], z + -torch.log(-torch.log(u.to(logits.device))), logits)


def choice_margin(scored: torch.Tensor, claimed: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """How far below the seeded choice ``chosen`` [B] the ``claimed`` token [B] scores in ``scored``
    (:func:`scores`), float32 [B]: 0 where they agree, inf for a token the nucleus excludes. A flip from
    floating-point nondeterminism (bf16) needs a near-tie, a margin within the logits' noise; a token
    the seed could not have chosen lies further away.

    >>> logits = torch.tensor([[2.0, 1.9, -3.0], [2.0, 1.9, -3.0]])
    >>> m = choice_margin(scores(logits, torch.zeros(2), torch.ones(2), None), torch.tensor([1, 2]), torch.tensor([0, 0]))
    >>> [round(x, 4) for x in m.tolist()]
    [0.1, 5.0]
    """
    claimed, chosen = claimed.to(scored.device), chosen.to(scored.device)
    margin = scored.gather(-1, chosen[:, None]) - scored.gather(-1, claimed[:, None])
    return torch.where(chosen == claimed, 0.0, margin[:, 0].nan_to_num(torch.inf))


def sample_token(logits_row: torch.Tensor, temperature: float, top_p: float, uniform_row: torch.Tensor) -> int:
    """The validator's recomputation of one choice: :func:`sample` on a batch of one.

    >>> logits = torch.tensor([0.0, 3.0, 1.0])
    >>> sample_token(logits, 0.0, 1.0, uniforms(0, 0, 3))
    1
    >>> sample_token(logits, 1.0, 0.5, uniforms(123, 4, 3))   # top-p 0.5 keeps only id 1
    1
    """
    t = torch.tensor([temperature])
    return int(sample(logits_row[None], t, torch.tensor([top_p]), uniform_row[None])[0])


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 ``log softmax(logits / T)`` at ``tokens`` (T = 1 for greedy rows), before top-p.

    Same scaling as a GRPO trainer that divides its logits by the sampling temperature.
    """
    t = temperature.to(logits.device, torch.float32)
    z = logits.float() / torch.where(t > 0, t, 1.0)[:, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """float64 ``[n, V]``: the distribution :func:`sample` draws from, per row: ``softmax(logits / T)``
    over the top-p nucleus, 0 outside it; one-hot at the argmax (lowest id on ties) where ``T == 0``.

    >>> logits = torch.tensor([[0.0, 2.0, 0.0], [0.0, 2.0, 0.0], [1.0, 1.0, 0.0]])
    >>> sampling_probs(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.5, 1.0])).numpy().round(3)
    array([[0.107, 0.787, 0.107],
           [0.   , 1.   , 0.   ],
           [1.   , 0.   , 0.   ]])
    """
    logits = logits.float()
    temperature = temperature.to(logits.device, torch.float32)
    hot = temperature > 0
    # the sampler's own steps: float32 z, then the float64 nucleus rule
    z = logits / torch.where(hot, temperature, 1.0)[:, None]
    if bool((top_p < 1).any()):
        z = top_p_mask(z, top_p)
    probs = torch.softmax(z.double(), -1)
    greedy = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(hot[:, None], probs, greedy)


def low_prob_draws(probs: torch.Tensor, tokens: torch.Tensor, min_token_prob: float, floor: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, chance)``, both ``[n]``: whether each chosen token's probability is below
    ``min_token_prob``, and the chance that an honest draw from ``probs`` is (the mass of the
    tokens below it), raised to at least ``floor``.

    >>> probs = torch.tensor([[0.90, 0.08, 0.02], [0.50, 0.49, 0.01], [0.90, 0.08, 0.02]], dtype=torch.float64)
    >>> low, chance = low_prob_draws(probs, torch.tensor([0, 2, 2]), min_token_prob=0.05, floor=0.001)
    >>> low.tolist(), chance.tolist()
    ([False, True, True], [0.02, 0.01, 0.02])
    """
    chosen = probs.gather(-1, tokens[:, None].to(probs.device))[:, 0]
    chance = (probs * (probs < min_token_prob)).sum(-1).clamp(min=floor)
    return chosen < min_token_prob, chance


@dataclass(frozen=True, slots=True)
class LowProb:
    """What a prefill needs to flag each scored token for the TOPLOC distribution check
    (:func:`low_prob_draws`): the probability below which a token is *low*, and the least chance of
    an honest low draw assumed at any position."""

    min_token_prob: float
    floor: float = 0.0


def score_tokens(logits: torch.Tensor, claimed: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor, low_prob: LowProb | None = None,
                 max_elements: int = 1 << 24) -> dict[str, torch.Tensor]:
    """Per-token results of scoring ``claimed`` [n >= 1] under ``logits`` [n, V] (rows: one scored token
    each, with its temperature, top-p, request seed and generated position), all ``[n]`` on the CPU:
    ``resampled`` (what :func:`sample` picks with the seed's noise), ``margin`` (:func:`choice_margin`),
    ``logprobs`` (:func:`chosen_logprobs`) and, with ``low_prob``, ``low`` and ``chance`` (:func:`low_prob_draws`
    under :func:`sampling_probs`). Nothing of vocabulary size leaves the logits' device.

    Rows are scored ``max_elements // V`` at a time: the float64 ``[rows, V]`` intermediates
    (probabilities, the nucleus sort, the noise) stay bounded whatever the batch, and every step is
    row-wise, so the results do not depend on the slicing.

    >>> logits = torch.tensor([[0.0, 4.0, 0.0], [3.0, 0.0, 0.0]])
    >>> out = score_tokens(logits, torch.tensor([1, 2]), torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]),
    ...                    torch.tensor([7, 7]), torch.tensor([0, 1]), LowProb(0.05, floor=0.001))
    >>> out["resampled"].tolist(), out["low"].tolist(), out["chance"].numpy().round(3).tolist()
    ([1, 0], [False, True], [0.035, 0.001])
    """
    vocab, hot = logits.shape[-1], bool((temperature > 0).any())
    step = max(1, max_elements // vocab)
    parts: dict[str, list[torch.Tensor]] = {}
    for a in range(0, len(logits), step):
        rows = slice(a, a + step)
        flat, t, p = logits[rows].float(), temperature[rows], top_p[rows]
        u = uniforms(seeds[rows], positions[rows], vocab) if hot else None
        scored = scores(flat, t, p, u)  # once: the seeded choice and the margin both read it
        chosen = scored.argmax(-1)
        got = {"resampled": chosen, "logprobs": chosen_logprobs(flat, claimed[rows], t),
               "margin": choice_margin(scored, claimed[rows], chosen)}
        if low_prob is not None:
            got["low"], got["chance"] = low_prob_draws(sampling_probs(flat, t, p), claimed[rows],
                                                       low_prob.min_token_prob, low_prob.floor)
        for k, v in got.items():
            parts.setdefault(k, []).append(v.cpu())
    return {k: torch.cat(v) for k, v in parts.items()}
