"""The write side of SHARDCAST's store: the origin's :class:`VersionWriter` and :func:`publish_folder`,
and the page-cache writes every downloader uses (:func:`write_at`, :func:`preallocate`).

:class:`VersionWriter` cuts a checkpoint into shards as its bytes go in: each full shard is hashed,
signed, renamed into place and listed at once, so relays and clients start before the checkpoint
is whole. A checkpoint folder that already exists on the origin's file system is published without
a copy (:func:`publish_folder`): its files are hard-linked into ``v<N>/files/``, hashed once, and
each shard is served as a range of them, so a checkpoint takes no second copy on the trainer's disk
and publishing writes nothing but manifests and listings. The sizes and modification times of the
linked files are kept in ``v<N>/linked.json``; a file changed in place after publishing is refused,
not served (:class:`~intellect.shardcast.store.SourceChanged`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from intellect.shardcast.chain import whole_hasher
from intellect.shardcast.header import FILE_NAME, FULL, Lineage
from intellect.shardcast.manifest import FileEntry, Manifest, ShardEntry
from intellect.shardcast.signing import VersionSigner
from intellect.shardcast.store import LINKED, LINKED_STAT, SourceChanged, VersionStore, atomic_write
from intellect.storage import STABLE
from intellect.trust.keys import SigningKey

log = logging.getLogger("intellect.shardcast.writer")

_COPY_CHUNK = 4 << 20
# Page-cache writes go in pieces this big: the kernel sizes a new file's folios by the write, and
# large folios can be dear to touch first (under free-page reporting in a VM, for one); several
# writers at once favour small pieces (figures: benchmarks/results).
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
    writes come. Not ``os.posix_fallocate``: where the file system has no fallocate, glibc emulates
    it by writing a byte into every block. A failure is left to the writes that follow to report.
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

    def __init__(self, store: VersionStore, version: int, shard_size: int, key: SigningKey, linked: bool = False,
                 lineage: Lineage = FULL):
        if store.manifest(version) is not None:
            raise FileExistsError(f"version {version} already exists in {store.root}")
        self.store, self.version, self.shard_size, self.linked = store, version, shard_size, linked
        self._signer = VersionSigner(key, version, lineage=lineage)
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
            shard_hash, fh, hasher = self._shard_hash, self._fh, self._hasher
            in_shard = self._pos - len(self._shards) * self.shard_size
            take = view[: self.shard_size - in_shard]
            # the whole-blob hash goes piece by piece, so that its state at each shard's end (the
            # chaining value) is there to read when the shard is sealed
            if len(take) >= _PARALLEL_MIN and copy:
                assert hasher is not None and fh is not None  # made above: view is at least as long as take
                hashing = [hasher.submit(self._whole.update, take), hasher.submit(shard_hash.update, take)]
                try:
                    write_at(fh, take, in_shard)
                finally:
                    for f in hashing:
                        f.result()
            elif len(take) >= _PARALLEL_MIN:  # nothing to write: this thread hashes one of the two
                assert hasher is not None  # made above: view is at least as long as take
                hashing = hasher.submit(shard_hash.update, take)
                try:
                    self._whole.update(take)
                finally:
                    hashing.result()
            else:
                if copy:
                    assert fh is not None  # opened above with the shard's hash
                    write_at(fh, take, in_shard)
                self._whole.update(take)
                shard_hash.update(take)
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
        atomic_write(d / LINKED_STAT, json.dumps(self._linked_stat).encode())
        return dest

    def _seal_shard(self) -> None:
        index = len(self._shards)
        size = self._pos - index * self.shard_size
        shard_hash = self._shard_hash
        assert shard_hash is not None  # only a shard with bytes in it is sealed
        if self._fh is not None:
            assert self._tmp is not None  # opened together
            os.close(self._fh)
            self.store.put_shard(self.version, index, self._tmp)
        entry = self._signer.shard(ShardEntry(index=index, offset=index * self.shard_size, size=size,
                                              sha256=shard_hash.hexdigest(), chain=self._whole.chain()))
        self._shards.append(entry)
        self._fh = self._tmp = self._shard_hash = None
        if self._files != self._header_files:  # the header first: it must cover the shard's files
            self._header_files = list(self._files)
            self.store.write_manifest(Manifest(version=self.version, files=self._files, shard_size=self.shard_size,
                                               publication=self._signer.publication, lineage=self._signer.lineage,
                                               signature=self._signer.header(self._files, self.shard_size)))
        self.store.append_listing(self.version, [entry])

    def _publish(self) -> None:
        sha = self._whole.hexdigest()
        self.store.write_manifest(Manifest(
            version=self.version, files=self._files, shards=self._shards, shard_size=self.shard_size,
            total_size=self._pos, sha256=sha, complete=True, publication=self._signer.publication,
            lineage=self._signer.lineage,
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
        return _published(self.store, self.version)

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def abort(self) -> None:
        """Withdraw a version that failed halfway: nobody may take its listed shards for a checkpoint."""
        self._stop_hasher()
        if self._fh is not None:
            os.close(self._fh)
            if self._tmp is not None:  # opened together
                self._tmp.unlink(missing_ok=True)
        self.store.drop(self.version)

    def __enter__(self) -> "VersionWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        elif not self._done:
            self.abort()


def _published(store: VersionStore, version: int) -> Manifest:
    m = store.manifest(version)
    if m is None:
        raise RuntimeError(f"version {version} was deleted as it was published")
    return m


def _size_mtime(path: str | os.PathLike) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def publish_folder(store: VersionStore, version: int, folder: str | os.PathLike, shard_size: int,
                   keep: int, *, key: SigningKey, skip: frozenset[str] | set[str] = frozenset({STABLE}),
                   link: bool = True, lineage: Lineage = FULL) -> Manifest:
    """Publish the regular files of a checkpoint folder (sorted by name, but not those in ``skip``;
    or one file) as ``version``, signed with the trainer's ``key``, then keep the newest ``keep``.

    With ``link`` the files are hard-linked into the store, not copied, where the file system allows
    (else they are copied): they must not be modified in place afterwards (a file changed after
    publishing is refused by the server; a new checkpoint in new files is what trainers write).
    ``lineage`` says what the files are (a whole checkpoint, or a weight patch), signed with the header."""
    src = Path(folder)
    files = [src] if src.is_file() else sorted(
        p for p in src.iterdir() if p.is_file() and FILE_NAME.match(p.name) and p.name not in skip)
    try:
        with VersionWriter(store, version, shard_size, key, linked=link, lineage=lineage) as w:
            for p in files:
                w.add_file(p)
    except _CannotLink as e:  # the version was withdrawn: publish it again as a copy
        log.info("%s; copying instead", e)
        with VersionWriter(store, version, shard_size, key, lineage=lineage) as w:
            for p in files:
                w.add_file(p)
    store.retain(keep)
    return _published(store, version)
