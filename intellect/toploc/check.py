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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from intellect.inference.protocol import Request
from intellect.toploc.proofs import ToplocConfig, build_proofs_many, check_many

if TYPE_CHECKING:
    from intellect.inference.protocol import Completion, InferenceEngine
    from intellect.inference.sampling import SamplingParams
    from intellect.rl.rollouts import Rollout

#: Policy step -> an engine holding that checkpoint's weights (raises ``FileNotFoundError`` if absent).
EngineFor = Callable[[int], "InferenceEngine"]


def completion_proofs(completions: Sequence[Completion], cfg: ToplocConfig) -> list[bytes]:
    """The proof blob of each completion (its engine must capture hidden states)."""
    if any(c.hidden_states is None for c in completions):
        raise ValueError("TOPLOC proofs need hidden states: build the engine with capture_hidden=True")
    return build_proofs_many([c.hidden_states for c in completions], cfg.chunk, cfg.k)


def toploc_check(engine_for: EngineFor, sampling: SamplingParams, cfg: ToplocConfig
                 ) -> Callable[[Sequence[Rollout]], list[str | None]]:
    """The validator's row check: ``None`` for a row whose every chunk passes, else the first reason."""

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
            for i, chunks in zip(idx, checks):
                bad = next((c.reason for c in chunks if not c.ok), None)
                reasons[i] = None if bad is None else f"toploc_{bad}"
        return reasons

    return check
