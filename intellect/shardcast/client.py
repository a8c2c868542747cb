"""Download a version from relays: shards in parallel, each checked on arrival, the whole checked before it shows.

:meth:`ShardcastClient.fetch` starts as soon as any relay lists the version, even while the origin
is still writing it, and downloads each shard from a relay that advertises it (picked by
:mod:`~intellect.shardcast.choice`). One thread per relay watches its listing with long polls (the
relay answers when it holds another shard, with only the shards new to this client), and one
:class:`~intellect.shardcast.manifest.ManifestView` unites the relays' listings. Each shard is read
from a kept-alive connection into one reused buffer (:class:`ShardConnections`), hashed piece by
piece as it arrives, and written to its place in the checkpoint's files (no second copy). The
hash starts from the blob's SHA-256 chaining value where the shard begins
(:mod:`~intellect.shardcast.chain`), so one pass checks the shard against the manifest's chaining
value at its end and also extends the whole-checkpoint SHA-256; a shard that does not match is
discarded and fetched again from another relay, up to ``attempts`` tries. The whole checkpoint's
SHA-256 is then the last chaining value finished off, compared with the manifest's. Shards without
chaining values (an origin without OpenSSL's SHA-256 calls, a last shard ending mid-block, or
``reread``) are checked by their own SHA-256 and read back from the page cache by a thread that
hashes the finished prefix, so the whole hash is ready right after the last shard. Only then is
the temporary folder renamed to its final name and ``STABLE`` written: a failed fetch leaves
nothing visible, and every wait is bounded by one deadline.
"""

from __future__ import annotations

import hashlib
import heapq
import http.client
import itertools
import logging
import math
import os
import random
import select
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx

from intellect.shardcast import chain
from intellect.shardcast.choice import RelayScore, observe, pick
from intellect.shardcast.config import ClientConfig
from intellect.shardcast.manifest import Manifest, ManifestDelta, ManifestView, ShardEntry, chain_before
from intellect.shardcast.store import preallocate, write_at
from intellect.storage import STABLE

log = logging.getLogger("intellect.shardcast.client")

_LONG_POLL = 1.0  # seconds a relay may hold a manifest request until it has news
_READ_BACK = 4 << 20


class ShardcastError(RuntimeError):
    """A version could not be fetched (the message says which relays failed how)."""


class ShardError(Exception):
    """One try of one shard failed."""


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
            raise ShardError("sha256 chaining value mismatch")
    elif h.hexdigest() != entry.sha256:
        raise ShardError("sha256 mismatch")
    return chained


def http_client(servers: int) -> httpx.Client:
    """One client for a process's listings and manifest requests: a kept-alive connection for each
    server's watcher and one more for listings."""
    n = 2 * servers
    return httpx.Client(limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=n))


def get_json(http: httpx.Client, url: str, timeout: httpx.Timeout):
    r = http.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def fetch_delta(http: httpx.Client, base: str, version: int, query: str, wait: float,
                timeout: httpx.Timeout) -> ManifestDelta:
    """The server's answer to a :meth:`ManifestView.query` about ``version``, held up to ``wait`` s until
    it has news; raises httpx.HTTPError or ValueError (a malformed answer)."""
    return ManifestDelta.model_validate(get_json(http, f"{base}/v/{version}/manifest?{query}&wait={wait:.3f}",
                                                 timeout))


def list_versions(http: httpx.Client, base: str, timeout: httpx.Timeout, newer: int | None = None,
                  wait: float = 0.0) -> list[tuple[int, bool]]:
    """``(version, complete)`` for each version the server at ``base`` lists (with ``newer``: once it
    lists a newer version, or after ``wait`` s); raises httpx.HTTPError or ValueError when it does not
    answer or answers something else."""
    query = f"?newer={newer}&wait={wait:.3f}" if newer is not None else ""
    try:
        listed = get_json(http, f"{base}/versions{query}", timeout)["versions"]
        return [(int(v["version"]), bool(v["complete"])) for v in listed]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{base}/versions: unexpected answer ({e!r})") from e


@dataclass
class FetchStats:
    version: int
    bytes: int
    seconds: float
    shards: int
    retries: int
    by_relay: dict[str, int]


class _Assembly:
    """The checkpoint's files in a temporary folder, written at shard offsets, hashed in order."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()
        # One writer at a time per process: concurrent pwrite() calls on one file make the kernel
        # spin on the inode lock (measured: ~18% of the client's CPU with 8 downloads at once).
        self.write_lock = threading.Lock()

    def fd(self, name: str) -> int:
        with self.lock:
            if name not in self.fds:
                self.fds[name] = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o644)
            return self.fds[name]

    def sink(self, manifest: Manifest, entry: ShardEntry) -> Callable[[int, memoryview], None]:
        segs = [(self.fd(name), foff, n) for name, foff, n in manifest.segments(entry)]
        for fd, foff, n in segs:
            preallocate(fd, foff, n)

        def write(pos: int, data: memoryview) -> None:
            view, seg_start = memoryview(data), 0
            for fd, foff, n in segs:  # shard-relative [seg_start, seg_start + n) lies at foff in its file
                lo, hi = max(pos, seg_start), min(pos + len(view), seg_start + n)
                if lo < hi:
                    with self.write_lock:
                        write_at(fd, view[lo - pos: hi - pos], foff + lo - seg_start)
                seg_start += n

        return write

    def finish(self, manifest: Manifest) -> None:
        for f in manifest.files:  # empty files, and files whose bytes no shard carried
            os.ftruncate(self.fd(f.name), f.size)
        self.close()

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


class ShardcastClient:
    def __init__(self, relays: list[str], cfg: ClientConfig | None = None):
        if not relays:
            raise ValueError("a SHARDCAST client needs at least one relay URL")
        self.relays = [r.rstrip("/") for r in relays]
        self.cfg = cfg or ClientConfig()
        self.scores = {r: RelayScore() for r in self.relays}
        self.rng = random.Random(self.cfg.seed)
        self._timeout = httpx.Timeout(self.cfg.read_timeout, connect=self.cfg.connect_timeout)
        self._http = http_client(len(self.relays))
        self._conns = ShardConnections(self.cfg.connect_timeout, self.cfg.read_timeout, self.cfg.parallel)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()
        self._conns.close()

    def __enter__(self) -> "ShardcastClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ discovery

    def versions(self) -> dict[int, bool]:
        """Version -> complete on some relay, over every relay that answers (silent ones are skipped)."""
        out: dict[int, bool] = {}
        for relay in self.relays:
            try:
                listed = list_versions(self._http, relay, self._timeout)
            except (httpx.HTTPError, ValueError) as e:
                log.debug("relay %s: %s", relay, e)
                continue
            for v, complete in listed:
                out[v] = out.get(v, False) or complete
        return out

    def complete_versions(self) -> list[int]:
        return sorted(v for v, done in self.versions().items() if done)

    # ------------------------------------------------------------------ fetch

    def fetch(self, version: int, dest: str | os.PathLike,
              progress: Callable[[int, int | None], None] | None = None) -> FetchStats:
        """Download ``version`` into folder ``dest`` (made atomically, ``STABLE`` last); a no-op if it is there.

        ``progress(shards_done, shards_total or None while the version is incomplete)`` is called after each shard.
        """
        dest = Path(dest)
        if (dest / STABLE).exists():
            return FetchStats(version, 0, 0.0, 0, 0, {})
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)  # a folder without STABLE is a leftover, never a checkpoint
        t0 = time.monotonic()
        deadline = t0 + self.cfg.deadline
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            stats = self._fetch_into(version, tmp, deadline, progress)
            os.replace(tmp, dest)
            (dest / STABLE).write_text(f'{{"version": {version}}}\n')
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        stats.seconds = time.monotonic() - t0
        return stats

    def _fetch_into(self, version: int, folder: Path, deadline: float,
                    progress: Callable[[int, int | None], None] | None) -> FetchStats:
        cfg = self.cfg
        errors: dict[str, str] = {}
        asm = _Assembly(folder)
        pool = ThreadPoolExecutor(cfg.parallel, thread_name_prefix="shardcast-get")
        inflight: dict[Future, tuple[ShardEntry, str, float]] = {}
        done: set[int] = set()
        tries: dict[int, list[str]] = {}
        by_relay: dict[str, int] = {}
        view = ManifestView(version)  # every relay's listing, each answer costing only its news
        ref: Manifest | None = None  # the view when last looked at: what downloads are started from
        pending: list[int] = []  # a heap of listed shards not yet started: lowest index first
        heard: list[ShardEntry] = []  # listed since ref was last made
        told_total = False
        unheard, first_heard = set(self.relays), 0.0
        watch = {_in_thread(self._watch, relay, version, view.query(relay), 0.0, 0.0, deadline): relay
                 for relay in self.relays}
        hasher = _OrderedHasher(asm)
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    raise ShardcastError(self._why(f"version {version} not fetched within {cfg.deadline:.0f} s",
                                                   errors, done, ref))
                if ref is not None:
                    unheld, busy = [], {e.index for e, _, _ in inflight.values()}
                    load = Counter(r for _, r, _ in inflight.values())
                    while pending and len(inflight) < cfg.parallel:
                        index = heapq.heappop(pending)
                        s, relays = view.shard(index), view.holders.get(index)
                        if index in done or index in busy or s is None or ref.shard(index) != s:
                            continue  # done, started, or no longer listed as it was
                        if not relays:  # its relays went quiet: wait for one to list it again
                            unheld.append(index)
                            continue
                        fresh = [r for r in relays if r not in tries.get(index, [])] or relays
                        with self._lock:
                            relay = pick(self.scores, fresh, self.rng, load)
                        load[relay] += 1
                        tries.setdefault(index, []).append(relay)
                        fut = pool.submit(download_shard, self._conns, relay, version, s, asm.sink(ref, s),
                                          deadline, chain_before(ref, s))
                        inflight[fut] = (s, relay, time.monotonic())
                        busy.add(index)  # a shard listed twice in the heap starts once
                    for index in unheld:
                        heapq.heappush(pending, index)
                    if ref.complete and len(done) == len(ref.shards):
                        if progress is not None and not told_total:  # the total became known after the last shard
                            progress(len(done), len(ref.shards))
                        break
                if not inflight and not watch:
                    time.sleep(min(cfg.poll_interval, max(0.0, deadline - time.monotonic())))
                    continue
                finished, _ = wait([*inflight, *watch], timeout=cfg.poll_interval, return_when=FIRST_COMPLETED)
                for fut in finished:
                    if fut in watch:
                        unheard.discard(watch[fut])
                        first_heard = first_heard or time.monotonic()
                        heard += self._watched(fut, watch, view, errors, version, deadline)
                        continue
                    entry, relay, started = inflight.pop(fut)
                    err = fut.exception()
                    with self._lock:
                        observe(self.scores, relay, ok=err is None, nbytes=entry.size,
                                seconds=time.monotonic() - started, alpha=cfg.alpha, heal=cfg.heal)
                    if err is None:
                        done.add(entry.index)
                        by_relay[relay] = by_relay.get(relay, 0) + 1
                        hasher.add(entry.index, fut.result() and not cfg.reread)
                        if progress is not None:
                            told_total = ref.complete
                            progress(len(done), len(ref.shards) if ref.complete else None)
                        continue
                    errors[relay] = f"shard {entry.index}: {err}"
                    log.warning("shard %d of v%d from %s failed: %s", entry.index, version, relay, err)
                    if len(tries[entry.index]) >= cfg.attempts:
                        raise ShardcastError(self._why(f"shard {entry.index} of version {version} failed "
                                                       f"{len(tries[entry.index])} tries", errors, done, ref))
                    heapq.heappush(pending, entry.index)
                # the first look waits (briefly) for every relay, so the first wave of shards is
                # spread over all of them, not sent to whichever answered first
                if (heard or (view.header is not None and (ref is None or view.header.complete != ref.complete))) \
                        and (not unheard or time.monotonic() - first_heard >= cfg.poll_interval):
                    ref = view.manifest()
                    for e in heard:
                        heapq.heappush(pending, e.index)
                    heard = []
                    if ref is not None:
                        hasher.manifest = ref
            digest = hasher.result(deadline)
            if digest != ref.sha256:
                raise ShardcastError(f"version {version}: the assembled checkpoint's sha256 {digest} differs from "
                                     f"the manifest's {ref.sha256}; nothing was kept")
            asm.finish(ref)
            return FetchStats(version, ref.total_size, 0.0, len(ref.shards),
                              sum(len(t) - 1 for t in tries.values()), by_relay)
        finally:
            hasher.stop()
            for fut in inflight:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            asm.close()

    def _watch(self, relay: str, version: int, query: str, hold: float, delay: float,
               deadline: float) -> ManifestDelta:
        """``relay``'s answer to ``query`` about ``version`` after ``delay`` s, held up to ``hold`` s until
        it has news (a long poll)."""
        if delay > 0:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        return fetch_delta(self._http, relay, version, query, max(0.0, min(hold, deadline - time.monotonic())),
                           self._timeout)

    def _watched(self, fut: Future, watch: dict[Future, str], view: ManifestView, errors: dict[str, str],
                 version: int, deadline: float) -> list[ShardEntry]:
        """Take one answer of a relay's watcher into ``view`` (returns the shards new to it) and start
        its next look (none once it listed the whole version)."""
        relay = watch.pop(fut)
        err, new = fut.exception(), []
        # an answer with nothing new (the long poll expired, or a server that does not hold
        # requests) is followed by a pause, so no relay is asked in a tight loop
        delay = self.cfg.poll_interval
        if err is None:
            d = fut.result()
            try:
                new = view.apply(relay, d)
                if d.shards or d.complete:
                    delay = 0.0
            except ValueError as e:
                errors[relay] = f"manifest disagrees with the other relays ({str(e)[:200]})"
        else:
            if not isinstance(err, (httpx.HTTPError, ValueError)):
                raise err
            errors[relay] = f"manifest: {str(err).splitlines()[0][:200]}"
            view.drop(relay)  # not used until it answers again
        if not view.complete_at(relay):
            hold = min(_LONG_POLL, self.cfg.read_timeout / 2) if relay in view.servers() else 0.0
            watch[_in_thread(self._watch, relay, version, view.query(relay), hold, delay, deadline)] = relay
        return new

    @staticmethod
    def _why(head: str, errors: dict[str, str], done: set[int], ref: Manifest | None) -> str:
        if ref is None:
            got = "no relay listed the version"
        elif ref.complete:
            got = f"{len(done)}/{len(ref.shards)} shards"
        else:
            got = f"{len(done)} shards, the version is complete on no relay ({len(ref.shards)} shards listed)"
        detail = "; ".join(f"{r}: {e}" for r, e in sorted(errors.items())) or "no errors recorded"
        return f"{head} ({got}; {detail})"


def _in_thread(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a new daemon thread: a watcher blocked in a long poll when the fetch ends must
    not hold up the fetch's return or the interpreter's exit (a pool's threads would)."""
    fut: Future = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting fetch loop
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="shardcast-watch").start()
    return fut


class _OrderedHasher:
    """SHA-256 of the blob, fed shard by shard in index order as shards finish.

    A shard checked by its chaining value costs nothing here: the hash jumps to the value after it.
    Any other shard (no chaining values in the manifest, the last one ending mid-block, or
    ``reread``) is read back from the page cache and hashed on this thread."""

    def __init__(self, asm: _Assembly):
        self.asm = asm
        self.manifest: Manifest | None = None
        self._h = chain.whole_hasher()
        self._ready: dict[int, bool] = {}  # finished shard -> checked by its chaining value
        self._next = 0
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="shardcast-hash")
        self._thread.start()

    def add(self, index: int, chained: bool) -> None:
        with self._cv:
            self._ready[index] = chained
            self._cv.notify()

    def _run(self) -> None:
        buf = memoryview(bytearray(_READ_BACK))  # reused: no fresh memory per read
        try:
            while True:
                with self._cv:
                    while not self._stop and self._next not in self._ready:
                        self._cv.wait()
                    if self._stop:
                        return
                    index, manifest, chained = self._next, self.manifest, self._ready[self._next]
                entry = manifest.shard(index)
                if chained:
                    self._h = chain.ChainedSha256(entry.chain, entry.offset + entry.size)
                else:
                    self._read_back(manifest, entry, buf)
                with self._cv:
                    self._next += 1
                    self._cv.notify_all()
        except BaseException as e:  # reported by result()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _read_back(self, manifest: Manifest, entry: ShardEntry, buf: memoryview) -> None:
        for name, foff, n in manifest.segments(entry):
            fd = self.asm.fd(name)
            for off in range(0, n, _READ_BACK):
                want = min(_READ_BACK, n - off)
                got = os.preadv(fd, [buf[:want]], foff + off)
                if got != want:
                    raise OSError(f"{name}: read {got} of {want} bytes at {foff + off}")
                self._h.update(buf[:want])

    def result(self, deadline: float) -> str:
        total = len(self.manifest.shards)
        with self._cv:
            while self._next < total and self._error is None:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise ShardcastError("hashing the checkpoint did not finish before the deadline")
            if self._error is not None:
                raise ShardcastError(f"hashing the checkpoint failed: {self._error}") from self._error
        return self._h.hexdigest()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
