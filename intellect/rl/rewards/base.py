"""What every reward returns: a value and the reason the validator's ledger records."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RewardResult", "after_thinking"]


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A reward and why.

    ``reason`` is a short machine-readable code (``"ok"``, ``"mismatch"``,
    ``"timeout"``...; each reward module lists its own) and ``detail`` is free
    text for humans, bounded in length.

    >>> RewardResult(1.0, "ok").passed, RewardResult(0.0, "no_answer").passed
    (True, False)
    """

    reward: float
    reason: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.reason == "ok"


def after_thinking(completion: str) -> str:
    """The part of a completion after its last ``</think>`` (all of it when there is none).

    Reasoning models may quote candidate answers while thinking; only what
    follows the thinking counts.

    >>> after_thinking("<think>maybe 3</think> 4"), after_thinking("4")
    (' 4', '4')
    """
    head, sep, tail = completion.rpartition("</think>")
    return tail if sep else completion
