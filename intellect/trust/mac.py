"""HMAC-SHA256 tags over canonical messages, and keys derived per purpose from one shared secret.

A run's secret never keys a MAC directly: :func:`derive_key` gives each purpose (a step's
all-reduce, a verdict file) its own key, so a tag made for one purpose or step never verifies
for another.

>>> k = derive_key(b"a run secret of 32 bytes or so..", "allreduce", 7)
>>> t = tag(k, "intellect/demo/v1", b"payload")
>>> check(k, t, "intellect/demo/v1", b"payload"), check(k, t, "intellect/demo/v1", b"payloaf")
(True, False)
>>> check(derive_key(b"a run secret of 32 bytes or so..", "allreduce", 8), t, "intellect/demo/v1", b"payload")
False
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from intellect.trust.canonical import Field, canonical

TAG_BYTES = 32
SECRET_BYTES = 32


def new_secret() -> bytes:
    """A fresh random secret of :data:`SECRET_BYTES` bytes."""
    return secrets.token_bytes(SECRET_BYTES)


def derive_key(secret: bytes, purpose: str, *context: Field) -> bytes:
    """The key for ``purpose`` under ``context`` (e.g. a step number), derived from ``secret``."""
    if len(secret) < 16:
        raise ValueError("a shared secret needs at least 16 bytes")
    return hmac.new(secret, canonical("intellect/derive/v1", purpose, *context), hashlib.sha256).digest()


def tag(key: bytes, domain: str, *fields: Field) -> bytes:
    """The HMAC-SHA256 of the canonical message ``(domain, *fields)`` under ``key``."""
    return hmac.new(key, canonical(domain, *fields), hashlib.sha256).digest()


def check(key: bytes, got: bytes, domain: str, *fields: Field) -> bool:
    """Whether ``got`` is :func:`tag` of the message, compared in constant time."""
    return isinstance(got, bytes) and hmac.compare_digest(got, tag(key, domain, *fields))
