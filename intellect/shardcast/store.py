"""The folder an origin or relay serves: ``v<N>/manifest.json``, ``v<N>/listing.jsonl`` and ``v<N>/shard_<i>.bin``.

Files are the contract between the process that writes a version (the trainer's publish,
:mod:`~intellect.shardcast.writer`; a relay's sync thread) and the server that serves it: each
shard is written to a temporary name, checked, and renamed into place before it is listed (one line
appended to the version's listing, after the manifest header that covers its files), and a
manifest is replaced atomically. So a server never advertises a shard it cannot send, and a crash
leaves at most a ``.tmp-*`` file, which is ignored and removed, or a last line half appended, which
is not read. :class:`VersionStore` holds the layout, the reads a server answers from, and these few
atomic steps (rename, append, replace, delete); cutting a checkpoint into shards is the writer's.

Every header and listing line carries the trainer's signature (:mod:`~intellect.shardcast.signing`):
the origin's writer signs them as it writes, a relay writes them as it received and verified them.
A server passes them on unchanged, and its readers check them in turn.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from intellect.shardcast.manifest import Manifest, ManifestDelta, ShardEntry

log = logging.getLogger("intellect.shardcast.store")

MANIFEST = "manifest.json"
# A version being written is its manifest's header (files, shard size; no shards) and this log of
# its shards in listing order, one JSON line each: a new shard is one append, not a rewrite of a list
# that grows with every shard (quadratic in the shard count). Its first line
# names the listing. The complete manifest lists every shard itself.
LISTING = "listing.jsonl"
LINKED = "files"  # a version's hard-linked files (origin only)
LINKED_STAT = "linked.json"
_VERSION_DIR = re.compile(r"^v(0|[1-9][0-9]{0,9})$")
_TMP = ".tmp-"


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data`` in one rename: a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Listing:
    """A version's listing log as read so far: read on from where the last look stopped."""

    def __init__(self, inode: int):
        self.inode, self.offset, self.name = inode, 0, ""
        self.entries: list[ShardEntry] = []
        self.by_index: dict[int, ShardEntry] = {}
        self.broken = False

    def take(self, raw: bytes, path: Path) -> None:
        end = raw.rfind(b"\n") + 1  # a line being appended is read once it is whole
        for line in raw[:end].splitlines():
            if self.broken:
                break
            try:
                if not self.name:
                    header = _LISTING_NAME.match(line)
                    if header is None:
                        raise ValueError(f"not a listing header: {line[:80]!r}")
                    self.name = header.group(1).decode()
                    continue
                e = ShardEntry.model_validate_json(line)
            except (ValueError, AttributeError) as err:
                log.warning("%s: unreadable line after %d shards, listing stops there (%s)", path,
                            len(self.entries), str(err).splitlines()[0])
                self.broken = True
                break
            known = self.by_index.get(e.index)
            if known is None:
                self.entries.append(e)
                self.by_index[e.index] = e
            elif known != e:
                log.warning("%s: shard %d listed twice, differently; listing stops there", path, e.index)
                self.broken = True
        self.offset += end


_LISTING_NAME = re.compile(rb'^\{"listing": ?"([0-9a-f]{1,32})"\}$')


class VersionStore:
    """Versions under ``root``; every name is built from integers, never from a request path."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        # file name -> version -> (the file's inode, mtime and size, its parsed content)
        self._parsed: dict[str, dict[int, tuple[tuple[int, int, int], Any]]] = {}
        self._listings: dict[int, _Listing] = {}
        self._lock = threading.Lock()
        self._merged: dict[int, tuple[Manifest, int, Manifest]] = {}  # version -> (header, listed, manifest)

    def version_dir(self, version: int) -> Path:
        if not 0 <= version < 10**10:
            raise ValueError(f"version out of range: {version}")
        return self.root / f"v{version}"

    def shard_path(self, version: int, index: int) -> Path:
        if not 0 <= index < 10**7:
            raise ValueError(f"shard index out of range: {index}")
        return self.version_dir(version) / f"shard_{index:05d}.bin"

    def open_shard(self, version: int, index: int) -> list[tuple[int, int, int]] | None:
        """Shard ``index`` of ``version`` as ``(fd, offset, length)`` pieces, open for reading (the caller
        closes them): its shard file, or ranges of the version's linked files; None when not held.
        Raises :class:`SourceChanged` when a linked file no longer is what was published."""
        try:
            fd = os.open(self.shard_path(version, index), os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return self._open_linked(version, index)
        try:
            return [(fd, 0, os.fstat(fd).st_size)]  # a shard file is final once it has its name
        except BaseException:
            os.close(fd)
            raise

    def _open_linked(self, version: int, index: int) -> list[tuple[int, int, int]] | None:
        stats = self._read(version, LINKED_STAT, json.loads)  # read once per version, not per request
        if stats is None:
            return None
        d = self.version_dir(version)
        m, _ = self.look(version)
        entry = None
        if m is not None:
            entry = m.shard(index)
            with self._lock:
                listing = self._listings.get(version)
                if entry is None and listing is not None:
                    entry = listing.by_index.get(index)
        if entry is None or m is None:  # not listed yet: not hashed yet (no entry without m)
            return None
        pieces: list[tuple[int, int, int]] = []
        try:
            for name, off, n in m.segments(entry):
                fd = os.open(d / LINKED / name, os.O_RDONLY)
                pieces.append((fd, off, n))
                st = os.fstat(fd)
                if [st.st_size, st.st_mtime_ns] != stats.get(name):
                    raise SourceChanged(f"v{version}/{name} changed after it was published "
                                        f"(size, mtime {stats.get(name)} -> {[st.st_size, st.st_mtime_ns]})")
        except BaseException:
            for fd, _, _ in pieces:
                os.close(fd)
            raise
        return pieces

    def versions(self) -> list[int]:
        """Versions with a manifest, oldest first."""
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and (p / MANIFEST).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def manifest(self, version: int) -> Manifest | None:
        """The version's manifest: its header with every shard listed so far (None: no such version)."""
        head, listed, count, _ = self._state(version)
        if head is None or head.complete or not count:
            return head
        hit = self._merged.get(version)
        if hit is not None and hit[0] is head and hit[1] == count:
            return hit[2]
        shards = sorted(listed[:count], key=lambda e: e.index)  # every entry was validated as it was read
        m = Manifest.model_construct(**{**{k: getattr(head, k) for k in Manifest.model_fields}, "shards": shards})
        self._merged[version] = (head, count, m)
        return m

    def look(self, version: int) -> tuple[Manifest | None, int]:
        """The version's manifest as written (for a version being written: the header) and how many
        shards it lists beyond those. Servers answer every poll from here: a look reads only what was
        appended since the last, and copies nothing."""
        head, _, count, _ = self._state(version)
        return head, count

    def _state(self, version: int) -> tuple[Manifest | None, list[ShardEntry], int, str]:
        """``(header, listing, shards listed, listing name)``: the listing is only ever appended to, so
        its first ``shards listed`` entries stay what they are after the lock is let go."""
        # one look at a time: a relay's server and its sync threads share the store
        with self._lock:
            # the log before the header: a shard is appended after the header that lists its files,
            # so a header read afterwards covers every shard read
            listing = self._listing(version)
            head = self._read(version, MANIFEST, Manifest.model_validate_json)
            if head is None or head.complete or listing is None:
                return head, [], 0, ""
            listed = listing.entries
            if head.shards:
                listed = [e for e in listed if head.shard(e.index) is None]
            return head, listed, len(listed), listing.name

    def delta(self, version: int, since: int, listing: str) -> ManifestDelta | None:
        """What a server answers a manifest long poll with: the header and the shards of its listing
        from ``since`` on (from the start when ``listing`` is not the current listing's name)."""
        head, listed, count, name = self._state(version)
        if head is None:
            return None
        fields = {**head.header_fields(), "complete": head.complete}
        if head.complete:
            return ManifestDelta.model_construct(**fields, listing="", since=0, shards=head.shards)
        total = len(head.shards) + count
        if listing != name or since > total:
            since = 0
        news = [*head.shards, *listed[:count]][since:] if head.shards else listed[since:count]
        return ManifestDelta.model_construct(**fields, listing=name, since=since, shards=news)

    def _listing(self, version: int) -> _Listing | None:
        path = self.version_dir(version) / LISTING
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._listings.pop(version, None)
            return None
        try:
            st = os.fstat(fd)
            state = self._listings.get(version)
            if state is None or state.inode != st.st_ino or st.st_size < state.offset:
                state = self._listings[version] = _Listing(st.st_ino)
            if st.st_size > state.offset and not state.broken:
                state.take(os.pread(fd, st.st_size - state.offset, state.offset), path)
            return state
        finally:
            os.close(fd)

    def append_listing(self, version: int, entries: list[ShardEntry]) -> None:
        """List ``entries`` (shards now held, checked and in place) after those listed before."""
        path = self.version_dir(version) / LISTING
        if not path.exists():
            atomic_write(path, b'{"listing": "%s"}\n' % os.urandom(8).hex().encode())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            data = b"".join(e.model_dump_json().encode() + b"\n" for e in entries)
            view = memoryview(data)
            while view:  # one write for a line, so a reader never sees half of one but at the end
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def _read(self, version: int, name: str, parse: Callable[[bytes], Any]) -> Any:
        """``parse`` of the version's file ``name`` (None when there is none), parsed again only when the
        file was replaced (every write is a new inode) or changed."""
        path = self.version_dir(version) / name
        cache = self._parsed.setdefault(name, {})
        try:
            st = path.stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            hit = cache.get(version)
            if hit is not None and hit[0] == key:
                return hit[1]
            raw = path.read_bytes()
        except FileNotFoundError:
            cache.pop(version, None)
            return None
        value = parse(raw)
        cache[version] = (key, value)
        return value

    def write_manifest(self, manifest: Manifest) -> None:
        d = self.version_dir(manifest.version)
        d.mkdir(exist_ok=True)
        atomic_write(d / MANIFEST, manifest.model_dump_json().encode())

    def put_shard(self, version: int, index: int, tmp: Path) -> Path:
        """Rename a fully written and checked temporary file (made by :meth:`temp_file`) into place."""
        dest = self.shard_path(version, index)
        os.replace(tmp, dest)
        return dest

    def temp_file(self, version: int) -> Path:
        d = self.version_dir(version)
        d.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=d)
        os.close(fd)
        return Path(tmp)

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` versions and the bases they are patches against, down to
        their full versions (the manifest first, so none is served half-deleted): a patch still served
        never loses its base. So at most ``keep`` + the origin's anchor interval - 1 versions stay."""
        versions = self.versions()
        kept = set(versions[-keep:] if keep > 0 else [])
        todo = sorted(kept)
        while todo:
            m = self.manifest(todo.pop())
            base = m.lineage.base if m is not None else None
            if base is not None and base not in kept:
                kept.add(base)
                todo.append(base)
        doomed = [v for v in versions if v not in kept]
        for v in doomed:
            self.drop(v)
        return doomed

    def drop(self, version: int) -> None:
        """Delete one version, its manifest first so it stops being served before its shards go."""
        d = self.version_dir(version)
        (d / MANIFEST).unlink(missing_ok=True)
        with self._lock:
            for cache in self._parsed.values():
                cache.pop(version, None)
            self._listings.pop(version, None)
            self._merged.pop(version, None)
        shutil.rmtree(d, ignore_errors=True)

    def clean_temp(self) -> None:
        """Remove what a crashed writer left behind."""
        for p in self.root.glob(f"v*/{_TMP}*"):
            p.unlink(missing_ok=True)


class SourceChanged(OSError):
    """A hard-linked file of a published version was modified in place afterwards."""
