"""Signed HTTP requests: a participant's key signs every request it makes, and a server checks
each one once.

The signature covers :func:`request_message`: the audience (which service, e.g. a run name, so a
request signed for one run is refused by another), the method, the path with its query, the
sha256 of the body, a timestamp in milliseconds and a random nonce. A server accepts a request
whose timestamp is within ``window`` seconds of its clock and whose ``(key, nonce)`` it has not
seen within the window (:class:`ReplayGuard`), so a captured request cannot be sent again, and
an altered method, path or body fails the signature. The body's sha256 also travels in the
``x-intellect-content-sha256`` header (:data:`CONTENT_HEADER`), so a server can check the signature
before it reads a byte of the body, then check that the body hashes to it as it streams in.

>>> from intellect.trust.keys import SigningKey
>>> key = SigningKey.from_seed(bytes(32))
>>> h = sign_request(key, "POST", "/v1/submit?step=3", b"{}", audience="run-a", now=100.0)
>>> v = RequestVerifier("run-a")
>>> v.verify("POST", "/v1/submit?step=3", b"{}", h, now=101.0).id == key.public.id
True
>>> try:
...     v.verify("POST", "/v1/submit?step=3", b"{}", h, now=101.0)
... except AuthError as e:
...     print(e)
replay: nonce already used
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Literal, Mapping

from intellect.trust.canonical import canonical
from intellect.trust.keys import BadKey, SigningKey, VerifyKey

KEY_HEADER = "x-intellect-key"
TIME_HEADER = "x-intellect-time"
NONCE_HEADER = "x-intellect-nonce"
SIGNATURE_HEADER = "x-intellect-signature"
CONTENT_HEADER = "x-intellect-content-sha256"  # a hint, not proof: the signature covers the sha256 it names
HEADERS = (KEY_HEADER, TIME_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
_DOMAIN = "intellect/request/v1"
_NONCE_HEX = 32

Reason = Literal["unsigned", "malformed", "stale", "bad_signature", "replay", "busy"]


class AuthError(PermissionError):
    """A request that is refused; ``reason`` is one of :data:`Reason`."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason
        self.detail = detail


def request_message(audience: str, method: str, path: str, body_sha256: str, time_ms: int, nonce: str) -> bytes:
    """The bytes a request's signature covers (see the module docstring)."""
    return canonical(_DOMAIN, audience, method.upper(), path, body_sha256, time_ms, nonce)


def sign_request(key: SigningKey, method: str, path: str, body: bytes, *, audience: str,
                 now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The headers that authenticate one request of ``key`` to ``audience``."""
    time_ms = int((time.time() if now is None else now) * 1000)
    nonce = nonce or secrets.token_hex(_NONCE_HEX // 2)
    digest = hashlib.sha256(body).hexdigest()
    msg = request_message(audience, method, path, digest, time_ms, nonce)
    return {KEY_HEADER: key.public.hex, TIME_HEADER: str(time_ms), NONCE_HEADER: nonce,
            SIGNATURE_HEADER: key.sign(msg).hex(), CONTENT_HEADER: digest}


class ReplayGuard:
    """The ``(key, nonce)`` pairs seen in the last ``2 * window`` seconds, at most ``capacity`` of them,
    and at most ``per_key`` of any one key (``None``: no per-key bound).

    A pair is remembered until no timestamp it could carry is fresh any more. When full, new
    requests are refused (``busy``) rather than forgetting pairs early, which would reopen replays;
    the per-key bound keeps one key's flood from filling the guard for every other key.

    >>> g = ReplayGuard(window=10, capacity=4, per_key=2)
    >>> g.admit(b"a", "n1", now=0.0); g.admit(b"a", "n2", now=0.0)
    >>> try:
    ...     g.admit(b"a", "n3", now=0.0)
    ... except AuthError as e:
    ...     print(e.reason)
    busy
    >>> g.admit(b"b", "n1", now=0.0)  # another key still has room
    """

    def __init__(self, window: float, capacity: int = 1 << 20, per_key: int | None = None):
        if capacity < 1 or (per_key is not None and per_key < 1):
            raise ValueError("need capacity >= 1 and per_key >= 1")
        self.window, self.capacity, self.per_key = window, capacity, per_key
        self._per: collections.Counter[bytes] = collections.Counter()
        self._seen: set[tuple[bytes, str]] = set()
        self._order: collections.deque[tuple[float, tuple[bytes, str]]] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, key: bytes, nonce: str, now: float) -> None:
        with self._lock:
            while self._order and self._order[0][0] <= now:
                old = self._order.popleft()[1]
                self._seen.discard(old)
                self._per[old[0]] -= 1
                if self._per[old[0]] <= 0:
                    del self._per[old[0]]
            item = (key, nonce)
            if item in self._seen:
                raise AuthError("replay", "nonce already used")
            if len(self._seen) >= self.capacity:
                raise AuthError("busy", "too many requests in the replay window")
            if self.per_key is not None and self._per[key] >= self.per_key:
                raise AuthError("busy", "too many requests of this key in the replay window")
            self._seen.add(item)
            self._per[key] += 1
            self._order.append((now + 2 * self.window, item))


@dataclass(frozen=True)
class SignedHeaders:
    """The well-formed signature headers of a request; nothing is proved by them yet."""

    key: VerifyKey
    time_ms: int
    nonce: str
    signature: bytes


def parse_headers(headers: Mapping[str, str], window: float, now: float | None = None) -> SignedHeaders:
    """The signature headers of a request, once they are well formed and the timestamp is within
    ``window`` seconds of ``now``; :class:`AuthError` otherwise. Cheap: a server can refuse a
    request from its headers before it reads the body."""
    now = time.time() if now is None else now
    missing = [h for h in HEADERS if headers.get(h) is None]
    if missing:
        raise AuthError("unsigned", "missing " + ", ".join(missing))
    got = {h: headers[h] for h in HEADERS}
    try:
        key = VerifyKey.from_hex(got[KEY_HEADER])
        time_ms = int(got[TIME_HEADER]) if len(got[TIME_HEADER]) <= 16 else None
        nonce, sig_hex = got[NONCE_HEADER], got[SIGNATURE_HEADER]
        if time_ms is None or len(nonce) != _NONCE_HEX or len(sig_hex) != 128:
            raise ValueError("bad field length")
        int(nonce, 16)
        signature = bytes.fromhex(sig_hex)
    except (BadKey, ValueError) as e:
        raise AuthError("malformed", str(e)) from None
    if abs(time_ms / 1000 - now) > window:
        raise AuthError("stale", f"timestamp {time_ms / 1000:.0f} is {time_ms / 1000 - now:+.0f} s off")
    return SignedHeaders(key, time_ms, nonce, signature)


class RequestVerifier:
    """Checks the signed requests of one ``audience`` (see the module docstring)."""

    def __init__(self, audience: str, window: float = 30.0, guard: ReplayGuard | None = None):
        self.audience, self.window = audience, window
        self.guard = guard if guard is not None else ReplayGuard(window)  # an empty guard is falsy

    def verify(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str],
               now: float | None = None, *, body_sha256: str | None = None) -> VerifyKey:
        """The key that signed this request; :class:`AuthError` when it is unsigned, malformed,
        stale, mis-signed or a replay. Header names are looked up in lower case. A body that was
        hashed as it streamed in is given by its hex ``body_sha256`` instead of its bytes."""
        now = time.time() if now is None else now
        h = parse_headers(headers, self.window, now)
        if body_sha256 is None:
            if body is None:
                raise ValueError("give the body or its sha256")
            body_sha256 = hashlib.sha256(body).hexdigest()
        msg = request_message(self.audience, method, path, body_sha256, h.time_ms, h.nonce)
        if not h.key.verify(h.signature, msg):
            raise AuthError("bad_signature", "signature does not match the request")
        self.guard.admit(h.key.raw, h.nonce, now)  # only signed requests can fill the guard
        return h.key
