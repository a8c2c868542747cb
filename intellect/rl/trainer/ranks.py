"""The trainer as M processes (``trainer.ranks``): rank 0 owns the run and drives the others.

Rank 0 is the run's process (service, ledger, publishing). :meth:`ShardedTrainer.start` starts ranks
1..M-1 with the DiLoCo worker's launcher (:class:`~intellect.diloco.worker_ranks.WorkerRanks`: a
store of its own on 127.0.0.1, one device per rank, no rank outliving another) as
``python -m intellect.rl.trainer.ranks M``, and hands them a :class:`TrainerSpec` through that store.
Every rank builds the same trainer (:func:`build`): checkpoint ``spec.checkpoint``'s weights, verified
against the digest rank 0 read from its ledger, sharded over the ranks' group
(:class:`~intellect.diloco.mesh.WorkerMesh`), and the trainer's sharded state of that checkpoint when
it was saved (:mod:`intellect.rl.trainer.state`). Then each call rank 0 makes (a step on the step's
samples, a publish, a save) is broadcast over the group first, and the followers (:func:`follow`)
make it too; only rank 0 writes the consolidated checkpoint and its sidecars, every rank its own
shards of the trainer's state.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from pydantic import Field

from intellect.checkpoints import OPTIMIZER, Sidecar, verified_copy
from intellect.config import ComputeConfig, StorageConfig, StrictModel
from intellect.device import resolve_device
from intellect.diloco.checkpoint_shards import ShardsRefused
from intellect.diloco.mesh import WorkerMesh
from intellect.diloco.worker_ranks import WorkerRanks
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample, StepStats
from intellect.rl.trainer.state import has_state, load_one_process_state, load_state, save_state
from intellect.storage import RunStorage

__all__ = ["SPEC_KEY", "ShardedTrainer", "TrainerSpec", "build", "follow"]

log = logging.getLogger("intellect.rl.trainer.ranks")

SPEC_KEY = "rl/trainer/spec"  # the store key rank 0 hands the spec to its followers under
_MODULE = "intellect.rl.trainer.ranks"


class TrainerSpec(StrictModel):
    """What every rank of a sharded trainer builds it from."""

    run_name: str = Field(min_length=1, max_length=128)
    storage: StorageConfig
    trainer: RLTrainerConfig
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    checkpoint: int = Field(ge=0, le=10_000_000, description="The checkpoint whose weights the trainer starts from.")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                               description="Its recorded digest (None: not checked).")
    threads: int = Field(default=0, ge=0, le=1024, description="torch threads per rank (0: torch's default).")
    reference_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="The recorded digest of checkpoint 0, the reference of the loss's KL term, which the "
        "trainer loads when trainer.loss.kl_coef > 0 (None: not checked).")


def reference_model(storage: RunStorage, sha256: str | None) -> torch.nn.Module:
    """The reference policy of the loss's KL term (``trainer.loss.kl_coef > 0``), fp32: the run's first
    checkpoint, verified against ``sha256`` (its recorded digest), whatever step a trainer of any number
    of ranks starts or resumes at, so a trainer rebuilt from storage regularizes toward the same
    weights as one kept in memory."""
    with verified_copy(storage, 0, sha256=sha256) as folder:
        return load_checkpoint_copy(folder, torch.float32)[0]


def build(spec: TrainerSpec, rank: int, size: int, store: dist.Store  # pyright: ignore[reportPrivateImportUsage]
          ) -> tuple[GRPOTrainer, RunStorage]:
    """This rank's trainer of ``spec`` (collective over the ``size`` ranks that rendezvous at ``store``)
    and the run's storage."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    storage = RunStorage.from_config(spec.storage, spec.run_name)
    mesh = WorkerMesh.create(resolve_device(spec.compute.device), rank, size, store=store)
    with verified_copy(storage, spec.checkpoint, sha256=spec.sha256) as folder:
        model, tok = load_checkpoint_copy(folder, torch.float32)  # FSDP2 shards fp32 masters, whatever was published
        # a one-process trainer's state, when that is what wrote the checkpoint
        whole = torch.load(folder / OPTIMIZER, weights_only=True, map_location="cpu") \
            if (folder / OPTIMIZER).exists() else None
    ref = reference_model(storage, spec.reference_sha256) if spec.trainer.loss.kl_coef > 0 else None
    trainer = GRPOTrainer(model, tok, spec.trainer, ref_model=ref, compute=spec.compute, mesh=mesh)
    if has_state(storage, spec.checkpoint):
        saved = load_state(storage, spec.checkpoint, trainer, mesh.intra)
        log.info("rank %d: the trainer's state of checkpoint %d (saved by %d ranks) loaded", rank, spec.checkpoint,
                 saved)
    elif whole is not None:
        load_one_process_state(trainer, whole)
    return trainer, storage


def _group(trainer: GRPOTrainer) -> dist.ProcessGroup:
    assert trainer.mesh is not None  # built by build()
    return trainer.mesh.intra


def _call(trainer: GRPOTrainer, storage: RunStorage, name: str, args: tuple, sidecars=None) -> Any:
    """One call, on every rank alike (rank 0 also passes the sidecars it alone writes)."""
    if name == "train_step":
        return trainer.train_step(args[0])
    if name == "publish":
        return trainer.publish(storage, args[0], sidecars)
    if name == "save_state":
        return save_state(storage, args[0], trainer, _group(trainer))
    if name == "on_ranks":
        out: list[Any] = [None] * dist.get_world_size(_group(trainer))
        dist.all_gather_object(out, args[0](trainer), group=_group(trainer))
        return out
    raise ValueError(f"not a call of the sharded trainer: {name!r}")


def follow(trainer: GRPOTrainer, storage: RunStorage) -> None:
    """A follower: make each call rank 0 broadcasts, until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=_group(trainer))
        name, args = box[0]
        if name == "stop":
            return
        try:
            _call(trainer, storage, name, args)
        except (ShardsRefused, FileExistsError) as e:  # agreed by every rank: rank 0 decides what follows
            log.warning("rank %d: %s failed on every rank (%s)", dist.get_rank(_group(trainer)), name, e)


@dataclass
class ShardedTrainer:
    """Rank 0's trainer of ``trainer.ranks`` processes: the calls the run makes, made on every rank."""

    trainer: GRPOTrainer
    storage: RunStorage
    ranks: WorkerRanks

    @classmethod
    def start(cls, spec: TrainerSpec, env: Mapping[str, str] | None = None, timeout: float = 300.0) -> ShardedTrainer:
        """Start the followers (this process's environment plus ``env``), then build rank 0's trainer."""
        size = spec.trainer.ranks
        ranks = WorkerRanks.start(size, ["-m", _MODULE, str(size)], env, timeout=timeout)
        try:
            ranks.store.set(SPEC_KEY, spec.model_dump_json())
            trainer, storage = build(spec, 0, size, ranks.store)
        except BaseException:
            ranks.close(grace=0.0)
            raise
        ranks.watch()
        return cls(trainer, storage, ranks)

    @property
    def step(self) -> int:
        return self.trainer.step

    def _broadcast(self, name: str, args: tuple = ()) -> None:
        dist.broadcast_object_list([(name, args)], src=0, group=_group(self.trainer))

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        self._broadcast("train_step", (list(samples),))
        return _call(self.trainer, self.storage, "train_step", (samples,))

    def publish(self, storage: RunStorage, step: int, sidecars: Mapping[Sidecar, Any] | None = None) -> str:
        """The consolidated checkpoint ``step`` (written by this rank into the trainer's own storage,
        which must be ``storage``)."""
        if storage.url != self.storage.url:
            raise ValueError(f"the sharded trainer publishes into {self.storage.url}, not {storage.url}")
        self._broadcast("publish", (step,))
        return _call(self.trainer, self.storage, "publish", (step,), sidecars)

    def save_state(self, step: int) -> str:
        """The trainer's sharded state as ``trainer_state/step_<step>``, every rank its own shards."""
        self._broadcast("save_state", (step,))
        return _call(self.trainer, self.storage, "save_state", (step,))

    def on_ranks(self, fn: Callable[[GRPOTrainer], Any]) -> list[Any]:
        """``fn(trainer)`` on every rank (a module-level function, which travels by name: the
        followers must import its module), its results by rank (picklable)."""
        self._broadcast("on_ranks", (fn,))
        return _call(self.trainer, self.storage, "on_ranks", (fn,))

    def close(self, grace: float = 30.0) -> None:
        """Stop the followers (they exit once they have the word) and leave the group."""
        try:
            if not self.ranks.lost:
                self._broadcast("stop")
        finally:
            self.ranks.close(grace)
            assert self.trainer.mesh is not None
            self.trainer.mesh.close()


def main(argv: Sequence[str]) -> None:
    """A follower: ``python -m intellect.rl.trainer.ranks <ranks>``, started by rank 0."""
    logging.basicConfig(level=os.environ.get("INTELLECT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    size = int(argv[0])
    ranks = WorkerRanks.join(size)
    spec = TrainerSpec.model_validate_json(ranks.store.get(SPEC_KEY))
    trainer, storage = build(spec, ranks.rank, size, ranks.store)
    follow(trainer, storage)
    assert trainer.mesh is not None
    trainer.mesh.close()


if __name__ == "__main__":
    main(sys.argv[1:])
