"""Where inference workers get policy weights: run storage, or SHARDCAST relays.

Both sources answer the two questions a worker asks (:func:`~intellect.rl.worker.run_worker`):
which checkpoints are complete, and the model of one of them. With SHARDCAST the trainer publishes
each checkpoint's :func:`~intellect.checkpoints.inference_files` (never a trainer-only sidecar) to
the origin (:func:`publish_to_origin`), signed with the trainer's key; relays mirror it, and a
worker downloads a version into its own cache folder, keeping only the newest few. Relays and
workers pin the trainer's public key and use nothing it did not sign
(:mod:`intellect.shardcast.signing`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from intellect.checkpoints import CHECKPOINTS, fetch, inference_files
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.rl.config import RLRunConfig
from intellect.shardcast.client import ShardcastClient
from intellect.shardcast.config import ClientConfig
from intellect.shardcast.manifest import Manifest, verify_header
from intellect.shardcast.signing import Untrusted, Verifier
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey, VerifyKey

log = logging.getLogger("intellect.rl.weights")


class WeightSource(Protocol):
    def complete_steps(self) -> list[int]: ...

    def load(self, step: int) -> tuple[Any, Any]: ...  # (model, tokenizer)

    def close(self) -> None: ...


class StorageWeights:
    """Checkpoints straight from run storage (``STABLE`` marks the complete ones)."""

    def __init__(self, storage: RunStorage):
        self.storage = storage

    def complete_steps(self) -> list[int]:
        return self.storage.complete_steps(CHECKPOINTS)

    def load(self, step: int):
        return fetch(self.storage, step)

    def close(self) -> None:
        pass


class ShardcastWeights:
    """Checkpoints downloaded from relays into ``cache`` (the newest ``keep`` stay on disk)."""

    def __init__(self, client: ShardcastClient, cache: str | Path, keep: int):
        self.client, self.cache, self.keep = client, Path(cache), keep
        self.cache.mkdir(parents=True, exist_ok=True)

    def complete_steps(self) -> list[int]:
        return self.client.complete_versions()

    def load(self, step: int):
        dest = self.cache / f"step_{step}"
        self.client.fetch(step, dest)
        model, tok = load_checkpoint_copy(dest)  # the folder may be pruned later
        self._prune()
        return model, tok

    def _prune(self) -> None:
        held = sorted((int(p.name[5:]), p) for p in self.cache.glob("step_*") if p.name[5:].isdigit())
        for _, p in held[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        self.client.close()


def weight_source(cfg: RLRunConfig, storage: RunStorage, cache: str | Path,
                  trainer_key: VerifyKey | str | None = None) -> WeightSource:
    """The source ``cfg`` asks for: SHARDCAST when ``cfg.shardcast`` is set (its relays must be resolved,
    and ``trainer_key``, the trainer's public key or its hex, given: only versions it signed are used)."""
    sc = cfg.shardcast
    if sc is None:
        return StorageWeights(storage)
    if not sc.relays:
        raise ValueError("shardcast.relays is empty: the run resolves it when it starts its relays")
    if trainer_key is None:
        raise ValueError("SHARDCAST needs the trainer's public key (trainer_key): there is no unsigned mode")
    key = trainer_key.hex if isinstance(trainer_key, VerifyKey) else VerifyKey.from_hex(trainer_key).hex
    client = ShardcastClient(sc.relays, ClientConfig(**sc.client.model_dump(), trainer_key=key))
    return ShardcastWeights(client, cache, keep=cfg.async_level + 2)


def _signed(m: Manifest, key: VerifyKey) -> bool:
    """Whether every header and shard of ``m`` carries ``key``'s signature: a version the origin holds from
    before (another key, or none) would get the origin marked bad by every relay, so it is written anew."""
    verifier = Verifier(key)
    try:
        verify_header(verifier, m)
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
