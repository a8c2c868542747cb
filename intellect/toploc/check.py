"""TOPLOC in an RL step: workers attach proofs to their rollouts; the validator checks them with
one prefill per policy checkpoint.

A worker's engine captures the final hidden state of every generated token
(:class:`~intellect.inference.protocol.Completion`);
:func:`~intellect.toploc.proofs.completion_proofs` turns a batch of completions into one proof blob
each. The validator's :func:`toploc_check` is a
:data:`~intellect.rl.service.validator.RowCheck`: it groups a submission's rows by the checkpoint they
claim, prefills ``prompt + output`` once with that checkpoint
(:meth:`~intellect.inference.torch_engine.TorchEngine.prefill`, or :func:`right_padded_prefill`),
and checks every chunk's proof against its own hidden states
(:func:`~intellect.toploc.proofs.check_many`). A row fails with ``toploc_<reason>``
(``toploc_exponent``, ``toploc_mantissa``, ``toploc_sign``, ``toploc_proof_count``,
``toploc_malformed``, ``toploc_null_proof``, ...); a checkpoint the validator cannot load fails its
rows with ``toploc_no_checkpoint`` instead of raising.

The prefill computes on its engine's device and in its precision (the run's ``compute``:
:meth:`~intellect.inference.torch_engine.TorchEngine.for_tokenizer`); TOPLOC commits to bf16
hidden states whatever the precision, and its tolerances hold when workers and validator compute
alike (:class:`~intellect.rl.worker.worker.WorkerRunInfo` tells workers the run's precision).

The same prefill gives two more checks, in this order after the computation check. It computes
on the logits' device what they need per scored token (the seeded choice, the claimed token's
log-probability, and its ``low`` flag and ``chance`` below), so no ``[tokens x vocab]`` tensor
reaches the CPU (:func:`~intellect.inference.sampling.score_tokens`).

**Sampling** (``toploc_sampling``; which layer failed is logged, see :func:`sampling_detail`):

* *seeded re-check* (``cfg.seeded_check``): the engines sample with seeded Gumbel-max, so the
  validator recomputes each token's choice from its own logits and the request seed: the row's
  ``seed``, which :func:`~intellect.rl.service.validator.validate_submission` sets to the seed the
  assignment fixes before any extra check sees the row (a seed the worker chose or searched for
  never reaches this check). A differing
  token that scores more than ``flip_margin`` below the seeded choice fails the rollout (an edited
  token, or the hybrid attack: a small model samples, the claimed one builds the proofs): rounding
  noise flips only near-ties. Near-tie flips fail it beyond ``max_resampled_fraction`` of its tokens
  when honest flips cannot plausibly make the count, so one flip in a short bf16 rollout passes. The count is also pooled over
  the submission's rows that passed the computation check, and they all fail when honest near-tie
  flips at ``honest_flip_rate`` cannot plausibly make it (the Chernoff bound of
  :func:`low_prob_surprise` below ``10 ** -max_low_prob_surprise``): a checkpoint a few RL updates
  older than the claimed one passes the computation check but moves a few tokens in every few
  hundred. It needs a reproducible seeded sampler on the worker, which a vLLM deployment does not
  have;
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

from intellect.device import autocast
from intellect.inference.protocol import Request, Scored
from intellect.inference.sampling import LowProb, low_prob_draws, sampling_probs
from intellect.inference.torch_engine import lm_head, scored_rows
from intellect.toploc.proofs import ToplocConfig, check_many

if TYPE_CHECKING:
    from intellect.inference.protocol import Scorer
    from intellect.inference.sampling import SamplingParams
    from intellect.inference.torch_engine import TorchEngine
    from intellect.rl.wire.rollouts import Rollout

log = logging.getLogger("intellect.toploc.check")

#: Policy step -> an engine holding that checkpoint's weights (raises ``FileNotFoundError`` if absent).
EngineFor = Callable[[int], "Scorer"]
#: ``prefill(engine, requests, outputs, sampling, low_prob) -> scored``: how the validator scores rows
#: (``low_prob`` None: no per-token ``low`` and ``chance``).
Prefill = Callable[["Scorer", Sequence[Request], Sequence[Sequence[int]], "SamplingParams",
                    "LowProb | None"], "list[Scored]"]

__all__ = ["Draws", "EngineFor", "Prefill", "engine_prefill", "low_prob_draws", "low_prob_surprise",
           "right_padded_prefill", "sampling_detail", "sampling_probs", "toploc_check"]


# ---------------------------------------------------------------- distribution statistic (pure)


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


def sampling_detail(layer: str, scope: str, draws: Draws | None = None, resampled: int = 0, tokens: int = 0,
                    expected: float | None = None, far: int = 0) -> str:
    """What a ``toploc_sampling`` verdict was about, for the log (the ledger keeps only the reason);
    ``expected``: the differing tokens honest near-tie flips account for (the pooled seeded test);
    ``far``: how many differ by more than ``flip_margin`` (no near-tie).

    >>> sampling_detail("distribution", "submission", Draws(tokens=40, low=12, expected=0.5))
    'distribution (submission): 12 of 40 tokens below min_token_prob where 0.50 were expected, surprise 11.6'
    >>> sampling_detail("seeded", "rollout", resampled=3, tokens=20, far=1)
    'seeded re-check (rollout): 3 of 20 tokens differ from the seed and logits choice, 1 beyond flip_margin'
    >>> sampling_detail("seeded", "submission", resampled=9, tokens=500, expected=0.005)
    'seeded re-check (submission): 9 of 500 tokens differ from the seed and logits choice where 0.005 were expected, surprise 25.4'
    """
    if layer == "seeded":
        text = f"seeded re-check ({scope}): {resampled} of {tokens} tokens differ from the seed and logits choice"
        if far:
            text += f", {far} beyond flip_margin"
        if expected is not None:
            text += (f" where {expected:.2g} were expected, surprise "
                     f"{float(low_prob_surprise(float(resampled), expected)):.1f}")
        return text
    assert draws is not None, "a distribution detail needs its draws"
    return (f"distribution ({scope}): {draws.low} of {draws.tokens} tokens below min_token_prob where "
            f"{draws.expected:.2f} were expected, surprise {draws.surprise:.1f}")


# ---------------------------------------------------------------- prefill


def engine_prefill(engine: Scorer, requests: Sequence[Request], outputs: Sequence[Sequence[int]],
                   sampling: SamplingParams, low_prob: LowProb | None = None) -> list[Scored]:
    """The engine's own prefill (left-padded batches for :class:`TorchEngine`)."""
    return engine.prefill(requests, outputs, sampling, low_prob=low_prob)


@torch.no_grad()
def right_padded_prefill(engine: TorchEngine, requests: Sequence[Request], outputs: Sequence[Sequence[int]],
                         sampling: SamplingParams, low_prob: LowProb | None = None) -> list[Scored]:
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
    head = lm_head(model)
    out: list[Scored] = []
    for start in range(0, len(requests), engine.max_batch_size):
        reqs, outs = requests[start:start + engine.max_batch_size], outputs[start:start + engine.max_batch_size]
        n = [len(o) for o in outs]
        if not any(n):
            out += engine.prefill(list(reqs), [[] for _ in reqs], sampling, low_prob=low_prob)
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
            with autocast(dev, engine.precision):  # the engine's own precision, as its left-padded prefill
                logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev),
                               logits_to_keep=width - skip).logits
        finally:
            handle.remove()
        rows = [(r, first[r] - skip + t) for r in range(len(outs)) for t in range(n[r])]
        r_idx, c_idx = (torch.tensor(x, device=dev) for x in zip(*rows))
        temperature = torch.full((len(rows),), sampling.temperature, device=dev)
        top_p = torch.full((len(rows),), sampling.top_p, device=dev)
        out += scored_rows(seen[0][r_idx, c_idx], logits[r_idx, c_idx], outs, reqs, temperature, top_p, low_prob)
    return out


# ---------------------------------------------------------------- the row check


def toploc_check(engine_for: EngineFor, sampling: SamplingParams, cfg: ToplocConfig, eos_ids: Sequence[int] = (),
                 prefill: Prefill = engine_prefill) -> Callable[[Sequence[Rollout]], list[str | None]]:
    """The validator's row check: ``None`` for a row that passes the computation, sampling and
    termination checks, else the first failure (in that order). ``eos_ids`` empty: no termination
    check. ``prefill`` scores a checkpoint's rows (:func:`engine_prefill` or
    :func:`right_padded_prefill`); each token's ``low`` and ``chance`` come back only when the
    distribution check needs them."""
    eos = set(eos_ids)
    low_prob = LowProb(cfg.min_token_prob, cfg.low_prob_floor) if cfg.distribution_check else None

    def check(rows: Sequence[Rollout]) -> list[str | None]:
        reasons: list[str | None] = [None] * len(rows)
        ends: list[str | None] = [None] * len(rows)  # termination verdicts: they come after every sampling one
        flips: dict[int, tuple[int, int]] = {}  # rows that passed the computation check: (tokens differing, tokens)
        draws: dict[int, Draws] = {}
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
            scored = prefill(engine, requests, outputs, sampling, low_prob)
            checks = check_many([s.hidden_states for s in scored], [rows[i].proof for i in idx], cfg.chunk, cfg.k, cfg)
            # the group's per-token results in one tensor each, so that per row only numbers remain
            n = [len(o) for o in outputs]
            claimed = torch.tensor([t for o in outputs for t in o], dtype=torch.int64)
            resampled = torch.cat([s.resampled for s in scored])
            row_of = torch.repeat_interleave(torch.arange(len(idx)), torch.tensor(n, dtype=torch.int64))

            def per_row(values: torch.Tensor) -> list[float]:
                return torch.bincount(row_of, weights=values.double(), minlength=len(idx)).tolist()

            differ = [int(d) for d in per_row(resampled != claimed)]
            margin = torch.cat(_asked([s.margin for s in scored], "margin"))
            far = [int(d) for d in per_row((resampled != claimed) & (margin > cfg.flip_margin))]
            lows = [int(x) for x in per_row(torch.cat(_asked([s.low for s in scored], "low")))] if low_prob else []
            expected = per_row(torch.cat(_asked([s.chance for s in scored], "chance"))) if low_prob else []
            ends_at = [e - 1 for e in torch.tensor(n).cumsum(0).tolist()]
            same_last = (resampled == claimed).tolist()
            probs = torch.cat([s.logprobs for s in scored]).exp().tolist()
            for j, (i, chunks) in enumerate(zip(idx, checks)):
                bad = next((c.reason for c in chunks if not c.ok), None)
                if bad:
                    reasons[i] = f"toploc_{bad}"
                    continue
                flips[i] = differ[j], n[j]
                if cfg.seeded_check and (far[j] or (differ[j] > cfg.max_resampled_fraction * n[j] and float(
                        low_prob_surprise(float(differ[j]), cfg.honest_flip_rate * n[j])) > cfg.max_low_prob_surprise)):
                    reasons[i] = _sampling(i, sampling_detail("seeded", "rollout", resampled=differ[j], tokens=n[j],
                                                              far=far[j]))
                last = ends_at[j]
                ends[i] = _termination(outputs[j], sampling, cfg, eos, n[j] > 0 and same_last[last],
                                       n[j] and probs[last])
                if low_prob:
                    draws[i] = Draws(n[j], lows[j], expected[j])
        if cfg.seeded_check and flips:
            # near-tie flips of honest rows are rare and independent, so a submission's count is tested
            # pooled: a few differing tokens in each of many rows (a checkpoint a few updates stale) add up
            differ, tokens = (sum(x) for x in zip(*flips.values()))
            expect = cfg.honest_flip_rate * tokens
            if float(low_prob_surprise(float(differ), expect)) > cfg.max_low_prob_surprise:
                detail = sampling_detail("seeded", "submission", resampled=differ, tokens=tokens, expected=expect)
                for i in flips:
                    reasons[i] = reasons[i] or _sampling(i, detail)
        # the distribution check weighs only tokens the seeded re-check did not already disown
        draws = {i: d for i, d in draws.items() if reasons[i] is None}
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


def _asked(values: Sequence[torch.Tensor | None], what: str) -> list[torch.Tensor]:
    """Per-token results a prefill returns only when asked (``low``, ``chance``: with a ``LowProb``)."""
    out = [v for v in values if v is not None]
    if len(out) != len(values):
        raise ValueError(f"the prefill returned no {what!r} although low_prob was given")
    return out


def _sampling(row: int, detail: str) -> str:
    log.info("row %d: toploc_sampling: %s", row, detail)
    return "toploc_sampling"


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
