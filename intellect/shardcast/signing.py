"""The trainer's signatures on SHARDCAST versions: relays are untrusted mirrors, the trainer's key is the root.

Each time the origin writes a version it picks a random *publication* id and signs, with the
trainer's Ed25519 key (:mod:`intellect.trust.keys`), canonical byte strings
(:mod:`intellect.trust.canonical`) of:

* every **header** it lists (:func:`header_message`): the version number, the publication, the
  shard size, the files begun so far (name, offset, size; the size None for the file still being
  written), the version's lineage (full or a patch against which base, and the digest of the
  checkpoint it yields) and, once the version is sealed, its total size and whole-blob SHA-256;
* every **shard** (:func:`shard_message`): the version, the publication, the shard's index,
  offset, size, SHA-256 and the blob's SHA-256 chaining value at its end.

A listing delta is a header and shards, each carrying its own signature, so a relay passes on the
trainer's signatures as they are, whatever order it lists its shards in and whichever it holds, and
a reader verifies each shard once, when it first hears of it: linear in the shard count, never the
whole listing again per delta. What a relay cannot do:

* forge or alter anything: every field is signed;
* replay an older version's data under a newer number: the version is in every message;
* splice two writings of one version (the origin withdrew a half-written version and wrote it
  anew): the publication id is in every message, and a view holds one publication at a time;
* reorder shards or drop one and put another in its place: each shard's index is signed, and its
  chaining value binds it to every byte before it (a shard checked from the previous shard's signed
  chaining value to its own is exactly the trainer's bytes, :mod:`~intellect.shardcast.chain`).

What a header and a shard entry are, and the exact bytes signed of each, are
:mod:`~intellect.shardcast.header`'s.

Anything that does not verify raises :class:`Untrusted` with a reason; the client and relays mark
the server that sent it bad (:mod:`~intellect.shardcast.client`, :mod:`~intellect.shardcast.relay`).

>>> from intellect.trust.keys import SigningKey
>>> from intellect.shardcast.manifest import FileEntry, ShardEntry
>>> key = SigningKey.from_seed(bytes(32))
>>> signer = VersionSigner(key, version=3, publication="ab" * 16)
>>> files = [FileEntry(name="w", offset=0, size=4)]
>>> head = signer.header(files, shard_size=4, total_size=4, sha256="0" * 64)
>>> shard = signer.shard(ShardEntry(index=0, offset=0, size=4, sha256="1" * 64))
>>> v = Verifier(key.public.hex)
>>> v.header(3, "ab" * 16, 4, files, 4, "0" * 64, head); v.shard(3, "ab" * 16, shard)
>>> try:
...     v.header(4, "ab" * 16, 4, files, 4, "0" * 64, head)   # version 3's header as version 4
... except Untrusted as e:
...     print(e.reason)
bad_signature
"""

from __future__ import annotations

import secrets
from typing import Callable, Literal, Sequence

from intellect.shardcast.header import (
    FULL, PUBLICATION_HEX, SIGNATURE_HEX, FileEntry, Lineage, ShardEntry, SignedHeader, header_message, shard_message,
)
from intellect.trust.keys import SigningKey, VerifyKey

__all__ = ["FULL", "Reason", "Untrusted", "Verifier", "VersionSigner", "header_message", "new_publication",
           "shard_message"]

_CACHE = 4096  # header messages remembered as verified (a version has one per file begun, and its seal)

Reason = Literal["unsigned", "truncated_signature", "bad_signature", "rollback", "wrong_version", "malformed",
                 "oversized", "mismatch"]


class Untrusted(ValueError):
    """Data from a server that does not carry the trainer's valid signature, or lies about what it
    signed; ``reason`` is one of :data:`Reason`. The server that sent it is marked bad."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def new_publication() -> str:
    return secrets.token_hex(PUBLICATION_HEX // 2)


class VersionSigner:
    """Signs one writing of ``version`` (a fresh :attr:`publication` unless given) of ``lineage``."""

    def __init__(self, key: SigningKey, version: int, publication: str | None = None, lineage: Lineage = FULL):
        if lineage.base is not None and lineage.base >= version:
            raise ValueError(f"version {version} cannot be a patch against version {lineage.base}")
        self.key, self.version, self.lineage = key, version, lineage
        self.publication = publication or new_publication()

    def header(self, files: Sequence[FileEntry], shard_size: int, total_size: int | None = None,
               sha256: str | None = None) -> str:
        """The hex signature of a header of this writing."""
        return self.key.sign(header_message(self.version, self.publication, shard_size, files, total_size,
                                            sha256, self.lineage)).hex()

    def shard(self, entry: ShardEntry) -> ShardEntry:
        """``entry`` with its signature."""
        sig = self.key.sign(shard_message(self.version, self.publication, entry)).hex()
        return entry.model_copy(update={"signature": sig})


def _signature(field: str | None, what: str) -> bytes:
    if not field:
        raise Untrusted("unsigned", f"{what} carries no signature")
    if len(field) != SIGNATURE_HEX:
        raise Untrusted("truncated_signature", f"{what}: a signature of {len(field)} hex digits, not {SIGNATURE_HEX}")
    try:
        return bytes.fromhex(field)
    except ValueError:
        raise Untrusted("malformed", f"{what}: signature is not hex") from None


class Verifier:
    """Checks headers and shards against the trainer's pinned public key (a :class:`VerifyKey` or
    its 64 hex digits). A header already verified is remembered (by its exact message and
    signature), so a server resending it costs a lookup, not a verification."""

    def __init__(self, key: VerifyKey | str):
        self.key = key if isinstance(key, VerifyKey) else VerifyKey.from_hex(key)
        self._verified: set[tuple[bytes, bytes]] = set()

    def header(self, version: int, publication: str | None, shard_size: int, files: Sequence[FileEntry],
               total_size: int | None, sha256: str | None, signature: str | None, lineage: Lineage = FULL) -> None:
        """Raise :class:`Untrusted` unless ``signature`` is the trainer's over this header (of ``lineage``)."""
        self._header(version, publication, signature,
                     lambda: header_message(version, publication, shard_size, files, total_size, sha256, lineage))

    def verify(self, h: SignedHeader) -> None:
        """Raise :class:`Untrusted` unless ``h``'s header is the trainer's."""
        self._header(h.version, h.publication, h.signature, h.message)

    def _header(self, version: int, publication: str | None, signature: str | None,
                message: Callable[[], bytes]) -> None:
        sig = _signature(signature, f"the header of version {version}")
        if publication is None:
            raise Untrusted("unsigned", f"the header of version {version} names no publication")
        msg = message()
        if (msg, sig) in self._verified:
            return
        if not self.key.verify(sig, msg):
            raise Untrusted("bad_signature", f"the header of version {version} is not signed by the trainer's key "
                                             f"{self.key.id}")
        if len(self._verified) >= _CACHE:
            self._verified.clear()
        self._verified.add((msg, sig))

    def shard(self, version: int, publication: str | None, entry: ShardEntry) -> None:
        """Raise :class:`Untrusted` unless ``entry`` carries the trainer's signature for this writing."""
        sig = _signature(entry.signature, f"shard {entry.index} of version {version}")
        if not self.key.verify(sig, shard_message(version, publication, entry)):
            raise Untrusted("bad_signature", f"shard {entry.index} of version {version} is not signed by the "
                                             f"trainer's key {self.key.id} for this publication")
