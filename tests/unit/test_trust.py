"""The crypto home (intellect.trust): canonical bytes, keys and key files, signed requests, MACs."""

from __future__ import annotations

import doctest
import hashlib
import os
import stat

import pytest

import intellect.trust.canonical as canonical_mod
import intellect.trust.keys as keys_mod
import intellect.trust.mac as mac_mod
import intellect.trust.requests as requests_mod
from intellect.trust.canonical import canonical
from intellect.trust.keys import BadKey, SigningKey, VerifyKey, is_key_id, key_id
from intellect.trust.mac import check, derive_key, new_secret, tag
from intellect.trust.requests import (
    CONTENT_HEADER, KEY_HEADER, NONCE_HEADER, SIGNATURE_HEADER, TIME_HEADER, AuthError, ReplayGuard, RequestVerifier,
    sign_request,
)


@pytest.mark.parametrize("mod", [canonical_mod, keys_mod, mac_mod, requests_mod])
def test_docstring_examples(mod):
    assert doctest.testmod(mod).failed == 0


def test_canonical_fields_cannot_run_together():
    assert canonical("d", "ab", "c") != canonical("d", "a", "bc")
    assert canonical("d", b"1") != canonical("d", "1") != canonical("d", 1)
    assert canonical("d", True) != canonical("d", 1)
    assert canonical("d1", "x") != canonical("d2", "x")
    with pytest.raises(ValueError):
        canonical("a\0b")
    with pytest.raises(ValueError):
        canonical("d", 1 << 63)
    with pytest.raises(TypeError):
        canonical("d", 1.5)  # type: ignore[arg-type]


def test_key_ids_derive_from_keys():
    a, b = SigningKey.generate(), SigningKey.generate()
    assert a.public.id != b.public.id and is_key_id(a.public.id) and is_key_id(b.public.id)
    assert a.public.id == key_id(a.public.raw) == VerifyKey.from_hex(a.public.hex).id
    assert not is_key_id("worker-a") and not is_key_id("k" + "0" * 19) and not is_key_id("K" + "0" * 20)
    with pytest.raises(BadKey):
        key_id(b"short")


@pytest.mark.parametrize("text", ["", "zz" * 32, "00" * 31, "00" * 33, None, 5])
def test_malformed_public_keys_are_refused(text):
    with pytest.raises(BadKey):
        VerifyKey.from_hex(text)  # type: ignore[arg-type]


def test_verify_never_raises_on_hostile_signatures():
    key = SigningKey.generate()
    sig = key.sign(b"m")
    for bad in [b"", sig[:-1], sig + b"\0", bytes(64), "str", None]:
        assert key.public.verify(bad, b"m") is False  # type: ignore[arg-type]
    assert SigningKey.generate().public.verify(sig, b"m") is False


def test_key_file_roundtrip_mode_and_refusals(tmp_path):
    key = SigningKey.generate()
    path = key.save(tmp_path / "k" / "worker.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SigningKey.load(path).public == key.public
    with pytest.raises(FileExistsError):
        SigningKey.generate().save(path)  # never overwritten by accident
    assert SigningKey.load(path).public == key.public
    os.chmod(path, 0o644)
    with pytest.raises(BadKey, match="accessible by others"):
        SigningKey.load(path)
    bad = tmp_path / "bad.key"
    for body in ["{", '{"kind": "other"}', '{"kind": "intellect-ed25519-v1", "private": "00"}', "x" * 5000,
                 '{"kind": "intellect-ed25519-v1", "private": "%s", "public": "%s"}'
                 % (bytes(32).hex(), SigningKey.generate().public.hex)]:
        bad.write_text(body)
        os.chmod(bad, 0o600)
        with pytest.raises(BadKey):
            SigningKey.load(bad)


def _signed(key, **kw):
    args = dict(method="PUT", path="/v1/submissions/3/0", body=b"parquet bytes", audience="run-a", now=1000.0)
    args.update(kw)
    return sign_request(key, args["method"], args["path"], args["body"], audience=args["audience"], now=args["now"])


def test_a_signed_request_verifies_once():
    key = SigningKey.generate()
    v = RequestVerifier("run-a", window=30)
    h = _signed(key)
    assert v.verify("PUT", "/v1/submissions/3/0", b"parquet bytes", h, now=1001.0) == key.public
    with pytest.raises(AuthError) as e:
        v.verify("PUT", "/v1/submissions/3/0", b"parquet bytes", h, now=1002.0)
    assert e.value.reason == "replay"


@pytest.mark.parametrize("change,reason", [
    (dict(method="POST"), "bad_signature"),
    (dict(path="/v1/submissions/3/1"), "bad_signature"),
    (dict(body=b"other bytes"), "bad_signature"),
    (dict(audience="run-b"), "bad_signature"),
    (dict(now=1100.0), "stale"),
    (dict(now=900.0), "stale"),
])
def test_tampered_requests_are_refused(change, reason):
    key = SigningKey.generate()
    h = _signed(key)
    req = dict(method="PUT", path="/v1/submissions/3/0", body=b"parquet bytes", now=1000.0)
    verifier_audience = "run-a"
    if "audience" in change:
        verifier_audience = change.pop("audience")
    req.update(change)
    with pytest.raises(AuthError) as e:
        RequestVerifier(verifier_audience).verify(req["method"], req["path"], req["body"], h, now=req["now"])
    assert e.value.reason == reason


def test_another_key_cannot_claim_a_signature():
    a, b = SigningKey.generate(), SigningKey.generate()
    h = _signed(a)
    h[KEY_HEADER] = b.public.hex  # b claims a's request as its own
    with pytest.raises(AuthError) as e:
        RequestVerifier("run-a").verify("PUT", "/v1/submissions/3/0", b"parquet bytes", h, now=1000.0)
    assert e.value.reason == "bad_signature"


@pytest.mark.parametrize("header,value,reason", [
    (KEY_HEADER, None, "unsigned"), (SIGNATURE_HEADER, None, "unsigned"),
    (KEY_HEADER, "zz", "malformed"), (TIME_HEADER, "soon", "malformed"), (TIME_HEADER, "9" * 40, "malformed"),
    (NONCE_HEADER, "x" * 32, "malformed"), (NONCE_HEADER, "00", "malformed"),
    (SIGNATURE_HEADER, "00" * 63, "malformed"), (SIGNATURE_HEADER, "00" * 64, "bad_signature"),
])
def test_malformed_headers_are_refused(header, value, reason):
    h = _signed(SigningKey.generate())
    if value is None:
        del h[header]
    else:
        h[header] = value
    with pytest.raises(AuthError) as e:
        RequestVerifier("run-a").verify("PUT", "/v1/submissions/3/0", b"parquet bytes", h, now=1000.0)
    assert e.value.reason == reason


def test_replay_guard_forgets_only_after_the_window_and_is_bounded():
    g = ReplayGuard(window=10, capacity=3)
    g.admit(b"k", "n1", now=0.0)
    with pytest.raises(AuthError):
        g.admit(b"k", "n1", now=19.0)  # a timestamp of 0 + 10 could still be fresh at 19
    g.admit(b"k", "n1", now=20.5)  # forgotten: no timestamp it carried is fresh any more
    g.admit(b"k2", "n1", now=20.5)  # another key's nonce is its own
    g.admit(b"k", "n2", now=20.5)
    with pytest.raises(AuthError) as e:
        g.admit(b"k", "n3", now=20.5)
    assert e.value.reason == "busy" and len(g) == 3


def test_replay_guard_bounds_each_key_so_one_key_cannot_fill_it_for_all():
    g = ReplayGuard(window=10, capacity=8, per_key=3)
    for i in range(3):
        g.admit(b"flood", f"n{i}", now=0.0)
    with pytest.raises(AuthError) as e:
        g.admit(b"flood", "n3", now=0.0)
    assert e.value.reason == "busy" and len(g) == 3  # the refused nonce is not remembered
    for i in range(5):  # every other key still has the rest of the guard
        g.admit(b"honest-%d" % i, "n0", now=1.0)
    with pytest.raises(AuthError) as e:
        g.admit(b"late", "n0", now=1.0)
    assert e.value.reason == "busy"  # the global bound still holds
    g.admit(b"flood", "n3", now=20.5)  # its pairs expired: the key's quota is back
    with pytest.raises(ValueError):
        ReplayGuard(window=10, per_key=0)
    given = ReplayGuard(window=10, per_key=1)
    v = RequestVerifier("run-a", guard=given)  # the guard given is the one used, even while empty
    v.verify("GET", "/x", b"", sign_request(SigningKey.from_seed(bytes(32)), "GET", "/x", b"", audience="run-a"))
    assert len(given) == 1


def test_signed_headers_name_the_body_digest_the_signature_covers():
    h = sign_request(SigningKey.from_seed(bytes(32)), "PUT", "/x", b"body", audience="a", now=5.0)
    assert h[CONTENT_HEADER] == hashlib.sha256(b"body").hexdigest()


def test_macs_are_bound_to_key_purpose_and_context():
    s = new_secret()
    k7 = derive_key(s, "allreduce", 7)
    t = tag(k7, "intellect/test/v1", b"payload", 3)
    assert check(k7, t, "intellect/test/v1", b"payload", 3)
    assert not check(k7, t, "intellect/test/v1", b"payload", 4)
    assert not check(derive_key(s, "allreduce", 8), t, "intellect/test/v1", b"payload", 3)
    assert not check(derive_key(s, "verdicts", 7), t, "intellect/test/v1", b"payload", 3)
    assert not check(derive_key(new_secret(), "allreduce", 7), t, "intellect/test/v1", b"payload", 3)
    assert not check(k7, t[:-1], "intellect/test/v1", b"payload", 3)
    assert not check(k7, "nope", "intellect/test/v1", b"payload", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        derive_key(b"short", "x")
