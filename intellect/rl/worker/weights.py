"""Policy weights into a worker: the trainer publishes each checkpoint as a signed SHARDCAST version
(:func:`~intellect.rl.trainer.publish.publish_to_origin`), relays mirror it, and a worker
(:func:`~intellect.rl.worker.worker.run_worker`) downloads a version into its own cache folder, keeping
only the newest few (:class:`ShardcastWeights`), and hands its engine the folder. Workers pin the
trainer's public key and use nothing it did not sign (:mod:`intellect.shardcast.signing`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from intellect.storage import parse_step, step_name

if TYPE_CHECKING:
    from intellect.shardcast.client import ShardcastClient


class WeightSource(Protocol):
    """Where a worker's checkpoints come from: the complete ones, and one as a verified local folder."""

    def complete_steps(self) -> list[int]: ...

    def folder(self, step: int) -> Path: ...

    def close(self) -> None: ...


class ShardcastWeights:
    """Checkpoints downloaded from relays into ``cache`` (the newest ``keep`` stay on disk)."""

    def __init__(self, client: ShardcastClient, cache: str | Path, keep: int):
        self.client, self.cache, self.keep = client, Path(cache), keep
        self.cache.mkdir(parents=True, exist_ok=True)

    def complete_steps(self) -> list[int]:
        return self.client.complete_versions()

    def folder(self, step: int) -> Path:
        """Checkpoint ``step`` as a folder of the cache, every file verified against the trainer's
        signature (:meth:`ShardcastClient.fetch`). It stays until ``keep`` newer ones are fetched: an
        engine reads it at once (:func:`~intellect.inference.engines.make_engine`, ``update_weights``)."""
        dest = self.cache / step_name(step)
        self.client.fetch(step, dest)
        self._prune()
        return dest

    def _prune(self) -> None:
        held = sorted((n, p) for p in self.cache.iterdir() if (n := parse_step(p.name)) is not None)
        for _, p in held[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        self.client.close()
