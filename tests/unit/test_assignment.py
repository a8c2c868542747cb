"""Deterministic prompt assignment: recomputable anywhere, uniform, checked by the validator."""

from __future__ import annotations

import doctest
import hashlib
from collections import Counter
from dataclasses import replace

import pytest

from intellect import ids
from intellect.ids import canonical_worker
from intellect.rl.wire import assignment
from intellect.rl.wire.assignment import assign_prompts, assignment_seed, check_assignment
from intellect.rl.wire.rollouts import Rollout


def test_doctests():
    assert doctest.testmod(assignment).failed == 0
    assert doctest.testmod(ids).failed == 0


def test_seed_follows_the_documented_formula():
    msg = b"intellect/assignment/v1\0" + b"0xabc\0" + (7).to_bytes(8, "big") + (0).to_bytes(8, "big")
    assert assignment_seed("0xABC", 7, 0) == int.from_bytes(hashlib.sha256(msg).digest()[:8], "big")


def test_prompts_are_pinned():
    # Golden values: a change here breaks every validator that recomputes old assignments.
    assert assignment_seed("0xabc", 7, 0) == 0x8345969EC0C52F0B
    assert assign_prompts(285_000, "0xabc", 7, 0, 8) == [157548, 52793, 163332, 165794, 27676, 149298, 143634, 163007]


def test_inputs_each_change_the_assignment():
    base = assign_prompts(10_000, "w1", 5, 0, 16)
    others = [assign_prompts(10_000, "w2", 5, 0, 16), assign_prompts(10_000, "w1", 6, 0, 16),
              assign_prompts(10_000, "w1", 5, 1, 16)]
    assert all(o != base for o in others)
    assert assign_prompts(10_000, "W1", 5, 0, 16) == base  # worker ids are case-insensitive


def test_without_replacement_and_in_range():
    for k in range(20):
        a = assign_prompts(50, "w", 1, k, 50)
        assert sorted(a) == list(range(50))
    a = assign_prompts(1 << 40, "w", 1, 0, 1000)  # huge task sets cost O(n_prompts)
    assert len(set(a)) == 1000 and all(0 <= i < 1 << 40 for i in a)


def test_roughly_uniform():
    counts = Counter(i for k in range(2000) for i in assign_prompts(10, "w", 0, k, 3))
    assert set(counts) == set(range(10))
    assert all(500 < c < 700 for c in counts.values())  # expected 600 each


def test_bad_arguments():
    for args in [(0, "w", 0, 0, 1), (5, "w", 0, 0, 6), (5, "w", -1, 0, 1), (5, "w", 0, 2**64, 1),
                 (5, "", 0, 0, 1), (5, "a/b", 0, 0, 1), (5, "-w", 0, 0, 1), (5, "w", 0, 0, True)]:
        with pytest.raises(ValueError):
            assign_prompts(*args)
    assert canonical_worker("Node_1.x-Y") == "node_1.x-y"


TASKS = [f"task-{i}" for i in range(100)]


def _submission(worker="w1", step=4, k=0, n_prompts=3, group_size=2):
    ids = assign_prompts(len(TASKS), worker, step, k, n_prompts)
    return [
        Rollout(run="r", step=step, policy_step=step, worker=worker, submission=k, seed=10 * j + s,
                prompt_id=TASKS[ids[j]], group_id=j, prompt_tokens=(1, ids[j] % 7 + 2), output_tokens=(3, s),
                finish_reason="stop", reward=1.0, task_reward=1.0, length_penalty=0.0, advantage=0.0)
        for j in range(n_prompts) for s in range(group_size)
    ]


def _tokens(task_id):
    return (1, int(task_id.split("-")[1]) % 7 + 2)


def test_check_assignment_accepts_the_assigned_prompts():
    rows = _submission()
    assert check_assignment(rows, TASKS, 3) is None
    assert check_assignment(rows, TASKS, 3, group_size=2, prompt_tokens=_tokens) is None
    assert check_assignment(list(reversed(rows)), TASKS, 3) is None  # row order is free


def test_check_assignment_rejects_cherry_picks():
    rows = _submission()
    picked = [replace(r, prompt_id="task-0") if r.group_id == 1 else r for r in rows]
    assert "group 1 must answer" in check_assignment(picked, TASKS, 3)
    # the same prompts claimed under another submission index do not match that index's draw
    assert check_assignment([replace(r, submission=1) for r in rows], TASKS, 3) is not None
    # the right id on an easier prompt's tokens
    swapped = [replace(r, prompt_tokens=(9, 9)) if r.group_id == 0 else r for r in rows]
    assert "prompt tokens differ" in check_assignment(swapped, TASKS, 3, prompt_tokens=_tokens)
    mixed = [replace(r, prompt_tokens=(9, 9)) if r.group_id == 0 and r.seed == 0 else r for r in rows]
    assert "mixes" in check_assignment(mixed, TASKS, 3)


def test_check_assignment_rejects_missing_extra_or_uneven_groups():
    rows = _submission()
    assert check_assignment([r for r in rows if r.group_id != 2], TASKS, 3) is not None
    assert check_assignment(_submission(n_prompts=4), TASKS, 3) is not None
    assert "samples" in check_assignment(rows[:-1], TASKS, 3, group_size=2)
    assert check_assignment([], TASKS, 3) == "no rows"
    assert "disagree" in check_assignment(rows[:1] + [replace(rows[1], step=5)], TASKS, 3)
    assert "cannot recompute" in check_assignment(rows, TASKS[:2], 3)
