"""Token log-probs of packed rows without a ``[tokens x vocab]`` float32 tensor for the whole row.

A causal LM's logits are its output embeddings (the LM head) applied to the last hidden state. So
the base model runs once over the row (:mod:`intellect.rl.trainer.packing`: ``position_ids`` restart per
sample, no attention mask, no KV cache), the hidden states at the positions that predict an output
token are gathered (prompt positions and the last token of each sample cost nothing past the base
model), and the head runs over them ``chunk_tokens`` at a time. Each chunk goes through
:func:`~intellect.rl.trainer.loss.token_logprobs` (float32 at least, divided by the temperature, exactly as
the full-logits path). The forward keeps only the hidden states, and the backward recomputes each
chunk's logits (for an ``nn.Linear`` head, a hand-written backward that also accumulates the
weight's gradient in place; for any other head, a non-reentrant activation checkpoint per chunk),
so at most one chunk of logits (and its softmax) is alive at a time, forward or backward.

Worked example: a head that maps hidden ``(0, 0, 2)`` to logits ``(0, 0, 2 ln 2)``, at temperature 2
(probs 1/4, 1/4, 1/2), one token per chunk; the gradient reaches the hidden states and the head::

    >>> import math
    >>> head = torch.nn.Linear(3, 3, bias=False)
    >>> with torch.no_grad():
    ...     _ = head.weight.copy_(torch.eye(3) * math.log(2))
    >>> hidden = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 2.0]], requires_grad=True)
    >>> logp, h = chunked_token_logprobs(head, hidden, torch.tensor([0, 2]), 2.0, entropy_grad=True, chunk_tokens=1)
    >>> logp.exp(), round(h[0].item() / math.log(2), 4)          # H = 1.5 ln 2
    (tensor([0.2500, 0.5000], grad_fn=<ExpBackward0>), 1.5)
    >>> (logp.sum() + h.sum()).backward()
    >>> head.weight.grad.abs().sum().item() > 0, hidden.grad.shape
    (True, torch.Size([2, 3]))
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch.utils.checkpoint import checkpoint

from intellect.rl.trainer.loss import token_logprobs
from intellect.rl.trainer.packing import PackedRow

DEFAULT_CHUNK_TOKENS = 256

Context = Callable[[], ContextManager]


def split_causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The base model (whose output's ``last_hidden_state`` the head reads) and the LM head of an HF
    causal LM. :func:`packing_isolates` checks that the two really compose to the model's logits."""
    base = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if base is None or base is model or head is None:
        raise TypeError(f"{type(model).__name__} is not a causal LM with a base model and output embeddings")
    return base, head


def hidden_states(base: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``[R, L, H]`` of packed rows ``ids`` ``[R, L]``. ``use_cache=False`` is what
    makes transformers read sample boundaries from ``position_ids``: with a cache it builds a plain
    causal mask, and samples of a row would attend to each other."""
    return base(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy_grad: bool, context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    with context():
        logits = head(hidden)
    # outside the context: the log-softmax and everything after it run in float32 (bf16 logits upcast)
    return token_logprobs(logits, targets, temperature, entropy_grad=entropy_grad)


class _LinearHeadLogprobs(torch.autograd.Function):
    """:func:`chunked_token_logprobs` of an ``nn.Linear`` head, with the backward written out: per
    chunk it recomputes the logits and forms their gradient in place (``d logp_t / dz = onehot_t - p``,
    ``dH / dz = -p (log p + H)``), and accumulates the weight's gradient into one buffer, so that
    neither a per-chunk weight gradient nor autograd's intermediates are ever alive."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, targets, temperature, chunk_tokens, entropy_grad, context):
        # weight and bias are head's, passed for their gradients; the forward calls the module itself
        logps, entropies = [], []
        with torch.no_grad():
            for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
                h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
                lp, ent = _chunk_logprobs(head, h, t, temperature, False, context)
                logps.append(lp)
                entropies.append(ent)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad, ctx.context = temperature, chunk_tokens, entropy_grad, context
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, *grads):
        g_logp, g_entropy = grads
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden.shape[0])
            h, t, g = hidden[start:end], targets[start:end], g_logp[start:end, None]
            with ctx.context():
                logits = torch.nn.functional.linear(h, weight, bias)
            z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            if ctx.temperature != 1.0:
                z = z / ctx.temperature
            logp_all = torch.log_softmax(z, dim=-1)
            del z
            p = logp_all.exp()
            if ctx.entropy_grad:
                logp_all.clamp_(min=torch.finfo(logp_all.dtype).min)  # as token_logprobs: 0 * log 0 = 0
                entropy = -(p * logp_all).sum(-1, keepdim=True)
                grad_z = logp_all.add_(entropy).mul_(p).mul_(-g_entropy[start:end, None])
                grad_z.add_(p.mul_(-g))
            else:
                grad_z = p.mul_(-g)
            del logp_all
            grad_z[torch.arange(end - start, device=t.device), t] += g[:, 0].to(grad_z.dtype)
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_logits = grad_z.to(logits.dtype)  # the matmuls' dtype (bf16 under autocast)
            del grad_z
            if grad_h is not None:
                grad_h[start:end] = (grad_logits @ weight.to(logits.dtype)).to(hidden.dtype)
            if grad_w is not None:
                if logits.dtype == grad_w.dtype:
                    grad_w.addmm_(grad_logits.t(), h.to(logits.dtype))
                else:
                    grad_w += (grad_logits.t() @ h.to(logits.dtype)).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += grad_logits.sum(0).to(grad_b.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_token_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
    entropy_grad: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, context: Context = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~intellect.rl.trainer.loss.token_logprobs` of ``head(hidden)`` (``hidden`` ``[N, H]``, ``targets``
    ``[N]``), ``chunk_tokens`` rows of logits at a time; the head runs under ``context`` (autocast).
    With grad, an ``nn.Linear`` head (every HF causal LM's) has a hand-written chunked backward;
    any other head has each chunk checkpointed (module docstring)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    track = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    if track and type(head) is torch.nn.Linear:
        out = _LinearHeadLogprobs.apply(hidden, head.weight, head.bias, head, targets, temperature, chunk_tokens,
                                        entropy_grad, context)
        return out[0], out[1]  # type: ignore[index]  - apply is untyped
    logps, entropies = [], []
    # an empty row still runs one (empty) chunk: its loss then has a graph, and backward gives zero grads
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if track:
            lp, ent = checkpoint(_chunk_logprobs, head, h, t, temperature, entropy_grad, context, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(head, h, t, temperature, entropy_grad, context)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)


def row_logprobs(
    model: torch.nn.Module, row: PackedRow, temperature: float = 1.0, *, entropy_grad: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, context: Context = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[N]`` of every output token of ``row`` (row order, on the row's device);
    the model runs under ``context``."""
    base, head = split_causal_lm(model)
    with context():
        hidden = hidden_states(base, row.ids[None], row.position_ids[None])[0]
    return chunked_token_logprobs(head, hidden[row.predict], row.targets, temperature, entropy_grad=entropy_grad,
                                  chunk_tokens=chunk_tokens, context=context)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return bool((a - b).abs().max() <= rtol * b.abs().max().clamp(min=1e-6))


@torch.no_grad()
def packing_isolates(model: torch.nn.Module, *, prefix: int = 12, tokens: int = 4,
                     context: Context = contextlib.nullcontext) -> bool:
    """Whether ``model`` keeps packed samples apart: a sample's logits after a ``prefix``-token sample in
    the same row (positions restarting at 0) equal its logits alone. Raises when the LM head applied
    to the base model's last hidden state is not the model's logits (softcapped or scaled logits, an
    architecture :func:`row_logprobs` cannot serve). A few forwards of a few tokens, in eval mode, under
    ``context`` (the trainer's autocast)."""
    base, head = split_causal_lm(model)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", None) or getattr(head, "out_features"))
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (prefix,), generator=g), torch.randint(0, vocab, (tokens,), generator=g)
    ids = torch.cat([a, b])[None].to(device)
    pos = torch.cat([torch.arange(prefix), torch.arange(tokens)])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        with context():
            half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16) \
                or torch.is_autocast_enabled(device.type)
            full = model(input_ids=ids[:, prefix:], use_cache=False).logits[0].float()
            alone = head(hidden_states(base, ids[:, prefix:], pos[:, prefix:])[0]).float()
            packed = head(hidden_states(base, ids, pos)[0, prefix:]).float()
    finally:
        model.train(was_training)
    rtol = 3e-2 if half else 1e-3
    if not _close(alone, full, rtol):
        raise TypeError(f"{type(model).__name__}: its logits are not the output embeddings of the last hidden state")
    return _close(packed, alone, rtol)
