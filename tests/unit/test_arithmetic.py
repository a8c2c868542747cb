"""Synthetic arithmetic: determinism, the fixed held-out split, the difficulty knob, the alphabet."""

from __future__ import annotations

import doctest
import hashlib
import itertools
import random

import pytest

import intellect.data.arithmetic as arithmetic
from intellect.config import DataConfig
from intellect.data import (
    ALPHABET,
    MathTask,
    Problem,
    batch_texts,
    documents,
    heldout_problems,
    in_alphabet,
    is_heldout,
    operand_range,
    problem_space_size,
    sample_problem,
    train_stream,
    verify_answer,
)


def take(stream, n):
    return list(itertools.islice(stream, n))


def test_docstring_examples_hold():
    result = doctest.testmod(arithmetic)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------- Problem


@pytest.mark.parametrize(
    "a, op, b, prompt, answer",
    [
        (12, "+", 345, "12+345=", "357"),
        (12, "-", 345, "12-345=", "-333"),
        (345, "-", 12, "345-12=", "333"),
        (0, "*", 999, "0*999=", "0"),
        (999, "*", 999, "999*999=", "998001"),
        (5, "-", 5, "5-5=", "0"),
    ],
)
def test_problem_fields(a, op, b, prompt, answer):
    p = Problem(a, op, b)
    assert p.prompt == prompt
    assert p.answer == answer
    assert p.text == prompt + answer
    assert p.id == prompt[:-1]
    assert Problem.from_id(p.id) == p == Problem.from_id(p.prompt)
    assert p.to_task() == MathTask(id=p.id, prompt=prompt, answer=answer)


@pytest.mark.parametrize("args", [(1, "/", 2), (-1, "+", 2), (1, "+", 2.0), (True, "+", 1)])
def test_problem_rejects_bad_fields(args):
    with pytest.raises(ValueError):
        Problem(*args)


@pytest.mark.parametrize("text", ["", "1+", "a+b", "1/2", "-1+2", "1++2"])
def test_from_id_rejects_non_problems(text):
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        Problem.from_id(text)


def test_answers_are_correct_for_sampled_problems():
    rng = random.Random(3)
    cfg = DataConfig(max_digits=4)
    for _ in range(3000):
        p = sample_problem(rng, cfg)
        assert int(p.answer) == eval(p.id)  # noqa: S307 - digits and one operator only
        assert p.text == p.prompt + p.answer and p.prompt.endswith("=")


# --------------------------------------------------------------------- alphabet


def test_alphabet_is_the_tokenizer_contract():
    assert ALPHABET == "0123456789+-*/=()., :abcdefghijklmnopqrstuvwxyz"
    assert len(set(ALPHABET)) == len(ALPHABET)


def test_every_text_uses_only_the_alphabet():
    cfg = DataConfig(min_digits=1, max_digits=6)
    texts = batch_texts(train_stream(cfg), 5000) + [p.text for p in heldout_problems(DataConfig(), 200)]
    assert all(in_alphabet(t) for t in texts)
    assert set("".join(texts)) <= set("0123456789+-*=")


def test_in_alphabet_rejects_foreign_characters():
    assert in_alphabet("")
    assert not in_alphabet("1+1=2\n")
    assert not in_alphabet("X")


# --------------------------------------------------------------------- verify_answer


@pytest.mark.parametrize(
    "expected, completion, ok",
    [
        ("357", "357", True),
        ("357", "  357 \n", True),
        ("-333", "-333", True),
        (Problem(12, "-", 345), "-333", True),
        (357, "357", True),
        ("357", "0357", True),
        ("357", "+357", True),
        ("357", "356", False),
        ("-333", "333", False),
        ("357", "357.0", False),
        ("357", "3 57", False),
        ("357", "357=", False),
        ("357", "", False),
        ("357", "abc", False),
        ("357", "٣٥٧", False),  # non-ASCII digits are not digits here
        ("357", None, False),
        ("1/2", "1/2", False),  # not an integer answer: exact check says no
        (True, "1", False),
    ],
)
def test_verify_answer(expected, completion, ok):
    assert verify_answer(expected, completion) is ok


# --------------------------------------------------------------------- sampling and the difficulty knob


def test_operand_range():
    assert [operand_range(d) for d in (1, 2, 3)] == [(0, 9), (10, 99), (100, 999)]
    with pytest.raises(ValueError):
        operand_range(0)


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 2), (2, 2), (3, 3), (1, 3), (2, 5)])
def test_difficulty_knob_sets_operand_ranges(lo, hi):
    cfg = DataConfig(min_digits=lo, max_digits=hi)
    rng = random.Random(0)
    operands = [x for _ in range(4000) for p in [sample_problem(rng, cfg)] for x in (p.a, p.b)]
    assert min(operands) >= operand_range(lo)[0]
    assert max(operands) <= operand_range(hi)[1]
    # every allowed digit count shows up, uniformly enough
    counts = {d: sum(len(str(x)) == d for x in operands) for d in range(lo, hi + 1)}
    assert all(c > len(operands) / (hi - lo + 1) * 0.8 for c in counts.values()), counts


def test_harder_config_draws_bigger_numbers():
    easy = take(train_stream(DataConfig(max_digits=1)), 500)
    hard = take(train_stream(DataConfig(min_digits=3, max_digits=3)), 500)
    assert max(max(p.a, p.b) for p in easy) <= 9
    assert min(min(p.a, p.b) for p in hard) >= 100


def test_ops_follow_config_uniformly():
    problems = take(train_stream(DataConfig(ops=["-", "*"])), 3000)
    counts = {op: sum(p.op == op for p in problems) for op in "+-*"}
    assert counts["+"] == 0
    assert 1300 < counts["-"] < 1700 and 1300 < counts["*"] < 1700


def test_problem_space_size():
    assert problem_space_size(DataConfig(ops=["+"], min_digits=1, max_digits=1)) == 100
    assert problem_space_size(DataConfig(ops=["+", "+"], min_digits=2, max_digits=2)) == 90 * 90
    assert problem_space_size(DataConfig(max_digits=3)) == 3 * 1000 * 1000
    assert problem_space_size(DataConfig()) == 3 * 100 * 100


# --------------------------------------------------------------------- determinism


def test_same_seed_same_stream():
    cfg = DataConfig(seed=42)
    assert take(train_stream(cfg), 500) == take(train_stream(cfg), 500)
    assert batch_texts(train_stream(cfg), 50) == [p.text for p in take(train_stream(cfg), 50)]


def test_different_seed_different_stream():
    a = take(train_stream(DataConfig(seed=1)), 200)
    b = take(train_stream(DataConfig(seed=2)), 200)
    assert a != b
    assert take(train_stream(DataConfig(seed=1), seed=2), 200) == b


# --------------------------------------------------------------------- the held-out split


def test_is_heldout_is_the_content_hash():
    for pid in ("12+345", "7*8", "0-0", "999*999"):
        h = int(hashlib.sha256(pid.encode()).hexdigest(), 16) % 100
        assert is_heldout(pid, h + 1) and not is_heldout(pid, h)
        assert is_heldout(Problem.from_id(pid), h + 1)


def test_heldout_share_matches_percent():
    problems = [Problem(a, "+", b) for a in range(100) for b in range(100)]
    share = sum(is_heldout(p, 10) for p in problems) / len(problems)
    assert 0.08 < share < 0.12


def test_heldout_split_is_nested_in_percent():
    problems = [Problem(a, op, b) for a in range(40) for b in range(40) for op in "+-*"]
    small = {p for p in problems if is_heldout(p, 5)}
    large = {p for p in problems if is_heldout(p, 20)}
    assert small < large


def test_train_never_yields_heldout():
    cfg = DataConfig(seed=3, max_digits=3)
    held = {p.id for p in heldout_problems(cfg, 2000)}
    assert len(held) == 2000
    train = take(train_stream(cfg), 20_000)
    assert not any(is_heldout(p, cfg.heldout_percent) for p in train)
    assert held.isdisjoint(p.id for p in train)


def test_train_never_yields_heldout_in_a_small_space():
    cfg = DataConfig(max_digits=1, heldout_percent=30)
    held = {p.id for p in heldout_problems(cfg, 1000)}
    train = {p.id for p in take(train_stream(cfg), 20_000)}
    assert held and held.isdisjoint(train)
    # the small space is covered exactly: every problem is either train or held out
    assert len(held) + len(train) == problem_space_size(cfg)


def test_heldout_list_is_independent_of_seed():
    lists = [heldout_problems(DataConfig(seed=s), 300) for s in (0, 1, 12345)]
    assert lists[0] == lists[1] == lists[2]
    assert len(lists[0]) == 300 and len(set(lists[0])) == 300
    assert all(is_heldout(p, 5) for p in lists[0])


def test_heldout_list_is_prefix_stable_and_deterministic():
    cfg = DataConfig()
    long = heldout_problems(cfg, 500)
    assert heldout_problems(cfg, 100) == long[:100]
    assert heldout_problems(cfg, 0) == []
    # the caller may mutate what it gets back without touching the cache
    long.clear()
    assert len(heldout_problems(cfg, 500)) == 500


def test_heldout_list_follows_difficulty_and_ops():
    held = heldout_problems(DataConfig(ops=["*"], min_digits=2, max_digits=3), 200)
    assert all(p.op == "*" and 10 <= p.a <= 999 and 10 <= p.b <= 999 for p in held)


def test_heldout_list_in_a_small_space_returns_all_it_has():
    cfg = DataConfig(ops=["+"], max_digits=1, heldout_percent=20)
    everything = {Problem(a, "+", b) for a in range(10) for b in range(10) if is_heldout(Problem(a, "+", b), 20)}
    got = heldout_problems(cfg, 1000)
    assert set(got) == everything and len(got) == len(everything)
    assert heldout_problems(cfg, 3) == got[:3]


def test_heldout_list_too_large_for_a_big_space_is_a_clear_error():
    cfg = DataConfig(min_digits=3, max_digits=3, heldout_percent=1)  # ~24k held out
    with pytest.raises(ValueError, match="held-out problems"):
        heldout_problems(cfg, 20_000)
    with pytest.raises(ValueError):
        heldout_problems(cfg, -1)


def test_train_stream_in_a_space_that_is_all_held_out_is_an_error(monkeypatch):
    monkeypatch.setattr(arithmetic, "is_heldout", lambda p, pct: True)
    arithmetic._has_train_problem.cache_clear()
    try:
        with pytest.raises(ValueError, match="every problem"):
            train_stream(DataConfig(max_digits=1))
    finally:
        arithmetic._has_train_problem.cache_clear()


# --------------------------------------------------------------------- corpus with slips


def test_documents_without_slips_are_the_stream():
    cfg = DataConfig(seed=9)
    assert take(documents(cfg), 300) == [p.text for p in take(train_stream(cfg), 300)]


def test_slipped_documents_flip_the_sign_at_the_configured_rate():
    cfg = DataConfig(seed=4, slip_rate=0.6)
    docs, problems = take(documents(cfg), 4000), take(train_stream(cfg), 4000)
    assert all(d.startswith(p.prompt) for d, p in zip(docs, problems))
    answers = [d[len(p.prompt):] for d, p in zip(docs, problems)]
    assert all(a in (p.answer, p.slip) for a, p in zip(answers, problems))
    differ = [(a, p) for a, p in zip(answers, problems) if p.answer != p.slip]
    share = sum(a == p.slip for a, p in differ) / len(differ)
    assert abs(share - 0.6) < 0.03  # 4000 draws: s.e. ~0.008
    assert take(documents(cfg), 100) == docs[:100]  # seeded
    assert take(documents(cfg, seed=5), 100) != docs[:100]


def test_a_slip_is_the_negated_result():
    for p in (Problem(12, "+", 34), Problem(3, "-", 40), Problem(40, "-", 3), Problem(6, "*", 7), Problem(0, "*", 9)):
        assert int(p.slip) == -p.value and verify_answer(p, p.slip) == (p.value == 0)


def test_slip_rate_is_bounded():
    with pytest.raises(ValueError, match="slip_rate"):
        DataConfig(slip_rate=1.0)
