"""The submission service's HTTP transport: uvicorn with bounded connections, bodies read under
caps and deadlines, and JSON answers.

:class:`~intellect.rl.service.SubmissionService` answers routes; what is here keeps a slow or
flooding client from holding memory, disk or connections for long. Bodies are capped while they
stream in, hashed as they arrive and kept in memory only up to :data:`SPILL` bytes
(:class:`Body`), so an upload costs no more memory than that, whatever its size. A body slower
than ``min_body_rate`` after ``body_grace`` seconds is refused (``too_slow``) and its connection
closed (:func:`read_body`); a request head must arrive within ``header_timeout``; an address (an
IPv6 one by its /64, as everywhere here) holds at most ``max_connections_per_address`` connections
(:func:`guarded_protocol`, served by :func:`guarded_server`). A handler's answer, or its
:class:`~intellect.rl.admission.Refusal`, becomes a JSON response (:func:`respond`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from intellect.rl.admission import Refusal, address_bucket
from intellect.trust.requests import CONTENT_HEADER

if TYPE_CHECKING:
    from intellect.storage import RunStorage

__all__ = ["SPILL", "Body", "guarded_protocol", "guarded_server", "read_body", "respond"]

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


def guarded_protocol(per_address: int, header_timeout: float, open_: collections.Counter,
                     refuse: Callable[[str, str, str], None]) -> type[H11Protocol]:
    """uvicorn's h11 protocol with at most ``per_address`` connections per address bucket (counted
    in ``open_``) and ``header_timeout`` seconds for each request head; ``refuse(client, reason,
    detail)`` records a connection it ends. A body is timed by the app, which knows its length."""

    class Guarded(H11Protocol):
        _bucket: str | None = None
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            client = (self.client or ("unknown",))[0]
            bucket = address_bucket(client)
            if open_[bucket] >= per_address:
                refuse(client, "busy", f"{per_address} connections from this address are open")
                transport.close()
                return
            open_[bucket] += 1
            self._bucket = bucket
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._bucket is not None:
                open_[self._bucket] -= 1
                if open_[self._bucket] <= 0:
                    del open_[self._bucket]
                self._bucket = None
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request head has its own deadline

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(header_timeout, self._late)

        def _late(self) -> None:
            self._timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                if self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]:  # a head began
                    refuse((self.client or ("unknown",))[0], "too_slow",
                           f"no complete request head within {header_timeout:g} s")
                self.transport.close()

    return Guarded


def guarded_server(app, *, max_connections: int, per_address: int, header_timeout: float,
                   open_: collections.Counter, refuse: Callable[[str, str, str], None]) -> uvicorn.Server:
    """A uvicorn server of ``app`` over :func:`guarded_protocol` (``per_address``, ``header_timeout``,
    ``open_`` and ``refuse`` are its), with at most ``max_connections`` open connections (more get 503)."""
    # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from any local client as the
    # client's address, and a flood from 127.0.0.1 could name a fresh address per registration
    protocol = guarded_protocol(per_address, header_timeout, open_, refuse)
    config = uvicorn.Config(app, interface="asgi3", http=protocol, loop="asyncio", lifespan="off",
                            log_level="warning", access_log=False, proxy_headers=False,
                            timeout_keep_alive=min(5, int(header_timeout) or 1),
                            limit_concurrency=max_connections, h11_max_incomplete_event_size=32 << 10)
    return uvicorn.Server(config)
