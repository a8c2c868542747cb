"""Where inference workers get policy weights: run storage, or SHARDCAST relays.

Both sources answer the two questions a worker asks (:func:`~intellect.rl.worker.run_worker`):
which checkpoints are complete, and the model of one of them. With SHARDCAST the trainer publishes
each checkpoint's inference files (not its optimizer state) to the origin
(:func:`publish_to_origin`), relays mirror it, and a worker downloads a version into its own cache
folder, keeping only the newest few.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from intellect.model.checkpoint import load_checkpoint_copy
from intellect.pretrain import CHECKPOINTS, fetch_checkpoint
from intellect.rl.config import RLRunConfig
from intellect.shardcast.client import ShardcastClient
from intellect.shardcast.store import VersionStore, publish_folder
from intellect.storage import STABLE, RunStorage

log = logging.getLogger("intellect.rl.weights")

# Trainer state saved beside each checkpoint that inference does not need (2x the weights for AdamW).
TRAINER_ONLY = frozenset({"optimizer.pt", "rl_step.json", "origin.json"})


class WeightSource(Protocol):
    def complete_steps(self) -> list[int]: ...

    def load(self, step: int): ...  # -> (model, tokenizer)

    def close(self) -> None: ...


class StorageWeights:
    """Checkpoints straight from run storage (``STABLE`` marks the complete ones)."""

    def __init__(self, storage: RunStorage):
        self.storage = storage

    def complete_steps(self) -> list[int]:
        return self.storage.complete_steps(CHECKPOINTS)

    def load(self, step: int):
        return fetch_checkpoint(self.storage, step)

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


def weight_source(cfg: RLRunConfig, storage: RunStorage, cache: str | Path) -> WeightSource:
    """The source ``cfg`` asks for: SHARDCAST when ``cfg.shardcast`` is set (its relays must be resolved)."""
    sc = cfg.shardcast
    if sc is None:
        return StorageWeights(storage)
    if not sc.relays:
        raise ValueError("shardcast.relays is empty: the run resolves it when it starts its relays")
    return ShardcastWeights(ShardcastClient(sc.relays, sc.client), cache, keep=cfg.async_level + 2)


def publish_to_origin(cfg: RLRunConfig, storage: RunStorage, step: int, origin_dir: str | Path) -> dict:
    """Publish checkpoint ``step``'s inference files as SHARDCAST version ``step`` (idempotent: an
    existing complete version is kept, a half-written one replaced)."""
    store = VersionStore(origin_dir)
    have = store.manifest(step)
    if have is not None and have.complete:
        return {"version": step, "bytes": have.total_size, "shards": len(have.shards), "published": False}
    if have is not None:
        store.drop(step)
    rel = storage.step_path(step, CHECKPOINTS)
    skip = TRAINER_ONLY | {STABLE}
    if (local := storage.local_path(rel)) is not None:
        m = publish_folder(store, step, local, cfg.shardcast.shard_size, cfg.shardcast.keep, skip=skip)
    else:  # S3: the checkpoint comes down once, into a folder that goes away after
        with tempfile.TemporaryDirectory(prefix="intellect-publish-") as tmp:
            storage.get_dir(rel, Path(tmp) / "ckpt")
            m = publish_folder(store, step, Path(tmp) / "ckpt", cfg.shardcast.shard_size, cfg.shardcast.keep,
                               skip=skip)
    return {"version": step, "bytes": m.total_size, "shards": len(m.shards), "published": True}
