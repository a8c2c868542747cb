"""The wire between SHARDCAST servers and their readers: shard bodies over kept-alive connections, each
checked as it streams in, and JSON answers (listings, manifests) read with a byte cap before they
are parsed. The client (:mod:`~intellect.shardcast.client`) and relays (:mod:`~intellect.shardcast.relay`)
both read through here.

Every request, shard or JSON, has an overall deadline besides its per-read timeout, enforced by one
watchdog thread that shuts the socket down when it passes (:class:`_Deadlines`): a server that sends a
byte now and then, in the headers or the body, cannot hold a reader past it. A JSON answer's
deadline allows its byte cap at a minimum rate (:func:`answer_budget`), and readers that ask several
servers ask them at once (:func:`ask_each`), so one slow server delays nothing beyond its own deadline.
"""

from __future__ import annotations

import hashlib
import heapq
import http.client
import itertools
import math
import select
import socket
import threading
import time
from concurrent.futures import Future, wait
from typing import Callable, Mapping, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from intellect.shardcast import chain
from intellect.shardcast.manifest import ManifestDelta, ShardEntry, VersionList
from intellect.shardcast.signing import Untrusted, Verifier


class WireError(Exception):
    """A request failed: the server did not answer, not with 200, or not in full."""


class DeadlineMissed(WireError):
    """A server did not finish its answer before the request's overall deadline (it may have sent
    every byte within the read timeout, just too few of them)."""


class ShardError(WireError):
    """One try of one shard failed."""


class ShardMismatch(ShardError):
    """A shard's bytes are not the ones its signed SHA-256 or chaining value names: the server lies or
    its disk is bad, and is not asked again in this fetch."""


class _Deadlines:
    """Shuts a request's socket down when its deadline passes: one thread for all of a process's requests.

    Read timeouts bound each wait, not a request: a server that sends a byte now and then, in the
    body or the headers, would otherwise hold a download thread (and a client's fetch past its
    deadline), or a listing every worker waits on, for days.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._armed: set[int] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, deadline: float) -> int | None:
        if deadline == math.inf:
            return None
        with self._cv:
            key = next(self._seq)
            heapq.heappush(self._heap, (deadline, key, sock))
            self._armed.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardcast-deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()
        return key

    def disarm(self, key: int | None) -> None:
        if key is not None:
            with self._cv:
                self._armed.discard(key)

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # finished in time
                if not self._heap:
                    self._cv.wait()
                    continue
                deadline, key, sock = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                heapq.heappop(self._heap)
                self._armed.discard(key)
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
                except OSError:
                    pass


_DEADLINES = _Deadlines()  # the process's one watchdog, shared by every reader (it idles when none is armed)


class ShardConnections:
    """Kept-alive HTTP/1.1 connections to servers, a few per server, and one reused buffer per thread.

    Shard bodies come through the standard library's ``http.client``, whose ``readinto`` fills the
    buffer straight from the socket; httpx hands a body over as fresh ``bytes`` after h11 has
    copied every byte twice, and that copying is the bulk of a downloader's CPU, hashing aside.
    Listings and manifests come through the same connections, so the socket is at hand to guard
    with the request's deadline before a byte of the answer, headers included, is read.
    """

    BUFFER = 1 << 20  # per download thread; each fill is one hash call and one write

    def __init__(self, connect_timeout: float, read_timeout: float, per_server: int):
        self.connect_timeout, self.read_timeout, self.per_server = connect_timeout, read_timeout, per_server
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = False
        self.deadlines = _DEADLINES

    def buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.BUFFER))
        return buf

    def take(self, base: str, fresh: bool = False,
             deadline: float = math.inf) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``base`` (True: reused) or, when there is none or ``fresh``, a new one,
        connected within the connect timeout (and before ``deadline``)."""
        while not fresh:
            with self._lock:
                idle = self._idle.get(base)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if _idle_and_open(conn):
                return conn, True
            conn.close()  # the server closed it (or sent something unasked) while it idled
        url = urlsplit(base)
        if url.hostname is None:
            raise WireError(f"{base}: not a server's base URL")
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineMissed(f"{base}: deadline passed before a connection was opened")
        conn = cls(url.hostname, url.port, timeout=min(self.connect_timeout, left))
        conn.connect()
        conn.sock.settimeout(self.read_timeout)
        return conn, False

    def give_back(self, base: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(base, [])
            if conn.sock is not None and not self._closed and len(idle) < self.per_server:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _idle_and_open(conn: http.client.HTTPConnection) -> bool:
    """True when a pooled connection still has its socket and nothing to read: a closed one reads as EOF."""
    if conn.sock is None:
        return False
    poll = select.poll()
    poll.register(conn.sock, select.POLLIN)
    return not poll.poll(0)


def _ask(conns: ShardConnections, base: str, path: str,
         deadline: float) -> tuple[http.client.HTTPConnection, int | None, http.client.HTTPResponse]:
    """``GET path`` on a connection to ``base`` guarded by ``deadline``, its answer's headers read;
    the caller disarms the guard, then gives the connection back or closes it. A kept-alive
    connection the server closed just as it was reused is replaced once by a new one."""
    conn, reused = conns.take(base, deadline=deadline)
    guard = conns.deadlines.arm(conn.sock, deadline)
    try:
        try:
            conn.request("GET", path)
            return conn, guard, conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused or time.monotonic() >= deadline:
                raise
            conn.close()
            conns.deadlines.disarm(guard)
            conn, _ = conns.take(base, fresh=True, deadline=deadline)
            guard = conns.deadlines.arm(conn.sock, deadline)
            conn.request("GET", path)
            return conn, guard, conn.getresponse()
    except BaseException:
        conns.deadlines.disarm(guard)
        conn.close()
        raise


def _path(base: str, path: str) -> str:
    return f"{urlsplit(base).path.rstrip('/')}{path}"


def download_shard(conns: ShardConnections, base: str, version: int, entry: ShardEntry,
                   sink: Callable[[int, memoryview], None], deadline: float, start: str | None = None) -> bool:
    """Stream shard ``entry`` from ``base``, handing each piece to ``sink(offset_in_shard, piece)`` as it
    arrives (``piece`` is this thread's reused buffer: use it before returning); raise ShardError
    unless exactly ``entry.size`` bytes arrived before ``deadline``, with ``entry.sha256``. The caller
    keeps what ``sink`` wrote private until then.

    With ``start``, the blob's chaining value where the shard begins (see
    :func:`~intellect.shardcast.manifest.chain_before`), and ``entry.chain``, the bytes are checked by
    the chain instead, in the same one pass; True when they were (the caller's whole-blob hash may
    then skip this shard)."""
    chained = chain.AVAILABLE and start is not None and entry.chain is not None
    h = chain.ChainedSha256(start, entry.offset) if chained else hashlib.sha256()
    conn = guard = None
    try:
        conn, guard, r = _ask(conns, base, _path(base, f"/v/{version}/shard/{entry.index}"), deadline)
        if r.status != 200:
            raise ShardError(f"HTTP {r.status}")
        announced = r.getheader("content-length")
        if r.chunked or announced != str(entry.size):  # a wrong length fails before a byte is written
            raise ShardError(f"{announced} bytes announced, {entry.size} expected")
        buf, pos = conns.buffer(), 0
        while pos < entry.size:
            want, got = min(len(buf), entry.size - pos), 0
            while got < want:
                n = r.readinto(buf[got:want])
                if not n:
                    raise ShardError(f"{pos + got} of {entry.size} bytes: the server closed the connection")
                got += n
            piece = buf[:got]
            h.update(piece)  # while the piece is still in this core's cache
            sink(pos, piece)
            pos += got
        conns.deadlines.disarm(guard)
    except BaseException as e:
        conns.deadlines.disarm(guard)
        if conn is not None:
            conn.close()  # mid-answer: nothing more can be read from it in step
        if time.monotonic() >= deadline and isinstance(e, (WireError, http.client.HTTPException, OSError)):
            raise ShardError("deadline passed mid-shard") from e
        if isinstance(e, (http.client.HTTPException, OSError)):
            raise ShardError(f"{type(e).__name__}: {e}") from e
        raise
    conns.give_back(base, conn)
    if isinstance(h, chain.ChainedSha256):
        if h.chain() != entry.chain:
            raise ShardMismatch("sha256 chaining value mismatch")
    elif h.hexdigest() != entry.sha256:
        raise ShardMismatch("sha256 mismatch")
    return chained


def answer_budget(read_timeout: float, limit: int, min_rate: float, wait: float = 0.0) -> float:
    """Seconds a JSON answer of at most ``limit`` bytes may take in all: the server's allowed silence
    before it answers, any long poll it was asked to hold, and the cap at ``min_rate`` bytes/s.

    >>> answer_budget(30.0, 1 << 20, 65536.0)  # a /versions answer by default
    46.0
    >>> answer_budget(1.0, 1 << 20, float(1 << 20), wait=0.5)
    2.5
    """
    return read_timeout + wait + limit / min_rate


def get_json(conns: ShardConnections, base: str, path: str, limit: int, deadline: float) -> bytes:
    """The body of ``base``'s JSON answer to ``GET path``, of at most ``limit`` bytes, complete before
    ``deadline`` (a ``time.monotonic()`` value); raises
    :class:`~intellect.shardcast.signing.Untrusted` (``oversized``) as soon as it is longer, having
    held at most ``limit`` bytes of it, :class:`DeadlineMissed` when the deadline passed first (every
    byte may have come within the read timeout, headers included), and :class:`WireError` when the
    server does not answer 200 in full.

    Bodies come unencoded (``identity``): a compressed one could inflate past any cap in one piece."""
    url = base + path
    conn = guard = r = None
    try:
        conn, guard, r = _ask(conns, base, _path(base, path), deadline)
        if r.status != 200:
            raise WireError(f"{url}: HTTP {r.status}")
        encoding = r.getheader("content-encoding", "identity")
        if encoding.lower() != "identity":
            raise Untrusted("malformed", f"{url}: an encoded answer ({encoding!r})")
        announced = r.getheader("content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > limit):
            raise Untrusted("oversized", f"{url}: {announced} bytes announced, at most {limit} taken")
        body = r.read(limit + 1)  # chunked or not: at most one byte past the cap is held
        if len(body) > limit:
            raise Untrusted("oversized", f"{url}: answer over {limit} bytes")
        if announced is not None and len(body) != int(announced):
            if time.monotonic() >= deadline:
                raise DeadlineMissed(f"{url}: {len(body)} of {announced} bytes by the deadline")
            raise WireError(f"{url}: {len(body)} of {announced} bytes: the server closed the connection")
        conns.deadlines.disarm(guard)
    except BaseException as e:
        conns.deadlines.disarm(guard)
        if r is not None:
            r.close()
        if conn is not None:
            conn.close()
        if isinstance(e, (Untrusted, DeadlineMissed)) or \
                not isinstance(e, (WireError, http.client.HTTPException, OSError)):
            raise
        if time.monotonic() >= deadline:
            raise DeadlineMissed(f"{url}: no full answer before the deadline ({type(e).__name__}: {e})") from e
        if isinstance(e, WireError):
            raise
        raise WireError(f"{url}: {type(e).__name__}: {e}") from e
    conns.give_back(base, conn)
    return body


def fetch_delta(conns: ShardConnections, base: str, version: int, query: str, wait: float, limit: int,
                deadline: float) -> ManifestDelta:
    """The server's answer to a :meth:`ManifestView.query` about ``version``, held up to ``wait`` s until
    it has news (its signatures not checked yet: :meth:`ManifestView.apply` does), before
    ``deadline``; raises :class:`WireError`, or :class:`~intellect.shardcast.signing.Untrusted` for an
    oversized or malformed answer."""
    body = get_json(conns, base, f"/v/{version}/manifest?{query}&wait={wait:.3f}", limit, deadline)
    try:
        return ManifestDelta.model_validate_json(body)
    except ValidationError as e:
        raise Untrusted("malformed", f"manifest of version {version}: {str(e).splitlines()[0]} "
                                     f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None


def list_versions(conns: ShardConnections, base: str, verifier: Verifier, limit: int, deadline: float,
                  newer: int | None = None, wait: float = 0.0) -> list[tuple[int, bool]]:
    """``(version, complete)`` for each version the server at ``base`` lists (with ``newer``: once it
    lists a newer version, or after ``wait`` s), each header verified, and complete only when the
    trainer sealed it; raises :class:`WireError` when the server does not answer before ``deadline``,
    and :class:`~intellect.shardcast.signing.Untrusted` when it answers anything else."""
    query = f"?newer={newer}&wait={wait:.3f}" if newer is not None else ""
    body = get_json(conns, base, f"/versions{query}", limit, deadline)
    try:
        listed = VersionList.model_validate_json(body).versions
    except ValidationError as e:
        raise Untrusted("malformed", f"{base}/versions: {str(e).splitlines()[0]}") from None
    for v in listed:
        verifier.verify(v)
        if v.complete and v.sha256 is None:
            raise Untrusted("unsigned", f"{base}/versions: version {v.version} listed complete, but not sealed")
    return [(v.version, v.complete) for v in listed]


def in_thread(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a new daemon thread: a request blocked until its deadline when its asker has
    moved on must not hold up the asker's return or the interpreter's exit (a pool's threads would)."""
    fut: Future = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting asker
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="shardcast-ask").start()
    return fut


K = TypeVar("K")
T = TypeVar("T")
_SLACK = 1.0  # seconds past a deadline a request's thread may take to notice that its socket was shut


def ask_each(jobs: Mapping[K, Callable[[], T]], deadline: float) -> dict[K, T | BaseException]:
    """Run every job at once, each on its own thread and each bounded by ``deadline`` itself (a request
    of this module); returns each one's result or the exception it raised, a
    :class:`DeadlineMissed` for one still running shortly after ``deadline``."""
    if len(jobs) == 1:  # nothing to overlap with: no thread
        [(key, job)] = jobs.items()
        try:
            return {key: job()}
        except Exception as e:  # noqa: BLE001 - handed over as the others' are
            return {key: e}
    futs = {key: in_thread(job) for key, job in jobs.items()}
    wait(futs.values(), timeout=max(0.0, deadline - time.monotonic()) + _SLACK)
    out: dict[K, T | BaseException] = {}
    for key, fut in futs.items():
        if not fut.done():
            out[key] = DeadlineMissed(f"{key}: no answer {_SLACK:g} s past the deadline")
        else:
            out[key] = fut.exception() or fut.result()
    return out
