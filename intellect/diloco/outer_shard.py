"""DiLoCo's outer state for a model sharded by FSDP2: each rank keeps only its own shard.

:class:`ShardedOuterState` is :class:`~intellect.diloco.outer.OuterState` (the same fp32 CPU copy,
pseudo-gradient, SGD-Nesterov step, load and checkpoint helpers, unchanged) over the *local* shard of
every parameter (``DTensor.to_local()``) instead of the whole parameter. Each rank's buffers are
sized from its own local element count: FSDP2 splits dim 0 as ``torch.chunk`` does, so shards are
uneven (:func:`intellect.parallel.shard_bounds`) and a rank may hold an empty shard. Rank *i* of a
worker averages its pseudo-gradient shard with rank *i* of the other workers
(:attr:`intellect.diloco.mesh.WorkerMesh.cross`); the outer step is elementwise, so stepping each
shard is stepping the whole model.

:meth:`ShardedOuterState.full_digest` gathers the shards over the worker's ranks and hashes the
full tensors exactly as :meth:`OuterState.digest` does, so a sharded worker and an unsharded one
holding the same weights give the same digest: concatenating the dim-0 shards in rank order is the
full tensor's row-major bytes.

    >>> import torch
    >>> [b - a for a, b in shard_extents(torch.Size([5, 3]), 2)]   # elements per rank of a 5x3 weight
    [9, 6]
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from intellect.diloco.outer import OuterState
from intellect.parallel import shard_bounds

__all__ = ["ShardedOuterState", "consolidated", "local_part", "local_params", "shard_extents"]


def shard_extents(shape: torch.Size, ranks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's shard in the flattened full tensor (``Shard(0)``)."""
    row = shape[1:].numel()
    return [(s * row, e * row) for s, e in shard_bounds(shape[0] if len(shape) else 1, ranks)]


def local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's part of every parameter: the local shard of a ``DTensor`` (a view of the storage
    FSDP all-gathers from, so writing into it changes the model), the parameter itself otherwise."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        if isinstance(p, DTensor):
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(f"sharded outer state: placements {p.placements} on a {p.device_mesh.ndim}-D "
                                 "mesh; FSDP2's Shard(0) on one axis expected")
            out.append(p.to_local())
        else:
            out.append(p)
    return out


class ShardedOuterState(OuterState):
    """:class:`OuterState` over this rank's shards of ``model`` (built by
    :func:`intellect.parallel.parallelize`); the same constructor arguments. :attr:`params` are the
    fp32 CPU copies of the local shards, :meth:`pseudo_gradient` and :meth:`step` take and give
    local shards, :meth:`load_into` writes into the sharded model, :meth:`digest` hashes this rank's
    shards only (equal across workers for the same local rank); :meth:`full_digest` is the worker's."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.7, momentum: float = 0.5, nesterov: bool = True,
                 *, device: torch.device | None = None):
        self.full_shapes = [p.shape for p in model.parameters()]
        groups = {p.device_mesh.get_group() for p in model.parameters() if isinstance(p, DTensor)}
        if len(groups) > 1:
            raise ValueError("sharded outer state: parameters sharded over more than one group")
        self.group = groups.pop() if groups else None
        self._host_mesh: DeviceMesh | None = None
        super().__init__(model, lr, momentum, nesterov, device=device)
        if self.group is not None:  # the gather and the digest rely on torch.chunk's split
            rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
            for p, shape in zip(self.params, self.full_shapes):
                s, e = shard_extents(shape, ranks)[rank]
                if p.numel() != e - s:
                    raise ValueError(f"sharded outer state: rank {rank} holds {p.numel()} elements of a "
                                     f"{tuple(shape)} parameter, not the {e - s} of a dim-0 chunk")

    @staticmethod
    def _model_params(model: torch.nn.Module) -> list[torch.Tensor]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return local_params(model)

    def _gathered(self, shards: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Each full tensor of ``shards`` (laid out as :attr:`params`) in turn, fp32 on the CPU,
        gathered from the worker's ranks: a collective over the intra-worker group, one parameter
        in memory at a time."""
        if len(shards) != len(self.params):
            raise ValueError(f"expected {len(self.params)} shards, got {len(shards)}")
        if self.group is None:
            yield from shards
            return
        ranks = dist.get_world_size(self.group)
        # an NCCL group moves device tensors only; gloo the CPU's
        dev = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        for p, shape in zip(shards, self.full_shapes):
            extents = shard_extents(shape, ranks)
            width = max(e - s for s, e in extents)
            mine = torch.zeros(width, dtype=torch.float32, device=dev)
            mine[:p.numel()] = p.reshape(-1)
            parts = [torch.empty_like(mine) for _ in range(ranks)]
            dist.all_gather(parts, mine, group=self.group)
            yield torch.cat([t[:e - s] for t, (s, e) in zip(parts, extents)]).cpu().view(shape)

    def iter_gathered(self, shards: Sequence[torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """The full tensors of ``shards`` (default: ``theta_sync``) one at a time on every rank
        (collective; every rank must consume them all): an export holds one full parameter at once."""
        return self._gathered(self.params if shards is None else shards)

    def as_dtensors(self, shards: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``shards`` (default: ``theta_sync``; or the momentum) as ``Shard(0)`` DTensors of the full
        shapes over the worker's ranks, on a CPU mesh (a DTensor moves its local tensor to its mesh's
        device type; these stay the fp32 host copies, sharing their storage): the form
        ``torch.distributed.checkpoint`` saves and loads to any number of ranks. The shards
        themselves when the model is not sharded."""
        shards = self.params if shards is None else shards
        if len(shards) != len(self.params):
            raise ValueError(f"expected {len(self.params)} shards, got {len(shards)}")
        if self.group is None:
            return list(shards)
        if self._host_mesh is None:  # no new group: a view of the worker's, for the DTensors' layout only
            self._host_mesh = DeviceMesh.from_group(self.group, "cpu")
        return [DTensor.from_local(t, self._host_mesh, [Shard(0)], run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())
                for t, shape in zip(shards, self.full_shapes)]

    def gather(self, shards: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The full tensors of ``shards`` (default: ``theta_sync``; or the momentum, a pseudo-gradient)
        on every rank (collective): for checks and small models; a large model's export goes through
        the checkpoint path, not this."""
        return list(self._gathered(self.params if shards is None else shards))

    def full_digest(self) -> str:
        """SHA-256 of the full ``theta_sync`` (collective over the worker's ranks): equal to
        :meth:`OuterState.digest` of an unsharded replica holding the same weights."""
        h = hashlib.sha256()
        for t in self._gathered(self.params):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def local_part(outer: ShardedOuterState, full: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of each full tensor (a checkpoint's momentum), laid out as ``outer``'s shards:
    how a worker of any number of ranks loads the one checkpoint format."""
    if outer.group is None:
        return list(full)
    rank, ranks = dist.get_rank(outer.group), dist.get_world_size(outer.group)
    out = []
    for t, shape, p in zip(full, outer.full_shapes, outer.params):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"a full tensor of shape {tuple(t.shape)} for a {tuple(shape)} parameter")
        s, e = shard_extents(shape, ranks)[rank]
        out.append(t.reshape(-1)[s:e].view_as(p))
    return out


def consolidated(outer: ShardedOuterState, shell: torch.nn.Module | None, lr: float = 0.7, momentum: float = 0.5,
                 nesterov: bool = True) -> OuterState | None:
    """The worker's whole outer state, ``theta_sync`` and momentum gathered over its ranks (collective:
    every rank calls it), as an :class:`OuterState` over ``shell`` (an fp32 CPU model of the same
    architecture) on the rank that passes one; None on the others. What a checkpoint is written from."""
    theta = outer.gather()
    moments = outer.gather(outer.momentum_buffers())
    if shell is None:
        return None
    full = OuterState(shell, lr, momentum, nesterov, device=torch.device("cpu"))
    full.set_state(theta, moments if outer.has_momentum() else None)
    return full
