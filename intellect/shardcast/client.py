"""Download a version from relays: shards in parallel, each checked on arrival, the whole checked before it shows.

:meth:`ShardcastClient.fetch` starts as soon as any relay lists the version, even while the origin
is still writing it, and downloads each shard from a relay that advertises it (picked by
:mod:`~intellect.shardcast.choice`). One thread per relay watches its listing with long polls (the
relay answers when it holds another shard, with only the shards new to this client), and one
:class:`~intellect.shardcast.manifest.ManifestView` unites the relays' listings. Each shard is read
from a kept-alive connection into one reused buffer
(:class:`~intellect.shardcast.wire.ShardConnections`), hashed piece by piece as it arrives, and written to its place in the checkpoint's files (no second copy). The
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

Nothing a relay says is taken on its word: every header and shard entry must carry the trainer's
signature (:mod:`~intellect.shardcast.signing`, checked by the view before anything is used), and
every JSON answer is read with a byte cap before it is parsed. A relay that serves anything
unsigned, mis-signed, of another version, oversized or malformed, or shard bytes that do not match
the signed hashes, is marked bad for the rest of the fetch (the reason is kept in
:attr:`ShardcastClient.bad`), and the shards come from the others; when every relay is bad the fetch
fails at once. Nor is a relay's pace: every answer has a deadline (:func:`~intellect.shardcast.wire.answer_budget`),
the relays are asked at once, and one that misses its deadline counts as a failure in the relay choice.
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from intellect.shardcast import chain
from intellect.shardcast.choice import RelayScore, observe, pick
from intellect.shardcast.config import ClientConfig
from intellect.shardcast.manifest import Manifest, ManifestDelta, ManifestView, ShardEntry, chain_before
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.store import preallocate, write_at
from intellect.shardcast.wire import (DeadlineMissed, ShardConnections, ShardMismatch, WireError, answer_budget,
                                      ask_each, download_shard, fetch_delta, in_thread, list_versions)
from intellect.storage import STABLE

log = logging.getLogger("intellect.shardcast.client")

_LONG_POLL = 1.0  # seconds a relay may hold a manifest request until it has news
_READ_BACK = 4 << 20


class ShardcastError(RuntimeError):
    """A version could not be fetched (the message says which relays failed how)."""


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
    """Fetches versions signed by ``cfg.trainer_key`` from ``relays``."""

    def __init__(self, relays: list[str], cfg: ClientConfig):
        if not relays:
            raise ValueError("a SHARDCAST client needs at least one relay URL")
        self.relays = [r.rstrip("/") for r in relays]
        self.cfg = cfg
        self.verifier = Verifier(cfg.trainer_key)
        #: relay -> why it was marked bad (in the fetch or listing that last found it so)
        self.bad: dict[str, str] = {}
        self.scores = {r: RelayScore() for r in self.relays}
        self.rng = random.Random(self.cfg.seed)
        self._conns = ShardConnections(self.cfg.connect_timeout, self.cfg.read_timeout, self.cfg.parallel)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._conns.close()

    def __enter__(self) -> "ShardcastClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ discovery

    def versions(self) -> dict[int, bool]:
        """Version -> complete on some relay, over every relay that answers (silent ones are skipped).

        The relays are asked at once, and the call returns once each has answered or missed the
        listing's deadline: ``deadline``, or less, ``read_timeout`` + ``max_versions_bytes`` / ``min_rate``."""
        cfg = self.cfg
        deadline = time.monotonic() + min(cfg.deadline, answer_budget(cfg.read_timeout, cfg.max_versions_bytes,
                                                                      cfg.min_rate))
        answers = ask_each({relay: (lambda relay=relay: list_versions(self._conns, relay, self.verifier,
                                                                      cfg.max_versions_bytes, deadline))
                            for relay in self.relays}, deadline)
        out: dict[int, bool] = {}
        for relay, listed in answers.items():
            if isinstance(listed, Untrusted):
                self._distrust(relay, f"/versions: {listed}")
                continue
            if isinstance(listed, DeadlineMissed):
                self._missed(relay, f"/versions: {listed}")
                continue
            if isinstance(listed, (WireError, ValueError)):
                log.debug("relay %s: %s", relay, listed)
                continue
            if isinstance(listed, BaseException):
                raise listed
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
        bad: set[str] = set()  # relays not asked again in this fetch
        asm = _Assembly(folder)
        pool = ThreadPoolExecutor(cfg.parallel, thread_name_prefix="shardcast-get")
        inflight: dict[Future, tuple[ShardEntry, str, float]] = {}
        done: set[int] = set()
        tries: dict[int, list[str]] = {}
        by_relay: dict[str, int] = {}
        view = ManifestView(version, self.verifier)  # every relay's listing, each answer costing only its news
        ref: Manifest | None = None  # the view when last looked at: what downloads are started from
        pending: list[int] = []  # a heap of listed shards not yet started: lowest index first
        heard: list[ShardEntry] = []  # listed since ref was last made
        told_total = False
        unheard, first_heard = set(self.relays), 0.0
        watch = {in_thread(self._watch, relay, version, view.query(relay), 0.0, 0.0, deadline): relay
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
                        s = view.shard(index)
                        relays = [r for r in view.holders.get(index, ()) if r not in bad]
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
                        heard += self._watched(fut, watch, view, errors, bad, version, deadline)
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
                    if isinstance(err, ShardMismatch):
                        self._mark_bad(relay, f"shard {entry.index}: {err} (not the signed bytes)", view, errors, bad)
                    if len(tries[entry.index]) >= cfg.attempts:
                        raise ShardcastError(self._why(f"shard {entry.index} of version {version} failed "
                                                       f"{len(tries[entry.index])} tries", errors, done, ref))
                    heapq.heappush(pending, entry.index)
                # the first look waits (briefly) for every relay, so the first wave of shards is
                # spread over all of them, not sent to whichever answered first
                if (heard or (view.header is not None and (ref is None or view.header.complete != ref.complete))) \
                        and (not unheard or time.monotonic() - first_heard >= cfg.poll_interval):
                    new_ref = view.manifest()
                    if done and new_ref is not None and new_ref.publication != ref.publication:
                        raise ShardcastError(f"version {version} was written anew while it was fetched; fetch again")
                    ref = new_ref
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
        cfg = self.cfg
        if delay > 0:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        hold = max(0.0, min(hold, deadline - time.monotonic()))
        until = min(deadline, time.monotonic() + answer_budget(cfg.read_timeout, cfg.max_manifest_bytes, cfg.min_rate,
                                                               hold))
        return fetch_delta(self._conns, relay, version, query, hold, cfg.max_manifest_bytes, until)

    def _distrust(self, relay: str, why: str) -> None:
        self.bad[relay] = why
        log.warning("relay %s marked bad: %s", relay, why)
        with self._lock:
            observe(self.scores, relay, ok=False, nbytes=0, seconds=0.0, alpha=self.cfg.alpha, heal=self.cfg.heal)

    def _missed(self, relay: str, why: str) -> None:
        """``relay`` did not answer before a deadline: a failure in the relay choice, not a lie."""
        log.warning("relay %s too slow: %s", relay, why)
        with self._lock:
            observe(self.scores, relay, ok=False, nbytes=0, seconds=0.0, alpha=self.cfg.alpha, heal=self.cfg.heal)

    def _mark_bad(self, relay: str, why: str, view: ManifestView, errors: dict[str, str], bad: set[str]) -> None:
        """Stop using ``relay`` in this fetch; fail the fetch when no relay is left."""
        if relay in bad:
            return
        bad.add(relay)
        errors[relay] = f"marked bad: {why}"
        view.drop(relay)
        self._distrust(relay, why)
        if bad.issuperset(self.relays):
            raise ShardcastError(f"version {view.version}: every relay served data that failed verification "
                                 f"({'; '.join(f'{r}: {errors[r]}' for r in self.relays)}); nothing was kept")

    def _watched(self, fut: Future, watch: dict[Future, str], view: ManifestView, errors: dict[str, str],
                 bad: set[str], version: int, deadline: float) -> list[ShardEntry]:
        """Take one answer of a relay's watcher into ``view`` (returns the shards new to it) and start
        its next look (none once it listed the whole version, or once it is bad)."""
        relay = watch.pop(fut)
        if relay in bad:
            return []
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
            except Untrusted as e:
                self._mark_bad(relay, f"manifest: {str(e)[:300]}", view, errors, bad)
                return []
            except ValueError as e:
                errors[relay] = f"manifest disagrees with the other relays ({str(e)[:200]})"
        elif isinstance(err, Untrusted):
            self._mark_bad(relay, f"manifest: {str(err)[:300]}", view, errors, bad)
            return []
        else:
            if not isinstance(err, (WireError, ValueError)):
                raise err
            if isinstance(err, DeadlineMissed):
                self._missed(relay, f"manifest: {err}")
            errors[relay] = f"manifest: {str(err).splitlines()[0][:200]}"
            view.drop(relay)  # not used until it answers again
        if not view.complete_at(relay):
            hold = min(_LONG_POLL, self.cfg.read_timeout / 2) if relay in view.servers() else 0.0
            watch[in_thread(self._watch, relay, version, view.query(relay), hold, delay, deadline)] = relay
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
