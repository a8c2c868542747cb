"""Math rewards that reach the symbolic checker, which runs in processes of its own: symbolic equivalence,
the time limit with a killed and replaced checker, and the row, file and worker budgets of a bounded
pool of checkers where one file's slow rows do not hold up another file, nor one worker's files
another worker's."""

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
    """Four files of hard answers from one worker beside one honest file of 16 symbolic rows, on two
    checkers: the honest file is scored through, the hard worker draws no more than its bucket."""
    cfg = MathRewardConfig(checkers=2, timeout_s=1.0, file_budget_s=20.0, worker_budget_s=5.0)
    assert warm_checkers(cfg) == 2
    honest, refs = [c for c in HONEST if c != "46"] * 4, [r for r in HONEST_REFS if r != "46"] * 4
    honest, refs = honest[:16], refs[:16]
    assert [r.reason for r in math_rewards(honest[:5], refs[:5], cfg)] == ["ok"] * 5  # sympy's caches warm

    hard: dict = {}

    def hard_file(n: int):
        t = time.monotonic()
        hard[n] = math_rewards(HARD, ["1/2"] * len(HARD), cfg, worker="mallory"), time.monotonic() - t

    threads = [threading.Thread(target=hard_file, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # mallory's files hold both checkers and queue for more
        t0 = time.monotonic()
        scored = math_rewards(honest, refs, cfg, total_budget_s=10.0, worker="alice")
        latency = time.monotonic() - t0
        busy = checker_processes()
    finally:
        for thread in threads:
            thread.join(60)
    assert [r.reason for r in scored] == ["ok"] * 16, [r.detail for r in scored if r.reason != "ok"]
    # one hard check in flight and a replaced checker's start-up at most, then alice keeps her checker
    assert latency < 2 * cfg.timeout_s + 5.0, latency
    reasons = [r.reason for n in hard for r in hard[n][0]]
    assert set(reasons) <= {"timeout", "budget"} and "budget" in reasons
    # every timeout drew a whole row budget from mallory's bucket: no more of them than it holds
    assert reasons.count("timeout") <= cfg.worker_budget_s / cfg.timeout_s
    assert max(seconds for _, seconds in hard.values()) < cfg.file_budget_s
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
