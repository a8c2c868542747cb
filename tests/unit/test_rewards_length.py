"""Thinking-budget reward: the three modes of prime-rl's INTELLECT-2 config, and the budget in the prompt."""

from __future__ import annotations

import doctest
import random

import pytest
from pydantic import ValidationError

import intellect.rl.rewards.length as length_mod
from intellect.data.arithmetic import in_alphabet
from intellect.rl.rewards import (
    LengthRewardConfig,
    add_budget,
    budget_reward,
    length_reward,
    parse_budget,
    sample_target,
)


def test_docstring_examples_hold():
    result = doctest.testmod(length_mod)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "task_reward, length, target, coef, expected",
    [
        (1.0, 100, 100, 0.01, 1.0),
        (1.0, 90, 100, 0.01, 0.9),
        (1.0, 110, 100, 0.01, 0.9),
        (0.0, 110, 100, 0.01, -0.1),  # exact can go negative: a wrong answer of the wrong length is worse
        (1.0, 5000, 2000, 0.0003, 0.1),  # INTELLECT-2's coefficient
        (1.0, 7, 100, 0.0, 1.0),
    ],
)
def test_exact(task_reward, length, target, coef, expected):
    assert length_reward(task_reward, length, target, "exact", coef) == pytest.approx(expected)


@pytest.mark.parametrize(
    "task_reward, length, target, coef, expected",
    [
        (1.0, 100, 100, 0.01, 0.5),  # at the target: half
        (1.0, 50, 100, 0.01, 1.0),  # 50 under: full
        (1.0, 0, 100, 0.01, 1.0),  # clipped at 1
        (1.0, 125, 100, 0.01, 0.25),
        (1.0, 150, 100, 0.01, 0.0),  # 50 over: nothing
        (1.0, 1000, 100, 0.01, 0.0),  # clipped at 0
        (0.0, 10, 100, 0.01, 0.0),  # multiplicative: a wrong answer stays 0
        (0.5, 75, 100, 0.01, 0.375),
    ],
)
def test_max(task_reward, length, target, coef, expected):
    assert length_reward(task_reward, length, target, "max", coef) == pytest.approx(expected)


@pytest.mark.parametrize(
    "task_reward, length, target, expected",
    [(1.0, 99, 100, 1.0), (1.0, 100, 100, 1.0), (1.0, 101, 100, 0.0), (0.0, 50, 100, 0.0), (0.7, 1, 100, 0.7)],
)
def test_clip(task_reward, length, target, expected):
    assert length_reward(task_reward, length, target, "clip", 123.0) == expected


@pytest.mark.parametrize(
    "args",
    [(1.0, -1, 100, "exact", 0.1), (1.0, 1, -1, "exact", 0.1), (1.0, 1, 1, "exact", -0.1), (1.0, 1, 1, "min", 0.1)],
)
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        length_reward(*args)


@pytest.mark.parametrize("target", [1, 8, 64, 2000, 10**9])
def test_budget_round_trips_in_the_tiny_alphabet(target):
    prompt = add_budget("12+34=", target)
    assert in_alphabet(prompt)
    assert parse_budget(prompt) == (target, "12+34=")


@pytest.mark.parametrize(
    "prompt", ["12+34=", "Think for 8 tokens: 1+1=", "think for x tokens: 1+1=", "1+1= think for 8 tokens: "]
)
def test_prompt_without_budget(prompt):
    assert parse_budget(prompt) == (None, prompt)
    assert budget_reward(0.75, prompt, 999, LengthRewardConfig()) == 0.75


def test_budget_reward_reads_the_target_from_the_prompt():
    cfg = LengthRewardConfig(mode="clip")
    prompt = add_budget("7*8=", 4)
    assert budget_reward(1.0, prompt, 4, cfg) == 1.0
    assert budget_reward(1.0, prompt, 5, cfg) == 0.0


def test_sample_target_is_seeded_and_in_the_list():
    cfg = LengthRewardConfig(targets=[4, 8, 16])
    a = [sample_target(cfg, random.Random(3)) for _ in range(5)]
    draws = [sample_target(cfg, rng) for rng in [random.Random(3)] for _ in range(200)]
    assert a == [a[0]] * 5 and set(draws) == {4, 8, 16}


@pytest.mark.parametrize("bad", [{"targets": []}, {"targets": [0]}, {"coef": -1}, {"mode": "min"}, {"extra": 1}])
def test_config_rejects(bad):
    with pytest.raises(ValidationError):
        LengthRewardConfig(**bad)


def test_default_is_intellect2():
    cfg = LengthRewardConfig()
    assert (cfg.mode, cfg.coef, min(cfg.targets), max(cfg.targets)) == ("exact", 0.0003, 2000, 10000)
