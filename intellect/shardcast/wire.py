"""The wire between SHARDCAST servers and their readers: shard bodies over kept-alive connections, each
checked as it streams in, and JSON answers (listings, manifests) read with a byte cap before they
are parsed. The client (:mod:`~intellect.shardcast.client`) and relays (:mod:`~intellect.shardcast.relay`)
both read through here.
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
from typing import Callable
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from intellect.shardcast import chain
from intellect.shardcast.manifest import ManifestDelta, ShardEntry, VersionList, verify_header
from intellect.shardcast.signing import Untrusted, Verifier


class ShardError(Exception):
    """One try of one shard failed."""


class ShardMismatch(ShardError):
    """A shard's bytes are not the ones its signed SHA-256 or chaining value names: the server lies or
    its disk is bad, and is not asked again in this fetch."""


class _Deadlines:
    """Shuts a download's socket down when its deadline passes: one thread for all of a process's downloads.

    Read timeouts bound each wait, not a download: a server that sends a byte now and then, in the
    body or the headers, would otherwise hold a download thread (and a client's fetch past its
    deadline) for days.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._armed: set[int] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

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

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
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


class ShardConnections:
    """Kept-alive HTTP/1.1 connections for shard bodies, a few per server, and one reused buffer per thread.

    Shard bodies come through the standard library's ``http.client``, whose ``readinto`` fills the
    buffer straight from the socket; httpx hands a body over as fresh ``bytes`` after h11 has
    copied every byte twice. On loopback, 1 GiB in 16 MiB shards, 4 at once, hashed and written:
    1.1 CPU-s against 1.7 through httpx (the bulk of a relay's and a client's CPU, hashing aside).
    Listings and manifests, small and JSON, stay on httpx.
    """

    BUFFER = 1 << 20  # per download thread; each fill is one hash call and one write

    def __init__(self, connect_timeout: float, read_timeout: float, per_server: int):
        self.connect_timeout, self.read_timeout, self.per_server = connect_timeout, read_timeout, per_server
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = False
        self.deadlines = _Deadlines()

    def buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.BUFFER))
        return buf

    def take(self, base: str, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``base`` (True: reused) or, when there is none or ``fresh``, a new one,
        connected within the connect timeout."""
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
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = cls(url.hostname, url.port, timeout=self.connect_timeout)
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
        self.deadlines.close()
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
    path = f"{urlsplit(base).path.rstrip('/')}/v/{version}/shard/{entry.index}"
    conn = guard = None
    try:
        conn, reused = conns.take(base)
        guard = conns.deadlines.arm(conn.sock, deadline)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused or time.monotonic() >= deadline:
                raise
            conn.close()  # closed by the server just as it was reused: once more, on a new connection
            conns.deadlines.disarm(guard)
            conn, _ = conns.take(base, fresh=True)
            guard = conns.deadlines.arm(conn.sock, deadline)
            conn.request("GET", path)
            r = conn.getresponse()
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
        if time.monotonic() >= deadline and isinstance(e, (ShardError, http.client.HTTPException, OSError)):
            raise ShardError("deadline passed mid-shard") from e
        if isinstance(e, (http.client.HTTPException, OSError)):
            raise ShardError(f"{type(e).__name__}: {e}") from e
        raise
    conns.give_back(base, conn)
    if chained:
        if h.chain() != entry.chain:
            raise ShardMismatch("sha256 chaining value mismatch")
    elif h.hexdigest() != entry.sha256:
        raise ShardMismatch("sha256 mismatch")
    return chained


def http_client(servers: int) -> httpx.Client:
    """One client for a process's listings and manifest requests: a kept-alive connection for each
    server's watcher and one more for listings."""
    n = 2 * servers
    return httpx.Client(limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=n))


def get_json(http: httpx.Client, url: str, timeout: httpx.Timeout, limit: int) -> bytes:
    """The body of a JSON answer of at most ``limit`` bytes, read as it streams in; raises
    :class:`~intellect.shardcast.signing.Untrusted` (``oversized``) as soon as it is longer, having
    held at most ``limit`` bytes of it, and httpx.HTTPError when the server does not answer 200.

    Bodies come unencoded (``identity``): a compressed one could inflate past any cap in one piece."""
    with http.stream("GET", url, timeout=timeout, headers={"accept-encoding": "identity"}) as r:
        r.raise_for_status()
        if r.headers.get("content-encoding", "identity").lower() != "identity":
            raise Untrusted("malformed", f"{url}: an encoded answer ({r.headers['content-encoding']!r})")
        announced = r.headers.get("content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > limit):
            raise Untrusted("oversized", f"{url}: {announced} bytes announced, at most {limit} taken")
        pieces, n = [], 0
        for piece in r.iter_raw():
            n += len(piece)
            if n > limit:
                raise Untrusted("oversized", f"{url}: answer over {limit} bytes")
            pieces.append(piece)
    return b"".join(pieces)


def fetch_delta(http: httpx.Client, base: str, version: int, query: str, wait: float,
                timeout: httpx.Timeout, limit: int) -> ManifestDelta:
    """The server's answer to a :meth:`ManifestView.query` about ``version``, held up to ``wait`` s until
    it has news (its signatures not checked yet: :meth:`ManifestView.apply` does); raises
    httpx.HTTPError, or :class:`~intellect.shardcast.signing.Untrusted` for an oversized or malformed
    answer."""
    body = get_json(http, f"{base}/v/{version}/manifest?{query}&wait={wait:.3f}", timeout, limit)
    try:
        return ManifestDelta.model_validate_json(body)
    except ValidationError as e:
        raise Untrusted("malformed", f"manifest of version {version}: {str(e).splitlines()[0]} "
                                     f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None


def list_versions(http: httpx.Client, base: str, timeout: httpx.Timeout, verifier: Verifier, limit: int,
                  newer: int | None = None, wait: float = 0.0) -> list[tuple[int, bool]]:
    """``(version, complete)`` for each version the server at ``base`` lists (with ``newer``: once it
    lists a newer version, or after ``wait`` s), each header verified, and complete only when the
    trainer sealed it; raises httpx.HTTPError when the server does not answer, and
    :class:`~intellect.shardcast.signing.Untrusted` when it answers anything else."""
    query = f"?newer={newer}&wait={wait:.3f}" if newer is not None else ""
    body = get_json(http, f"{base}/versions{query}", timeout, limit)
    try:
        listed = VersionList.model_validate_json(body).versions
    except ValidationError as e:
        raise Untrusted("malformed", f"{base}/versions: {str(e).splitlines()[0]}") from None
    for v in listed:
        verify_header(verifier, v)
        if v.complete and v.sha256 is None:
            raise Untrusted("unsigned", f"{base}/versions: version {v.version} listed complete, but not sealed")
    return [(v.version, v.complete) for v in listed]
