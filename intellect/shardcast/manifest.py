"""What a SHARDCAST version is: a checkpoint's files, cut into shards, each with its SHA-256.

A version is the concatenation of its files in manifest order (the *blob*), cut into shards of
``shard_size`` bytes (the last one shorter). The manifest lists every file with its offset in the
blob and every shard with its offset, size, SHA-256 and the blob's SHA-256 chaining value at its end
(:mod:`~intellect.shardcast.chain`), plus the whole blob's SHA-256 once the version is ``complete``.
The origin rewrites the manifest as each shard lands, so a reader may see a manifest that lists
only the first shards and the files begun so far (``size`` None for the file still being written);
every shard listed is final.

Relays serve a manifest restricted to the shards they hold (:meth:`Manifest.holding`), so a
manifest never advertises a byte the server cannot send.

>>> m = Manifest(version=3, files=[FileEntry(name="config.json", offset=0, size=5),
...                                FileEntry(name="model.safetensors", offset=5, size=7)],
...              shards=[ShardEntry(index=0, offset=0, size=8, sha256="0" * 64),
...                      ShardEntry(index=1, offset=8, size=4, sha256="1" * 64)],
...              shard_size=8, total_size=12, sha256="2" * 64, complete=True)
>>> [(f, o, n) for f, o, n in m.segments(m.shards[0])]
[('config.json', 0, 5), ('model.safetensors', 0, 3)]
>>> m.holding({1}).shards[0].index, m.holding({1}).complete
(1, False)
"""

from __future__ import annotations

import re
from bisect import bisect_left
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

from intellect.shardcast.chain import INITIAL

SHA256_HEX = r"^[0-9a-f]{64}$"
# A file name of a version: one path component, no hidden or temporary names, so a client can
# never be steered into writing outside its target folder.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    name: str = Field(pattern=FILE_NAME.pattern, description="File name inside the checkpoint folder.")
    offset: int = Field(ge=0, description="Offset of the file's first byte in the blob.")
    size: int | None = Field(None, ge=0, description="Bytes; None while the origin is still writing it.")


class ShardEntry(_Strict):
    index: int = Field(ge=0, le=10_000_000)
    offset: int = Field(ge=0)
    size: int = Field(ge=1)
    sha256: str = Field(pattern=SHA256_HEX)
    chain: str | None = Field(
        None, pattern=SHA256_HEX, description="SHA-256 chaining value of the blob right after this shard "
        "(:mod:`~intellect.shardcast.chain`): with the previous shard's, it checks this shard and, shard by "
        "shard, the whole blob in one pass. None where the shard ends mid-block or the origin had no way to "
        "compute it.")


class Manifest(_Strict):
    version: int = Field(ge=0, description="The checkpoint's step.")
    files: list[FileEntry] = Field(default_factory=list)
    shards: list[ShardEntry] = Field(default_factory=list)
    shard_size: int = Field(16 << 20, ge=1, description="Bytes per shard (the last one may be shorter).")
    total_size: int | None = Field(None, ge=0, description="Blob bytes, once complete.")
    sha256: str | None = Field(None, pattern=SHA256_HEX, description="SHA-256 of the blob, once complete.")
    complete: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        pos = 0
        for i, f in enumerate(self.files):
            if f.offset != pos:
                raise ValueError(f"file {f.name!r} starts at {f.offset}, expected {pos}")
            if f.size is None:
                if i != len(self.files) - 1 or self.complete:
                    raise ValueError(f"file {f.name!r} has no size but is not the one being written")
                pos = None
                break
            pos += f.size
        if len({f.name for f in self.files}) != len(self.files):
            raise ValueError("duplicate file names")
        for s in self.shards:
            if s.offset != s.index * self.shard_size or s.size > self.shard_size:
                raise ValueError(f"shard {s.index} at {s.offset}+{s.size} does not fit shard_size {self.shard_size}")
            if s.chain is not None and (s.offset + s.size) % 64:
                raise ValueError(f"shard {s.index} ends mid-block ({s.offset + s.size}) but has a chaining value")
            if pos is not None and s.offset + s.size > pos:
                raise ValueError(f"shard {s.index} ends past the files ({pos} bytes)")
        if len({s.index for s in self.shards}) != len(self.shards):
            raise ValueError("duplicate shard indices")
        if any(a.index > b.index for a, b in zip(self.shards, self.shards[1:])):
            raise ValueError("shards must be listed in index order")
        if self.complete:
            if self.total_size is None or self.sha256 is None:
                raise ValueError("a complete manifest needs total_size and sha256")
            if pos != self.total_size:
                raise ValueError(f"files hold {pos} bytes, total_size says {self.total_size}")
            if sorted(s.index for s in self.shards) != list(range(shard_count(self.total_size, self.shard_size))):
                raise ValueError("a complete manifest must list every shard")
            for s in self.shards:
                if s.size != min(self.shard_size, self.total_size - s.offset):
                    raise ValueError(f"shard {s.index} has {s.size} bytes, the layout says otherwise")
        return self

    def shard(self, index: int) -> ShardEntry | None:
        # a bisection, not a scan: clients look shards up per shard, and a 62 GB checkpoint has ~4,000
        i = bisect_left(self.shards, index, key=lambda s: s.index)
        return self.shards[i] if i < len(self.shards) and self.shards[i].index == index else None

    def holding(self, indices: set[int]) -> "Manifest":
        """The manifest a server holding only ``indices`` advertises (complete only when it holds all)."""
        shards = [s for s in self.shards if s.index in indices]
        return self.model_copy(update={"shards": shards,
                                       "complete": self.complete and len(shards) == len(self.shards)})

    def segments(self, shard: ShardEntry) -> Iterator[tuple[str, int, int]]:
        """``(file name, offset in file, length)`` pieces of ``shard``, in order."""
        start, end = shard.offset, shard.offset + shard.size
        for f in self.files:
            f_end = f.offset + f.size if f.size is not None else end
            lo, hi = max(start, f.offset), min(end, f_end)
            if lo < hi:
                yield f.name, lo - f.offset, hi - lo


def shard_count(total: int, shard_size: int) -> int:
    """Shards of a ``total``-byte blob (an empty blob has none).

    >>> shard_count(0, 4), shard_count(8, 4), shard_count(9, 4)
    (0, 2, 3)
    """
    return -(-total // shard_size)


def compatible(a: Manifest, b: Manifest) -> bool:
    """Whether two views of one version (e.g. two relays' manifests) can both be true: same layout,
    same hash wherever both list a shard.

    >>> m = Manifest(version=1, shard_size=4, files=[FileEntry(name="w", offset=0)],
    ...              shards=[ShardEntry(index=0, offset=0, size=4, sha256="a" * 64)])
    >>> compatible(m, m.holding(set())), compatible(m, m.model_copy(update={"shard_size": 8}))
    (True, False)
    """
    if a.shard_size != b.shard_size or (a.complete and b.complete and a.sha256 != b.sha256):
        return False
    for fa, fb in zip(a.files, b.files):
        if fa.name != fb.name or fa.offset != fb.offset or (None not in (fa.size, fb.size) and fa.size != fb.size):
            return False
    hb = {s.index: s for s in b.shards}
    return all(s.index not in hb or (hb[s.index].sha256 == s.sha256 and hb[s.index].chain == s.chain)
               for s in a.shards)


def chain_before(m: Manifest, entry: ShardEntry) -> str | None:
    """The blob's chaining value where ``entry`` starts, if ``m`` says (SHA-256's initial one for the first).

    >>> m = Manifest(version=1, shard_size=64, files=[FileEntry(name="w", offset=0)],
    ...              shards=[ShardEntry(index=i, offset=64 * i, size=64, sha256="a" * 64, chain=c * 64)
    ...                      for i, c in ((0, "b"), (2, "d"))])
    >>> chain_before(m, m.shards[0])[:8], chain_before(m, m.shards[1])
    ('6a09e667', None)
    """
    if entry.offset == 0:
        return INITIAL
    prev = m.shard(entry.index - 1)
    return prev.chain if prev is not None else None
