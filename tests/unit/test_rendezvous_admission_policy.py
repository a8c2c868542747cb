"""DiLoCo admission and the rendezvous bounds, without a server: the join exchange's two halves, the
per-step window, gloo's per-rank keys, a ban, and what the store drops as the run moves on."""

from __future__ import annotations

import base64
import doctest
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import intellect.diloco.admission as admission_mod
from intellect.diloco.admission import Admission, Refusal, coordinator_identity
from intellect.diloco.membership import retire, scope
from intellect.diloco.protocol import AHEAD, BEHIND, KEEP_STEPS
from intellect.diloco.rendezvous import allreduce_root, peer_key
from intellect.trust.keys import SigningKey
from intellect.trust.requests import AuthError, sign_request

SECRET = bytes(range(32))


def _set(key: str, value: str = "1") -> dict:
    return {"key": key, "value": base64.b64encode(value.encode()).decode()}


def test_docstring_examples():
    assert doctest.testmod(admission_mod).failed == 0


def test_the_admission_answer_carries_only_the_contributors_own_credentials():
    me, stranger = SigningKey.from_seed(bytes([1] * 32)), SigningKey.from_seed(bytes([2] * 32))
    adm = Admission(SECRET, "run", [me.public.hex], config="{}")
    ephemeral = X25519PrivateKey.generate().public_key().public_bytes_raw().hex()
    body = json.dumps({"ephemeral": ephemeral}).encode()
    data: dict[str, bytes] = {"launched": b"2", "launched/0": b"w0", "launched/1": b"w1"}
    with pytest.raises(Refusal, match="not_admitted"):
        adm.admit(sign_request(stranger, "POST", "/v1/join", body, audience="diloco-join/run"), body, data)
    with pytest.raises(AuthError, match="bad_signature"):  # signed for another run
        adm.admit(sign_request(me, "POST", "/v1/join", body, audience="diloco-join/other"), body, data)
    headers = sign_request(me, "POST", "/v1/join", body, audience="diloco-join/run")
    answer, _, writes = adm.admit(headers, body, data)
    doc = json.loads(answer)
    assert doc["worker"] == me.public.id and doc["index"] == 2
    assert writes == {"launched/2": me.public.id.encode(), "launched": b"3"}
    plain = [peer_key(SECRET, "run", me.public.id), allreduce_root(SECRET, "run"), SECRET,
             peer_key(SECRET, "run", "coordinator")]
    assert not any(k.hex() in answer.decode() for k in plain)  # sealed, and nothing else is in it
    with pytest.raises(AuthError, match="replay"):
        adm.admit(headers, body, data)
    data.update({k: v for k, v in writes.items()})
    again = sign_request(me, "POST", "/v1/join", body, audience="diloco-join/run")
    assert json.loads(adm.admit(again, body, data)[0])["index"] == 2  # a rejoin: its place, nothing written
    data[f"banned/{me.public.id}"] = b"{}"
    with pytest.raises(Refusal, match="banned"):
        adm.admit(sign_request(me, "POST", "/v1/join", body, audience="diloco-join/run"), body, data)
    assert coordinator_identity(SECRET, "run").public != me.public


def test_per_step_keys_are_taken_only_around_the_runs_step():
    data = {"progress": b"10"}
    assert scope("a", "set", _set(f"metrics/{10 - BEHIND}/a"), data) is None
    assert scope("a", "set", _set(f"ready/{10 + AHEAD}/0/a"), data) is not None  # not a member, in the window
    for t in (10 - BEHIND - 1, 10 + AHEAD + 1, 10**9):
        assert "are written for steps" in scope("a", "set", _set(f"metrics/{t}/a"), data)
    assert "attempts" in scope("a", "set", _set("ready/10/5000/a"), data)


def test_a_banned_peer_writes_nothing_but_may_read_a_counter():
    data = {"banned/a": b"{}"}
    for req, op in ((_set("hb/a"), "set"), (_set("metrics/0/a"), "set"), ({"key": "hb/a", "amount": 1}, "add")):
        assert scope("a", op, req, data) == ("banned", "a was banned from the run: it writes nothing")
    assert scope("a", "add", {"key": "hb/b", "amount": 0}, data) is None
    assert scope("b", "set", _set("metrics/0/b"), data) is None


def test_gloo_keys_belong_to_their_rank_in_the_attempts_member_order():
    data = {"members/3/1": b'["b", "a"]', "ready/3/1/a": b"1", "ready/3/1/b": b"1", "members/3/0": b'["a", "b"]'}
    assert scope("a", "set", _set("pg/3/1//0/1"), data) is None
    assert "only rank 0" in scope("a", "set", _set("pg/3/1//0/0"), data)
    assert scope("a", "set", _set("pg/3/onboard//0/0"), data) is None  # the step's members: a is rank 0
    assert scope("a", "set", _set("bw/3/col/0"), data) is None
    assert "once" in scope("a", "set", _set("pg/3/1//0/1"), {**data, "pg/3/1//0/1": b"x"})
    assert "ready" in scope("a", "set", _set("pg/3/1//0/1"), {k: v for k, v in data.items() if k != "ready/3/1/b"})
    for key in ("pg/3/1/x", "pg/3/1//0/1/extra", "pg/3/zz//0/0", "bw/3/row/0"):
        assert scope("a", "set", _set(key), data) is not None, key
    assert scope("a", "delete", {"key": "pg/3/1//0/1"}, data) == "gloo's keys are written with set"


def test_a_workers_rings_and_catch_up_groups_have_their_own_writers():
    data = {"members/3/1": b'["b", "a"]', "ready/3/1/a": b"1", "ready/3/1/b": b"1",
            "members/3/0": b'["a", "b", "c"]', "committed/3/a": b"3", "committed/3/b": b"3", "committed/3/c": b"1"}
    # local rank 1's ring of a worker of several ranks: any of the worker's processes speaks as it
    assert scope("a", "set", _set("pg/3/1/shard1//0/1"), data) is None
    assert "only rank 0" in scope("a", "set", _set("pg/3/1/shard1//0/0"), data)
    for key in ("pg/3/1/shard0//0/1", "pg/3/1/shard64//0/1", "pg/3/1/shardx//0/1", "pg/3/1/shard1/x/0/1"):
        assert scope("a", "set", _set(key), data) is not None, key
    # c (member 2) is behind: b (the source: of the newest, a and b by name, the one step 3 turns to) is
    # rank 0, c rank 1, nobody else
    assert scope("b", "set", _set("pg/3/catchup2//0/0"), data) is None
    assert scope("c", "set", _set("pg/3/catchup2//0/1"), data) is None
    assert scope("b", "set", _set("pg/3/catchup2/shard1//0/0"), data) is None
    assert "only b" in scope("a", "set", _set("pg/3/catchup2//0/0"), data)
    assert "only c" in scope("b", "set", _set("pg/3/catchup2//0/1"), data)
    assert "not behind" in scope("a", "set", _set("pg/3/catchup1//0/1"), data)
    assert "no member 7" in scope("a", "set", _set("pg/3/catchup7//0/1"), data)
    assert "two ranks" in scope("a", "set", _set("pg/3/catchup2//0/2"), data)
    assert "once" in scope("c", "set", _set("pg/3/catchup2//0/1"), {**data, "pg/3/catchup2//0/1": b"x"})


def test_the_store_drops_the_steps_the_run_left_behind():
    data = {f"metrics/{t}/a": b"{}" for t in range(30)} | {"pg/2/0//0/0": b"x", "hb/a": b"3", "banned/b": b"{}",
                                                          "launched/0": b"a", "progress": b"20"}
    gone = set(retire("progress", data))
    assert gone == {f"metrics/{t}/a" for t in range(20 - KEEP_STEPS)} | {"pg/2/0//0/0"}
    assert retire("metrics/5/a", data) == []
