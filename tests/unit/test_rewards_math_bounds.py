"""Bounded math rewards (issue 17, attack 9): linear ``\\boxed{`` extraction of megabyte completions. The
row and file budgets and the bounded pool of checker processes are in
tests/integration/test_rewards_math_checker.py."""

from __future__ import annotations

import random
import time

import pytest

from intellect.rl.rewards import math as math_mod
from intellect.rl.rewards.base import after_thinking
from intellect.rl.rewards.math import extract_answer, math_reward

MB = 1 << 20


def quadratic_last_boxed(text: str) -> str | None:
    """The reference: for each ``\\boxed{`` from the last, scan forward until its brace closes."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)
    return None


def reference_extract(completion: str) -> str | None:
    text = after_thinking(completion)
    boxed = quadratic_last_boxed(text)
    if boxed is not None:
        answer = boxed
    else:
        hits = list(math_mod._ANSWER.finditer(text))
        answer = text[hits[-1].end():].split("\n", 1)[0] if hits else text
    return answer.strip() or None


PIECES = ["\\boxed{", "\\boxed{", "{", "}", "}", "x", "1", " ", "\\boxed", "boxed{", "\\", "Answer:", "\n", "</think>",
          "\u00e9", "\U0001f600", "\ud800"]  # non-ASCII, astral and a lone surrogate: indices stay aligned


def test_extraction_equals_the_quadratic_reference_on_random_short_strings():
    rng = random.Random(17)
    for _ in range(5000):
        s = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 24)))
        assert math_mod._last_boxed(s) == quadratic_last_boxed(s), s
        assert extract_answer(s) == reference_extract(s), s


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{" * (MB // 7), "\\boxed{\\boxed{"),  # none closes: the whole text is the answer
        ("\\boxed{" + "{" * MB, None),
        ("\\boxed{" * (MB // 7) + "46}", "46"),  # only the innermost closes
        ("{}" * (MB // 2) + "\\boxed{46}", "46"),
        ("\\boxed{{}" * (MB // 9), None),
        ("}" * MB + "\\boxed{" + "{" * (MB // 2) + "}" * (MB // 2) + "46}", None),
        ("Answer:" + " " * MB, None),
        ("answer " * (MB // 7), None),
        ("</think>" * (MB // 8) + "\\boxed{46}", "46"),
    ],
    ids=["unclosed-boxes", "unclosed-braces", "innermost-closes", "braces-then-box", "half-open",
         "closers-then-deep", "answer-spaces", "answer-words", "think-tags"],
)
def test_a_megabyte_adversarial_completion_is_scored_within_2s(completion, answer):
    assert len(completion) >= MB - 16
    start = time.perf_counter()
    got = extract_answer(completion)
    result = math_reward(completion, "46")  # an integer reference: never the symbolic checker
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{elapsed:.2f}s"
    if answer is not None:
        assert got is not None and got.startswith(answer)
    assert result.reason in {"ok", "mismatch", "invalid", "no_answer"}
    assert (result.reward == 1.0) == (result.reason == "ok")
