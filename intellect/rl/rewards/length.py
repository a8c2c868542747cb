"""Thinking-budget reward: a target length in the prompt, the task reward shaped by it.

As in prime-rl's INTELLECT-2 ``LenRewardsConfig``: a target ``N`` is sampled
per prompt and written into it, and the task reward ``r`` of a completion of
``len`` tokens becomes

=========  ==============================================
``exact``  ``r - coef * |N - len|``
``max``    ``r * clip(coef * (N - len) + 0.5, 0, 1)``
``clip``   ``0`` if ``len > N`` else ``r``
=========  ==============================================

The target is written as the prefix ``"think for N tokens: "`` (lowercase
letters, digits, ``:`` and spaces only, so the character tokenizer of the tiny
model encodes it). The validator reads the target back from the prompt it
already holds (:func:`parse_budget`), so a worker cannot claim another one.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Literal

from pydantic import Field

from intellect.config import StrictModel

__all__ = [
    "LengthMode", "LengthRewardConfig", "add_budget", "budget_reward", "length_reward", "parse_budget", "sample_target",
]

LengthMode = Literal["exact", "max", "clip"]

_PREFIX = re.compile(r"think for ([0-9]{1,10}) tokens: ")


class LengthRewardConfig(StrictModel):
    """The thinking-budget reward (defaults: INTELLECT-2's ``exact`` with 2k to 10k targets)."""

    mode: LengthMode = Field(
        default="exact", description="exact: r - coef*|N-len|; max: r*clip(coef*(N-len)+0.5, 0, 1); clip: 0 past N."
    )
    coef: float = Field(
        default=0.0003, ge=0, le=10, description="Penalty per token of distance (exact) or slope (max).",
    )
    targets: list[Annotated[int, Field(ge=1, le=10**9)]] = Field(
        default=[2000, 4000, 6000, 8000, 10000], min_length=1, max_length=1000,
        description="Target lengths in tokens, one drawn uniformly per prompt (each 1..10^9).",
    )


def length_reward(task_reward: float, length: int, target: int, mode: LengthMode, coef: float) -> float:
    """The task reward shaped by the distance of ``length`` to ``target`` (both in tokens).

    >>> length_reward(1.0, 120, 100, "exact", 0.01), length_reward(1.0, 80, 100, "exact", 0.01)
    (0.8, 0.8)
    >>> [length_reward(1.0, n, 100, "max", 0.01) for n in (40, 100, 130, 160)]
    [1.0, 0.5, 0.2, 0.0]
    >>> length_reward(1.0, 100, 100, "clip", 0.0), length_reward(1.0, 101, 100, "clip", 0.0)
    (1.0, 0.0)
    """
    if length < 0 or target < 0 or coef < 0:
        raise ValueError(f"length, target and coef must be >= 0 (got {length}, {target}, {coef})")
    if mode == "exact":
        return round(task_reward - coef * abs(target - length), 12)
    if mode == "max":
        return round(task_reward * min(1.0, max(0.0, coef * (target - length) + 0.5)), 12)
    if mode == "clip":
        return 0.0 if length > target else task_reward
    raise ValueError(f"mode must be exact, max or clip (got {mode!r})")


def sample_target(cfg: LengthRewardConfig, rng: random.Random) -> int:
    """One target length, uniform over ``cfg.targets``."""
    return rng.choice(cfg.targets)


def add_budget(prompt: str, target: int) -> str:
    """The prompt with its thinking budget in front.

    >>> add_budget("12+34=", 8)
    'think for 8 tokens: 12+34='
    """
    if not 1 <= target <= 10**9:
        raise ValueError(f"target must lie in 1..10^9 (got {target})")
    return f"think for {target} tokens: {prompt}"


def parse_budget(prompt: str) -> tuple[int | None, str]:
    """``(target, prompt without the budget)``; ``(None, prompt)`` when it has none.

    >>> parse_budget("think for 8 tokens: 12+34="), parse_budget("12+34=")
    ((8, '12+34='), (None, '12+34='))
    """
    m = _PREFIX.match(prompt)
    return (int(m[1]), prompt[m.end():]) if m else (None, prompt)


def budget_reward(task_reward: float, prompt: str, length: int, cfg: LengthRewardConfig) -> float:
    """:func:`length_reward` with the target read from the prompt; prompts without one keep ``task_reward``.

    >>> budget_reward(1.0, "think for 8 tokens: 12+34=", 10, LengthRewardConfig(coef=0.1))
    0.8
    """
    target, _ = parse_budget(prompt)
    return task_reward if target is None else length_reward(task_reward, length, target, cfg.mode, cfg.coef)
