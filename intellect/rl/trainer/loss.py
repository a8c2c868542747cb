"""The INTELLECT-2 GRPO loss: two-sided clipped ratio, optional k3 KL and entropy bonus.

Per completion token, with ratio ``r = exp(logp_new - logp_old)`` and the
sequence's advantage ``A`` (prime-rl I2 ``zeroband/training/loss.py``)::

    coef1 = clamp(r, 0, delta)                   delta = 4
    coef2 = clamp(coef1, 1 - eps_low, 1 + eps_high)   eps = 0.2
    loss  = max(-coef1 * A, -coef2 * A)

For A > 0 the max already caps the ratio at 1 + eps, so delta only binds for
A < 0: it bounds how hard one stale, now-likely token can be pushed down.

Worked example, one token per sequence::

    >>> import torch
    >>> r = torch.tensor([1.5, 1.5, 5.0, 0.5, 0.5])    # ratio
    >>> A = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0])
    >>> # per-token loss:  -1.2 (1+eps)  1.5 (r)  4.0 (delta)  0.8 (1-eps)  -0.5 (r)
    >>> cfg = GRPOLossConfig(normalization="token")
    >>> loss, stats = grpo_loss(r.log()[:, None], torch.zeros(5, 1), A, torch.ones(5, 1), cfg)
    >>> round(loss.item(), 4)                           # (-1.2 + 1.5 + 4 + 0.8 - 0.5) / 5
    0.92
    >>> {k: round(stats[k].item(), 2) for k in ("clip_low", "clip_high", "clip_delta", "clip_fraction")}
    {'clip_low': 0.2, 'clip_high': 0.2, 'clip_delta': 0.2, 'clip_fraction': 0.6}

Normalization of ``sum(loss * mask)`` (``mask`` marks completion tokens):

- ``constant``: divide by ``batch x max_len``, a constant token budget (Dr. GRPO;
  the INTELLECT-2 paper and I2 code). Long and short completions get the same
  per-token weight, and the scale does not depend on how many tokens were real.
  TRL ``dr_grpo`` with ``max_len = max_completion_length``.
- ``token``: divide by the number of completion tokens (this micro-batch's, or
  ``token_count`` for the whole optimizer step). TRL ``bnpo`` / ``dapo``.
- ``sequence``: mean over each sequence's tokens, then over sequences. TRL ``grpo``.

The k3 KL ``exp(ref - logp) - (ref - logp) - 1`` (clamped to at most 10 per
token, as in I2) is taken on the live ``logp_new``, so it has a gradient. I2
passed the no-grad recomputed log-probs there, which made its KL a constant.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from intellect.config import StrictModel

KL_CLAMP = 10.0


class GRPOLossConfig(StrictModel):
    """The policy-gradient loss of the RL trainer (defaults: INTELLECT-2)."""

    epsilon_low: float = Field(default=0.2, gt=0, lt=1, description="Lower clip: coef2 >= 1 - epsilon_low.")
    epsilon_high: float = Field(default=0.2, gt=0, le=10, description="Upper clip: coef2 <= 1 + epsilon_high.")
    delta: float | None = Field(
        default=4.0, gt=1, le=1000,
        description="Cap on the unclipped ratio (coef1 = clamp(r, 0, delta)); binds only for negative "
        "advantages. None disables it (plain PPO clipping).",
    )
    normalization: Literal["constant", "token", "sequence"] = Field(
        default="constant",
        description="constant: sum / (batch x max_len), Dr. GRPO as in INTELLECT-2; token: mean over "
        "completion tokens; sequence: per-sequence token mean, then mean over sequences.",
    )
    old_logprobs: Literal["recomputed", "behaviour"] = Field(
        default="recomputed",
        description="Denominator of the ratio: log-probs recomputed by the trainer with the weights at the "
        "start of the step (INTELLECT-2), or the behaviour policy's (the inference engine's, which "
        "importance-corrects the async lag). Read by the trainer, which passes the matching logp_old.",
    )
    kl_coef: float = Field(
        default=0.0, ge=0, le=10, description="Weight of the k3 KL to the reference model; 0 disables it."
    )
    entropy_coef: float = Field(
        default=0.0, ge=0, le=1, description="Weight of the entropy bonus (subtracted from the loss); 0 disables it."
    )

    @model_validator(mode="after")
    def _delta_above_clip(self) -> "GRPOLossConfig":
        if self.delta is not None and self.delta < 1 + self.epsilon_high:
            raise ValueError(f"delta ({self.delta}) must be >= 1 + epsilon_high ({1 + self.epsilon_high})")
        return self


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``tokens`` under ``softmax(logits / temperature)``, and the entropy per position.

    ``logits`` is ``[..., V]`` already aligned with ``tokens`` ``[...]`` (the
    caller drops the last position and the prompt). Half-precision logits are
    upcast to float32. The log-prob path stores no ``[..., V]`` tensor beyond
    the scaled logits (gather minus logsumexp); the entropy needs a full
    softmax, so it is computed without grad unless ``entropy_grad`` (for a
    nonzero ``entropy_coef``).

        >>> import math
        >>> logits = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 2.0]]) * math.log(2)
        >>> logp, h = token_logprobs(logits, torch.tensor([0, 2]), temperature=2.0)   # probs 1/4, 1/4, 1/2
        >>> logp.exp(), round(h[0].item() / math.log(2), 4)                          # H = 1.5 ln 2
        (tensor([0.2500, 0.5000]), 1.5)
    """
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp_all = torch.log_softmax(z, dim=-1)
        # -inf logits (masked vocab) give p = 0 and log p = -inf; clamping keeps 0 * log p at 0, not NaN.
        entropy = -(logp_all.exp() * logp_all.clamp(min=torch.finfo(z.dtype).min)).sum(-1)
    return logp, entropy


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOLossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    max_len: int | None = None,
    token_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss of one micro-batch, and detached 0-d statistics for logging.

    ``logp_new`` (with grad), ``logp_old``, ``mask`` (1 on completion tokens) and
    the optional ``ref_logp`` / ``entropy`` are ``[B, T]``; ``advantages`` is
    ``[B]`` (one per sequence) or ``[B, T]``. ``max_len`` is the token budget per
    sequence of ``constant`` normalization (default ``T``); ``token_count`` the
    denominator of ``token`` normalization when it spans more than this
    micro-batch (grad accumulation, data parallel). Splitting a batch into
    micro-batches is the caller's to scale.

    Stats (token means over ``mask``): ``clip_low`` (A < 0, r < 1 - eps_low),
    ``clip_high`` (A > 0, r > 1 + eps_high), ``clip_delta`` (A < 0, r > delta),
    ``clip_fraction`` (any of them: tokens whose policy gradient a clip cuts off),
    ``ratio_mean/min/max`` (min/max are +-inf with no tokens), and ``kl`` /
    ``entropy`` when given (``kl`` is logged even with ``kl_coef = 0``).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    tok = mask.bool()
    # Zero the padding first, so garbage there (inf, NaN) reaches neither the loss nor the gradient.
    pad = ~tok
    logp_new, logp_old = logp_new.masked_fill(pad, 0), logp_old.masked_fill(pad, 0)
    advantages = advantages.masked_fill(pad, 0) if advantages.shape == tok.shape else advantages
    ref_logp = None if ref_logp is None else ref_logp.masked_fill(pad, 0)
    entropy = None if entropy is None else entropy.masked_fill(pad, 0)
    mask = tok.to(logp_new.dtype)
    ratio = torch.exp(logp_new - logp_old)
    coef1 = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    coef2 = coef1.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    per_token = torch.maximum(-coef1 * advantages, -coef2 * advantages)

    kl = None
    if ref_logp is not None:
        d = ref_logp - logp_new
        kl = (torch.exp(d) - d - 1).clamp(max=KL_CLAMP)
    if cfg.kl_coef > 0:
        if kl is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs an entropy with grad (token_logprobs(..., entropy_grad=True))")
        per_token = per_token - cfg.entropy_coef * entropy

    masked = per_token * mask
    if cfg.normalization == "constant":
        loss = masked.sum() / (mask.shape[0] * (max_len or mask.shape[-1]))
    elif cfg.normalization == "token":
        denom = mask.sum() if token_count is None else torch.as_tensor(token_count).to(mask)
        loss = masked.sum() / denom.clamp(min=1)
    else:
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        neg, pos = (advantages < 0).expand_as(tok), (advantages > 0).expand_as(tok)
        low = tok & neg & (ratio < 1 - cfg.epsilon_low)
        high = tok & pos & (ratio > 1 + cfg.epsilon_high)
        over = tok & neg & (ratio > cfg.delta) if cfg.delta is not None else torch.zeros_like(tok)
        r = ratio.detach()
        stats = {
            "clip_low": low.sum() / n,
            "clip_high": high.sum() / n,
            "clip_delta": over.sum() / n,
            "clip_fraction": (low | high | over).sum() / n,
            "ratio_mean": (r * mask).sum() / n,
            "ratio_min": r.masked_fill(~tok, float("inf")).min(),
            "ratio_max": r.masked_fill(~tok, float("-inf")).max(),
        }
        if kl is not None:
            stats["kl"] = (kl.detach() * mask).sum() / n
        if entropy is not None:
            stats["entropy"] = (entropy.detach() * mask).sum() / n
    return loss, stats
