"""The salt of a key: drawn at admission, kept for the run (across reloads and expiry), the input of
its assignments and seeds; and the registration's proof of work."""

from __future__ import annotations

import doctest
import json

import pytest

from intellect.rl.wire import work
from intellect.rl.wire.assignment import NO_SALT, assign_prompts, assignment_seed
from intellect.rl.service.registry import Registry, read_salts
from intellect.rl.worker.submission import sample_seed
from intellect.trust.keys import SigningKey

KEY, OTHER = SigningKey.from_seed(b"k" * 32).public, SigningKey.from_seed(b"o" * 32).public


def test_doctests():
    assert doctest.testmod(work).failed == 0


def test_the_salt_changes_assignments_and_seeds_and_must_be_32_bytes():
    a, b = bytes(32), bytes(31) + b"\1"
    assert assign_prompts(1000, "w", 1, 0, 8, a) != assign_prompts(1000, "w", 1, 0, 8, b)
    assert assign_prompts(1000, "w", 1, 0, 8, NO_SALT) == assign_prompts(1000, "w", 1, 0, 8)
    assert sample_seed("w", 1, 0, 0, 0, a) != sample_seed("w", 1, 0, 0, 0, b) != sample_seed("w", 1, 0, 0, 0)
    for bad in (b"\0" * 16, "00" * 32, None):
        with pytest.raises(ValueError):
            assignment_seed("w", 1, 0, bad)  # type: ignore[arg-type]


def test_a_key_keeps_its_first_salt_across_reloads_and_expiry(tmp_path):
    reg = Registry(tmp_path)
    assert reg.admit(KEY, now=0.0) and reg.admit(OTHER, now=1.0)
    salt = reg.salt(KEY.id)
    assert salt is not None and len(salt) == 32 and salt != reg.salt(OTHER.id)
    assert not reg.admit(KEY) and reg.salt(KEY.id) == salt  # registering again draws nothing
    # registry full: KEY, idle past its expiry, gives its place up, then comes back with the same salt
    third = SigningKey.from_seed(b"t" * 32).public
    assert reg.admit(third, max_workers=2, expire_after=10.0, now=100.0)
    assert reg.salt(KEY.id) is None and reg.salts()[KEY.id] == salt
    assert reg.admit(KEY, now=101.0) and reg.salt(KEY.id) == salt
    reg.close()
    again = Registry(tmp_path)
    assert again.salt(KEY.id) == salt and again.salts() == read_salts(tmp_path)
    again.close()


def test_a_registry_line_with_a_changed_salt_is_refused(tmp_path):
    reg = Registry(tmp_path)
    reg.admit(KEY)
    reg.close()
    first = json.loads(reg.path.read_text().splitlines()[0])
    reg.path.write_text(reg.path.read_text() + json.dumps({**first, "salt": "11" * 32}) + "\n")
    with pytest.raises(RuntimeError, match="salt"):
        Registry(tmp_path)


def test_the_proof_of_work_binds_run_key_and_difficulty():
    nonce = work.solve("run", KEY.raw, 12)
    assert work.check("run", KEY.raw, nonce, 12)
    # (deterministic: the keys and so the nonce are fixed)
    assert not work.check("run", OTHER.raw, nonce, 12) and not work.check("other", KEY.raw, nonce, 12)
    assert all(work.check("run", KEY.raw, n, 0) for n in (0, 1, 2**63))
    assert not work.check("run", KEY.raw, -1, 0) and not work.check("run", KEY.raw, 2**64, 0)
    with pytest.raises(ValueError):
        work.solve("run", KEY.raw, work.MAX_BITS + 1)


def test_a_given_salt_is_used_once_and_a_key_keeps_its_first(tmp_path):
    reg = Registry(tmp_path)
    assert reg.admit(KEY, salt=b"\1" * 32) and reg.salt(KEY.id) == b"\1" * 32
    assert not reg.admit(KEY, salt=b"\2" * 32) and reg.salt(KEY.id) == b"\1" * 32
    with pytest.raises(ValueError):
        reg.admit(OTHER, salt=b"\3" * 8)
    assert reg.key(OTHER.id) is None
    reg.close()
