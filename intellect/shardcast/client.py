"""Download a version from relays: shards in parallel, each checked on arrival, the whole checked before it shows.

:meth:`ShardcastClient.fetch` starts as soon as any relay lists the version, even while the origin
is still writing it, and downloads each shard from a relay that advertises it (picked by the
client's :class:`~intellect.shardcast.choice.Scheduler`). One thread per relay watches its listing
with long polls (the relay answers when it holds another shard, with only the shards new to this
client), and one :class:`~intellect.shardcast.manifest.ManifestView` unites the relays' listings.
Each shard streams through :func:`~intellect.shardcast.wire.download_shard` into its place in the
checkpoint's files (:class:`~intellect.shardcast.assembly.Assembly`, no second copy), hashed piece
by piece as it arrives. The hash starts from the blob's SHA-256 chaining value where the shard
begins (:mod:`~intellect.shardcast.chain`), so one pass checks the shard against the manifest's
chaining value at its end and also extends the whole-checkpoint SHA-256
(:class:`~intellect.shardcast.assembly.OrderedHasher`); a shard that does not match is discarded and
fetched again from another relay, up to ``attempts`` tries. Only once the whole checkpoint's SHA-256
matches the manifest's is the temporary folder renamed to its final name and ``STABLE`` written: a
failed fetch leaves nothing visible, and every wait is bounded by one deadline.

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
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from intellect.shardcast.assembly import Assembly, HashFailed, OrderedHasher
from intellect.shardcast.choice import Scheduler, Try
from intellect.shardcast.config import ClientConfig
from intellect.shardcast.manifest import Manifest, ManifestDelta, ManifestView, ShardEntry, chain_before
from intellect.shardcast.patch import MAX_CHAIN, PatchRefused, apply_patch
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.wire import (DeadlineMissed, ShardConnections, ShardMismatch, WireError, answer_budget,
                                      ask_each, download_shard, fetch_delta, in_thread, list_versions)
from intellect.storage import STABLE

log = logging.getLogger("intellect.shardcast.client")

_LONG_POLL = 1.0  # seconds a relay may hold a manifest request until it has news
_LAST_WORD = 0.5  # seconds a fetch past its deadline waits for its requests (bounded by it too) to end
_FRAMES = 64  # checkpoints remembered as bases for patches
# refusals that a base changed on disk since it was fetched would also cause: rebuilt from a fresh base
_BASE_FAULTS = frozenset({"base_mismatch", "layout_mismatch", "digest_mismatch"})

Progress = Callable[[int, int | None], None]


class ShardcastError(RuntimeError):
    """A version could not be fetched (the message says which relays failed how)."""


class VersionRefused(ShardcastError):
    """A weight patch that does not rebuild the checkpoint the trainer signed, or cannot be rebuilt
    (its base is listed by no relay); ``reason`` as :data:`intellect.shardcast.patch.Reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class FetchStats:
    version: int
    bytes: int
    seconds: float
    shards: int
    retries: int
    by_relay: dict[str, int]


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
        #: the relay choice, kept across fetches
        self.scheduler = Scheduler(self.relays, alpha=cfg.alpha, heal=cfg.heal, seed=cfg.seed)
        self.conns = ShardConnections(cfg.connect_timeout, cfg.read_timeout, cfg.parallel)
        #: version -> (folder, signed digest) of checkpoints this client fetched: the bases of the next patches
        self._frames: dict[int, tuple[Path, str | None]] = {}

    def close(self) -> None:
        self.conns.close()

    def __enter__(self) -> "ShardcastClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def versions(self) -> dict[int, bool]:
        """Version -> complete on some relay, over every relay that answers (silent ones are skipped).

        The relays are asked at once, and the call returns once each has answered or missed the
        listing's deadline: ``deadline``, or less, ``read_timeout`` + ``max_versions_bytes`` / ``min_rate``."""
        cfg = self.cfg
        deadline = time.monotonic() + min(cfg.deadline, answer_budget(cfg.read_timeout, cfg.max_versions_bytes,
                                                                      cfg.min_rate))
        answers = ask_each({relay: (lambda relay=relay: list_versions(self.conns, relay, self.verifier,
                                                                      cfg.max_versions_bytes, deadline))
                            for relay in self.relays}, deadline)
        out: dict[int, bool] = {}
        for relay, listed in answers.items():
            if isinstance(listed, Untrusted):
                self.distrust(relay, f"/versions: {listed}")
                continue
            if isinstance(listed, DeadlineMissed):
                self.missed(relay, f"/versions: {listed}")
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

    def fetch(self, version: int, dest: str | os.PathLike, progress: Progress | None = None) -> FetchStats:
        """Download ``version`` into folder ``dest`` (made atomically, ``STABLE`` last); a no-op if it is there.

        A version that is a weight patch (:mod:`~intellect.shardcast.patch`) is rebuilt into the
        checkpoint it stands for: from its base, where this client fetched that before and it is still
        on disk, else from the last full version and the patches after it, each downloaded in turn. The
        rebuilt checkpoint must have the digest the trainer signed, or the version is refused
        (:class:`VersionRefused`) and nothing is kept: ``dest`` holds the checkpoint either way.

        ``progress(shards_done, shards_total or None while the version is incomplete)`` is called after each
        shard of ``version`` itself.
        """
        dest = Path(dest)
        if (dest / STABLE).exists():
            return FetchStats(version, 0, 0.0, 0, 0, {})
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)  # a folder without STABLE is a leftover, never a checkpoint
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            folder, stats, digest = self._rebuild(version, work, t0 + self.cfg.deadline, progress, 0)
            os.replace(folder, dest)
            (dest / STABLE).write_text(f'{{"version": {version}}}\n')
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._frames[version] = (dest, digest)
        while len(self._frames) > _FRAMES:
            del self._frames[min(self._frames)]
        stats.seconds = time.monotonic() - t0
        return stats

    def _rebuild(self, version: int, work: Path, deadline: float, progress: Progress | None,
                 depth: int) -> tuple[Path, FetchStats, str | None]:
        """``version``'s checkpoint in a new folder under ``work``: ``(folder, stats, signed digest)``."""
        got = work / f"v{version}"
        got.mkdir()
        fetch = _Fetch(self, version, got, deadline, progress)
        stats = fetch.run()
        assert fetch.ref is not None  # run returns once the complete version is in
        lineage = fetch.ref.lineage
        if not lineage.patch or lineage.base is None:
            return got, stats, lineage.checkpoint_digest
        out, frame = work / f"r{version}", self._frames.get(lineage.base)
        if frame is not None and (frame[0] / STABLE).exists():
            try:
                apply_patch(frame[0], got, out, frame[1], lineage.checkpoint_digest, lineage.encoding)
                shutil.rmtree(got)
                return out, stats, lineage.checkpoint_digest
            except PatchRefused as e:
                if e.reason not in _BASE_FAULTS:
                    raise VersionRefused(e.reason, f"version {version}: {e.detail}") from e
                # the base on disk may not be what was fetched (changed since): rebuild it
                log.warning("version %d does not rebuild from version %d at %s (%s); from the last full version",
                            version, lineage.base, frame[0], e)
        if depth + 1 >= MAX_CHAIN:
            raise VersionRefused("chain_too_long", f"version {version}: more than {MAX_CHAIN} patches in a row")
        if lineage.base not in self.versions():
            raise VersionRefused("base_missing", f"version {version} is a patch against version {lineage.base}, "
                                                 "which no relay lists")
        base, more, base_digest = self._rebuild(lineage.base, work, deadline, None, depth + 1)
        try:
            apply_patch(base, got, out, base_digest, lineage.checkpoint_digest, lineage.encoding)
        except PatchRefused as e:
            raise VersionRefused(e.reason, f"version {version} against version {lineage.base}: {e.detail}") from e
        shutil.rmtree(base)
        shutil.rmtree(got)
        for k, n in more.by_relay.items():
            stats.by_relay[k] = stats.by_relay.get(k, 0) + n
        stats.bytes, stats.shards, stats.retries = (stats.bytes + more.bytes, stats.shards + more.shards,
                                                    stats.retries + more.retries)
        return out, stats, lineage.checkpoint_digest

    def ask_manifest(self, relay: str, version: int, query: str, hold: float, delay: float,
                     deadline: float) -> ManifestDelta:
        """``relay``'s answer to ``query`` about ``version`` after ``delay`` s, held up to ``hold`` s until
        it has news (a long poll)."""
        cfg = self.cfg
        if delay > 0:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        hold = max(0.0, min(hold, deadline - time.monotonic()))
        until = min(deadline, time.monotonic() + answer_budget(cfg.read_timeout, cfg.max_manifest_bytes, cfg.min_rate,
                                                               hold))
        return fetch_delta(self.conns, relay, version, query, hold, cfg.max_manifest_bytes, until)

    def distrust(self, relay: str, why: str) -> None:
        """``relay`` served something the trainer did not sign: kept in :attr:`bad`, and a failure in the choice."""
        self.bad[relay] = why
        log.warning("relay %s marked bad: %s", relay, why)
        self.scheduler.penalize(relay)

    def missed(self, relay: str, why: str) -> None:
        """``relay`` did not answer before a deadline: a failure in the relay choice, not a lie."""
        log.warning("relay %s too slow: %s", relay, why)
        self.scheduler.penalize(relay)


class _Fetch:
    """One fetch in progress: what the relays list, which shards are started, done or failed, and the
    step that moves it on (:meth:`run`).

    Only the caller's thread changes this state. Downloads run on a pool and each relay's listing on
    its own watcher thread; their futures come back to :meth:`_step`, which takes each in turn.
    """

    def __init__(self, client: ShardcastClient, version: int, folder: Path, deadline: float,
                 progress: Progress | None):
        self.client, self.cfg, self.version = client, client.cfg, version
        self.deadline, self.progress = deadline, progress
        self.files = Assembly(folder)
        self.hasher = OrderedHasher(self.files)
        self.view = ManifestView(version, client.verifier)  # every relay's listing, each answer costing only its news
        self.ref: Manifest | None = None  # the view when last looked at: what downloads are started from
        self.pending: list[int] = []  # a heap of listed shards not yet started: lowest index first
        self.heard: list[ShardEntry] = []  # listed since ref was last made
        self.inflight: dict[Future, tuple[ShardEntry, Try]] = {}
        self.watch: dict[Future, str] = {}  # each relay's listing request in flight
        self.done: set[int] = set()
        self.started: set[int] = set()
        self.by_relay: Counter[str] = Counter()
        self.errors: dict[str, str] = {}  # relay -> its last failure, for the error message
        self.bad: set[str] = set()  # relays not asked again in this fetch
        self.unheard, self.first_heard = set(client.relays), 0.0
        self.told_total = False  # progress was called with the total
        self.pool = ThreadPoolExecutor(self.cfg.parallel, thread_name_prefix="shardcast-get")

    def run(self) -> FetchStats:
        try:
            for relay in self.client.relays:
                self._look(relay, hold=0.0, delay=0.0)
            while not self._step():
                pass
            try:
                digest = self.hasher.result(self.deadline)
            except HashFailed as e:
                raise ShardcastError(str(e)) from e
            ref = self.ref
            assert ref is not None and ref.total_size is not None  # _step ends once ref is the complete version
            if digest != ref.sha256:
                raise ShardcastError(f"version {self.version}: the assembled checkpoint's sha256 {digest} differs "
                                     f"from the manifest's {ref.sha256}; nothing was kept")
            self.files.finish(ref)
            retries = sum(self.client.scheduler.tries(self._key(i)) - 1 for i in self.started)
            return FetchStats(self.version, ref.total_size, 0.0, len(ref.shards), retries, dict(self.by_relay))
        finally:
            self.hasher.stop()
            for fut in self.inflight:
                fut.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
            for _, t in self.inflight.values():
                self.client.scheduler.abandon(t)
            self.client.scheduler.forget(self._key(i) for i in self.started)
            self.files.close()

    def _key(self, index: int) -> tuple[_Fetch, int]:
        return self, index  # this fetch's shard: another fetch of the same version keeps its own tries

    def _step(self) -> bool:
        """Start what can start, take what finished; True once every shard of the complete version is in."""
        if time.monotonic() > self.deadline:
            # the requests in flight share this deadline and end with it: their errors say why
            self._take(wait([*self.inflight, *self.watch], timeout=_LAST_WORD, return_when=ALL_COMPLETED)[0])
            raise ShardcastError(self._why(f"version {self.version} not fetched within {self.cfg.deadline:.0f} s"))
        if self.ref is not None:
            self._start_downloads()
            if self.ref.complete and len(self.done) == len(self.ref.shards):
                if self.progress is not None and not self.told_total:  # the total became known after the last shard
                    self.progress(len(self.done), len(self.ref.shards))
                return True
        if not self.inflight and not self.watch:
            time.sleep(min(self.cfg.poll_interval, max(0.0, self.deadline - time.monotonic())))
            return False
        self._take(wait([*self.inflight, *self.watch], timeout=self.cfg.poll_interval, return_when=FIRST_COMPLETED)[0])
        self._refresh()
        return False

    def _take(self, finished: set[Future]) -> None:
        for fut in finished:
            if fut in self.watch:
                self._listed(fut)
            elif fut in self.inflight:
                self._downloaded(fut)

    def _start_downloads(self) -> None:
        """Start listed shards, lowest index first, while fewer than ``parallel`` are in flight."""
        view, ref, sched = self.view, self.ref, self.client.scheduler
        assert ref is not None  # downloads start from a reference
        unheld, busy = [], {e.index for e, _ in self.inflight.values()}
        while self.pending and len(self.inflight) < self.cfg.parallel:
            index = heapq.heappop(self.pending)
            s = view.shard(index)
            relays = [r for r in view.holders.get(index, ()) if r not in self.bad]
            if index in self.done or index in busy or s is None or ref.shard(index) != s:
                continue  # done, started, or no longer listed as it was
            if not relays:  # its relays went quiet: wait for one to list it again
                unheld.append(index)
                continue
            t = sched.start(self._key(index), relays)
            self.started.add(index)
            fut = self.pool.submit(download_shard, self.client.conns, t.relay, self.version, s,
                                   self.files.sink(ref, s), self.deadline, chain_before(ref, s))
            self.inflight[fut] = (s, t)
            busy.add(index)  # a shard listed twice in the heap starts once
        for index in unheld:
            heapq.heappush(self.pending, index)

    def _downloaded(self, fut: Future) -> None:
        entry, t = self.inflight.pop(fut)
        sched, err, ref = self.client.scheduler, fut.exception(), self.ref
        assert ref is not None  # it was started from one
        if err is None:
            sched.succeeded(t, entry.size)
            self.done.add(entry.index)
            self.by_relay[t.relay] += 1
            self.hasher.add(entry.index, fut.result() and not self.cfg.reread)
            if self.progress is not None:
                self.told_total = ref.complete
                self.progress(len(self.done), len(ref.shards) if ref.complete else None)
            return
        tries = sched.failed(t)
        self.errors[t.relay] = f"shard {entry.index}: {err}"
        log.warning("shard %d of v%d from %s failed: %s", entry.index, self.version, t.relay, err)
        if isinstance(err, ShardMismatch):
            self._mark_bad(t.relay, f"shard {entry.index}: {err} (not the signed bytes)")
        if tries >= self.cfg.attempts:
            raise ShardcastError(self._why(f"shard {entry.index} of version {self.version} failed {tries} tries"))
        heapq.heappush(self.pending, entry.index)

    def _refresh(self) -> None:
        """Take the view as the reference for new downloads when it has news. The first look waits
        (briefly) for every relay, so the first wave of shards is spread over all of them, not sent
        to whichever answered first."""
        view, ref = self.view, self.ref
        news = self.heard or (view.header is not None and (ref is None or view.header.complete != ref.complete))
        if not news or (self.unheard and time.monotonic() - self.first_heard < self.cfg.poll_interval):
            return
        new_ref = view.manifest()
        if self.done and new_ref is not None and ref is not None and new_ref.publication != ref.publication:
            raise ShardcastError(f"version {self.version} was written anew while it was fetched; fetch again")
        self.ref = new_ref
        for e in self.heard:
            heapq.heappush(self.pending, e.index)
        self.heard = []
        if new_ref is not None:
            self.hasher.manifest = new_ref

    def _look(self, relay: str, hold: float, delay: float) -> None:
        fut = in_thread(self.client.ask_manifest, relay, self.version, self.view.query(relay), hold, delay,
                        self.deadline)
        self.watch[fut] = relay

    def _listed(self, fut: Future) -> None:
        """Take one answer of a relay's watcher into the view (its new shards into :attr:`heard`) and
        start its next look (none once it listed the whole version, or once it is bad)."""
        relay = self.watch.pop(fut)
        self.unheard.discard(relay)
        self.first_heard = self.first_heard or time.monotonic()
        if relay in self.bad:
            return
        view, err = self.view, fut.exception()
        # an answer with nothing new (the long poll expired, or a server that does not hold
        # requests) is followed by a pause, so no relay is asked in a tight loop
        delay = self.cfg.poll_interval
        if err is None:
            d = fut.result()
            try:
                self.heard += view.apply(relay, d)
                if d.shards or d.complete:
                    delay = 0.0
            except Untrusted as e:
                self._mark_bad(relay, f"manifest: {str(e)[:300]}")
                return
            except ValueError as e:
                self.errors[relay] = f"manifest disagrees with the other relays ({str(e)[:200]})"
        elif isinstance(err, Untrusted):
            self._mark_bad(relay, f"manifest: {str(err)[:300]}")
            return
        else:
            if not isinstance(err, (WireError, ValueError)):
                raise err
            if isinstance(err, DeadlineMissed):
                self.client.missed(relay, f"manifest: {err}")
            self.errors[relay] = f"manifest: {str(err).splitlines()[0][:200]}"
            view.drop(relay)  # not used until it answers again
        if not view.complete_at(relay):
            self._look(relay, min(_LONG_POLL, self.cfg.read_timeout / 2) if relay in view.servers() else 0.0, delay)

    def _mark_bad(self, relay: str, why: str) -> None:
        """Stop using ``relay`` in this fetch; fail the fetch when no relay is left."""
        if relay in self.bad:
            return
        self.bad.add(relay)
        self.errors[relay] = f"marked bad: {why}"
        self.view.drop(relay)
        self.client.distrust(relay, why)
        if self.bad.issuperset(self.client.relays):
            raise ShardcastError(f"version {self.version}: every relay served data that failed verification "
                                 f"({'; '.join(f'{r}: {self.errors[r]}' for r in self.client.relays)}); "
                                 "nothing was kept")

    def _why(self, head: str) -> str:
        ref = self.ref
        if ref is None:
            got = "no relay listed the version"
        elif ref.complete:
            got = f"{len(self.done)}/{len(ref.shards)} shards"
        else:
            got = f"{len(self.done)} shards, the version is complete on no relay ({len(ref.shards)} shards listed)"
        detail = "; ".join(f"{r}: {e}" for r, e in sorted(self.errors.items())) or "no errors recorded"
        return f"{head} ({got}; {detail})"
