"""Math reward: answer extraction, exact comparison and the parser allowlist. The symbolic comparison and its
time limit run in checker processes: tests/integration/test_rewards_math_checker.py."""

from __future__ import annotations

import doctest
import random

import pytest
from pydantic import ValidationError

import intellect.rl.rewards.base as base
import intellect.rl.rewards.math_checker as math_checker
from intellect.config import DataConfig
from intellect.data.arithmetic import sample_problem, verify_answer
from intellect.rl.rewards import (
    CodeRewardConfig,
    LengthRewardConfig,
    MathRewardConfig,
    SandboxConfig,
    equivalent,
    extract_answer,
    math_reward,
)


def test_docstring_examples_hold():
    # the math module's examples call the symbolic checker, a process: tests/integration/test_rewards_math_checker.py
    result = doctest.testmod(base)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("46", "46"),
        (" 46 \n", "46"),
        ("so the sum is \\boxed{46}.", "46"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{3} \\boxed{4", "3"),  # the unbalanced last one is skipped
        ("we add them.\nAnswer: 46\nthat is all", "46"),
        ("answer: 7 ... ANSWER: -8", "-8"),
        ("<think>answer: 1</think>answer: 2", "2"),
        ("<think>\\boxed{1}</think> 2", "2"),
    ],
)
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion", ["", "   \n", "\\boxed{}", "Answer:   ", "<think>46</think>"])
def test_empty_answer_is_no_answer(completion):
    assert math_reward(completion, "46").reason == "no_answer"
    assert math_reward(completion, "46").reward == 0.0


@pytest.mark.parametrize(
    "answer, reference, reason",
    [
        # integers: exact, literal only
        ("46", "46", "ok"),
        ("-333", "-333", "ok"),
        ("+046", "46", "ok"),
        ("1,234", "1234", "ok"),
        ("45", "46", "mismatch"),
        ("46.0", "46", "mismatch"),
        ("40+6", "46", "mismatch"),
        ("-46", "46", "mismatch"),
        # rationals, exact (decimals are not rounded)
        ("1/2", "0.5", "ok"),
        ("0.5", "1/2", "ok"),
        ("-3/4", "-0.75", "ok"),
        ("0.333", "1/3", "mismatch"),
        ("2/4", "1/2", "ok"),
    ],
)
def test_equivalence(answer, reference, reason):
    got, _ = equivalent(answer, reference)
    assert got == reason
    assert math_reward(f"\\boxed{{{answer}}}", reference).reward == (1.0 if reason == "ok" else 0.0)


@pytest.mark.parametrize(
    "answer",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "sqrt.__globals__",
        "pi.evalf()",
        "lambda: 1",
        "exec('1')",
        "x + 1",
        "(1, 2)",
        "1e400",
        "forty six",
        "46 apples",
    ],
)
def test_anything_outside_the_allowlist_never_reaches_the_parser(answer, monkeypatch):
    def boom(*_args):
        raise AssertionError("the symbolic checker must not see this input")

    monkeypatch.setattr(math_checker.CHECKERS, "check_all", boom)
    result = math_reward(f"Answer: {answer}", "1/2")
    assert (result.reward, result.reason) == (0.0, "invalid")


def test_over_long_answer_is_invalid_unparsed(monkeypatch):
    monkeypatch.setattr(math_checker.CHECKERS, "check_all", lambda *a: pytest.fail("parsed"))
    long = "+".join(["1"] * 200)
    assert math_reward(long, "1/2", MathRewardConfig(max_answer_chars=100)).reason == "invalid"


def test_bad_reference_is_reported_not_scored():
    result = math_reward("1", "x^2")
    assert (result.reward, result.reason) == (0.0, "bad_reference")


def test_agrees_with_the_synthetic_task_checker():
    rng = random.Random(0)
    cfg = DataConfig(max_digits=3)
    for _ in range(200):
        p = sample_problem(rng, cfg)
        for completion in (p.answer, f" {p.answer}\n", str(p.value + 1), "", p.prompt, f"{p.value}.0"):
            assert (math_reward(completion, p.answer).reward == 1.0) == verify_answer(p, completion), completion


@pytest.mark.parametrize("model", [MathRewardConfig, CodeRewardConfig, SandboxConfig, LengthRewardConfig])
def test_configs_are_strict_and_documented(model):
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
    with pytest.raises(ValidationError):
        model(nonexistent=1)


@pytest.mark.parametrize(
    "model, bad",
    [
        (MathRewardConfig, {"timeout_s": 0}),
        (MathRewardConfig, {"max_answer_chars": 0}),
        (SandboxConfig, {"memory_mb": 1}),
        (SandboxConfig, {"uid": 0}),
        (CodeRewardConfig, {"max_code_chars": 0}),
    ],
)
def test_config_bounds(model, bad):
    with pytest.raises(ValidationError):
        model(**bad)
