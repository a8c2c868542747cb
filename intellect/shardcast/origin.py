"""The trainer's side of SHARDCAST: :class:`Origin` publishes checkpoints, each as a full version or as
a weight patch against the version published before it.

Every ``anchor_every``-th version is the full checkpoint (an *anchor*); the ones between are weight
patches (:mod:`~intellect.shardcast.patch`) against the previous version, whose signed
:class:`~intellect.shardcast.header.Lineage` names that base and the digest of the checkpoint the
patch rebuilds. To diff against the previous version the origin keeps its inference files in
``<root>/.reference`` (hard links where the file system allows, so no second copy), with the
version and its digest; without a reference, or with one the store no longer holds, it publishes
an anchor. A patch that would be no smaller than the checkpoint is published full instead.

>>> import tempfile, safetensors.numpy as stn, numpy as np
>>> from intellect.trust.keys import SigningKey
>>> root = Path(tempfile.mkdtemp()); key = SigningKey.from_seed(bytes(32))
>>> origin = Origin(root / "origin", shard_size=1 << 16, keep=2, anchor_every=3)
>>> w = np.zeros(4096, np.float32)
>>> for step in range(1, 6):
...     w[step] = step
...     ckpt = root / f"step_{step}"; ckpt.mkdir(); stn.save_file({"w": w}, str(ckpt / "model.safetensors"))
...     p = origin.publish(ckpt, step, key)
...     print(step, p.encoding, p.base)
1 full None
2 bitpatch-v2 1
3 bitpatch-v2 2
4 full None
5 bitpatch-v2 4
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from intellect.shardcast.header import FULL, PATCH_ENCODING, Lineage, PatchEncoding
from intellect.shardcast.manifest import Manifest
from intellect.shardcast.patch import MAX_CHAIN, PatchStats, place, checkpoint_digest, checkpoint_files, make_patch
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey, VerifyKey

__all__ = ["Origin", "Published"]

REFERENCE = ".reference"  # not a version's name (store.py's v<N>), so no server lists it
_REFERENCE_NOTE = ".version.json"  # inside the reference; a hidden name, so never a checkpoint file


class Published(BaseModel):
    """What :meth:`Origin.publish` did."""

    version: int
    bytes: int | None  # the version's blob: what relays and workers download
    full_bytes: int | None  # the checkpoint's files
    shards: int
    published: bool  # False: the version was there already, signed by this key
    encoding: str
    base: int | None

    @property
    def share(self) -> float | None:
        """The version's bytes over the checkpoint's, when this call published it (None otherwise).

        >>> Published(version=2, bytes=25, full_bytes=100, shards=1, published=True, encoding="bitpatch-v2",
        ...           base=1).share
        0.25
        """
        if not self.published or self.bytes is None or not self.full_bytes:
            return None
        return self.bytes / self.full_bytes


def signed_by(m: Manifest, key: VerifyKey) -> bool:
    """Whether every header and shard of ``m`` carries ``key``'s signature: a version the origin holds from
    before (another key, or none) would get the origin marked bad by every relay, so it is written anew."""
    verifier = Verifier(key)
    try:
        verifier.verify(m)
        for s in m.shards:
            verifier.shard(m.version, m.publication, s)
    except Untrusted:
        return False
    return True


class Origin:
    """Publishes checkpoints into the store at ``root`` (served by an origin server), newest ``keep``
    versions kept with the bases their patches need, its patches of ``patch_encoding``."""

    def __init__(self, root: str | os.PathLike, *, shard_size: int, keep: int, anchor_every: int = 1,
                 patch_encoding: PatchEncoding = PATCH_ENCODING):
        if not 1 <= anchor_every <= MAX_CHAIN:
            raise ValueError(f"anchor_every must be 1..{MAX_CHAIN} (what a client rebuilds from), not {anchor_every}")
        self.root = Path(root)
        self.store = VersionStore(self.root)
        self.shard_size, self.keep, self.anchor_every = shard_size, keep, anchor_every
        self.patch_encoding: PatchEncoding = patch_encoding

    def publish(self, folder: str | os.PathLike, version: int, key: SigningKey, *,
                base: int | None = None) -> Published:
        """Publish checkpoint ``folder``'s inference files as ``version``, signed with ``key``: a weight
        patch against ``base`` (default: the version published before, unless this one is due to be an
        anchor), else the full checkpoint. Idempotent: a complete version signed by ``key`` is kept, a
        half-written one replaced."""
        have = self.store.manifest(version)
        if have is not None and have.complete and signed_by(have, key.public):
            return _report(have, None, published=False)
        if have is not None:
            self.store.drop(version)
        snap = Path(tempfile.mkdtemp(prefix=".tmp-ref-", dir=self.root))
        try:
            full_bytes = _snapshot(Path(folder), snap)
            digest = checkpoint_digest(snap)
            m = self._publish(snap, version, key, digest, base)
            (snap / _REFERENCE_NOTE).write_text(json.dumps({"version": version, "digest": digest,
                                                             "files": _stats(snap)}))
            self._set_reference(snap)
        finally:
            shutil.rmtree(snap, ignore_errors=True)
        return _report(m, full_bytes, published=True)

    def _publish(self, snap: Path, version: int, key: SigningKey, digest: str, base: int | None) -> Manifest:
        ref = self.reference()
        if base is not None and (ref is None or ref[0] != base):
            raise ValueError(f"a patch of version {version} against {base}: the origin's reference is "
                             f"{ref[0] if ref else 'none'}")
        if base is None and ref is not None and ref[0] < version and self._depth(ref[0]) + 1 < self.anchor_every:
            base = ref[0]
        if base is not None and ref is not None and self.store.manifest(base) is not None:
            with tempfile.TemporaryDirectory(prefix=".tmp-patch-", dir=self.root) as tmp:
                stats: PatchStats = make_patch(self.root / REFERENCE, snap, Path(tmp) / "patch", ref[1],
                                               self.patch_encoding)
                if stats.bytes < stats.full_bytes:
                    # linked into the store: the patch's files outlive this temporary folder
                    return publish_folder(self.store, version, Path(tmp) / "patch", self.shard_size, self.keep,
                                          key=key, skip=frozenset(), lineage=Lineage(
                                              encoding=self.patch_encoding, base=base, checkpoint_digest=digest))
        return publish_folder(self.store, version, snap, self.shard_size, self.keep, key=key, skip=frozenset(),
                              lineage=FULL.model_copy(update={"checkpoint_digest": digest}))

    def reference(self) -> tuple[int, str] | None:
        """``(version, digest)`` of the checkpoint the next patch is made against, if any."""
        try:
            note = json.loads((self.root / REFERENCE / _REFERENCE_NOTE).read_text())
            version, digest, files = int(note["version"]), str(note["digest"]), note["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        # its files are links to a checkpoint's: one rewritten in place since is no base for a patch
        return (version, digest) if files == _stats(self.root / REFERENCE) else None

    def _depth(self, version: int) -> int:
        """Patches from ``version`` down to its full version (a base the store lost: as deep as allowed)."""
        depth = 0
        while (m := self.store.manifest(version)) is not None and m.lineage.base is not None:
            depth, version = depth + 1, m.lineage.base
        return depth if m is not None else self.anchor_every

    def _set_reference(self, snap: Path) -> None:
        ref = self.root / REFERENCE
        old = self.root / f".tmp-old-{os.getpid()}"
        if ref.exists():
            os.replace(ref, old)  # no reference for a moment: a crash here makes the next version an anchor
        os.replace(snap, ref)
        shutil.rmtree(old, ignore_errors=True)


def _snapshot(folder: Path, snap: Path) -> int:
    """Link (else copy) ``folder``'s inference files into ``snap``; their bytes."""
    from intellect.checkpoints import inference_files  # noqa: PLC0415 - it loads torch: only the trainer publishes

    total = 0
    for name in inference_files(checkpoint_files(folder)):
        place(folder / name, snap / name)
        total += (snap / name).stat().st_size
    return total


def _stats(folder: Path) -> dict[str, list[int]]:
    return {n: [(st := (folder / n).stat()).st_size, st.st_mtime_ns] for n in checkpoint_files(folder)}


def _report(m: Manifest, full_bytes: int | None, published: bool) -> Published:
    return Published(version=m.version, bytes=m.total_size, full_bytes=full_bytes, shards=len(m.shards),
                     published=published, encoding=m.lineage.encoding, base=m.lineage.base)
