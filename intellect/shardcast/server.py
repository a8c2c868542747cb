"""The HTTP face of an origin or relay: a Starlette app over a :class:`VersionStore`, served by uvicorn.

Routes (all GET; anything else is 404/405, and a path can only name a version and a shard by
integer, so no request reaches a file outside the store)::

    /health                       {"ok": true}
    /versions                     {"versions": [{"version": 3, "complete": true, "shards": 4, <its signed
                                  header: files, shard_size, total_size, sha256, publication, signature>}, ...]}
    /versions?newer=V&wait=S      the same, once a version newer than V is listed (or after S
                                  seconds, at most 10): an idle relay learns of a new version at
                                  once, with one request a second instead of twenty
    /v/{version}/manifest         the manifest as this server holds it (only shards it can send)
    /v/{version}/manifest?since=K&listing=T&wait=S
                                  a ManifestDelta: the header and the shards of this server's
                                  listing T from position K on, answered once there are any (or the
                                  version is complete, or after S seconds, at most 10): relays and
                                  clients learn of a new shard at once, one request per change,
                                  each answer as long as the news, not the whole list
    /v/{version}/shard/{index}    the shard's bytes: its file, or its ranges of the version's linked files

One asyncio loop serves every connection (keep-alive; a held manifest request is a sleeping
coroutine, not a thread). A shard goes out by ``sendfile``: the kernel hands the page cache's pages
to the socket, and no byte passes through Python. uvicorn does not offer that, so :class:`H11Sendfile`
is uvicorn's h11 protocol with the ASGI zero-copy send extension added (h11 is told of the body's
length without its bytes); under a server without the extension, a shard is read in 1 MiB pieces
on worker threads instead, the next read overlapping the send of the current one.
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

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from intellect.http_server import url_of
from intellect.shardcast.manifest import ListedVersion, ManifestDelta, VersionList
from intellect.shardcast.store import SourceChanged, VersionStore

log = logging.getLogger("intellect.shardcast.server")

_WAIT_MAX = 10.0
# How often held requests look at the files (one look for all, :class:`_Changes`): the origin's
# writer is another process, so a stat is how news is seen; a look at an unchanged version costs
# microseconds (the parse is cached, the listing log read on from where the last look stopped).
_WAIT_STEP = 0.01
# Each read is a hop to a worker thread and each send a trip through the event loop, yet bigger
# pieces cost more: what the socket does not take at once is copied into the transport's buffer, and
# each piece is fresh memory; 1 MiB lies in the cheapest range (figures: benchmarks/results).
_READ = 1 << 20


#: The ASGI extension for sending part of a file by ``sendfile`` (asgi.readthedocs.io, "Zero Copy Send").
ZERO_COPY = "http.response.zerocopysend"


class _ShardResponse(Response):
    """A shard's bytes, ``(fd, offset, length)`` pieces of files, with their Content-Length: by zero-copy
    send where the server offers it, else read ahead by one piece on a worker thread."""

    media_type = "application/octet-stream"

    def __init__(self, pieces: list[tuple[int, int, int]]):
        size = sum(n for _, _, n in pieces)
        super().__init__(media_type=self.media_type, headers={"content-length": str(size)})
        self.pieces, self.size = pieces, size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if ZERO_COPY in scope.get("extensions", {}) and self.size:
                loop = asyncio.get_running_loop()
                for i, (fd, off, n) in enumerate(self.pieces):
                    # sendfile reads on the event loop's thread: ask for the pages first, from a worker
                    # thread, so a shard that left the page cache is read ahead, not waited on there
                    await loop.run_in_executor(None, os.posix_fadvise, fd, off, n, os.POSIX_FADV_WILLNEED)
                    with open(fd, "rb", buffering=0, closefd=False) as f:
                        await send({"type": ZERO_COPY, "file": f, "offset": off, "count": n,
                                    "more_body": i + 1 < len(self.pieces)})
            else:
                await self._read_ahead(send)
        finally:
            for fd, _, _ in self.pieces:
                os.close(fd)

    async def _read_ahead(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        # os.pread's arguments: (fd, length, offset)
        reads = [(fd, min(_READ, off + n - at), at) for fd, off, n in self.pieces for at in range(off, off + n, _READ)]
        pending = loop.run_in_executor(None, os.pread, *reads[0]) if reads else None
        try:
            if pending is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            for i, (_, want, at) in enumerate(reads):
                assert pending is not None  # the read of reads[i], started before this step
                piece = await pending
                pending = loop.run_in_executor(None, os.pread, *reads[i + 1]) if i + 1 < len(reads) else None
                if len(piece) != want:  # the file shrank under us: the client sees a short body and retries
                    raise OSError(f"read {len(piece)} of {want} bytes at {at}")
                await send({"type": "http.response.body", "body": piece, "more_body": pending is not None})
        finally:
            if pending is not None:  # the client went away mid-shard: let the read finish before the fd closes
                await asyncio.wait([pending])


class _FileRegion:
    """A body of ``len`` bytes that h11 counts against Content-Length but never sees: it is passed
    through to us (``send_with_data_passthrough``) and sent by ``sendfile``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _SendfileCycle(RequestResponseCycle):
    """uvicorn's request cycle, also taking :data:`ZERO_COPY` messages."""

    async def send(self, message) -> None:
        if message["type"] != ZERO_COPY:
            return await super().send(message)
        if not self.response_started or self.response_complete:
            raise RuntimeError(f"{ZERO_COPY} outside a response body")
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        count = message["count"]
        if self.scope["method"] != "HEAD":
            # h11 passes the Data event's object through untouched: it never needs the bytes, only len()
            region = h11.Data(data=_FileRegion(count))  # pyright: ignore[reportArgumentType]  # see above
            for piece in self.conn.send_with_data_passthrough(region) or ():  # None only for ConnectionClosed
                if not isinstance(piece, _FileRegion):
                    self.transport.write(piece)
                    continue
                try:
                    sent = await asyncio.get_running_loop().sendfile(self.transport, message["file"],
                                                                     message.get("offset", 0), count)
                except (OSError, RuntimeError) as e:  # the peer went away, or the transport is closing
                    sent, why = 0, e
                else:
                    why = f"the file ended after {sent} of {count} bytes"
                if sent != count:  # the body can no longer match its length: end the connection
                    log.debug("zero-copy send stopped: %s", why)
                    self.transport.close()
                    return
        await super().send({"type": "http.response.body", "body": b"", "more_body": message.get("more_body", False)})


class H11Sendfile(H11Protocol):
    """uvicorn's h11 protocol whose requests may use the :data:`ZERO_COPY` extension.

    uvicorn makes one request cycle per request inside :meth:`handle_events`; the cycle's task is
    only scheduled there, so the cycle made is given the extension before its application runs.
    """

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not before and type(cycle) is RequestResponseCycle:
            cycle.__class__ = _SendfileCycle
            cycle.scope.setdefault("extensions", {})[ZERO_COPY] = {}


def _listing(store: VersionStore) -> VersionList:
    out = []
    for v in store.versions():
        try:
            m, listed = store.look(v)
        except ValueError as e:  # a manifest this server cannot read is not served as a version
            log.warning("version %d: unreadable manifest (%s)", v, str(e).splitlines()[0])
            continue
        if m is not None:  # deleted between listing and reading
            out.append(ListedVersion.of(m, len(m.shards) + listed))
    return VersionList.model_construct(versions=out)


class _Changes:
    """Held requests sleep here until the store changes: one look at the store per step for all of
    them (the versions, and how many shards each version being waited on lists), not one per request.
    Dozens of clients following a version at one relay would otherwise each wake 100 times a second."""

    def __init__(self, store: VersionStore):
        self.store = store
        self.stamp = 0  # counts the changes seen
        self._watched: dict[int | None, int] = {}  # version (None: the version list) -> requests held on it
        self._cond: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None

    def _look(self) -> list:
        seen: list = [self.store.versions()]
        for v in self._watched:
            if v is not None:
                # the header itself, not its id: a replaced header may be freed and its id reused
                head, listed = self.store.look(v)
                seen.append((v, head, listed))
        return seen

    async def _run(self) -> None:
        cond = self._cond
        assert cond is not None  # wait() makes it before it starts this task
        last = None
        while self._watched:
            try:
                now = self._look()
            except (ValueError, OSError):  # a version being deleted: look again next step
                now = None
            if now != last:
                last = now
                self.stamp += 1
                async with cond:
                    cond.notify_all()
            await asyncio.sleep(_WAIT_STEP)
        self._task = None

    async def wait(self, stamp: int, seconds: float, version: int | None = None) -> None:
        """Return once a change after ``stamp`` (read before the caller's last look) was seen, or after
        ``seconds``."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        self._watched[version] = self._watched.get(version, 0) + 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            async with self._cond:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.stamp != stamp), seconds)
        except asyncio.TimeoutError:
            pass
        finally:
            self._watched[version] -= 1
            if not self._watched[version]:
                del self._watched[version]


async def _delta(store: VersionStore, changes: _Changes, version: int, since: int, listing: str,
                 wait: float) -> ManifestDelta | None:
    """``version``'s :class:`ManifestDelta` from ``since``, once it has shards past ``since`` (or is
    complete, or gone, or ``wait`` seconds passed)."""
    until = time.monotonic() + wait
    while True:
        stamp = changes.stamp
        d = store.delta(version, since, listing)
        left = until - time.monotonic()
        if d is None or d.complete or d.shards or left <= 0:
            return d
        await changes.wait(stamp, left, version)


async def _await_newer(store: VersionStore, changes: _Changes, newer: int, wait: float) -> None:
    """Return once a version newer than ``newer`` is listed, or ``wait`` seconds passed."""
    until = time.monotonic() + wait
    while True:
        stamp = changes.stamp
        versions = store.versions()
        left = until - time.monotonic()
        if (versions and versions[-1] > newer) or left <= 0:
            return
        await changes.wait(stamp, left)


def _held(query, key: str, least: int, *also: str) -> dict | None:
    """A held request's query: ``key`` (an int, at least ``least``), ``also`` (strings of up to 32
    characters) and ``wait`` (0..10 s), each once; None without a query; ValueError when malformed."""
    if not query:
        return None
    names = {key, *also, "wait"}
    if set(query) != names or any(len(query.getlist(k)) != 1 for k in query):
        raise ValueError(f"{', '.join(sorted(names))}, once each")
    out = {k: query[k] for k in also}
    out[key], out["wait"] = int(query[key]), float(query["wait"])
    if out[key] < least or any(len(query[k]) > 32 for k in also) or \
            not (math.isfinite(out["wait"]) and 0 <= out["wait"] <= _WAIT_MAX):
        raise ValueError(str(out))
    return out


def create_app(store: VersionStore) -> Starlette:
    changes = _Changes(store)

    async def health(_request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def versions(request: Request) -> Response:
        try:
            poll = _held(request.query_params, "newer", -1)
        except ValueError:
            return JSONResponse({"error": f"query must be newer=<version>&wait=<0..{_WAIT_MAX:g} seconds>"},
                                status_code=400)
        if poll is not None:
            await _await_newer(store, changes, poll["newer"], poll["wait"])
        return Response(_listing(store).model_dump_json(), media_type="application/json")

    async def manifest(request: Request) -> Response:
        version = request.path_params["version"]
        try:
            poll = _held(request.query_params, "since", 0, "listing")
        except ValueError:
            return JSONResponse({"error": f"query must be since=<shards>&listing=<name>&wait=<0..{_WAIT_MAX:g} "
                                          "seconds>"}, status_code=400)
        try:
            m = await _delta(store, changes, version, poll["since"], poll["listing"], poll["wait"]) \
                if poll is not None else store.manifest(version)
        except (ValueError, FileNotFoundError):  # a version out of range, or being deleted
            m = None
        if m is None:
            return JSONResponse({"error": "no such version"}, status_code=404)
        return Response(m.model_dump_json(), media_type="application/json")

    async def shard(request: Request) -> Response:
        try:
            pieces = store.open_shard(request.path_params["version"], request.path_params["index"])
        except SourceChanged as e:
            log.error("%s: not served", e)
            return JSONResponse({"error": "the published file changed since; this version is void"},
                                status_code=500)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=404)
        if pieces is None:
            return JSONResponse({"error": "shard not held"}, status_code=404)
        return _ShardResponse(pieces)

    return Starlette(routes=[
        Route("/health", health),
        Route("/versions", versions),
        Route("/v/{version:int}/manifest", manifest),
        Route("/v/{version:int}/shard/{index:int}", shard),
    ])


def write_port_file(path: str | os.PathLike, host: str, port: int) -> None:
    p = Path(path)
    tmp = p.with_name(f".tmp-{p.name}")
    tmp.write_text(f"http://{host}:{port}\n")
    os.replace(tmp, p)


class Server:
    """uvicorn serving ``store`` on ``sock``, in this thread (:meth:`run`) or a daemon thread (:meth:`start`)."""

    def __init__(self, store: VersionStore, sock: socket.socket, idle_timeout: float = 30.0, zero_copy: bool = True):
        self.sock = sock
        self.url = url_of(sock)
        # h11 (with sendfile unless told otherwise) and the stdlib loop, named: uvicorn's "auto" would
        # pick httptools/uvloop wherever they happen to be installed, and a server must behave the same
        # on every install.
        config = uvicorn.Config(create_app(store), http=H11Sendfile if zero_copy else "h11", loop="asyncio",
                                log_level="warning", access_log=False,
                                # uvicorn annotates an int, but uses it as a call_later delay: a float works
                                timeout_keep_alive=idle_timeout,  # pyright: ignore[reportArgumentType]
                                lifespan="off")
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
