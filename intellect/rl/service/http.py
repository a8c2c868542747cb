"""The submission service's HTTP transport: bodies read under caps and deadlines, and JSON answers.

:class:`~intellect.rl.service.server.SubmissionService` answers routes; what is here keeps a slow or
flooding client from holding memory, disk or connections for long. Bodies are capped while they
stream in, hashed as they arrive and kept in memory only up to :data:`SPILL` bytes
(:class:`Body`), so an upload costs no more memory than that, whatever its size. A body must
begin within ``body_grace`` seconds and, from its first byte, keep up with ``min_body_rate``
(:data:`RATE_SLACK` behind at most): one that falls behind is refused (``too_slow``) and its
connection closed at once (:func:`read_body`), so a declared size of n bytes holds a slot at most
``body_grace + RATE_SLACK + n / min_body_rate`` seconds and a trickle ends as soon as it lags; connections and request heads are bounded by
:mod:`intellect.http_server`, under the service's limits. Upload slots are shared fairly among
address prefixes, some kept for keys with accepted samples (:class:`UploadSlots`): an upload
displaced by a prefix asking for its share ends ``busy``. A handler's answer, or its
:class:`~intellect.rl.service.admission.Refusal`, becomes a JSON response (:func:`respond`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

from intellect.http_server import FairShare
from intellect.rl.service.admission import Refusal
from intellect.trust.requests import CONTENT_HEADER

if TYPE_CHECKING:
    from intellect.storage import RunStorage

__all__ = ["SPILL", "Body", "Slot", "UploadSlots", "read_body", "respond"]

log = logging.getLogger("intellect.rl.service.http")

SPILL = 1 << 20  # bodies past this go to a spool file: memory per upload stays bounded
RATE_SLACK = 1.0  # seconds a body may lag its rate: a stalled window or a retransmission, not a trickle


class Body:
    """A request body as it streams in: hashed, in memory up to :data:`SPILL` bytes, then on disk."""

    def __init__(self, spool: Path):
        self.spool, self.sha, self.size = spool, hashlib.sha256(), 0
        self.buf, self.file, self.path = bytearray(), None, None

    def add(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        self.size += len(chunk)
        if self.file is None and len(self.buf) + len(chunk) > SPILL:
            fd, self.path = tempfile.mkstemp(prefix="body-", dir=self.spool)
            self.file = os.fdopen(fd, "wb")
            self.file.write(self.buf)
            self.buf = bytearray()
        if self.file is not None:
            self.file.write(chunk)
        else:
            self.buf += chunk

    def store(self, storage: RunStorage, rel: str) -> None:
        if self.file is None or self.path is None:
            storage.write_bytes(rel, bytes(self.buf))
        else:
            self.file.flush()
            storage.put_file(self.path, rel)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.path is not None:
            os.unlink(self.path)
            self.file = None


class Slot:
    """An upload being read: its key, address prefix and declared size; :attr:`evicted` is set when a
    fairer claim displaced it (its read then ends ``busy``)."""

    def __init__(self, key: str, prefix: str, size: int):
        self.key, self.prefix, self.size = key, prefix, size
        self.evicted = asyncio.Event()


class UploadSlots:
    """The uploads read at once (event-loop thread only): one per key, at most ``per_prefix`` per
    address prefix, ``spool_bytes`` declared in all, and ``capacity`` slots shared max-min fairly
    among prefixes (:class:`~intellect.http_server.FairShare`), ``reserve`` of them for trusted keys.
    A prefix over its share loses its newest upload to a prefix asking for its own."""

    def __init__(self, capacity: int, reserve: int, per_prefix: int, spool_bytes: int):
        self.share: FairShare[Slot] = FairShare(capacity, reserve)
        self.per_prefix, self.spool_bytes = per_prefix, spool_bytes
        self._by_key: dict[str, Slot] = {}
        self.spooled = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def take(self, key: str, prefix: str, size: int, trusted: bool) -> Slot:
        """A slot for ``key``'s upload of ``size`` bytes, or :class:`Refusal` ``busy``."""
        if key in self._by_key:
            raise Refusal(503, "busy", "another upload of this key is being read; retry")
        if self.spooled and self.spooled + size > self.spool_bytes:  # alone, a body may take all of it
            raise Refusal(503, "busy", "too many bytes being uploaded at once; retry")
        if self.share.held[prefix] >= self.per_prefix:
            raise Refusal(503, "busy", f"{self.per_prefix} uploads from this address prefix are being read; retry")
        ok, heavy = self.share.claim(prefix, trusted)
        if not ok:
            raise Refusal(503, "busy", f"all {self.share.capacity} upload slots are taken"
                          f"{'' if trusted else f' ({self.share.reserve} kept for keys with accepted samples)'}, "
                          "none by an address prefix holding more than this one's; retry")
        if heavy is not None:
            self._evict(self.share.displaceable(heavy, trusted)[-1])
        slot = Slot(key, prefix, size)
        self.share.add(slot, prefix, trusted)
        self._by_key[key] = slot
        self.spooled += size
        return slot

    def give_back(self, slot: Slot) -> None:
        """End ``slot`` (nothing when it was evicted already)."""
        if self._by_key.get(slot.key) is slot:
            del self._by_key[slot.key]
            self.spooled -= slot.size
            self.share.remove(slot)

    def _evict(self, slot: Slot) -> None:
        self.give_back(slot)
        slot.evicted.set()


async def respond(scope, receive, send, handle: Callable[..., Awaitable[tuple[int, dict]]],
                  refused: Callable[[dict, Refusal], None]) -> None:
    """Answer an ASGI HTTP request with the JSON of ``await handle(scope, receive)`` (status, document);
    a :class:`~intellect.rl.service.admission.Refusal` is passed to ``refused(scope, refusal)`` and answered with
    its status, reason and detail, and any other error is a 500 that names only its type."""
    if scope["type"] != "http":
        return
    try:
        status, doc = await handle(scope, receive)
        body = json.dumps(doc).encode()
    except Refusal as r:
        refused(scope, r)
        status, body = r.status, json.dumps({"reason": r.reason, "detail": r.detail}).encode()
    except Exception as e:  # noqa: BLE001 - a request must never take the service down
        log.exception("submission service: %s %s failed", scope.get("method"), scope.get("path"))
        status, body = 500, json.dumps({"reason": "internal", "detail": type(e).__name__}).encode()
    await _send(send, status, body)


async def _send(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status >= 400:  # a refused body may still be arriving: end the connection, do not read it to its end
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive, headers: Mapping[str, str], *, cap: int, digest: str, spool: Path, grace: float,
                    rate: int, cancel: asyncio.Event | None = None) -> Body:
    """The body, capped at ``cap`` bytes, begun within ``grace`` seconds and arriving at ``rate``
    bytes/s from its first byte, and hashing to ``digest``; :class:`~intellect.rl.service.admission.Refusal`
    otherwise (the connection is closed), ``busy`` once ``cancel`` is set (its upload slot went to a
    fairer claim)."""
    declared = headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit() and int(declared) <= cap):
        raise Refusal(413, "too_large", f"body of {declared[:20]} bytes declared, at most {cap}")
    body, start, first = Body(spool), time.monotonic(), None
    stop = asyncio.ensure_future((cancel or asyncio.Event()).wait())
    try:
        more = True
        while more:
            due = start + grace if first is None else first + min(grace, RATE_SLACK) + body.size / rate
            left = due - time.monotonic()
            got = asyncio.ensure_future(receive())
            await asyncio.wait((got, stop), timeout=max(left, 1e-3), return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await got
                if stop.done():
                    raise Refusal(503, "busy", f"upload displaced after {body.size} bytes: its address prefix held "
                                  "more upload slots than its share while another asked for its own; retry")
                raise Refusal(408, "too_slow", f"{body.size} bytes in {time.monotonic() - start:.1f} s: a body "
                              f"must begin within {grace:g} s and arrive at {rate} bytes/s from its first byte")
            msg = got.result()
            if msg["type"] == "http.disconnect":
                raise Refusal(400, "bad_request", "the client went away mid-body")
            chunk = msg.get("body", b"")
            if chunk and first is None:
                first = time.monotonic()
            more = msg.get("more_body", False)
            if body.size + len(chunk) > cap:
                raise Refusal(413, "too_large", f"body over {cap} bytes")
            body.add(chunk)
        if body.sha.hexdigest() != digest:
            raise Refusal(400, "sha256_mismatch", f"the body's sha256 is {body.sha.hexdigest()}, "
                          f"the signed {CONTENT_HEADER} {digest}")
    except BaseException:
        body.close()
        raise
    finally:
        stop.cancel()
    return body
