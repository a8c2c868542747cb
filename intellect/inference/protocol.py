"""What every inference engine takes and returns.

Hidden-state convention (TOPLOC commits to these): row ``i`` of
``hidden_states`` is the final, post-norm hidden state (the input of the LM
head) at the position whose logits produced token ``i``; that is position
``len(prompt) - 1 + i`` of ``prompt + tokens``. A validator gets the same rows
from one prefill of ``prompt + tokens[:-1]``, and the logits of those rows are
the ones each token was sampled from. This is prime-rl's convention (a
pre-hook on the logits processor; validation prefills ``prompt + output[:-1]``
from position ``len(prompt) - 1``), and it needs no decode step beyond the
last sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import torch

from intellect.inference.sampling import MAX_SEED, LowProb, SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    seed: int  # all randomness of this request's sampling; see sampling.uniforms

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("every prompt needs at least one token (BOS)")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # generated ids; a final EOS is included (finish_reason "stop")
    finish_reason: FinishReason
    hidden_states: torch.Tensor | None  # bf16 [len(tokens), hidden] on CPU, see module docstring
    logprobs: torch.Tensor  # fp32 [len(tokens)], sampling.chosen_logprobs of the engine's logits


@dataclass(frozen=True)
class Scored:
    """A validator's prefill of ``prompt + output`` (rows as in ``Completion``)."""

    hidden_states: torch.Tensor  # bf16 [n_out, hidden]
    logprobs: torch.Tensor  # fp32 [n_out] of the claimed output tokens
    resampled: torch.Tensor  # int64 [n_out]: the token sampling.sample picks from these logits and the seed
    # float32 [n_out]: how far below that choice each claimed token scores (sampling.choice_margin)
    margin: torch.Tensor | None = None
    # with a LowProb asked for (sampling.low_prob_draws under sampling.sampling_probs), computed where the
    # logits are: each claimed token below min_token_prob, and the chance an honest draw there is
    low: torch.Tensor | None = None  # bool [n_out]
    chance: torch.Tensor | None = None  # float64 [n_out]


def stop_ids(tokenizer_eos: int | None, generation_eos: int | Sequence[int] | None) -> list[int]:
    """The ids a completion ends at: the tokenizer's EOS and the generation config's (chat models often
    list several there). Every engine stops at these and the validator's length check ends a ``stop``
    completion at them: one rule, so an honest rollout that ends at any of them passes.

    >>> stop_ids(2, [7, 2]), stop_ids(2, None), stop_ids(None, 5), stop_ids(None, None)
    ([2, 7], [2], [5], [])
    """
    extra = list(generation_eos) if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    return sorted({e for e in [tokenizer_eos, *extra] if isinstance(e, int)})


class InferenceEngine(Protocol):
    def generate(
        self, requests: Sequence[Request], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per request, in order; one ``SamplingParams`` for all or one per request."""
        ...


class Scorer(Protocol):
    """What a validator scores claimed outputs with (:meth:`~intellect.inference.torch_engine.TorchEngine.prefill`)."""

    def prefill(
        self,
        requests: Sequence[Request],
        outputs: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        low_prob: LowProb | None = None,
    ) -> list[Scored]:
        """One :class:`Scored` per request, in order."""
        ...


def per_request(sampling: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if len(sampling) != n:
        raise ValueError(f"{len(sampling)} SamplingParams for {n} requests")
    return list(sampling)
