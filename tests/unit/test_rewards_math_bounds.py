"""Bounded math rewards (issue 17, attack 9): linear ``\\boxed{`` extraction, a row budget, a file budget,
and a bounded pool of checker processes where one file's slow rows do not hold up another file."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import pytest
from pydantic import ValidationError

from intellect.rl.rewards import math as math_mod
from intellect.rl.rewards.base import after_thinking
from intellect.rl.rewards.math import MathRewardConfig, extract_answer, math_reward, math_rewards, warm_checkers

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


def test_the_batch_scores_like_the_row_function():
    completions = ["46", "\\boxed{1/2}", "Answer: sqrt(8)", "", "45", "lambda: 1"]
    references = ["46", "0.5", "2*sqrt(2)", "46", "46", "1"]
    assert math_rewards(completions, references) == [math_reward(c, r) for c, r in zip(completions, references)]
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        math_rewards(["1", "2"], ["1"])
    with pytest.raises(ValidationError):
        math_rewards(["1"], ["1"], row_budget_s=0)
    with pytest.raises(ValidationError):
        math_rewards(["1"], ["1"], total_budget_s=-1)


# Each makes sympy work far longer than any budget here (a power with ~350 million digits).
HARD = [f"\\boxed{{{b}^9^9}}" for b in (9, 8, 7, 6, 5, 4, 3)] + ["\\boxed{9^9^9+1}", "\\boxed{2*9^9^9}"]
HONEST = ["\\boxed{sqrt(8)}", "\\boxed{1/sqrt(2)}", "46", "\\boxed{2^(1/2)}", "\\boxed{2pi}", "Answer: 3\\cdot\\pi"]
HONEST_REFS = ["2*sqrt(2)", "sqrt(2)/2", "46", "sqrt(2)", "2*pi", "3pi"]


def checker_processes() -> int:
    return sum(p.name == "math-reward-checker" for p in multiprocessing.active_children())


@pytest.mark.slow
def test_a_file_of_hard_answers_stays_within_its_budget():
    cfg = MathRewardConfig(checkers=2)
    warm_checkers(cfg)
    start = time.monotonic()
    results = math_rewards(HARD + ["46"], ["1/2"] * len(HARD) + ["46"], cfg, row_budget_s=0.5, total_budget_s=2.0)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + 1.0, f"{elapsed:.2f}s"
    reasons = [r.reason for r in results]
    assert reasons[0] == "timeout" and "budget" in reasons and set(reasons[:-1]) <= {"timeout", "budget"}
    assert all(r.reward == 0.0 and r.detail for r in results[:-1])
    assert results[-1].reason == "ok"  # an in-process comparison still counts once the budget is spent
    assert checker_processes() <= cfg.checkers


@pytest.mark.slow
def test_a_hard_file_does_not_delay_another_files_rows():
    cfg = MathRewardConfig(checkers=2)
    assert warm_checkers(cfg) == 2
    math_rewards(HONEST, HONEST_REFS, cfg)  # sympy's caches warm in the checkers
    t0 = time.monotonic()
    alone = math_rewards(HONEST, HONEST_REFS, cfg)
    solo = time.monotonic() - t0
    assert [r.reason for r in alone] == ["ok"] * len(HONEST)

    hard: dict = {}

    def hard_file():
        t = time.monotonic()
        hard["results"] = math_rewards(HARD, ["1/2"] * len(HARD), cfg, row_budget_s=1.0, total_budget_s=4.0)
        hard["seconds"] = time.monotonic() - t

    thread = threading.Thread(target=hard_file)
    thread.start()
    try:
        time.sleep(0.3)  # the hard file holds a checker now
        t0 = time.monotonic()
        honest = math_rewards(HONEST, HONEST_REFS, cfg)
        latency = time.monotonic() - t0
        busy = checker_processes()
    finally:
        thread.join(30)
    assert [r.reason for r in honest] == ["ok"] * len(HONEST)
    assert 2.5 < hard["seconds"] < 4.0 + 1.5 and {r.reason for r in hard["results"]} <= {"timeout", "budget"}
    # with one shared checker the honest rows would have waited for the hard file's whole budget
    assert latency < solo + 1.5 and latency < hard["seconds"] / 2, (latency, solo, hard["seconds"])
    assert busy <= cfg.checkers


@pytest.mark.slow
def test_with_more_files_than_checkers_the_files_take_turns():
    cfg = MathRewardConfig(checkers=1)
    warm_checkers(cfg)
    done: dict = {}

    def hard_file():
        done["hard"] = math_rewards(HARD, ["1/2"] * len(HARD), cfg, row_budget_s=0.3, total_budget_s=120.0)
        done["hard_at"] = time.monotonic()

    thread = threading.Thread(target=hard_file)
    thread.start()
    try:
        time.sleep(0.1)  # the hard file holds the only checker now
        honest = math_rewards(HONEST[:3], HONEST_REFS[:3], cfg)
        honest_at = time.monotonic()
        assert checker_processes() <= 1
    finally:
        thread.join(120)
    assert [r.reason for r in honest] == ["ok"] * 3
    assert {r.reason for r in done["hard"]} == {"timeout"}
    # each honest row waited for one hard row at most (the checker is handed over in turn), so the
    # honest file ended while the hard one, with three times as many rows, was still running
    assert honest_at < done["hard_at"]
