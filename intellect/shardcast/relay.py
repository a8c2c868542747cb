"""A relay: mirrors the newest versions of its upstreams into its own store, shard by shard.

Every ``poll_interval`` the relay lists its upstreams' versions, and for each of the newest
``keep`` it does not hold completely it fetches the shards it lacks (several at once, each
checked against the upstream manifest's SHA-256, or its chaining value, before it is renamed into
place). While a version is being written upstream, the pause is a long poll instead: the upstream
answers the manifest request as soon as it lists another shard, so a shard is seen at once and an
idle wait costs no requests. Its own manifest is rewritten after each shard and lists only what
it holds, so it starts serving a version's first shards while the origin is still writing the last
ones, and never advertises a byte it cannot send. A bad shard is discarded and fetched again on a
later pass (one bad hop does not spread). When every upstream is down, it keeps serving what it has.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from intellect.shardcast.choice import RelayScore, observe, pick
from intellect.shardcast.client import (ShardConnections, ShardError, download_shard, get_json, http_client,
                                       list_versions)
from intellect.shardcast.config import ClientConfig, RelayConfig
from intellect.shardcast.manifest import Manifest, ShardEntry, chain_before, compatible
from intellect.shardcast.store import VersionStore, preallocate, write_at

log = logging.getLogger("intellect.shardcast.relay")

_LONG_POLL = 1.0  # seconds an upstream may hold a manifest request until it has another shard
_CHOICE = ClientConfig()  # a relay picks among its upstreams as a client does, with the client's defaults


class Relay:
    def __init__(self, store: VersionStore, cfg: RelayConfig, seed: int | None = None):
        self.store, self.cfg = store, cfg
        self.upstreams = [u.rstrip("/") for u in cfg.upstreams]
        self.scores = {u: RelayScore() for u in self.upstreams}
        self.rng = random.Random(seed)
        self._timeout = httpx.Timeout(cfg.read_timeout, connect=cfg.connect_timeout)
        self._http = http_client(len(self.upstreams))
        self._conns = ShardConnections(cfg.connect_timeout, cfg.read_timeout, cfg.parallel)
        self._pool = ThreadPoolExecutor(cfg.parallel, thread_name_prefix="relay-get")
        self._lock = threading.Lock()
        self._upstream: dict[int, Manifest] = {}  # newest upstream view of each version being mirrored
        self._held: dict[int, set[int]] = {}
        self._inflight: set[tuple[int, int]] = set()
        store.clean_temp()
        for v in store.versions():
            m = store.manifest(v)
            self._held[v] = {s.index for s in m.shards if store.shard_path(v, s.index).is_file()}

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
        self._http.close()
        self._conns.close()

    def sync_once(self) -> bool:
        """One pass over the upstreams; True when it waited on a version being written and got new
        shards of it (the next pass may start at once: the wait replaced the pause)."""
        listing = self._upstream_versions()
        news = held_on = False
        for v in sorted(listing)[-self.cfg.keep:]:
            local = self.store.manifest(v)
            if local is not None and local.complete:
                continue
            known = self._upstream.get(v)
            hold = 0.0
            if not held_on and known is not None and not known.complete:
                # one long poll per pass: the upstream answers when it has another shard
                hold, held_on = min(_LONG_POLL, self.cfg.read_timeout / 2), True
            up = self._upstream_manifest(v, listing[v], known if hold else None, hold)
            if up is None:
                continue
            if hold and len(up.shards) > len(known.shards):
                news = True
            with self._lock:
                if local is not None and not compatible(local, up):
                    log.warning("version %d changed upstream; dropping the local copy", v)
                    self.store.drop(v)
                    self._held[v] = set()
                self._upstream[v] = up
                held = self._held.setdefault(v, set())
                self._publish(v)
                todo = [s for s in up.shards if s.index not in held and (v, s.index) not in self._inflight]
                self._inflight.update((v, s.index) for s in todo)
            for s in todo:
                self._pool.submit(self._fetch, v, s, listing[v], chain_before(up, s))
        with self._lock:
            for v in self.store.retain(self.cfg.keep):
                self._held.pop(v, None)
                self._upstream.pop(v, None)
        return news

    # ------------------------------------------------------------------ parts

    def _upstream_versions(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for u in self.upstreams:
            try:
                for v, _ in list_versions(self._http, u, self._timeout):
                    out.setdefault(v, []).append(u)
            except (httpx.HTTPError, ValueError) as e:
                log.debug("upstream %s: %s", u, e)
        return out

    def _upstream_manifest(self, version: int, upstreams: list[str], known: Manifest | None = None,
                           hold: float = 0.0) -> Manifest | None:
        """The fullest of the upstreams' manifests; with ``known``, the first upstream is asked to hold
        the answer up to ``hold`` s until it lists more shards than ``known``."""
        best = None
        for i, u in enumerate(upstreams):
            url = f"{u}/v/{version}/manifest"
            if i == 0 and known is not None:
                url += f"?after={len(known.shards)}&wait={hold:.3f}"
            try:
                m = Manifest.model_validate(get_json(self._http, url, self._timeout))
            except (httpx.HTTPError, ValueError) as e:
                log.debug("upstream %s manifest v%d: %s", u, version, e)
                continue
            fuller = best is None or (m.complete, len(m.shards)) > (best.complete, len(best.shards))
            if m.version == version and fuller:
                best = m
        return best

    def _publish(self, version: int) -> None:
        """Rewrite this relay's manifest of ``version`` to list exactly the shards it holds (under the lock)."""
        up = self._upstream[version]
        mine = up.holding(self._held[version])
        if mine != self.store.manifest(version):
            self.store.write_manifest(mine)

    def _fetch(self, version: int, entry: ShardEntry, upstreams: list[str], start: str | None) -> None:
        tmp = self.store.temp_file(version)
        upstream = None
        t0 = time.monotonic()
        try:
            with self._lock:
                upstream = pick(self.scores, upstreams, self.rng)
            fd = os.open(tmp, os.O_WRONLY)
            try:
                preallocate(fd, 0, entry.size)
                download_shard(self._conns, upstream, version, entry, lambda pos, piece: write_at(fd, piece, pos),
                               float("inf"), start)
            finally:
                os.close(fd)
            with self._lock:
                observe(self.scores, upstream, ok=True, nbytes=entry.size, seconds=time.monotonic() - t0,
                        alpha=_CHOICE.alpha, heal=_CHOICE.heal)
                if version not in self._upstream:  # retired while we fetched
                    return
                self.store.put_shard(version, entry.index, tmp)
                self._held[version].add(entry.index)
                self._publish(version)
        except ShardError as e:
            log.warning("shard %d of v%d from %s: %s (will retry)", entry.index, version, upstream, e)
            with self._lock:
                if upstream is not None:
                    observe(self.scores, upstream, ok=False, nbytes=0, seconds=0.0, alpha=_CHOICE.alpha,
                            heal=_CHOICE.heal)
        except Exception:  # noqa: BLE001 - e.g. the version folder deleted by retention mid-fetch
            log.exception("shard %d of v%d", entry.index, version)
        finally:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._inflight.discard((version, entry.index))
