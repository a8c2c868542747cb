"""The process groups of a DiLoCo worker of M local ranks (INTELLECT-1's ElasticDeviceMesh).

A worker is M processes, one per device, started by a launcher (torchrun, or the coordinator) that
gives each its local rank. Two kinds of group connect them:

- **intra-worker** (``intra``, with ``fsdp_mesh`` over it): the worker's M ranks, FSDP's group.
  It is torch's default process group of the worker's launch (FSDP2's collectives need a group
  that torch has registered, which the directly built groups of :mod:`~intellect.diloco.transport`
  are not): gloo on the CPU, NCCL on GPUs. It lives as long as the worker.
- **cross-worker** (``cross``): local rank *i* of every worker, one group per local rank on the
  run's authenticated rendezvous store (:func:`~intellect.diloco.transport.shard_group`, prefix
  ``<membership>/shard<i>``). Rank *i* reduces only its own shard, so a worker runs M independent
  rings each carrying 1/M of the bytes. Rebuilt for each membership (:meth:`WorkerMesh.join`).

::

    worker 0: [rank 0 | rank 1]  --intra (FSDP)--     worker 1: [rank 0 | rank 1]
                 |        '------------ cross shard1 ---------------'    |
                 '------------------ cross shard0 -----------------------'

    >>> launcher_ranks({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    (1, 2)
    >>> launcher_ranks({})
    (0, 1)
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from intellect.device import LOCAL_RANK_ENV, dist_backend
from intellect.diloco import transport

__all__ = ["FSDP_AXIS", "WorkerMesh", "launcher_ranks"]

FSDP_AXIS = "fsdp"  # the name of the intra-worker mesh axis
# torchrun's count of ranks on this node; a worker's launch is one node's worth of ranks
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


def launcher_ranks(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(local_rank, local_size)`` as the launcher set them (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
    torchrun sets both); ``(0, 1)`` for a process started alone. A rank outside ``[0, size)`` is an
    error, not a guess."""
    env = os.environ if environ is None else environ
    rank = int(env.get(LOCAL_RANK_ENV, "0"))
    size = int(env.get(LOCAL_WORLD_SIZE_ENV, "1"))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"launcher ranks: {LOCAL_RANK_ENV}={rank} outside [0, {LOCAL_WORLD_SIZE_ENV}={size})")
    return rank, size


@dataclass
class WorkerMesh:
    """One rank's view of its worker's groups. Build it with :meth:`create`, then :meth:`join` the
    cross-worker group of each membership."""

    local_rank: int
    local_size: int
    device: torch.device
    intra: dist.ProcessGroup
    fsdp_mesh: DeviceMesh
    cross: dist.ProcessGroup | None = None
    worker_rank: int | None = None
    num_workers: int | None = None
    _owns_default: bool = field(default=False, repr=False)

    @classmethod
    def create(
        cls,
        device: torch.device,
        local_rank: int | None = None,
        local_size: int | None = None,
        *,
        store: dist.Store | None = None,  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
        timeout: float = 300.0,
    ) -> WorkerMesh:
        """The intra-worker group of this rank: ``local_rank``/``local_size`` given, else the
        launcher's (:func:`launcher_ranks`). ``store``: the worker's own rendezvous store (None: the
        launcher's ``MASTER_ADDR``/``MASTER_PORT``, as torchrun sets them). The FSDP mesh's device
        type is ``device``'s: an explicit CPU mesh on the CPU, since a gloo group on a GPU host
        otherwise picks CUDA (pytorch#132471)."""
        if local_rank is None or local_size is None:
            env_rank, env_size = launcher_ranks()
            local_rank = env_rank if local_rank is None else local_rank
            local_size = env_size if local_size is None else local_size
        if not 0 <= local_rank < local_size:
            raise ValueError(f"WorkerMesh: local rank {local_rank} outside [0, {local_size})")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL starts: its communicator binds the current device
        owns = False
        if dist.is_initialized():
            if dist.get_world_size() != local_size or dist.get_rank() != local_rank:
                raise RuntimeError(f"WorkerMesh: the default group is rank {dist.get_rank()} of "
                                   f"{dist.get_world_size()}, not local rank {local_rank} of {local_size}")
        else:
            backend, td = dist_backend(device), datetime.timedelta(seconds=timeout)
            if store is not None:
                dist.init_process_group(backend, store=store, rank=local_rank, world_size=local_size, timeout=td)
            else:
                dist.init_process_group(backend, init_method="env://", rank=local_rank, world_size=local_size,
                                        timeout=td)
            owns = True
        intra = dist.group.WORLD
        assert intra is not None  # initialised above
        mesh = DeviceMesh.from_group(intra, device.type, mesh_dim_names=(FSDP_AXIS,))
        return cls(local_rank, local_size, device, intra, mesh, _owns_default=owns)

    def join(
        self,
        store: dist.Store,  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
        prefix: str,
        worker_rank: int,
        num_workers: int,
        **kw,
    ) -> dist.ProcessGroup:
        """Build (and keep as :attr:`cross`) the cross-worker group of this local rank for the
        membership under ``prefix``: this worker is ``worker_rank`` of ``num_workers``, and every
        worker must have this mesh's ``local_size``. ``kw`` as in
        :func:`~intellect.diloco.transport.new_group` (gloo across workers, whatever the device)."""
        self.cross = transport.shard_group(store, prefix, worker_rank, num_workers, self.local_rank, **kw)
        self.worker_rank, self.num_workers = worker_rank, num_workers
        return self.cross

    def leave(self) -> None:
        """Drop the cross-worker group (a failed reduction leaves messages queued in it)."""
        self.cross = None
        self.worker_rank = self.num_workers = None

    def close(self) -> None:
        """Tear down the intra-worker group, when :meth:`create` set it up."""
        self.leave()
        if self._owns_default and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_default = False
