"""The pure half of the submission service: two-part request checks, rate limits, the registry."""

from __future__ import annotations

import doctest
import hashlib
import json
import random
import time

import pytest
from pydantic import ValidationError

from intellect import http_server
from intellect.http_server import FairShare
from intellect.rl.service import admission
from intellect.rl.worker import client as service_client
from intellect.rl.service.admission import (
    RateLimiter, Refusal, RegistrationLimiter, address_prefix, precheck, submission_bytes, verify_digest,
)
from intellect.rl.wire.rollout_schema import MAX_ID_CHARS, Rollout
from intellect.rl.wire.rollouts import encode_submission
from intellect.rl.service.registry import DoneRecord, Registry, SubmissionRecord
from intellect.rl.service.server import ServiceConfig
from intellect.rl.worker.client import pauses
from intellect.trust.keys import SigningKey
from intellect.trust.requests import AuthError, RequestVerifier, sign_request

KEY = SigningKey.from_seed(bytes(32))
OTHER = SigningKey.from_seed(bytes([1]) * 32)


def _signed(body: bytes = b"abc", now: float = 1000.0, audience: str = "run-a", path: str = "/v1/submissions/0/0"):
    return sign_request(KEY, "PUT", path, body, audience=audience, now=now)


# --------------------------------------------------------------------- signed requests in two halves


def test_verify_digest_accepts_what_request_verifier_accepts() -> None:
    h = _signed()
    v = RequestVerifier("run-a")
    assert verify_digest(v, "PUT", "/v1/submissions/0/0", hashlib.sha256(b"abc").hexdigest(), h, now=1001.0) == KEY.public
    with pytest.raises(AuthError) as e:  # the same nonce again: the shared replay guard refuses it
        v.verify("PUT", "/v1/submissions/0/0", b"abc", h, now=1001.0)
    assert e.value.reason == "replay"


@pytest.mark.parametrize("change, reason", [
    ({"digest": hashlib.sha256(b"abd").hexdigest()}, "bad_signature"),
    ({"path": "/v1/submissions/0/1"}, "bad_signature"),
    ({"method": "POST"}, "bad_signature"),
    ({"audience": "run-b"}, "bad_signature"),
    ({"now": 1000.0 + 31}, "stale"),
])
def test_verify_digest_refuses_altered_requests(change: dict, reason: str) -> None:
    h = _signed()
    v = RequestVerifier(change.get("audience", "run-a"))
    with pytest.raises(AuthError) as e:
        verify_digest(v, change.get("method", "PUT"), change.get("path", "/v1/submissions/0/0"),
                      change.get("digest", hashlib.sha256(b"abc").hexdigest()), h, now=change.get("now", 1000.5))
    assert e.value.reason == reason
    assert len(v.guard) == 0  # nothing unproven fills the replay guard


@pytest.mark.parametrize("edit, reason", [
    (lambda h: h.pop("x-intellect-signature"), "unsigned"),
    (lambda h: h.update({"x-intellect-key": "zz" * 32}), "malformed"),
    (lambda h: h.update({"x-intellect-time": "1" * 40}), "malformed"),
    (lambda h: h.update({"x-intellect-nonce": "g" * 32}), "malformed"),
    (lambda h: h.update({"x-intellect-signature": "00" * 10}), "malformed"),
])
def test_precheck_refuses_malformed_headers(edit, reason: str) -> None:
    h = _signed()
    edit(h)
    with pytest.raises(AuthError) as e:
        precheck(h, 30.0, now=1000.0)
    assert e.value.reason == reason


def test_refusal_reasons_are_known() -> None:
    assert Refusal.auth(AuthError("replay", "x")).status == 401
    with pytest.raises(ValueError):
        Refusal(400, "no-such-reason", "x")  # type: ignore[arg-type]


# --------------------------------------------------------------------- rate limits


def test_rate_limiter_refills_per_address() -> None:
    lim = RateLimiter(per_minute=3)
    assert [lim.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("b", 0.0)
    assert not lim.allow("a", 10.0)  # half a token back
    assert lim.allow("a", 20.0)
    assert not lim.allow("a", 20.0)


def test_rate_limiter_never_forgets_a_live_bucket() -> None:
    lim = RateLimiter(per_minute=1, max_addresses=2)
    assert lim.allow("a", 0.0) and lim.allow("b", 0.0)
    assert not lim.allow("c", 1.0)  # both buckets are still draining: a new address waits
    assert not lim.allow("a", 1.0)
    assert lim.allow("c", 61.0)  # a and b refilled, so they can go


def test_addresses_are_counted_by_what_one_client_controls() -> None:
    # an IPv6 end site is given a /48: every address in it is one prefix; an IPv4 client by its /24
    net = "2001:db8:1::/48"
    assert address_prefix("2001:db8:1:2::1") == address_prefix("2001:db8:1:ffff:ffff:ffff:ffff:ffff") == net
    assert address_prefix("2001:db8:2::1") != address_prefix("2001:db8:1::1")
    assert address_prefix("::ffff:192.0.2.7") == address_prefix("192.0.2.250") == "192.0.2.0/24"
    assert address_prefix("192.0.3.7") != address_prefix("192.0.2.7")
    assert address_prefix("unknown") == "unknown"
    lim = RateLimiter(per_minute=2)
    assert [lim.allow(address_prefix(f"2001:db8:0:{i:x}::1"), 0.0) for i in range(3)] == [True, True, False]


def test_a_few_prefixes_cannot_drain_the_shared_registrations() -> None:
    lim = RegistrationLimiter(per_prefix=10, total=30, reserve=15)
    drained = {p: sum(lim.allow(p, 0.0)[0] for _ in range(20)) for p in ("a", "b", "c")}
    assert drained == {"a": 10, "b": 5, "c": 5}  # b and c stop at the reserve once they used half their own
    got = [lim.allow("honest", 0.0) for _ in range(6)]
    assert [ok for ok, _ in got] == [True] * 5 + [False]
    assert "kept for address prefixes" in got[-1][1]
    assert sum(lim.allow("late", 0.0)[0] for _ in range(10)) == 5  # the rest of the reserve: another light prefix
    assert lim.allow("later", 0.0) == (False, "at most 30 new keys per minute")  # the shared total still holds
    assert not lim.allow("a", 10.0)[0]  # 10 s later: 5 shared tokens back, none for a prefix that used its own
    assert lim.allow("fresh", 10.0) == (True, "")
    with pytest.raises(ValueError):
        RegistrationLimiter(per_prefix=1, total=2, reserve=2)


# --------------------------------------------------------------------- fair shares and sizes


def test_fair_share_displaces_only_the_heaviest_group() -> None:
    share: FairShare[str] = FairShare(capacity=6, reserve=2)
    for i in range(4):  # untrusted holders fill all but the reserve
        assert share.claim("flood", trusted=False) == (True, None)
        share.add(f"f{i}", "flood", trusted=False)
    assert share.claim("flood", trusted=False) == (False, None)  # its own share: nothing to displace
    assert share.claim("honest", trusted=False) == (True, "flood")  # 4 > 0 + 1: its newest goes
    assert share.displaceable("flood", trusted=False)[-1] == "f3"
    share.remove("f3")
    share.add("h0", "honest", trusted=False)
    assert share.claim("trusted", trusted=True) == (True, None)  # the reserve is free
    share.add("t0", "trusted", trusted=True)
    share.add("t1", "trusted", trusted=True)
    assert len(share) == 6 and share.held == {"flood": 3, "honest": 1, "trusted": 2}
    assert share.claim("honest", trusted=False) == (True, "flood")  # 3 > 1 + 1
    share.remove("f2")
    share.add("h1", "honest", trusted=False)
    # now 2/2/2: nobody holds more than a newcomer would after the move
    assert share.claim("other", trusted=False) == (True, "flood") and share.held["flood"] == 2
    assert share.claim("honest", trusted=False) == (False, None)
    assert share.claim("trusted", trusted=True) == (False, None)
    share.remove("nobody")  # a holder without a place: nothing happens
    assert len(share) == 6
    with pytest.raises(ValueError):
        FairShare(capacity=2, reserve=2)


def test_doctests() -> None:
    for mod in (http_server, admission, service_client):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def test_retries_back_off_with_jitter_within_their_budget() -> None:
    slept: list[float] = []
    assert list(pauses(6, 60.0, first_pause=0.25, max_pause=2.0, rng=random.Random(1), sleep=slept.append)) == [
        0, 1, 2, 3, 4, 5, 6]
    for n, pause in enumerate(slept):  # doubling, capped, each drawn in [half, all] of it
        most = min(2.0, 0.25 * 2 ** n)
        assert most / 2 <= pause <= most
    other: list[float] = []
    list(pauses(6, 60.0, first_pause=0.25, max_pause=2.0, rng=random.Random(2), sleep=other.append))
    assert all(a != b for a, b in zip(slept, other))  # two clients refused together come back apart
    t0 = time.monotonic()
    tries = list(pauses(50, 0.3, first_pause=0.02, max_pause=0.1))  # the time budget ends it first
    assert 2 <= len(tries) < 51 and time.monotonic() - t0 <= 0.3 + 0.2


def test_an_honest_submission_fits_the_declared_size_cap() -> None:
    rng = random.Random(0)
    for rows, prompt, out, proof in [(32, 100, 16, 258), (4, 3000, 64, 516), (1, 1, 1, 0)]:
        worst = [Rollout("r" * 64, 1, 0, "k" * 21, 0, rng.getrandbits(63), "\U0001F600" * MAX_ID_CHARS, i,
                         tuple(rng.randrange(1 << 31) for _ in range(prompt)),
                         tuple(rng.randrange(1 << 31) for _ in range(out)), "length", 0.5, 0.5, 0.0, 0.1, None,
                         rng.randbytes(proof)) for i in range(rows)]
        size = len(encode_submission(worst))  # incompressible ids, the longest strings, random proofs
        assert size <= submission_bytes(rows, prompt, out, proof) < 64 * size, (rows, prompt, out, proof)


# --------------------------------------------------------------------- the registry


def _sub(step: int = 0, k: int = 0, worker: str = KEY.public.id, sha: str = "0" * 64) -> SubmissionRecord:
    return SubmissionRecord(worker, step, k, f"rollouts/step_{step}/{worker}-{k}.parquet", sha, 10, 1.0)


def test_registry_persists_and_reloads(tmp_path) -> None:
    reg = Registry(tmp_path)
    assert reg.admit(KEY.public) and not reg.admit(KEY.public)
    assert reg.admit(OTHER.public)
    assert reg.claim(0, KEY.public.id, 0) is None
    reg.release(0, KEY.public.id, 0, _sub())
    assert reg.claim(0, KEY.public.id, 0) == _sub()  # a stored name returns its record
    assert reg.finish(DoneRecord(KEY.public.id, 0, [_sub().path], 0, 2.0))
    reg.close()
    again = Registry(tmp_path)
    assert again.workers() == [KEY.public.id, OTHER.public.id]  # admission order, not id order
    assert again.submissions(0) == [_sub()]
    assert again.done(0)[KEY.public.id].files == [_sub().path]
    assert again.key(OTHER.public.id) == OTHER.public


def test_registry_claims_are_exclusive_and_end_with_done(tmp_path) -> None:
    reg = Registry(tmp_path)
    w = KEY.public.id
    assert reg.claim(0, w, 1) is None
    with pytest.raises(Refusal) as e:
        reg.claim(0, w, 1)
    assert e.value.reason == "busy"
    with pytest.raises(Refusal) as e:  # a done record cannot be written while a file is being stored
        reg.finish(DoneRecord(w, 0, [], 0, 1.0))
    assert e.value.reason == "busy"
    reg.release(0, w, 1)  # the write failed: the name is free again, nothing recorded
    assert reg.submissions(0) == [] and reg.claim(0, w, 1) is None
    reg.release(0, w, 1, _sub(k=1))
    assert reg.finish(DoneRecord(w, 0, [_sub(k=1).path], 0, 1.0))
    assert not reg.finish(DoneRecord(w, 0, [_sub(k=1).path], 0, 5.0))  # the same again: nothing new
    for rec, reason in [(DoneRecord(w, 0, [], 0, 1.0), "conflict"),
                        (DoneRecord(w, 1, [_sub(k=1).path], 0, 1.0), "unknown_file"),
                        (DoneRecord(OTHER.public.id, 0, [_sub(k=1).path], 0, 1.0), "unknown_file")]:
        with pytest.raises(Refusal) as e:
            reg.finish(rec)
        assert e.value.reason == reason
    with pytest.raises(Refusal) as e:
        reg.claim(0, w, 2)
    assert e.value.reason == "finished"
    assert reg.claim(0, w, 1) == _sub(k=1)  # a retry of a stored file still finds it


def test_registry_cuts_a_torn_last_line_and_refuses_a_corrupt_one(tmp_path) -> None:
    reg = Registry(tmp_path)
    reg.admit(KEY.public)
    reg.close()
    good = reg.path.read_bytes()
    reg.path.write_bytes(good + b'{"type": "worker", "wor')  # a crash mid-append
    again = Registry(tmp_path)
    assert again.workers() == [KEY.public.id]
    assert reg.path.read_bytes() == good
    again.admit(OTHER.public)  # appends start on a clean line
    again.close()
    assert Registry(tmp_path).workers() == [KEY.public.id, OTHER.public.id]
    forged = json.dumps({"type": "worker", "worker": "k" + "0" * 20, "public": KEY.public.hex, "time": 1.0,
                         "salt": "00" * 32})
    reg.path.write_bytes(good + forged.encode() + b"\n")
    with pytest.raises(RuntimeError, match="not the id of its key"):
        Registry(tmp_path)
    reg.path.write_bytes(b"garbage\n" + good)
    with pytest.raises(RuntimeError, match="unreadable registry record"):
        Registry(tmp_path)


def test_registry_bounds_admissions(tmp_path) -> None:
    reg = Registry(tmp_path)
    reg.admit(KEY.public, max_workers=1)
    with pytest.raises(Refusal) as e:
        reg.admit(OTHER.public, max_workers=1)
    assert e.value.reason == "full"
    assert not reg.admit(KEY.public, max_workers=1)


def test_registry_expires_only_idle_keys_and_only_when_full(tmp_path) -> None:
    keys = [SigningKey.from_seed(bytes([i + 2]) * 32).public for i in range(4)]
    reg = Registry(tmp_path)
    reg.admit(keys[0], 2, expire_after=60, now=0.0)
    reg.admit(keys[1], 2, expire_after=60, now=0.0)
    reg.release(0, keys[0].id, 0, _sub(worker=keys[0].id))  # keys[0] stored something: it stays
    with pytest.raises(Refusal) as e:  # keys[1] is idle but not long enough
        reg.admit(keys[2], 2, expire_after=60, now=30.0)
    assert e.value.reason == "full"
    assert reg.admit(keys[2], 2, expire_after=60, now=61.0)
    assert reg.workers() == [keys[0].id, keys[2].id] and reg.key(keys[1].id) is None
    with pytest.raises(Refusal):  # keys[2] was admitted just now; keys[0] is active
        reg.admit(keys[3], 2, expire_after=60, now=62.0)
    reg.close()
    again = Registry(tmp_path)
    assert again.workers() == [keys[0].id, keys[2].id]
    assert again.admit(keys[1], 3, expire_after=60, now=63.0)  # an expired key may come back
    assert again.stored_bytes(0, keys[0].id) == 10 and again.stored_bytes(0, keys[1].id) == 0


# --------------------------------------------------------------------- config


def test_service_config_is_strict() -> None:
    assert ServiceConfig(allowlist=[KEY.public.hex.upper()]).allowlist == [KEY.public.hex]
    for bad in ({"allowlist": ["00" * 31]}, {"port": 70000}, {"admission": "anyone"}, {"max_json_bytes": 1 << 30},
                {"typo": 1}, {"ahead": -1}, {"min_body_rate": 0}, {"header_timeout": 0},
                {"max_connections_per_prefix": 0}, {"replay_per_key": 1}, {"worker_expiry": 0}):
        with pytest.raises(ValidationError):
            ServiceConfig(**bad)
