"""The DiLoCo key namespace (intellect.diloco.protocol) and the write scopes derived from it."""

from __future__ import annotations

import base64
import doctest
import json

import pytest

from intellect.diloco import protocol as P
from intellect.diloco.membership import scope
from intellect.diloco.rendezvous import COORDINATOR


def test_keys_are_built_from_their_declared_fields_only():
    assert P.VOTE(4, 1, "w2") == "vote/4/1/w2" and P.VOTE.under(4, 1) == "vote/4/1"
    assert P.PROGRESS() == "progress" and P.LAUNCHED(0) == "launched/0" and P.LAUNCHED.under() == "launched"
    with pytest.raises(TypeError):
        P.VOTE(4, "w2")
    with pytest.raises(TypeError):
        P.MEMBERS.under(1, 0)  # a prefix is shorter than a key


def test_every_family_is_declared_once_with_a_writer():
    families = [v for v in vars(P).values() if isinstance(v, P.Family)]
    assert len({f.name for f in families}) == len(families) == len(P.FAMILIES)
    assert {f.name for f in families} >= {"ready", "vote", "outcome", "plan", "members", "arrive", "hb", "dead",
                                          "progress", "launched", "banned", "ban", "start", "committed"}
    assert all(isinstance(f.writer, P.Writer) and f.doc for f in families)


def _value(v: str) -> str:
    return base64.b64encode(v.encode()).decode()


@pytest.mark.parametrize("family", [f for f in P.FAMILIES.values() if f.writer is P.Writer.OWN], ids=lambda f: f.name)
def test_a_worker_writes_its_own_keys_and_nobody_elses(family):
    mine = family(*([0] * (len(family.fields) - 1)), "a")
    theirs = family(*([0] * (len(family.fields) - 1)), "b")
    op = "add" if family is P.HB else "set"
    assert scope("a", op, {"key": mine, "value": _value("0"), "amount": 1}, {}) is None
    assert scope("a", op, {"key": theirs, "value": _value("0"), "amount": 1}, {}) == \
        f"a worker writes only its own {family.name}/ key"


@pytest.mark.parametrize("family", [f for f in P.FAMILIES.values() if f.writer is P.Writer.COORDINATOR],
                         ids=lambda f: f.name)
def test_coordinator_families_are_the_coordinators(family):
    key = family(*([0] * len(family.fields)))
    assert scope("a", "set", {"key": key, "value": _value("1")}, {}) == f"{family.name}/ is the coordinator's"
    assert scope(COORDINATOR, "set", {"key": key, "value": _value("1")}, {}) is None


def test_readers_ignore_what_they_cannot_parse():
    assert P.read_ban(P.ban_record(3, 1)) == (3, 1)
    assert P.read_ban(b'{"step": "x", "attempt": 1}') is None and P.read_ban(b"[") is None
    assert P.read_count(b"-1") is None and P.read_names(b'["' + b"x" * 65 + b'"]') is None


def test_doctests():
    # among them: agreed_digest, what a joiner checks the state it receives against
    assert doctest.testmod(P).failed == 0


def _propose(peer: str, t: int, names: list[str], data: dict) -> str | tuple[str, str] | None:
    body = {"key": f"members/{t}/0", "expected": "", "desired": base64.b64encode(json.dumps(names).encode()).decode()}
    return scope(peer, "compare_set", body, data)


def test_the_next_steps_members_are_proposed_by_a_committer_or_overlapped_a_member_of_the_step_in_flight():
    arrived = {f"arrive/{t}/{w}": b"1" for t in range(4) for w in "abc"}
    base = {**arrived, "start": b"0", "members/0/0": b'["a", "b"]', "vote/0/0/a": b"ok"}
    # founders of step 0; overlapped, the next step's members come while step 0 is undecided
    assert _propose("a", 1, ["a", "b"], base) is None
    assert _propose("c", 1, ["a", "b", "c"], base) is not None  # not a member of step 0
    decided = {**base, "outcome/0/0": b"commit", "progress": b"1", "members/1/0": b'["a", "b", "c"]'}
    assert _propose("c", 2, ["a", "b", "c"], decided) is not None  # c joined step 1: it committed no step 0
    assert _propose("a", 2, ["a", "b", "c"], decided) is None  # a: step 0's commit, in step 1 in flight
    assert _propose("a", 2, ["a", "b"], {**decided, "outcome/1/0": b"abort"}) is not None  # 1 is no longer in flight
    retry = {**decided, "outcome/1/0": b"abort", "members/1/1": b'["a", "b"]'}
    assert _propose("b", 2, ["a", "b"], retry) is None  # a member of the retry in flight
    assert _propose("c", 2, ["a", "b"], {**retry, "outcome/0/0": b"commit"}) is not None
    # blocking runs never propose before the step commits: a committer of step 1 proposes step 2
    assert _propose("c", 2, ["a", "c"], {**decided, "outcome/1/0": b"commit"}) is None
