"""TOPLOC in an RL step: workers attach proofs to their rollouts; the validator checks them with
one prefill per policy checkpoint.

A worker's engine captures the final hidden state of every generated token
(:class:`~intellect.inference.protocol.Completion`); :func:`completion_proofs` turns a batch of
completions into one proof blob each. The validator's :func:`toploc_check` is a
:data:`~intellect.rl.validator.RowCheck`: it groups a submission's rows by the checkpoint they
claim, prefills ``prompt + output`` once with that checkpoint
(:meth:`~intellect.inference.torch_engine.TorchEngine.prefill`, or :func:`right_padded_prefill`),
and checks every chunk's proof against its own hidden states
(:func:`~intellect.toploc.proofs.check_many`). A row fails with ``toploc_<reason>``
(``toploc_exponent``, ``toploc_mantissa``, ``toploc_sign``, ``toploc_proof_count``,
``toploc_malformed``, ``toploc_null_proof``, ...); a checkpoint the validator cannot load fails its
rows with ``toploc_no_checkpoint`` instead of raising.

The same prefill's logits give two more checks, in this order after the computation check.

**Sampling** (``toploc_sampling``; which layer failed is logged, see :func:`sampling_detail`):

* *seeded re-check* (``cfg.seeded_check``): the engines sample with seeded Gumbel-max, so the
  validator recomputes each token's choice from its own logits and the request seed; more than
  ``max_resampled_fraction`` of a rollout's tokens differing fails (an edited token, or the hybrid
  attack: a small model samples, the claimed one builds the proofs). It needs a reproducible seeded
  sampler on the worker, which a vLLM deployment does not have;
* *distribution check* (``cfg.distribution_check``, INTELLECT-2's): tokens another model sampled
  often have a low probability under the claimed model. A token is *low* when the validator's
  sampling distribution (:func:`sampling_probs`) gives it less than ``min_token_prob``; an honest
  sampler draws a low token at position ``t`` with a chance the validator knows, the probability
  mass of that position's low tokens (:func:`low_prob_draws`). A rollout fails when a Chernoff
  bound on an honest sampler drawing at least as many low tokens is below
  ``10 ** -max_low_prob_surprise`` (:func:`low_prob_surprise`). Short rollouts carry too few
  tokens each, so the rows of a submission that passed the computation and seeded checks are also
  tested pooled, and fail together (a file is one worker's). The test adapts to the model's
  entropy, the temperature and top-p: a flat distribution makes every token low and expected so,
  and nothing is rejected where nothing can be told apart.

**Termination**: an output shorter than ``max_tokens`` must end with EOS (``toploc_truncated``), and
an EOS that the seeded sampler does not itself pick there (one slipped in under the sampling
check's allowance; every EOS when the seeded re-check is off) must have probability at least
``min_eos_prob`` under the validator's model (``toploc_eos_unlikely``): a worker may not stop early
to save compute. (INTELLECT-2 applies the probability rule to every EOS; with reproducible sampling
that would reject honest workers whose seed drew an unlikely EOS.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from intellect.inference.protocol import Request, Scored
from intellect.inference.sampling import chosen_logprobs, sample, top_p_mask, uniforms
from intellect.toploc.proofs import ToplocConfig, build_proofs_many, check_many

if TYPE_CHECKING:
    from intellect.inference.protocol import Completion, InferenceEngine
    from intellect.inference.sampling import SamplingParams
    from intellect.inference.torch_engine import TorchEngine
    from intellect.rl.rollouts import Rollout

log = logging.getLogger("intellect.toploc.check")

#: Policy step -> an engine holding that checkpoint's weights (raises ``FileNotFoundError`` if absent).
EngineFor = Callable[[int], "InferenceEngine"]
#: ``prefill(engine, requests, outputs, sampling, keep_logits) -> scored``: how the validator scores rows.
Prefill = Callable[["InferenceEngine", Sequence[Request], Sequence[Sequence[int]], "SamplingParams", bool],
                   "list[Scored]"]


def completion_proofs(completions: Sequence[Completion], cfg: ToplocConfig) -> list[bytes]:
    """The proof blob of each completion (its engine must capture hidden states)."""
    if any(c.hidden_states is None for c in completions):
        raise ValueError("TOPLOC proofs need hidden states: build the engine with capture_hidden=True")
    return build_proofs_many([c.hidden_states for c in completions], cfg.chunk, cfg.k)


# ---------------------------------------------------------------- distribution statistic (pure)


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """float64 ``[n, V]``: the distribution :func:`~intellect.inference.sampling.sample` draws from,
    per row: ``softmax(logits / T)`` over the top-p nucleus, 0 outside it; one-hot at the argmax
    (lowest id on ties) where ``T == 0``.

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


def low_prob_surprise(low: torch.Tensor | float, expected: torch.Tensor | float) -> torch.Tensor:
    """``-log10`` of the Chernoff bound on the chance that honest sampling draws at least ``low``
    low-probability tokens when it is expected to draw ``expected``: 0 while ``low <= expected``,
    else ``(expected - low + low * ln(low / expected)) / ln 10``; infinite when ``expected`` is 0.

    Worked example: 3 low tokens where 0.06 were expected (the chances of
    :func:`low_prob_draws`, summed) is a surprise of 3.8, i.e. honest sampling does that at most
    once in ``10 ** 3.8`` rollouts; 1 low token where 0.06 were expected is 0.8; 10 where 20 were
    expected is 0.

    >>> low_prob_surprise(torch.tensor([3.0, 1.0, 10.0]), torch.tensor([0.06, 0.06, 20.0])).numpy().round(1)
    array([3.8, 0.8, 0. ])
    """
    low, expected = torch.as_tensor(low, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    nats = expected - low + torch.xlogy(low, low) - torch.xlogy(low, expected)
    # clamp: where low barely exceeds expected, rounding can leave the exact 0+ slightly negative
    return torch.where(low > expected, nats / math.log(10), torch.zeros_like(nats)).clamp(min=0)


@dataclass(frozen=True, slots=True)
class Draws:
    """The distribution check's counts of some tokens: low-probability ones drawn and expected."""

    tokens: int
    low: int
    expected: float

    def __add__(self, other: "Draws") -> "Draws":
        return Draws(self.tokens + other.tokens, self.low + other.low, self.expected + other.expected)

    @property
    def surprise(self) -> float:
        return float(low_prob_surprise(float(self.low), self.expected))


def sampling_detail(layer: str, scope: str, draws: Draws | None = None, resampled: int = 0, tokens: int = 0
                    ) -> str:
    """What a ``toploc_sampling`` verdict was about, for the log (the ledger keeps only the reason).

    >>> sampling_detail("distribution", "submission", Draws(tokens=40, low=12, expected=0.5))
    'distribution (submission): 12 of 40 tokens below min_token_prob where 0.50 were expected, surprise 11.6'
    >>> sampling_detail("seeded", "rollout", resampled=3, tokens=20)
    'seeded re-check (rollout): 3 of 20 tokens differ from the seed and logits choice'
    """
    if layer == "seeded":
        return f"seeded re-check ({scope}): {resampled} of {tokens} tokens differ from the seed and logits choice"
    return (f"distribution ({scope}): {draws.low} of {draws.tokens} tokens below min_token_prob where "
            f"{draws.expected:.2f} were expected, surprise {draws.surprise:.1f}")


# ---------------------------------------------------------------- prefill


def engine_prefill(engine: InferenceEngine, requests: Sequence[Request], outputs: Sequence[Sequence[int]],
                   sampling: SamplingParams, keep_logits: bool = False) -> list[Scored]:
    """The engine's own prefill (left-padded batches for :class:`TorchEngine`)."""
    return engine.prefill(requests, outputs, sampling, keep_logits=keep_logits)


@torch.no_grad()
def right_padded_prefill(engine: TorchEngine, requests: Sequence[Request], outputs: Sequence[Sequence[int]],
                         sampling: SamplingParams, keep_logits: bool = False) -> list[Scored]:
    """:meth:`TorchEngine.prefill` with every batch padded on the right, in the given row order.

    Each row's tokens sit at columns ``0 .. len - 1`` with positions equal to the columns; the
    attention mask hides the padding after them (a causal model never looks right anyway, but the
    masked kernel is another code path). Hidden states and logits come from each row's own
    producing columns ``len(prompt) - 1 + t``, which differ from row to row. The scores equal the
    left-padded prefill's up to floating-point rounding. Generation must pad on the left (every
    row's next token lands in the last column); a prefill need not, and a verdict must not depend
    on which side a validator pads (``tests/integration/test_toploc_nondeterminism.py``).
    """
    model, dev = engine.model, engine.device
    head = model.get_output_embeddings()
    out: list[Scored] = []
    for start in range(0, len(requests), engine.max_batch_size):
        reqs, outs = requests[start:start + engine.max_batch_size], outputs[start:start + engine.max_batch_size]
        n = [len(o) for o in outs]
        if not any(n):
            out += engine.prefill(list(reqs), [[] for _ in reqs], sampling, keep_logits=keep_logits)
            continue
        seqs = [r.prompt_ids + list(o[:-1]) for r, o in zip(reqs, outs)]  # the last token produces nothing checked
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), engine.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, :len(s)], mask[row, :len(s)] = torch.tensor(s, dtype=torch.long), 1
        positions = torch.arange(width).expand(len(seqs), width)
        first = [len(r.prompt_ids) - 1 for r in reqs]  # the column whose logits produced each row's first token
        skip = min(f for f, k in zip(first, n) if k)  # logits only from the earliest producing column on
        seen: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].to(torch.bfloat16)))
        try:
            logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev),
                           logits_to_keep=width - skip).logits
        finally:
            handle.remove()
        rows = [(r, first[r] - skip + t) for r in range(len(outs)) for t in range(n[r])]
        r_idx, c_idx = (torch.tensor(x, device=dev) for x in zip(*rows))
        flat_logits, flat_hidden = logits[r_idx, c_idx].float(), seen[0][r_idx, c_idx]
        claimed = torch.tensor([tok for o in outs for tok in o], device=dev)
        temperature = torch.full((len(rows),), sampling.temperature, device=dev)
        top_p = torch.full((len(rows),), sampling.top_p, device=dev)
        seeds = torch.tensor([r.seed for r, k in zip(reqs, n) for _ in range(k)], device=dev)
        pos = torch.tensor([t for k in n for t in range(k)], device=dev)
        u = uniforms(seeds, pos, flat_logits.shape[-1]) if sampling.temperature > 0 else None
        resampled = sample(flat_logits, temperature, top_p, u).cpu()
        logprobs = chosen_logprobs(flat_logits, claimed, temperature).cpu()
        flat_hidden, flat_logits = flat_hidden.cpu(), flat_logits.cpu()
        bounds = torch.tensor([0] + n).cumsum(0).tolist()
        for a, b in zip(bounds, bounds[1:]):
            out.append(Scored(
                hidden_states=flat_hidden[a:b].clone(), logprobs=logprobs[a:b].clone(),
                resampled=resampled[a:b].clone(), logits=flat_logits[a:b].clone() if keep_logits else None,
            ))
    return out


# ---------------------------------------------------------------- the row check


def toploc_check(engine_for: EngineFor, sampling: SamplingParams, cfg: ToplocConfig, eos_ids: Sequence[int] = (),
                 prefill: Prefill = engine_prefill) -> Callable[[Sequence[Rollout]], list[str | None]]:
    """The validator's row check: ``None`` for a row that passes the computation, sampling and
    termination checks, else the first failure (in that order). ``eos_ids`` empty: no termination
    check. ``prefill`` scores a checkpoint's rows (:func:`engine_prefill` or
    :func:`right_padded_prefill`); the logits come back only when the distribution check needs them."""
    eos = set(eos_ids)

    def check(rows: Sequence[Rollout]) -> list[str | None]:
        reasons: list[str | None] = [None] * len(rows)
        ends: list[str | None] = [None] * len(rows)  # termination verdicts: they come after every sampling one
        draws: dict[int, Draws] = {}  # rows whose tokens the seeded re-check did not already disown
        by_policy: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_policy.setdefault(row.policy_step, []).append(i)
        for policy, idx in by_policy.items():
            try:
                engine = engine_for(policy)
            except FileNotFoundError:
                for i in idx:
                    reasons[i] = "toploc_no_checkpoint"
                continue
            requests = [Request(list(rows[i].prompt_tokens), rows[i].seed) for i in idx]
            outputs = [list(rows[i].output_tokens) for i in idx]
            scored = prefill(engine, requests, outputs, sampling, cfg.distribution_check)
            checks = check_many([s.hidden_states for s in scored], [rows[i].proof for i in idx], cfg.chunk, cfg.k, cfg)
            # the group's per-token results in one tensor each, so that per row only numbers remain
            n = [len(o) for o in outputs]
            claimed = torch.tensor([t for o in outputs for t in o], dtype=torch.int64)
            resampled = torch.cat([s.resampled for s in scored])
            row_of = torch.repeat_interleave(torch.arange(len(idx)), torch.tensor(n, dtype=torch.int64))
            differ = torch.bincount(row_of, weights=(resampled != claimed).double(), minlength=len(idx)).long().tolist()
            ends_at = [e - 1 for e in torch.tensor(n).cumsum(0).tolist()]
            same_last = (resampled == claimed).tolist()
            probs = torch.cat([s.logprobs for s in scored]).exp().tolist()
            passed = []
            for j, (i, chunks) in enumerate(zip(idx, checks)):
                bad = next((c.reason for c in chunks if not c.ok), None)
                if bad:
                    reasons[i] = f"toploc_{bad}"
                    continue
                if cfg.seeded_check and differ[j] > cfg.max_resampled_fraction * n[j]:
                    reasons[i] = _sampling(i, sampling_detail("seeded", "rollout", resampled=differ[j], tokens=n[j]))
                last = ends_at[j]
                ends[i] = _termination(outputs[j], sampling, cfg, eos, n[j] and same_last[last], n[j] and probs[last])
                if reasons[i] is None:
                    passed.append((i, scored[j]))
            if cfg.distribution_check and passed:
                draws.update(_draws(rows, passed, sampling, cfg))
        if draws:
            over = (low_prob_surprise(torch.tensor([float(d.low) for d in draws.values()], dtype=torch.float64),
                                      torch.tensor([d.expected for d in draws.values()], dtype=torch.float64))
                    > cfg.max_low_prob_surprise).tolist()
            for (i, d), o in zip(draws.items(), over):
                if o:
                    reasons[i] = _sampling(i, sampling_detail("distribution", "rollout", d))
        pooled = sum(draws.values(), Draws(0, 0, 0.0))
        if pooled.surprise > cfg.max_low_prob_surprise:
            for i in draws:
                reasons[i] = reasons[i] or _sampling(i, sampling_detail("distribution", "submission", pooled))
        return [r or e for r, e in zip(reasons, ends)]

    return check


def _sampling(row: int, detail: str) -> str:
    log.info("row %d: toploc_sampling: %s", row, detail)
    return "toploc_sampling"


def _draws(rows: Sequence[Rollout], scored: list[tuple[int, Scored]], sampling: SamplingParams,
           cfg: ToplocConfig) -> dict[int, Draws]:
    """Every row's low-probability counts, from one vectorized pass over the group's logits."""
    logits = torch.cat([s.logits for _, s in scored])
    tokens = torch.tensor([t for i, _ in scored for t in rows[i].output_tokens], dtype=torch.int64)
    probs = sampling_probs(logits, torch.full((len(tokens),), sampling.temperature),
                           torch.full((len(tokens),), sampling.top_p))
    low, chance = low_prob_draws(probs, tokens, cfg.min_token_prob, cfg.low_prob_floor)
    n = [len(rows[i].output_tokens) for i, _ in scored]
    row_of = torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n, dtype=torch.int64))
    lows = torch.bincount(row_of, weights=low.double(), minlength=len(n)).long().tolist()
    expected = torch.bincount(row_of, weights=chance, minlength=len(n)).tolist()
    return {i: Draws(k, lo, e) for (i, _), k, lo, e in zip(scored, n, lows, expected)}


def _termination(out: Sequence[int], sampling: SamplingParams, cfg: ToplocConfig, eos: set[int],
                 picked_last: bool, last_prob: float) -> str | None:
    """The termination verdict of output ``out``, given whether the validator's seeded sampler picks
    its last token and that token's probability under the validator's model."""
    if not eos or len(out) >= sampling.max_tokens:
        return None
    if not len(out) or int(out[-1]) not in eos:
        return "toploc_truncated"
    # an EOS the seeded sampler itself picks is honest however unlikely; one it does not pick
    # (tolerated by the sampling check's near-tie allowance), or any EOS when no seeded sampler
    # can be replayed, must at least be plausible
    if not (cfg.seeded_check and picked_last) and last_prob < cfg.min_eos_prob:
        return "toploc_eos_unlikely"
    return None
