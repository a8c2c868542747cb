"""The folder an origin or relay serves: ``v<N>/manifest.json``, ``v<N>/listing.jsonl`` and ``v<N>/shard_<i>.bin``.

Files are the contract between the process that writes a version (the trainer's publish, a relay's
sync thread) and the server that serves it: each shard is written to a temporary name, checked, and
renamed into place before it is listed (one line appended to the version's listing, after the
manifest header that covers its files), and a manifest is replaced atomically. So a server never
advertises a shard it cannot send, and a crash leaves at most a ``.tmp-*`` file, which is ignored
and removed, or a last line half appended, which is not read.

Every header and listing line carries the trainer's signature (:mod:`~intellect.shardcast.signing`):
the origin's :class:`VersionWriter` signs them as it writes, a relay writes them as it received and
verified them. A server passes them on unchanged, and its readers check them in turn.

:class:`VersionWriter` is how the origin publishes: bytes go in as the checkpoint is written,
shards come out as soon as they fill, so relays and clients start before the checkpoint is whole.
A checkpoint folder that already exists on the origin's file system is published without a copy
(:func:`publish_folder`): its files are hard-linked into ``v<N>/files/``, hashed once, and each
shard is served as a range of them. A 62 GB checkpoint then takes no second 62 GB on the trainer's
disk, and publishing writes nothing but manifests and listings (on loopback, 1 GiB origin -> 2 relays -> 1
client: 7.1 -> 6.0 CPU-s in all, most of it the page-cache writes of the copy, dear in a VM). The
sizes and modification times of the linked files are kept in ``v<N>/linked.json``; a file changed
in place after publishing is refused, not served.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from intellect.shardcast.chain import whole_hasher
from intellect.shardcast.manifest import FILE_NAME, FileEntry, Manifest, ManifestDelta, ShardEntry
from intellect.shardcast.signing import VersionSigner
from intellect.storage import STABLE
from intellect.trust.keys import SigningKey

log = logging.getLogger("intellect.shardcast.store")

MANIFEST = "manifest.json"
# A version being written is its manifest's header (files, shard size; no shards) and this log of
# its shards in listing order, one JSON line each: a new shard is one append, not a rewrite of a list
# that grows with every shard (quadratic: ~4,000 shards for a 62 GB checkpoint). Its first line
# names the listing. The complete manifest lists every shard itself.
LISTING = "listing.jsonl"
LINKED = "files"  # a version's hard-linked files (origin only)
_LINKED_STAT = "linked.json"
_VERSION_DIR = re.compile(r"^v(0|[1-9][0-9]{0,9})$")
_TMP = ".tmp-"
_COPY_CHUNK = 4 << 20
# Page-cache writes go in pieces this big: the kernel sizes a new file's folios by the write, and in
# this VM (free-page reporting) large folios are dear to touch first (perf: copy_folio_from_iter_atomic).
# Alone, a fresh 1 GiB file took 0.34 s in 16 KiB writes, 0.22 s in 64 KiB, 0.18 s in 256 KiB and
# 0.47 s in 1 MiB; but with five processes writing at once (the loopback benchmark, end to end, median
# of 3) 256 KiB pieces took 5.90-6.44 s against 5.63 s for 64 KiB and 5.67-5.71 s for 16 KiB.
WRITE_PIECE = 64 << 10
# A piece at least this big is hashed (shard and whole checkpoint) on two helper threads while this
# one writes it: the origin's writer is the head of the pipeline, so its latency is everyone's.
_PARALLEL_MIN = 256 << 10


def _load_fallocate():
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate  # Linux's; absent elsewhere
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return f


_FALLOCATE = _load_fallocate()


def preallocate(fd: int, offset: int, length: int) -> None:
    """Reserve ``length`` bytes of ``fd`` at ``offset`` before writing them, where the file system can.

    ext4 then allocates the range's extents once instead of reserving blocks page by page as the
    writes come: 1 GiB in 16 MiB files, written in 64 KiB pieces, took 0.17 CPU-s instead of 0.24
    (whole machine; the writeback after took 0.07-0.11 either way).
    Not ``os.posix_fallocate``: where the file system has no fallocate, glibc emulates it by writing
    a byte into every block. A failure is left to the writes that follow to report.
    """
    if _FALLOCATE is not None and length > 0:
        _FALLOCATE(fd, 0, offset, length)


def write_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``, in :data:`WRITE_PIECE` pieces."""
    view = memoryview(data)
    end = len(view)
    pos = 0
    while pos < end:
        pos += os.pwrite(fd, view[pos: pos + WRITE_PIECE], offset + pos)


def _atomic_write(path: Path, data: bytes) -> None:
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
                    self.name = _LISTING_NAME.match(line).group(1).decode()
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
        stats = self._read(version, _LINKED_STAT, json.loads)  # read once per version, not per request
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
        if entry is None:  # not listed yet: not hashed yet
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
        fields = {k: getattr(head, k) for k in ("version", "files", "shard_size", "total_size", "sha256", "complete",
                                                "publication", "signature")}
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
            _atomic_write(path, b'{"listing": "%s"}\n' % os.urandom(8).hex().encode())
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
        _atomic_write(d / MANIFEST, manifest.model_dump_json().encode())

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
        """Delete all but the newest ``keep`` versions (the manifest first, so none is served half-deleted)."""
        versions = self.versions()
        doomed = versions[:-keep] if keep > 0 else versions
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


class _CannotLink(OSError):
    """A file cannot be hard-linked into the store (another file system, or not permitted)."""


class VersionWriter:
    """Cut a checkpoint into shards while it is being written; each full shard is published at once,
    every header and shard signed with the trainer's ``key`` (:mod:`~intellect.shardcast.signing`:
    one Ed25519 signature per shard and one per file begun, and one to seal the version).

    With ``linked``, the version is whole files that already exist (:meth:`add_file` only): each is
    hard-linked into the store and hashed, and a shard is published as a range of them, no copy made.

    >>> import tempfile
    >>> store = VersionStore(tempfile.mkdtemp())
    >>> with VersionWriter(store, version=1, shard_size=4, key=SigningKey.from_seed(bytes(32))) as w:
    ...     w.begin_file("a.txt"); w.write(b"hello ")
    ...     w.begin_file("b.txt"); w.write(b"world")
    >>> m = store.manifest(1)
    >>> m.complete, m.total_size, [s.size for s in m.shards], [(f.name, f.offset, f.size) for f in m.files]
    (True, 11, [4, 4, 3], [('a.txt', 0, 6), ('b.txt', 6, 5)])
    """

    def __init__(self, store: VersionStore, version: int, shard_size: int, key: SigningKey, linked: bool = False):
        if store.manifest(version) is not None:
            raise FileExistsError(f"version {version} already exists in {store.root}")
        self.store, self.version, self.shard_size, self.linked = store, version, shard_size, linked
        self._signer = VersionSigner(key, version)
        self._linked_stat: dict[str, list[int]] = {}
        self._files: list[FileEntry] = []
        self._header_files: list[FileEntry] | None = None  # the files the manifest on disk lists
        self._shards: list[ShardEntry] = []
        self._whole = whole_hasher()
        self._pos = 0  # bytes written so far
        self._tmp: Path | None = None
        self._fh = None
        self._shard_hash = None
        self._done = False
        self._hasher: ThreadPoolExecutor | None = None

    def begin_file(self, name: str) -> None:
        if not FILE_NAME.match(name):
            raise ValueError(f"file name {name!r} must be one plain path component ({FILE_NAME.pattern})")
        if any(f.name == name for f in self._files):
            raise ValueError(f"file {name!r} written twice")
        if self._files:
            last = self._files[-1]
            self._files[-1] = last.model_copy(update={"size": self._pos - last.offset})
        self._files.append(FileEntry(name=name, offset=self._pos))

    def write(self, data: bytes | memoryview) -> None:
        if self.linked:
            raise RuntimeError("a version of linked files takes whole files (add_file)")
        self._take(memoryview(data), copy=True)

    def _take(self, view: memoryview, copy: bool) -> None:
        """Hash ``view`` into the current shard and the whole blob, and with ``copy`` write it to the shard file."""
        if not self._files:
            raise RuntimeError("begin_file before write")
        if len(view) >= _PARALLEL_MIN and self._hasher is None:
            self._hasher = ThreadPoolExecutor(2, thread_name_prefix="shardcast-hash")
        while view:
            if self._shard_hash is None:
                self._shard_hash = hashlib.sha256()
                if copy:
                    self._tmp = self.store.temp_file(self.version)
                    self._fh = os.open(self._tmp, os.O_WRONLY)
            in_shard = self._pos - len(self._shards) * self.shard_size
            take = view[: self.shard_size - in_shard]
            # the whole-blob hash goes piece by piece, so that its state at each shard's end (the
            # chaining value) is there to read when the shard is sealed
            if len(take) >= _PARALLEL_MIN and copy:
                hashing = [self._hasher.submit(h.update, take) for h in (self._whole, self._shard_hash)]
                try:
                    write_at(self._fh, take, in_shard)
                finally:
                    for f in hashing:
                        f.result()
            elif len(take) >= _PARALLEL_MIN:  # nothing to write: this thread hashes one of the two
                hashing = self._hasher.submit(self._shard_hash.update, take)
                try:
                    self._whole.update(take)
                finally:
                    hashing.result()
            else:
                if copy:
                    write_at(self._fh, take, in_shard)
                self._whole.update(take)
                self._shard_hash.update(take)
            self._pos += len(take)
            view = view[len(take):]
            if in_shard + len(take) == self.shard_size:
                self._seal_shard()

    def add_file(self, path: str | os.PathLike, name: str | None = None) -> None:
        """Stream a file that already exists into the version (linked: link it, then hash it)."""
        name = name or Path(path).name
        self.begin_file(name)
        if self.linked:
            path = self._link(Path(path), name)
        buf = memoryview(bytearray(_COPY_CHUNK))  # reused: fresh memory is dear to touch (see WRITE_PIECE)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                self._take(buf[:n], copy=not self.linked)
        if self.linked and self._linked_stat[name] != _size_mtime(path):
            raise SourceChanged(f"{path} changed while it was being published")

    def _link(self, src: Path, name: str) -> Path:
        d = self.store.version_dir(self.version)
        (d / LINKED).mkdir(parents=True, exist_ok=True)
        dest = d / LINKED / name
        dest.unlink(missing_ok=True)  # left by a publish of this version that died before its manifest
        try:
            os.link(src, dest)
        except OSError as e:
            raise _CannotLink(e.errno, f"cannot hard-link {src} into {d / LINKED}: {e.strerror}") from e
        self._linked_stat[name] = _size_mtime(dest)
        # before any shard of it is listed: a server checks each linked file against this
        _atomic_write(d / _LINKED_STAT, json.dumps(self._linked_stat).encode())
        return dest

    def _seal_shard(self) -> None:
        index = len(self._shards)
        size = self._pos - index * self.shard_size
        if self._fh is not None:
            os.close(self._fh)
            self.store.put_shard(self.version, index, self._tmp)
        entry = self._signer.shard(ShardEntry(index=index, offset=index * self.shard_size, size=size,
                                              sha256=self._shard_hash.hexdigest(), chain=self._whole.chain()))
        self._shards.append(entry)
        self._fh = self._tmp = self._shard_hash = None
        if self._files != self._header_files:  # the header first: it must cover the shard's files
            self._header_files = list(self._files)
            self.store.write_manifest(Manifest(version=self.version, files=self._files, shard_size=self.shard_size,
                                               publication=self._signer.publication,
                                               signature=self._signer.header(self._files, self.shard_size)))
        self.store.append_listing(self.version, [entry])

    def _publish(self) -> None:
        sha = self._whole.hexdigest()
        self.store.write_manifest(Manifest(
            version=self.version, files=self._files, shards=self._shards, shard_size=self.shard_size,
            total_size=self._pos, sha256=sha, complete=True, publication=self._signer.publication,
            signature=self._signer.header(self._files, self.shard_size, self._pos, sha)))

    def finish(self) -> Manifest:
        self._stop_hasher()
        if self._shard_hash is not None:  # bytes after the last full shard
            self._seal_shard()
        if self._files:
            last = self._files[-1]
            self._files[-1] = last.model_copy(update={"size": self._pos - last.offset})
        self._publish()
        self._done = True
        return self.store.manifest(self.version)

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def abort(self) -> None:
        """Withdraw a version that failed halfway: nobody may take its listed shards for a checkpoint."""
        self._stop_hasher()
        if self._fh is not None:
            os.close(self._fh)
            self._tmp.unlink(missing_ok=True)
        self.store.drop(self.version)

    def __enter__(self) -> "VersionWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        elif not self._done:
            self.abort()


def _size_mtime(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def publish_folder(store: VersionStore, version: int, folder: str | os.PathLike, shard_size: int,
                   keep: int, *, key: SigningKey, skip: frozenset[str] | set[str] = frozenset({STABLE}),
                   link: bool = True) -> Manifest:
    """Publish the regular files of a checkpoint folder (sorted by name, but not those in ``skip``;
    or one file) as ``version``, signed with the trainer's ``key``, then keep the newest ``keep``.

    With ``link`` the files are hard-linked into the store, not copied, where the file system allows
    (else they are copied): they must not be modified in place afterwards (a file changed after
    publishing is refused by the server; a new checkpoint in new files is what trainers write)."""
    src = Path(folder)
    files = [src] if src.is_file() else sorted(
        p for p in src.iterdir() if p.is_file() and FILE_NAME.match(p.name) and p.name not in skip)
    try:
        with VersionWriter(store, version, shard_size, key, linked=link) as w:
            for p in files:
                w.add_file(p)
    except _CannotLink as e:  # the version was withdrawn: publish it again as a copy
        log.info("%s; copying instead", e)
        with VersionWriter(store, version, shard_size, key) as w:
            for p in files:
                w.add_file(p)
    store.retain(keep)
    return store.manifest(version)
