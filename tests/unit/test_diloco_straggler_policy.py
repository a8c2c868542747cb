"""The straggler policy's pure parts (``intellect.diloco.stragglers``) and the rendezvous rule for ``CLOSE``."""

from __future__ import annotations

import base64
import math

import pytest
import torch

from intellect.diloco.config import DilocoConfig
from intellect.diloco.membership import scope
from intellect.diloco.stragglers import Ready, StragglerPolicy, Window, read_ready, ready_record, scale_of, token_weights

POLICY = StragglerPolicy(quorum=0.6, grace_ratio=0.1, grace_min=0.5, inner_steps=20)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def window(members: int, records: list[Ready | None]):
    clock, closes = Clock(), []
    w = Window(POLICY, members, lambda present: records[: len(present)], lambda: closes.append(clock.t), 0.25,
               now=clock)
    return w, clock, closes


def test_the_window_waits_for_the_quorum_then_the_grace_then_the_late_window():
    # 5 members: 3 make the quorum; phases of 10 s: grace 1 s, late window 1 + 2 x 0.25 + 4 x 0.5 = 3.5 s
    w, clock, closes = window(5, [Ready(100, 10.0)] * 5)
    assert not w(["a", "b"]) and w.opened is None  # below the quorum nothing opens, however long
    clock.t = 100.0
    assert not w(["a", "b", "c"]) and w.opened == 100.0 and not closes
    clock.t = 100.9
    assert not w(["a", "b", "c"]) and not closes
    clock.t = 101.0
    assert not w(["a", "b", "c", "d"]) and closes == [101.0]  # closed once ...
    clock.t = 104.4
    assert not w(["a", "b", "c", "d"]) and closes == [101.0]  # ... and the late window runs
    clock.t = 104.5
    assert w(["a", "b", "c", "d"])


def test_the_grace_follows_the_members_phase_times_and_a_liar_cannot_stretch_it_alone():
    assert POLICY.grace([Ready(100, 60.0), Ready(100, 80.0), Ready(100, 70.0)]) == pytest.approx(7.0)
    # one member claiming a day-long phase moves the median by one place only
    assert POLICY.grace([Ready(100, 60.0), Ready(100, 86400.0), Ready(100, 70.0)]) == pytest.approx(7.0)
    assert POLICY.grace([None, Ready(0, 1000.0)]) == POLICY.grace_min  # nothing readable of a phase
    assert StragglerPolicy(1.0, 0.1, 0.5, 20).needed(4) == 4 and POLICY.needed(5) == 3 and POLICY.needed(1) == 1


@pytest.mark.parametrize("raw", [b"1", b"", b"[]", b'{"tokens": true, "seconds": 1}', b'{"tokens": 1.5, "seconds": 1}',
                                 b'{"tokens": 1, "seconds": Infinity}', b'{"tokens": 1, "seconds": -1}',
                                 b'{"tokens": 1e30, "seconds": 1}', b'{"tokens": 1}', b"\xff\xfe", None])
def test_a_ready_record_that_is_not_one_reads_as_none(raw):
    assert read_ready(raw) is None


def test_token_weights_make_the_plain_mean_the_token_weighted_one_and_cap_a_liar_at_a_full_phase():
    g = torch.Generator().manual_seed(0)
    pseudo = [torch.randn(50, generator=g) for _ in range(4)]
    records = [Ready(1000, 10.0), Ready(1000, 10.0), Ready(400, 10.0), Ready(0, 0.0)]  # the last relays only
    weights = token_weights(records)
    assert weights == [1.0, 1.0, 0.4, 0.0]
    scales = [scale_of(weights, i) for i in range(4)]
    sent = [s * p for s, p in zip(scales, pseudo) if s > 0]
    mean = torch.stack(sent).mean(0)  # what the reduction computes over its contributors
    expect = (pseudo[0] + pseudo[1] + 0.4 * pseudo[2]) / 2.4
    assert torch.allclose(mean, expect, atol=1e-6)
    # a member claiming a billion tokens weighs what a full phase does, not more
    assert token_weights([Ready(10**9, 1.0), Ready(1000, 1.0), Ready(1000, 1.0)]) == [1.0, 1.0, 1.0]
    # records nobody can read count as full phases: an unweighted mean, as without the policy
    assert token_weights([None, None]) == [1.0, 1.0] and scale_of([1.0, 1.0], 1) == 1.0
    assert math.isclose(sum(scale_of(weights, i) for i in range(4)), 3.0)  # k contributors' scales sum to k


def test_the_config_turns_the_policy_on_below_a_quorum_of_one():
    assert DilocoConfig().stragglers() is None
    p = DilocoConfig(quorum=0.5, grace_ratio=0.2, grace_min=2.0, inner_steps=30).stragglers()
    assert p == StragglerPolicy(0.5, 0.2, 2.0, 30)
    with pytest.raises(ValueError):
        DilocoConfig(quorum=0.0)
    assert ready_record(5, 1.0) == '{"tokens": 5, "seconds": 1.0}'


def _cs(key: str, value: bytes) -> dict:
    return {"key": key, "expected": "", "desired": base64.b64encode(value).decode()}


def test_a_phase_is_closed_only_by_a_member_done_with_it_once_the_quorum_is():
    data = {"members/3/0": b'["a", "b", "c"]', "ready/3/0/a": b'{"tokens": 1, "seconds": 1.0}', "progress": b"3"}
    close = _cs("close/3", b"1")
    # one of three done: below a quorum of 0.6 (two), the one done cannot close the others' phase alone
    assert scope("a", "compare_set", close, data, quorum=0.6) == \
        "a step's phase is closed once 2 of its members are done with it"
    data["ready/3/0/b"] = b'{"tokens": 1, "seconds": 1.0}'
    assert scope("a", "compare_set", close, data, quorum=0.6) is None
    assert scope("c", "compare_set", close, data, quorum=0.6) == "only a member done with the step's phase closes it"
    assert scope("z", "compare_set", close, data, quorum=0.6) is not None  # no member at all
    assert scope("a", "compare_set", close, data) is not None  # quorum 1: every member must be done
    assert scope("a", "compare_set", _cs("close/3", b"now"), data, quorum=0.6) == "a close is 1"
    assert scope("a", "set", {"key": "close/3", "value": base64.b64encode(b"1").decode()}, data, quorum=0.6) is not None


def test_overlapped_a_vote_on_the_step_before_counts_as_done_with_the_phase():
    # overlapped, a member votes on step 2 as its phase 3 ends, before it is ready for step 3
    data = {"members/3/0": b'["a", "b", "c"]', "members/2/0": b'["a", "b", "c"]', "members/2/1": b'["a", "b"]',
            "vote/2/1/a": b"ok", "vote/2/0/b": b"ok", "progress": b"2"}
    close = _cs("close/3", b"1")
    assert scope("a", "compare_set", close, data, quorum=0.5) == \
        "a step's phase is closed once 2 of its members are done with it"  # b's vote is on an attempt left behind
    data["vote/2/1/b"] = b"ok"
    assert scope("a", "compare_set", close, data, quorum=0.5) is None
