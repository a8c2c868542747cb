"""What a SHARDCAST version is: a checkpoint's files, cut into shards, each with its SHA-256.

A version is the concatenation of its files in manifest order (the *blob*), cut into shards of
``shard_size`` bytes (the last one shorter). The manifest lists every file with its offset in the
blob and every shard with its offset, size, SHA-256 and the blob's SHA-256 chaining value at its end
(:mod:`~intellect.shardcast.chain`), plus the whole blob's SHA-256 once the version is ``complete``.
While a version is being written, a server lists its shards as they land (the store's listing
log; readers follow it by :class:`ManifestDelta`), so a reader may see a manifest that lists only the
first shards and the files begun so far (``size`` None for the file still being written); every
shard listed is final. A relay lists only the shards it holds, so a manifest never advertises a
byte the server cannot send (:meth:`Manifest.holding`: a manifest as such a server would list it).
Every header and shard entry carries the trainer's signature (:mod:`~intellect.shardcast.signing`);
:class:`ManifestView` takes nothing from a server before it verifies. ``complete`` is the server's
own word that it lists every shard; that the version is whole (``total_size`` and ``sha256``) is
the trainer's, signed.

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

from bisect import bisect_left, insort
from typing import Iterator

from pydantic import Field, model_validator

from intellect.shardcast.chain import INITIAL
from intellect.shardcast.header import FileEntry, ShardEntry, SignedHeader, Strict
from intellect.shardcast.signing import Untrusted, Verifier

__all__ = ["FileEntry", "ListedVersion", "Manifest", "ManifestDelta", "ManifestView", "ShardEntry", "VersionList",
           "chain_before", "shard_count"]


def _check_fits(s: ShardEntry, shard_size: int) -> None:
    if s.offset != s.index * shard_size or s.size > shard_size:
        raise ValueError(f"shard {s.index} at {s.offset}+{s.size} does not fit shard_size {shard_size}")
    if s.chain is not None and (s.offset + s.size) % 64:
        raise ValueError(f"shard {s.index} ends mid-block ({s.offset + s.size}) but has a chaining value")


class Manifest(SignedHeader):
    """A version's signed header with the shards listed (see the module docstring)."""

    # the header's field with a default, for a manifest built in code; a message from a server names it
    shard_size: int = Field(default=16 << 20, ge=1, description="Bytes per shard (the last one may be shorter).")
    shards: list[ShardEntry] = Field(default_factory=list)
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
            _check_fits(s, self.shard_size)
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


def chain_before(m: "Manifest | ManifestView", entry: ShardEntry) -> str | None:
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


class ManifestDelta(SignedHeader):
    """A server's listing of a version from position ``since`` on, with the version's header: what a
    manifest long poll answers, so each answer costs the shards new to the asker, not the whole list.

    A 62 GB checkpoint has ~4,000 shards of 16 MiB; sending, parsing and rewriting the whole manifest
    at every new shard would make following a version quadratic in its shard count.

    The *listing* is the order in which a server listed its shards (the origin: index order; a relay:
    the order in which its fetches finished); ``listing`` names it, so a server that starts its
    listing over (it dropped the version and fetches it again) is told apart: it answers with another
    name and ``since`` 0. A complete version's answer lists every shard, with ``since`` 0.

    >>> d = ManifestDelta(version=1, files=[FileEntry(name="w", offset=0)], shard_size=4, listing="ab", since=2,
    ...                   shards=[ShardEntry(index=3, offset=12, size=4, sha256="0" * 64)])
    >>> d.listed, d.complete
    (3, False)
    """

    complete: bool = False
    listing: str = Field(default="", pattern=r"^[0-9a-f]{0,32}$", description="Name of the server's listing.")
    since: int = Field(default=0, ge=0, description="Listing position of the first shard here.")
    shards: list[ShardEntry] = Field(default_factory=list, description="In listing order.")

    @model_validator(mode="after")
    def _fits(self) -> "ManifestDelta":
        if self.complete and (self.since or self.total_size is None or self.sha256 is None):
            raise ValueError("a complete version's answer lists every shard, with total_size and sha256")
        for s in self.shards:
            _check_fits(s, self.shard_size)
        return self

    @property
    def listed(self) -> int:
        """Shards the server had listed: the next question's ``since``."""
        return self.since + len(self.shards)


class ListedVersion(SignedHeader):
    """One version in a server's ``/versions`` answer, with its signed header: a reader counts a version
    only once the trainer's signature on its header verifies, and a version as complete only when
    that header is sealed (its total size and SHA-256 signed), so no server can make readers chase a
    version the trainer never wrote."""

    complete: bool = Field(description="The server holds every shard.")
    shards: int = Field(ge=0, description="Shards the server lists.")

    @classmethod
    def of(cls, m: Manifest, shards: int) -> "ListedVersion":
        return cls.model_construct(**m.header_fields(), complete=m.complete, shards=shards)


class VersionList(Strict):
    versions: list[ListedVersion] = Field(default_factory=list, max_length=100_000)


def _header_rank(h: ManifestDelta | Manifest) -> tuple[bool, bool, int, bool]:
    # the newest header of one version: complete, sealed, then more files begun, then the last one's size known
    return h.complete, h.sha256 is not None, len(h.files), bool(h.files) and h.files[-1].size is not None


class ManifestView:
    """One version as several servers list it, kept up to date from their :class:`ManifestDelta`
    answers: each answer costs its own shards, never the whole list again.

    Nothing enters the view before ``verifier`` checked the trainer's signature on it
    (:mod:`~intellect.shardcast.signing`): each header once, each shard once, when first heard; an
    answer that fails raises :class:`~intellect.shardcast.signing.Untrusted` and its server is
    dropped. The view holds every shard any agreeing server listed (a relay lists only what it
    holds), which servers hold each, and the newest header, all of one writing (publication) of the
    version. A server whose answer contradicts the view (another layout, another writing: the origin
    withdrew a half-written version and wrote it anew) is dropped from it, and heard again from the
    start; a complete listing of another writing replaces a view of one still being listed.

    >>> from intellect.trust.keys import SigningKey
    >>> from intellect.shardcast.signing import VersionSigner
    >>> key = SigningKey.from_seed(bytes(32)); sign = VersionSigner(key, 1)
    >>> w = [FileEntry(name="w", offset=0)]
    >>> head = dict(version=1, files=w, shard_size=4, publication=sign.publication, signature=sign.header(w, 4))
    >>> e = [sign.shard(ShardEntry(index=i, offset=4 * i, size=4, sha256=f"{i}" * 64)) for i in range(3)]
    >>> v = ManifestView(1, Verifier(key.public))
    >>> [s.index for s in v.apply("a", ManifestDelta(**head, listing="aa", shards=e[:2]))]
    [0, 1]
    >>> [s.index for s in v.apply("b", ManifestDelta(**head, listing="bb", shards=[e[2]]))]
    [2]
    >>> v.query("a"), v.holders[2], [s.index for s in v.manifest().shards]
    ('since=2&listing=aa', ['b'], [0, 1, 2])
    >>> forged = e[0].model_copy(update={"sha256": "f" * 64})
    >>> v.apply("c", ManifestDelta(**head, listing="cc", shards=[forged]))
    Traceback (most recent call last):
    ...
    intellect.shardcast.signing.Untrusted: bad_signature: shard 0 of version 1 is not signed by the trainer's key kfd0408a034418ede3f97 for this publication
    """

    def __init__(self, version: int, verifier: Verifier):
        self.version, self.verifier = version, verifier
        self.header: ManifestDelta | None = None  # the newest header heard (its shards unused)
        self.entries: dict[int, ShardEntry] = {}
        self.holders: dict[int, list[str]] = {}
        self._position: dict[str, tuple[str, int]] = {}  # server -> (its listing's name, shards taken)
        self._held: dict[str, list[int]] = {}
        self._sorted: list[ShardEntry] = []  # the entries by index, kept as they come (mostly appends)
        self._manifest: Manifest | None = None

    def shard(self, index: int) -> ShardEntry | None:
        return self.entries.get(index)

    def query(self, server: str) -> str:
        """The query that asks ``server`` for what this view has not heard from it yet."""
        listing, since = self._position.get(server, ("", 0))
        return f"since={since}&listing={listing}"

    def servers(self) -> list[str]:
        return list(self._position)

    def complete_at(self, server: str) -> bool:
        """Whether ``server`` listed the whole version (it has nothing more to say about it)."""
        return server in self._position and self._position[server][0] == _COMPLETE

    def drop(self, server: str, forget: bool = False) -> None:
        """Forget that ``server`` holds what it listed; with ``forget``, also the shards no one else
        listed (it starts its listing over, and may list them otherwise now)."""
        gone = []
        for i in self._held.pop(server, []):
            hs = self.holders.get(i)
            if hs is not None and server in hs:
                hs.remove(server)
                if forget and not hs:
                    gone.append(i)
        for i in gone:
            del self.entries[i], self.holders[i]
        if gone:
            self._sorted = [e for e in self._sorted if e.index in self.entries]
            self._manifest = None
        self._position.pop(server, None)
        if forget and not self.entries and not self._position:
            self.header = None  # nothing is left of what was heard: the version may be laid out anew

    def _positions_reset(self) -> None:
        """Forget every server and shard heard: the version is heard anew."""
        self.header, self._manifest = None, None
        self.entries.clear()
        self.holders.clear()
        self._position.clear()
        self._held.clear()
        self._sorted = []

    def apply(self, server: str, d: ManifestDelta) -> list[ShardEntry]:
        """Take one answer of ``server``; returns the shards new to the view. ValueError when the answer
        contradicts the view (``server`` is then dropped from it) or does not follow the last one."""
        if d.version != self.version:
            raise Untrusted("rollback" if d.version < self.version else "wrong_version",
                            f"manifest of version {d.version} served for {self.version}")
        try:
            self.verifier.verify(d)
        except Untrusted:
            self.drop(server)
            raise
        listing, since = self._position.get(server, ("", 0))
        if d.since == 0 and (d.complete or d.listing != listing or since):
            self.drop(server, forget=not d.complete)  # a listing from the start replaces its last one
        elif (d.listing, d.since) != (listing, since):
            raise ValueError(f"an answer from position {d.since} of listing {d.listing!r}, "
                             f"asked from {since} of {listing!r}")
        try:
            # each shard once, when first heard (an equal entry of the same writing was checked then),
            # and before anything else is learnt from the answer
            same = self.header is not None and self.header.publication == d.publication
            for s in d.shards:
                if not same or self.entries.get(s.index) != s:
                    self.verifier.shard(d.version, d.publication, s)
            self._check(d)
        except ValueError:
            self.drop(server)
            raise
        new = []
        held = self._held.setdefault(server, [])
        for s in d.shards:
            if s.index not in self.entries:
                self.entries[s.index] = s
                new.append(s)
                if self._sorted and self._sorted[-1].index > s.index:
                    insort(self._sorted, s, key=lambda e: e.index)
                else:
                    self._sorted.append(s)
            hs = self.holders.setdefault(s.index, [])
            if server not in hs:
                hs.append(server)
                held.append(s.index)
        if self.header is None or _header_rank(d) > _header_rank(self.header):
            self.header = d.model_copy(update={"shards": []})
        self._position[server] = (_COMPLETE if d.complete else d.listing, d.listed)
        if new or d.complete:
            self._manifest = None
        return new

    def _check(self, d: ManifestDelta) -> None:
        if d.complete:  # a whole manifest: checked whole (once per server and version)
            Manifest.model_validate(_header_fields(d, sorted(d.shards, key=lambda e: e.index)))
        h = self.header
        if h is None:
            return
        if d.shard_size != h.shard_size or (None not in (d.sha256, h.sha256) and d.sha256 != h.sha256):
            raise ValueError("another layout or hash of the version")
        if d.publication != h.publication:
            if d.complete and not h.complete:  # the finished writing replaces one the origin withdrew
                self._positions_reset()
                return
            # a server still listing a withdrawn writing, or already listing the new one
            raise ValueError("another writing of the version (another publication)")
        for fa, fb in zip(d.files, h.files):
            if fa.name != fb.name or fa.offset != fb.offset or (None not in (fa.size, fb.size) and fa.size != fb.size):
                raise ValueError(f"another layout of the version's files ({fa.name!r})")
        clashes = [s.index for s in d.shards if (k := self.entries.get(s.index)) is not None and
                   (k.sha256, k.chain, k.size) != (s.sha256, s.chain, s.size)]
        if h.complete:  # nothing more to learn: a shard it does not list is a lie
            clashes += [s.index for s in d.shards if s.index not in self.entries]
        elif d.complete:  # and a shard that it does not list, too
            listed = {s.index for s in d.shards}
            clashes += [i for i in self.entries if i not in listed]
        if not clashes:
            return
        if not d.complete or h.complete:
            raise ValueError(f"shard {clashes[0]} differs from the other servers' listing")
        # the first complete listing is the authority: whoever listed otherwise is dropped
        for i in clashes:
            for server in list(self.holders.get(i, [])):
                self.drop(server)
            del self.entries[i]
            self.holders.pop(i, None)
        self._sorted = [e for e in self._sorted if e.index in self.entries]

    def manifest(self) -> Manifest | None:
        """The view as a manifest (None before any answer); a complete one is checked whole, once."""
        if self.header is None:
            return None
        if self._manifest is None:
            shards = list(self._sorted)
            if self.header.complete:  # once per version: the full consistency check
                self._manifest = Manifest.model_validate(_header_fields(self.header, shards))
            else:  # every shard and the header were validated as they came
                self._manifest = Manifest.model_construct(**_header_fields(self.header, shards))
        return self._manifest


def _header_fields(d: ManifestDelta, shards: list[ShardEntry]) -> dict:
    return {**d.header_fields(), "complete": d.complete, "shards": shards}


_COMPLETE = "complete"  # a server's position once it listed the whole version
