"""Policy weights out of the trainer: each checkpoint's :func:`~intellect.checkpoints.inference_files`
(never a trainer-only sidecar) published to the SHARDCAST origin as one version, signed with the
trainer's key (:func:`publish_to_origin`). Relays mirror it; workers download it
(:class:`~intellect.rl.worker.weights.ShardcastWeights`) and use nothing the key did not sign
(:mod:`intellect.shardcast.signing`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from intellect.checkpoints import CHECKPOINTS, inference_files
from intellect.shardcast.manifest import Manifest
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey, VerifyKey

if TYPE_CHECKING:
    from intellect.rl.config import RLRunConfig
    from intellect.storage import RunStorage


def _signed(m: Manifest, key: VerifyKey) -> bool:
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


def _not_for_inference(folder: Path) -> frozenset[str]:
    """The files of ``folder`` that :func:`~intellect.checkpoints.inference_files` leaves out."""
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return frozenset(names) - frozenset(inference_files(names))


def publish_to_origin(cfg: RLRunConfig, storage: RunStorage, step: int, origin_dir: str | Path, *,
                      signing_key: SigningKey) -> dict:
    """Publish checkpoint ``step``'s inference files as SHARDCAST version ``step``, signed with the
    trainer's ``signing_key`` (idempotent: an existing complete version is kept, a half-written one
    replaced)."""
    sc = cfg.shardcast
    if sc is None:
        raise ValueError("publish_to_origin needs cfg.shardcast")
    store = VersionStore(origin_dir)
    have = store.manifest(step)
    if have is not None and have.complete and _signed(have, signing_key.public):
        return {"version": step, "bytes": have.total_size, "shards": len(have.shards), "published": False}
    if have is not None:
        store.drop(step)
    rel = storage.step_path(step, CHECKPOINTS)
    if (local := storage.local_path(rel)) is not None:
        m = publish_folder(store, step, local, sc.shard_size, sc.keep, key=signing_key,
                           skip=_not_for_inference(local))
    else:  # S3: the checkpoint comes down once, into a folder that goes away after
        with tempfile.TemporaryDirectory(prefix="intellect-publish-") as tmp:
            folder = Path(tmp) / "ckpt"
            storage.get_dir(rel, folder)
            m = publish_folder(store, step, folder, sc.shard_size, sc.keep,
                               key=signing_key, skip=_not_for_inference(folder))
    return {"version": step, "bytes": m.total_size, "shards": len(m.shards), "published": True}
