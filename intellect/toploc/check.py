"""TOPLOC in an RL step: workers attach proofs to their rollouts; the validator checks them with
one prefill per policy checkpoint.

A worker's engine captures the final hidden state of every generated token
(:class:`~intellect.inference.protocol.Completion`); :func:`completion_proofs` turns a batch of
completions into one proof blob each. The validator's :func:`toploc_check` is a
:data:`~intellect.rl.validator.RowCheck`: it groups a submission's rows by the checkpoint they
claim, prefills ``prompt + output`` once with that checkpoint
(:meth:`~intellect.inference.torch_engine.TorchEngine.prefill`), and checks every chunk's proof
against its own hidden states (:func:`~intellect.toploc.proofs.check_many`). A row fails with
``toploc_<reason>`` (``toploc_exponent``, ``toploc_mantissa``, ``toploc_sign``, ``toploc_proof_count``,
``toploc_malformed``, ``toploc_null_proof``, ...); a checkpoint the validator cannot load fails its
rows with ``toploc_no_checkpoint`` instead of raising.

The same prefill gives two more checks. **Sampling**: the engines sample with seeded Gumbel-max, so
the validator recomputes each token's choice from its own logits and the request seed; more than
``max_resampled_fraction`` of a rollout's tokens differing is ``toploc_sampling`` (an edited token,
or the hybrid attack: a small model samples, the claimed one builds the proofs). **Termination**: an
output shorter than ``max_tokens`` must end with EOS (``toploc_truncated``), and an EOS that the
seeded sampler does not itself pick there (one slipped in under the sampling check's allowance) must
have probability at least ``min_eos_prob`` under the validator's model (``toploc_eos_unlikely``): a
worker may not stop early to save compute. (INTELLECT-2 applies the probability rule to every EOS; with
reproducible sampling that would reject honest workers whose seed drew an unlikely EOS.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from intellect.inference.protocol import Request
from intellect.toploc.proofs import ToplocConfig, build_proofs_many, check_many

if TYPE_CHECKING:
    from intellect.inference.protocol import Completion, InferenceEngine, Scored
    from intellect.inference.sampling import SamplingParams
    from intellect.rl.rollouts import Rollout

#: Policy step -> an engine holding that checkpoint's weights (raises ``FileNotFoundError`` if absent).
EngineFor = Callable[[int], "InferenceEngine"]


def completion_proofs(completions: Sequence[Completion], cfg: ToplocConfig) -> list[bytes]:
    """The proof blob of each completion (its engine must capture hidden states)."""
    if any(c.hidden_states is None for c in completions):
        raise ValueError("TOPLOC proofs need hidden states: build the engine with capture_hidden=True")
    return build_proofs_many([c.hidden_states for c in completions], cfg.chunk, cfg.k)


def toploc_check(engine_for: EngineFor, sampling: SamplingParams, cfg: ToplocConfig, eos_ids: Sequence[int] = ()
                 ) -> Callable[[Sequence[Rollout]], list[str | None]]:
    """The validator's row check: ``None`` for a row that passes the computation, sampling and
    termination checks, else the first failure. ``eos_ids`` empty: no termination check."""
    eos = set(eos_ids)

    def check(rows: Sequence[Rollout]) -> list[str | None]:
        reasons: list[str | None] = [None] * len(rows)
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
            scored = engine.prefill(requests, [list(rows[i].output_tokens) for i in idx], sampling)
            checks = check_many([s.hidden_states for s in scored], [rows[i].proof for i in idx], cfg.chunk, cfg.k, cfg)
            for i, chunks, s in zip(idx, checks, scored):
                bad = next((c.reason for c in chunks if not c.ok), None)
                reasons[i] = f"toploc_{bad}" if bad else _sampling_and_termination(rows[i], s, sampling, cfg, eos)
        return reasons

    return check


def _sampling_and_termination(row: Rollout, scored: Scored, sampling: SamplingParams, cfg: ToplocConfig,
                              eos: set[int]) -> str | None:
    out = torch.tensor(row.output_tokens, dtype=torch.int64)
    if int((scored.resampled != out).sum()) > cfg.max_resampled_fraction * len(out):
        return "toploc_sampling"
    if eos and len(out) < sampling.max_tokens:
        if not len(out) or int(out[-1]) not in eos:
            return "toploc_truncated"
        # an EOS the seeded sampler itself picks is honest however unlikely; one it does not pick
        # (tolerated by the sampling check's near-tie allowance) must at least be plausible
        if int(scored.resampled[-1]) != int(out[-1]) and float(scored.logprobs[-1].exp()) < cfg.min_eos_prob:
            return "toploc_eos_unlikely"
    return None
