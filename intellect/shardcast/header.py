"""What the trainer signs of a SHARDCAST version: its header, each shard entry, and the bytes of each
signature (:mod:`~intellect.shardcast.signing` signs and verifies them).

A version's *header* is :class:`SignedHeader`'s fields: the version number, the publication (the id
of this writing of the version), the shard size, the files begun so far (name, offset, size; the
size None for the file still being written) and, once the version is sealed, its total size and the
whole blob's SHA-256, and its :class:`Lineage` (what the blob is: a whole checkpoint, or a weight
patch against a base version, and the digest of the checkpoint it yields), with the trainer's
signature over them (:func:`header_message`). Every message
that carries a header (a manifest, a listing delta, a ``/versions`` entry) is a :class:`SignedHeader`,
so the fields a server sends and the fields the trainer signed are declared once, here. A shard
entry is signed on its own (:func:`shard_message`), so a relay passes it on unchanged whatever it
lists it with.

>>> h = SignedHeader(version=3, publication="ab" * 16, shard_size=4, files=[FileEntry(name="w", offset=0)])
>>> h.message() == header_message(3, "ab" * 16, 4, h.files, None, None, FULL)
True
>>> h.message() == header_message(3, "ab" * 16, 4, h.files, None, None, Lineage(base=2, encoding="bitpatch-v1"))
False
>>> h.message() == header_message(3, "ab" * 16, 4, h.files, None, None)
True
>>> sorted(h.header_fields())
['files', 'lineage', 'publication', 'sha256', 'shard_size', 'signature', 'total_size', 'version']
"""

from __future__ import annotations

import re
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from intellect.trust.canonical import canonical
from intellect.trust.keys import SIGNATURE_BYTES

HEADER_DOMAIN = "intellect/shardcast/header/v1"
SHARD_DOMAIN = "intellect/shardcast/shard/v1"
SHA256_HEX = r"^[0-9a-f]{64}$"
SIGNATURE_HEX = 2 * SIGNATURE_BYTES
PUBLICATION_HEX = 32
PUBLICATION = rf"^[0-9a-f]{{{PUBLICATION_HEX}}}$"
# Signature fields accept any hex up to a whole signature, so that a short one is refused by the
# verifier with its own reason (``truncated_signature``), not as a schema error.
SIGNATURE_FIELD = rf"^[0-9a-f]{{0,{SIGNATURE_HEX}}}$"
# A file name of a version: one path component, no hidden or temporary names, so a client can
# never be steered into writing outside its target folder.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
MAX_FILES = 100_000  # files of one version: bounds what one header costs a reader to parse and check


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(Strict):
    name: str = Field(pattern=FILE_NAME.pattern, description="File name inside the checkpoint folder.")
    offset: int = Field(ge=0, description="Offset of the file's first byte in the blob.")
    size: int | None = Field(default=None, ge=0, description="Bytes; None while the origin is still writing it.")


class ShardEntry(Strict):
    index: int = Field(ge=0, le=10_000_000)
    offset: int = Field(ge=0)
    size: int = Field(ge=1)
    sha256: str = Field(pattern=SHA256_HEX)
    chain: str | None = Field(
        default=None, pattern=SHA256_HEX, description="SHA-256 chaining value of the blob right after this shard "
        "(:mod:`~intellect.shardcast.chain`): with the previous shard's, it checks this shard and, shard by "
        "shard, the whole blob in one pass. None where the shard ends mid-block or the origin had no way to "
        "compute it.")
    signature: str | None = Field(
        default=None, pattern=SIGNATURE_FIELD, description="The trainer's Ed25519 signature of this shard "
        "(:func:`shard_message`), passed on unchanged by relays.")


#: The encodings of a weight patch (:mod:`~intellect.shardcast.patch`), which rebuilds a checkpoint
#: from its base version: ``bitpatch-v1`` carries the changed elements' new bits raw, ``bitpatch-v2``
#: each as its difference from the base's bits, compressed (a sixth to a quarter of the values' bytes).
PatchEncoding = Literal["bitpatch-v1", "bitpatch-v2"]
#: The encodings of a version's blob: a whole checkpoint, or a weight patch.
Encoding = Literal["full", "bitpatch-v1", "bitpatch-v2"]
#: The patch encoding an origin publishes unless told otherwise (clients read every :data:`PatchEncoding`):
#: v2, a third of v1's bytes; its coding costs CPU time on both ends that only a link faster than a few
#: hundred Mb/s per client would not repay, and SHARDCAST's links are the public internet's (figures:
#: benchmarks/results, "XOR-coded patch values").
PATCH_ENCODING: PatchEncoding = "bitpatch-v2"


class Lineage(Strict):
    """What a version's blob is, signed with its header. A client verifies what it will *load*: the
    blob's SHA-256 proves the bytes it downloaded, ``checkpoint_digest`` the checkpoint it rebuilds
    from them (:func:`intellect.checkpoints.local_digest` of the inference files).

    >>> Lineage(base=4, encoding="bitpatch-v1").patch, FULL.patch
    (True, False)
    """

    encoding: Encoding = Field(default="full", description="'full': the blob is the checkpoint's files; "
                               "'bitpatch-v1' or 'bitpatch-v2': a weight patch against version ``base``.")
    base: int | None = Field(default=None, ge=0, description="The version a patch applies to (None for a full one).")
    checkpoint_digest: str | None = Field(
        default=None, pattern=SHA256_HEX, description="Digest of the checkpoint this version yields, rebuilt "
        "(intellect.checkpoints.local_digest, inference files); None where the origin did not compute it.")

    @model_validator(mode="after")
    def _base_iff_patch(self) -> "Lineage":
        if (self.base is None) != (self.encoding == "full"):
            raise ValueError(f"encoding {self.encoding!r} with base {self.base}: a patch names its base, a full "
                             "version none")
        return self

    @property
    def patch(self) -> bool:
        return self.encoding != "full"


FULL = Lineage()


class SignedHeader(Strict):
    """A version's header as the trainer signed it; every message that carries one derives from this."""

    version: int = Field(ge=0, description="The checkpoint's step.")
    files: list[FileEntry] = Field(default_factory=list, max_length=MAX_FILES)
    shard_size: int = Field(ge=1, description="Bytes per shard (the last one may be shorter).")
    total_size: int | None = Field(default=None, ge=0, description="Blob bytes, once sealed.")
    sha256: str | None = Field(default=None, pattern=SHA256_HEX, description="SHA-256 of the blob, once sealed.")
    publication: str | None = Field(default=None, pattern=PUBLICATION, description="Id of this writing of the version.")
    lineage: Lineage = Field(default=FULL, description="Full checkpoint or weight patch, and the rebuilt digest.")
    signature: str | None = Field(
        default=None, pattern=SIGNATURE_FIELD, description="The trainer's signature of the header: version, "
        "publication, shard size, files, total size, SHA-256 and lineage (:func:`header_message`).")

    @model_validator(mode="after")
    def _older_base(self) -> "SignedHeader":
        # a base older than its version: a chain of patches always ends, at a full version
        if self.lineage.base is not None and self.lineage.base >= self.version:
            raise ValueError(f"version {self.version} names base {self.lineage.base}, not an older version")
        return self

    def message(self) -> bytes:
        """The bytes :attr:`signature` covers."""
        return header_message(self.version, self.publication, self.shard_size, self.files, self.total_size,
                              self.sha256, self.lineage)

    def header_fields(self) -> dict[str, Any]:
        """The header's fields and their values, to build another message that carries the same header."""
        return {name: getattr(self, name) for name in SignedHeader.model_fields}


def header_message(version: int, publication: str | None, shard_size: int, files: Sequence[FileEntry],
                   total_size: int | None, sha256: str | None, lineage: Lineage = FULL) -> bytes:
    """The bytes a header's signature covers (``lineage``: a whole checkpoint unless said otherwise)."""
    fields: list = [version, publication, shard_size, total_size, sha256, lineage.encoding, lineage.base,
                    lineage.checkpoint_digest, len(files)]
    for f in files:
        fields += [f.name, f.offset, f.size]
    return canonical(HEADER_DOMAIN, *fields)


def shard_message(version: int, publication: str | None, e: ShardEntry) -> bytes:
    """The bytes a shard's signature covers: the version, the publication, the shard's index, offset,
    size, SHA-256 and the blob's chaining value at its end."""
    return canonical(SHARD_DOMAIN, version, publication, e.index, e.offset, e.size, e.sha256, e.chain)
