"""Math rewards that reach the symbolic checker, which runs in processes of its own: symbolic equivalence,
the time limit with a killed and replaced checker, and the row and file budgets of a bounded pool of
checkers where one file's slow rows do not hold up another file (issue 17, attack 9)."""

from __future__ import annotations

import doctest
import multiprocessing
import threading
import time

import pytest
from pydantic import ValidationError

import intellect.rl.rewards.math as math_reward_mod
from intellect.rl.rewards import MathRewardConfig, equivalent, math_reward
from intellect.rl.rewards.math import math_rewards, warm_checkers


def test_docstring_examples_hold():
    result = doctest.testmod(math_reward_mod)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "answer, reference, reason",
    [
        # parsed by the symbolic checker
        ("\\frac{3}{4}", "0.75", "ok"),
        ("sqrt(8)", "2*sqrt(2)", "ok"),
        ("1/sqrt(2)", "sqrt(2)/2", "ok"),
        ("2^(1/2)", "sqrt(2)", "ok"),
        ("2pi", "2*pi", "ok"),
        ("$3\\cdot\\pi$", "3pi", "ok"),
        ("pi", "3.14159", "mismatch"),
        ("sqrt(2)", "1.41421356", "mismatch"),
        ("1/0", "1/2", "mismatch"),
    ],
)
def test_symbolic_equivalence(answer, reference, reason):
    got, _ = equivalent(answer, reference)
    assert got == reason
    assert math_reward(f"\\boxed{{{answer}}}", reference).reward == (1.0 if reason == "ok" else 0.0)


def test_pathological_expression_times_out_and_the_checker_recovers():
    cfg = MathRewardConfig(timeout_s=0.5)
    start = time.monotonic()
    result = math_reward("\\boxed{9^9^9}", "1/2", cfg)
    assert (result.reward, result.reason) == (0.0, "timeout")
    assert time.monotonic() - start < 5
    # the killed worker is replaced: the next symbolic check works
    assert math_reward("\\boxed{sqrt(2)/2}", "1/sqrt(2)", MathRewardConfig(timeout_s=30)).reason == "ok"


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
