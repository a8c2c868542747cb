"""A relay: mirrors the newest versions of its upstreams into its own store, shard by shard.

Every ``poll_interval`` the relay lists its upstreams' versions (when it has nothing to mirror, a long
poll instead, answered when a new version appears), and for each of the newest
``keep`` it does not hold completely it fetches the shards it lacks (several at once, each
checked against the upstream manifest's SHA-256, or its chaining value, before it is renamed into
place). While a version is being written upstream, the pause is a long poll instead: the upstream
answers the manifest request as soon as it lists another shard, so a shard is seen at once and an
idle wait costs no requests; each answer carries only the shards new to the relay
(:class:`~intellect.shardcast.manifest.ManifestDelta`). Each shard it fetched is appended to its own
listing, which lists only what it holds, so it starts serving a version's first shards while the
origin is still writing the last ones, and never advertises a byte it cannot send. A bad shard is
discarded and fetched again on a later pass (one bad hop does not spread). When every upstream is
down, it keeps serving what it has.

A relay trusts nothing its upstreams say before the trainer's signature on it verifies
(:mod:`~intellect.shardcast.signing`, against ``trainer_key``): the versions they list, every header
and shard entry (the view checks each once), and every shard's bytes against the signed hashes
before it is renamed into place. It lists only the trainer's signed header and entries, unchanged,
so its own readers verify them in turn. An upstream that answers anything unsigned, mis-signed,
of another version, oversized or malformed is marked bad (:attr:`Relay.bad`, with the reason) and
not asked for ``distrust_seconds``: nothing it listed is mirrored, and the versions it lists do not
count. (Asked again after that, it is marked bad again at its first lie; an honest upstream that
served a stale version signed otherwise is not shut out for good.) Every answer has a deadline
(:func:`~intellect.shardcast.wire.answer_budget`, with ``min_rate``), the upstreams are asked at once,
and one that misses its deadline counts as a failure in the choice of upstream for shards.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard, TypeVar

from intellect.shardcast.choice import Scheduler, Try
from intellect.shardcast.config import ClientTuning, RelayConfig
from intellect.shardcast.manifest import Manifest, ManifestView, ShardEntry, chain_before
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.store import VersionStore
from intellect.shardcast.wire import (DeadlineMissed, ShardConnections, ShardError, WireError, answer_budget,
                                      ask_each, download_shard, fetch_delta, list_versions)
from intellect.shardcast.writer import preallocate, write_at

log = logging.getLogger("intellect.shardcast.relay")

_LONG_POLL = 1.0  # seconds an upstream may hold a manifest request until it has another shard
_CHOICE = ClientTuning()
T = TypeVar("T")  # a relay picks among its upstreams as a client does, with the client's defaults


class Relay:
    def __init__(self, store: VersionStore, cfg: RelayConfig, seed: int | None = None):
        self.store, self.cfg = store, cfg
        self.upstreams = [u.rstrip("/") for u in cfg.upstreams]
        self.verifier = Verifier(cfg.trainer_key)
        self.bad: dict[str, str] = {}  # upstream -> why it was last marked bad
        self._bad_until: dict[str, float] = {}  # upstream -> when it may be asked again
        #: the choice of upstream for each shard, with a client's default tuning
        self.scheduler = Scheduler(self.upstreams, alpha=_CHOICE.alpha, heal=_CHOICE.heal, seed=seed)
        self._conns = ShardConnections(cfg.connect_timeout, cfg.read_timeout, cfg.parallel)
        self._pool = ThreadPoolExecutor(cfg.parallel, thread_name_prefix="relay-get")
        self._lock = threading.Lock()
        self._views: dict[int, ManifestView] = {}  # the upstreams' listings of each version being mirrored
        self._mine: dict[int, dict[int, ShardEntry]] = {}  # what this relay lists, by version
        self._missing: dict[int, set[int]] = {}  # listed upstream, not held here, not being fetched
        self._inflight: set[tuple[int, int]] = set()
        self._newest = -1  # the newest version an upstream listed
        self._idle = False  # the last pass found nothing to mirror: the next one may wait upstream
        store.clean_temp()
        for v in store.versions():
            m = store.manifest(v)
            if m is None:  # dropped since it was listed
                continue
            try:  # what it holds from before (another trainer key, or none) is not served as signed data
                self.verifier.verify(m)
                for s in m.shards:
                    self.verifier.shard(v, m.publication, s)
            except Untrusted as e:
                log.warning("version %d in %s does not verify (%s); dropping it", v, store.root, e)
                store.drop(v)
                continue
            self._mine[v] = {s.index: s for s in m.shards if store.shard_path(v, s.index).is_file()}

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                news = self.sync_once()
            except Exception:  # noqa: BLE001 - a relay must outlive any one bad pass
                log.exception("relay sync pass failed")
                news = False
            if not news:
                stop.wait(self.cfg.poll_interval)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._conns.close()

    def sync_once(self) -> bool:
        """One pass over the upstreams; True when it waited upstream (on a version being written, and
        got new shards of it; or, idle, on the next version) so the next pass may start at once: the
        wait replaced the pause."""
        hold_for = min(_LONG_POLL, self.cfg.read_timeout / 2)  # the longest an upstream may hold a request
        listing, news = self._upstream_versions(hold_for if self._idle else 0.0)
        held_on = busy = False
        for v in self._wanted(listing):
            local, _ = self.store.look(v)
            if local is not None and local.complete:
                continue
            busy = True
            view = self._views.get(v) or ManifestView(v, self.verifier)
            hold = 0.0
            if not held_on and view.header is not None and not view.header.complete:
                # one long poll per pass: the upstream answers when it has another shard
                hold, held_on = hold_for, True
            new = self._follow(view, listing[v], hold)
            if view.header is None:
                continue
            news = news or bool(hold and new)
            with self._lock:
                self._views[v] = view
                mine = self._mine.setdefault(v, {})
                if any(e.index in mine and mine[e.index] != e for e in new) or \
                        (mine and local is not None and (local.shard_size, local.publication) !=
                         (view.header.shard_size, view.header.publication)):
                    log.warning("version %d changed upstream; dropping the local copy", v)
                    self.store.drop(v)
                    mine.clear()
                    new = list(view.entries.values())
                missing = self._missing.setdefault(v, set())
                missing.update(e.index for e in new if e.index not in mine)
                self._publish(v, [])
                todo = sorted(i for i in missing if (v, i) not in self._inflight)
                missing.difference_update(todo)
                self._inflight.update((v, i) for i in todo)
            for i in todo:
                e = view.entries[i]
                sources = [u for u in view.holders.get(i) or listing[v] if self._trusted(u)]
                self._pool.submit(self._fetch, v, e, sources, chain_before(view, e))
        with self._lock:
            for v in self.store.retain(self.cfg.keep):
                retired = self._views.get(v)
                if retired is not None:
                    self.scheduler.forget((v, i) for i in retired.entries)
                for d in (self._views, self._mine, self._missing):
                    d.pop(v, None)
            self._idle = not busy and not self._inflight
        return news

    # ------------------------------------------------------------------ parts

    def _wanted(self, listing: dict[int, list[str]]) -> list[int]:
        """The newest ``keep`` versions upstream lists and, down to their full versions, the bases of
        those that are weight patches (known once their headers are heard): a client that lacks a base
        rebuilds from here, and the store's retention keeps them as long as a patch on them is served."""
        want = set(sorted(listing)[-self.cfg.keep:])
        todo = list(want)
        while todo:
            v = todo.pop()
            head = self.store.look(v)[0] or (view.header if (view := self._views.get(v)) is not None else None)
            base = head.lineage.base if head is not None else None
            if base is not None and base in listing and base not in want:
                want.add(base)
                todo.append(base)
        return sorted(want)

    def _upstream_versions(self, hold: float = 0.0) -> tuple[dict[int, list[str]], bool]:
        """Which upstreams list which versions, all asked at once. With ``hold``, the first upstream is
        asked to answer once it lists a version newer than any seen (a long poll); True when it did, or
        held the request that long."""
        cfg, newest = self.cfg, self._newest
        trusted = [u for u in self.upstreams if self._trusted(u)]
        t0 = time.monotonic()
        deadline = t0 + answer_budget(cfg.read_timeout, cfg.max_versions_bytes, cfg.min_rate, hold)

        def ask(u: str, held: bool) -> tuple[list[tuple[int, bool]], float]:
            if held:
                return list_versions(self._conns, u, self.verifier, cfg.max_versions_bytes, deadline,
                                     newer=newest, wait=hold), time.monotonic() - t0
            return list_versions(self._conns, u, self.verifier, cfg.max_versions_bytes, deadline), 0.0

        answers = ask_each({u: (lambda u=u, i=i: ask(u, i == 0 and bool(hold))) for i, u in enumerate(trusted)},
                           deadline)
        out: dict[int, list[str]] = {}
        waited = False
        for i, (u, got) in enumerate(answers.items()):
            if not self._answered(got, u, "/versions"):
                continue
            listed, took = got
            if i == 0 and hold:
                # an answer at once with nothing newer (a server that does not hold) is no wait
                waited = any(v > newest for v, _ in listed) or took >= hold / 2
            for v, _ in listed:
                out.setdefault(v, []).append(u)
        self._newest = max([self._newest, *out])
        return out, waited

    def _follow(self, view: ManifestView, upstreams: list[str], hold: float) -> list[ShardEntry]:
        """Ask each upstream listing the version, all at once, for what ``view`` has not heard from it;
        the first may hold the answer up to ``hold`` s until it has news. Returns the shards new to the view."""
        cfg = self.cfg
        asked = [u for u in upstreams if not view.complete_at(u) and self._trusted(u)]
        held = {u: hold if u == upstreams[0] else 0.0 for u in asked}
        t0 = time.monotonic()
        deadline = t0 + answer_budget(cfg.read_timeout, cfg.max_manifest_bytes, cfg.min_rate, hold)
        answers = ask_each({u: (lambda u=u, q=view.query(u): fetch_delta(self._conns, u, view.version, q, held[u],
                                                                         cfg.max_manifest_bytes, deadline))
                            for u in asked}, deadline)
        new: list[ShardEntry] = []
        for u, d in answers.items():
            try:
                if isinstance(d, Untrusted):
                    raise d
                if self._answered(d, u, f"manifest of v{view.version}"):
                    new += view.apply(u, d)
            except Untrusted as e:
                view.drop(u)
                self._distrust(u, f"manifest of v{view.version}: {e}")
            except ValueError as e:
                log.debug("upstream %s manifest v%d: %s", u, view.version, e)
        return new

    def _answered(self, got: T | BaseException, upstream: str, what: str) -> TypeGuard[T]:
        """True when ``got`` is ``upstream``'s answer, not the exception its request raised (recorded:
        a lie marks it bad, a missed deadline counts as a failure in the choice of upstream)."""
        if isinstance(got, Untrusted):
            self._distrust(upstream, f"{what}: {got}")
        elif isinstance(got, DeadlineMissed):
            log.warning("upstream %s too slow: %s: %s", upstream, what, got)
            self.scheduler.penalize(upstream)
        elif isinstance(got, (WireError, ValueError)):
            log.debug("upstream %s %s: %s", upstream, what, got)
        elif isinstance(got, BaseException):
            raise got
        else:
            return True
        return False

    def _trusted(self, upstream: str) -> bool:
        return time.monotonic() >= self._bad_until.get(upstream, 0.0)

    def _distrust(self, upstream: str, why: str) -> None:
        with self._lock:
            self.bad[upstream] = why
            self._bad_until[upstream] = time.monotonic() + self.cfg.distrust_seconds
        self.scheduler.penalize(upstream)
        log.warning("upstream %s marked bad, not asked for %.0f s: %s", upstream, self.cfg.distrust_seconds, why)

    def _publish(self, version: int, added: list[ShardEntry]) -> None:
        """List ``added`` (now held) in this relay's manifest, after its header (under the lock). The
        header follows the upstreams'; once every shard is here, the complete manifest replaces both."""
        view, mine = self._views[version], self._mine[version]
        mine.update((e.index, e) for e in added)
        head, _ = self.store.look(version)
        up = view.header
        assert up is not None  # a version is followed only once its header is heard
        if up.complete and len(mine) == len(view.entries):
            if head is None or not head.complete:
                whole = view.manifest()
                assert whole is not None  # the header is heard
                self.store.write_manifest(whole)
            return
        if head is None or (head.files, head.shard_size, head.signature) != (up.files, up.shard_size, up.signature):
            # the trainer's header as signed (sealed or not), never one of the relay's own making
            self.store.write_manifest(Manifest(**up.header_fields()))
        if added:
            self.store.append_listing(version, added)

    def _fetch(self, version: int, entry: ShardEntry, upstreams: list[str], start: str | None) -> None:
        tmp = self.store.temp_file(version)
        t: Try | None = None
        held = False
        try:
            if not upstreams:
                raise ShardError("no trusted upstream lists it")
            t = self.scheduler.start((version, entry.index), upstreams)
            fd = os.open(tmp, os.O_WRONLY)
            try:
                preallocate(fd, 0, entry.size)
                download_shard(self._conns, t.relay, version, entry, lambda pos, piece: write_at(fd, piece, pos),
                               t.started + self.cfg.read_timeout + entry.size / self.cfg.min_rate, start)
            finally:
                os.close(fd)
            self.scheduler.succeeded(t, entry.size)
            with self._lock:
                if self._views.get(version, None) is None or self._views[version].entries.get(entry.index) != entry:
                    return  # retired, or changed upstream, while we fetched
                self.store.put_shard(version, entry.index, tmp)
                self._publish(version, [entry])
                held = True
            self.scheduler.forget([(version, entry.index)])
        except ShardError as e:
            log.warning("shard %d of v%d from %s: %s (will retry)", entry.index, version, t and t.relay, e)
            if t is not None:
                self.scheduler.failed(t)
        except Exception:  # noqa: BLE001 - e.g. the version folder deleted by retention mid-fetch
            log.exception("shard %d of v%d", entry.index, version)
        finally:
            tmp.unlink(missing_ok=True)
            if t is not None:
                self.scheduler.abandon(t)  # a try neither succeeded nor failed: nothing learned
            with self._lock:
                self._inflight.discard((version, entry.index))
                if not held and version in self._missing:  # fetched again on a later pass
                    self._missing[version].add(entry.index)
