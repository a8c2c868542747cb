"""Policy weights out of the trainer: each checkpoint's :func:`~intellect.checkpoints.inference_files`
(never a trainer-only sidecar) published to the SHARDCAST origin as one version, signed with the
trainer's key (:func:`publish_to_origin`): the whole checkpoint every ``shardcast.anchor_every``-th
version, else a weight patch against the version before (:class:`~intellect.shardcast.origin.Origin`).
Relays mirror it; workers download it (:class:`~intellect.rl.worker.weights.ShardcastWeights`, which
rebuilds a patch into the checkpoint) and use nothing the key did not sign
(:mod:`intellect.shardcast.signing`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from intellect.checkpoints import CHECKPOINTS
from intellect.shardcast.origin import Origin
from intellect.trust.keys import SigningKey

if TYPE_CHECKING:
    from intellect.rl.config import RLRunConfig
    from intellect.storage import RunStorage


def publish_to_origin(cfg: RLRunConfig, storage: RunStorage, step: int, origin_dir: str | Path, *,
                      signing_key: SigningKey) -> dict:
    """Publish checkpoint ``step``'s inference files as SHARDCAST version ``step``, signed with the
    trainer's ``signing_key``, whole or as a weight patch (:meth:`~intellect.shardcast.origin.Origin.publish`;
    idempotent: an existing complete version is kept, a half-written one replaced)."""
    sc = cfg.shardcast
    if sc is None:
        raise ValueError("publish_to_origin needs cfg.shardcast")
    origin = Origin(origin_dir, shard_size=sc.shard_size, keep=sc.keep, anchor_every=sc.anchor_every)
    rel = storage.step_path(step, CHECKPOINTS)
    if (local := storage.local_path(rel)) is not None:
        return origin.publish(local, step, signing_key).model_dump()
    with tempfile.TemporaryDirectory(prefix="intellect-publish-") as tmp:  # S3: the checkpoint comes down once
        storage.get_dir(rel, Path(tmp) / "ckpt")
        return origin.publish(Path(tmp) / "ckpt", step, signing_key).model_dump()
