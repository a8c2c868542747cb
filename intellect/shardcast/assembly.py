"""A checkpoint being assembled from shards: its files in a private folder, and its whole SHA-256.

:class:`Assembly` writes each shard's bytes at their place in the checkpoint's files as they arrive
(no second copy). :class:`OrderedHasher` extends the whole checkpoint's SHA-256 shard by shard, in
index order, as shards finish in any order: a shard checked by its chaining value
(:mod:`~intellect.shardcast.chain`) costs nothing here, the hash jumps to the value after it; any
other shard (no chaining values in the manifest, the last one ending mid-block, or ``reread``) is
read back from the page cache on the hasher's thread, so the whole hash is ready right after the
last shard.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from intellect.shardcast import chain
from intellect.shardcast.manifest import Manifest, ShardEntry
from intellect.shardcast.writer import preallocate, write_at

_READ_BACK = 4 << 20


class HashFailed(RuntimeError):
    """The whole checkpoint's SHA-256 could not be finished (a read-back failed, or the deadline passed)."""


class Assembly:
    """The checkpoint's files in ``folder``, written at shard offsets from any thread."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()
        # One writer at a time per process: concurrent pwrite() calls on one file make the kernel
        # spin on the inode lock.
        self.write_lock = threading.Lock()

    def fd(self, name: str) -> int:
        with self.lock:
            if name not in self.fds:
                self.fds[name] = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o644)
            return self.fds[name]

    def sink(self, manifest: Manifest, entry: ShardEntry) -> Callable[[int, memoryview], None]:
        """``write(offset_in_shard, piece)`` for shard ``entry``: each piece goes to its file ranges."""
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
            assert f.size is not None  # a complete manifest sizes every file
            os.ftruncate(self.fd(f.name), f.size)
        self.close()

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


class OrderedHasher:
    """SHA-256 of the blob, fed shard by shard in index order as shards finish (on its own thread).

    Set :attr:`manifest` before the first :meth:`add`, and again whenever a newer view of the same
    publication lists more shards; :meth:`stop` it in every case."""

    def __init__(self, asm: Assembly):
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
        """Shard ``index`` is written (``chained``: and checked by its chaining value)."""
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
                if manifest is None or (entry := manifest.shard(index)) is None:
                    raise RuntimeError(f"shard {index} finished but not in the manifest")
                if chained:
                    self._h = chain.ChainedSha256(entry.chain, entry.offset + entry.size)
                else:
                    self._read_back(manifest, entry, buf)
                with self._cv:
                    self._next += 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by result()
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
        """The whole blob's hex SHA-256 once every shard of :attr:`manifest` was added and hashed;
        raises :class:`HashFailed` past ``deadline`` or when hashing failed."""
        if self.manifest is None:
            raise HashFailed("no manifest to hash against")
        total = len(self.manifest.shards)
        with self._cv:
            while self._next < total and self._error is None:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise HashFailed("hashing the checkpoint did not finish before the deadline")
            if self._error is not None:
                raise HashFailed(f"hashing the checkpoint failed: {self._error}") from self._error
        return self._h.hexdigest()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
