"""The submission service's HTTP transport: bodies read under caps and deadlines, and JSON answers.

:class:`~intellect.rl.service.SubmissionService` answers routes; what is here keeps a slow or
flooding client from holding memory, disk or connections for long. Bodies are capped while they
stream in, hashed as they arrive and kept in memory only up to :data:`SPILL` bytes
(:class:`Body`), so an upload costs no more memory than that, whatever its size. A body slower
than ``min_body_rate`` after ``body_grace`` seconds is refused (``too_slow``) and its connection
closed (:func:`read_body`); connections and request heads are bounded by
:mod:`intellect.http_server`, under the service's limits. A handler's answer, or its
:class:`~intellect.rl.admission.Refusal`, becomes a JSON response (:func:`respond`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

from intellect.rl.admission import Refusal
from intellect.trust.requests import CONTENT_HEADER

if TYPE_CHECKING:
    from intellect.storage import RunStorage

__all__ = ["SPILL", "Body", "read_body", "respond"]

log = logging.getLogger("intellect.rl.service.http")

SPILL = 1 << 20  # bodies past this go to a spool file: memory per upload stays bounded


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


async def respond(scope, receive, send, handle: Callable[..., Awaitable[tuple[int, dict]]],
                  refused: Callable[[dict, Refusal], None]) -> None:
    """Answer an ASGI HTTP request with the JSON of ``await handle(scope, receive)`` (status, document);
    a :class:`~intellect.rl.admission.Refusal` is passed to ``refused(scope, refusal)`` and answered with
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
                    rate: int) -> Body:
    """The body, capped at ``cap`` bytes, arriving at ``rate`` bytes/s after ``grace`` seconds, and
    hashing to ``digest``; :class:`~intellect.rl.admission.Refusal` otherwise (the connection is closed)."""
    declared = headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit() and int(declared) <= cap):
        raise Refusal(413, "too_large", f"body of {declared[:20]} bytes declared, at most {cap}")
    body, start = Body(spool), time.monotonic()
    try:
        more = True
        while more:
            left = start + grace + body.size / rate - time.monotonic()
            try:
                msg = await asyncio.wait_for(receive(), max(left, 1e-3))
            except TimeoutError:
                raise Refusal(408, "too_slow", f"{body.size} bytes in {time.monotonic() - start:.1f} s: a body "
                              f"must arrive at {rate} bytes/s after {grace:g} s") from None
            if msg["type"] == "http.disconnect":
                raise Refusal(400, "bad_request", "the client went away mid-body")
            chunk = msg.get("body", b"")
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
    return body
