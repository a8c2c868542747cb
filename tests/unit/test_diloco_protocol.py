"""The DiLoCo key namespace (intellect.diloco.protocol) and the write scopes derived from it."""

from __future__ import annotations

import base64
import doctest

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
