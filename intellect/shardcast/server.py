"""The HTTP face of an origin or relay: a Starlette app over a :class:`VersionStore`, served by uvicorn.

Routes (all GET; anything else is 404/405, and a path can only name a version and a shard by
integer, so no request reaches a file outside the store)::

    /health                       {"ok": true}
    /versions                     {"versions": [{"version": 3, "complete": true, "shards": 4}, ...]}
    /v/{version}/manifest         the manifest as this server holds it (only shards it can send);
                                  with ?after=K&wait=S, answered once it lists more than K shards or
                                  is complete, or after S seconds (at most 10): relays and clients
                                  learn of a new shard at once, with one request per change
    /v/{version}/shard/{index}    the shard's bytes, streamed from disk in 1 MiB reads

One asyncio loop serves every connection (keep-alive; a held manifest request is a sleeping
coroutine, not a thread). Shard reads run on worker threads, the next read overlapping the send
of the current piece, so a cold read never stalls the other requests and at most two pieces of
a shard are in memory at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from intellect.shardcast.store import MANIFEST, VersionStore

log = logging.getLogger("intellect.shardcast.server")

_WAIT_MAX = 10.0
# How often a held manifest request looks at the file: the origin's writer is another process, so
# a stat is how news is seen; a stat of an unchanged manifest costs microseconds (the parse is cached).
_WAIT_STEP = 0.01
# Each read is a hop to a worker thread and each send a trip through the event loop, yet bigger
# pieces cost more: what the socket does not take at once is copied into the transport's buffer, and
# each piece is fresh memory. Measured serving 256 MiB to curl: 0.5-2 MiB cheapest, 4 MiB +30% CPU.
_READ = 1 << 20


class _ShardResponse(Response):
    """A shard file's bytes with its Content-Length, read ahead by one piece on a worker thread."""

    media_type = "application/octet-stream"

    def __init__(self, fd: int, size: int):
        super().__init__(media_type=self.media_type, headers={"content-length": str(size)})
        self.fd, self.size = fd, size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        pending = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            off = 0
            pending = loop.run_in_executor(None, os.pread, self.fd, min(_READ, self.size), 0) if self.size else None
            while pending is not None:
                piece = await pending
                if not piece:  # the file shrank under us: the client sees a short body and retries
                    raise OSError(f"shard file ended at {off} of {self.size} bytes")
                off += len(piece)
                more = off < self.size
                pending = loop.run_in_executor(None, os.pread, self.fd, min(_READ, self.size - off), off) \
                    if more else None
                await send({"type": "http.response.body", "body": piece, "more_body": more})
        finally:
            if pending is not None:  # the client went away mid-shard: let the read finish before closing
                await asyncio.wait([pending])
            os.close(self.fd)


def _listing(store: VersionStore) -> list[dict]:
    out = []
    for v in store.versions():
        try:
            m = store.manifest(v)
        except ValueError as e:  # a manifest this server cannot read is not served as a version
            log.warning("version %d: unreadable manifest (%s)", v, str(e).splitlines()[0])
            continue
        if m is not None:  # deleted between listing and reading
            out.append({"version": v, "complete": m.complete, "shards": len(m.shards)})
    return out


async def _await_change(store: VersionStore, version: int, after: int, wait: float) -> None:
    """Return once ``version``'s manifest is gone, complete, lists more than ``after`` shards, or
    ``wait`` seconds passed."""
    until = time.monotonic() + wait
    while True:
        try:
            m = store.manifest(version)
        except ValueError:  # being replaced, or unreadable: the caller reads it and decides
            return
        left = until - time.monotonic()
        if m is None or m.complete or len(m.shards) > after or left <= 0:
            return
        await asyncio.sleep(min(_WAIT_STEP, left))


def _long_poll(query) -> tuple[int, float] | None:
    """``(after, wait)`` of a manifest request's query; None without one; ValueError when malformed."""
    if not query:
        return None
    if set(query) != {"after", "wait"} or len(query.getlist("after")) != 1 or len(query.getlist("wait")) != 1:
        raise ValueError("after and wait, once each")
    after, wait = int(query["after"]), float(query["wait"])
    if after < 0 or not (math.isfinite(wait) and 0 <= wait <= _WAIT_MAX):
        raise ValueError(f"after={after}, wait={wait}")
    return after, wait


def create_app(store: VersionStore) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def versions(request: Request) -> Response:
        return JSONResponse({"versions": _listing(store)})

    async def manifest(request: Request) -> Response:
        version = request.path_params["version"]
        try:
            poll = _long_poll(request.query_params)
        except ValueError:
            return JSONResponse({"error": f"query must be after=<shards>&wait=<0..{_WAIT_MAX:g} seconds>"},
                                status_code=400)
        try:
            if poll is not None:
                await _await_change(store, version, *poll)
            body = (store.version_dir(version) / MANIFEST).read_bytes()
        except (ValueError, FileNotFoundError):
            return JSONResponse({"error": "no such version"}, status_code=404)
        return Response(body, media_type="application/json")

    async def shard(request: Request) -> Response:
        try:
            path = store.shard_path(request.path_params["version"], request.path_params["index"])
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=404)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return JSONResponse({"error": "shard not held"}, status_code=404)
        try:
            size = os.fstat(fd).st_size  # a shard file is final once it has its name
        except BaseException:
            os.close(fd)
            raise
        return _ShardResponse(fd, size)

    return Starlette(routes=[
        Route("/health", health),
        Route("/versions", versions),
        Route("/v/{version:int}/manifest", manifest),
        Route("/v/{version:int}/shard/{index:int}", shard),
    ])


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), bound before uvicorn starts so the port is known."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def write_port_file(path: str | os.PathLike, host: str, port: int) -> None:
    p = Path(path)
    tmp = p.with_name(f".tmp-{p.name}")
    tmp.write_text(f"http://{host}:{port}\n")
    os.replace(tmp, p)


class Server:
    """uvicorn serving ``store`` on ``sock``, in this thread (:meth:`run`) or a daemon thread (:meth:`start`)."""

    def __init__(self, store: VersionStore, sock: socket.socket, idle_timeout: float = 30.0):
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        # h11 and the stdlib loop, named: uvicorn's "auto" would pick httptools/uvloop wherever they
        # happen to be installed, and a server must behave the same on every install.
        config = uvicorn.Config(create_app(store), http="h11", loop="asyncio", log_level="warning",
                                access_log=False, timeout_keep_alive=idle_timeout, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        self._server.run(sockets=[self.sock])

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.run, daemon=True, name=f"shardcast-{self.url}")
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()
