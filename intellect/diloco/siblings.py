"""The local ranks of one DiLoCo worker: who leads, and how the leader's decisions reach the others.

A worker of ``diloco.ranks_per_worker = M`` ranks is M processes on one machine. Only its first, the
*leader* (local rank 0), speaks for the worker at the run's rendezvous: it heartbeats, arrives at
boundaries, votes and writes the worker's keys. The *followers* (ranks 1..M-1) hold a rendezvous
connection only for the gloo groups of their own rings (rank *i* with rank *i* of the other workers).
Whatever the leader decides that the followers must act on too (the step's members, the attempt and
its plan, commit or retry, the data position after a membership change) it hands them through
:meth:`Siblings.share`; what the ranks found (each ring's outcome, their losses) it collects with
:meth:`Siblings.gather`. Both travel as bounded JSON over a small gloo group of the worker's own,
on the worker's local store: never over FSDP's group (NCCL on GPUs, and busy with the model), and
one :class:`Siblings` per thread that uses it (the synchronizer's reduction thread has its own).

A worker of one rank is :data:`ALONE`: every call returns at once with what a single rank knows, so
``ranks_per_worker = 1`` runs exactly the code it ran before there were siblings.

    >>> ALONE.share({"members": ["w0", "w1"]}), ALONE.gather(3), ALONE.all(False), ALONE.leader
    ({'members': ['w0', 'w1']}, [3], False, True)
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from intellect.diloco.transport import CommError, new_group

__all__ = ["ALONE", "MAX_MESSAGE", "Siblings"]

MAX_MESSAGE = 64 << 20  # bytes of one shared or gathered JSON value at most (a data position is a few KiB)


class Siblings:
    """Rank ``rank`` of ``size`` of one worker, over ``group`` (gloo, CPU tensors; None when ``size`` is
    1). ``timeout`` bounds each wait: a sibling that dies closes its sockets and the others fail at once,
    so the bound only catches a live rank that stopped answering."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int = 0, size: int = 1,
                 timeout: float = 3600.0):
        if size > 1 and group is None:
            raise ValueError("siblings: a worker of several ranks needs their group")
        self.group, self.rank, self.size = group, rank, size
        self.timeout = datetime.timedelta(seconds=timeout)

    @classmethod
    def on(cls, store: dist.Store, name: str, rank: int, size: int,  # pyright: ignore[reportPrivateImportUsage]
           timeout: float = 3600.0) -> Siblings:
        """The worker's ranks' group ``name`` on the worker's local ``store`` (:data:`ALONE` for one rank)."""
        if size == 1:
            return ALONE
        return cls(new_group(store, f"siblings/{name}", rank, size, timeout=timeout, backend="gloo"), rank, size, timeout)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:  # gloo: a sibling's closed socket, or the timeout
            raise CommError(f"siblings: {what}: {e}") from e

    def _bcast(self, t: torch.Tensor, what: str) -> None:
        assert self.group is not None
        self._wait(self.group.broadcast(t, 0), what)

    def share(self, value: Any = None) -> Any:
        """The leader's ``value`` (JSON), on every rank: the leader passes it, the followers pass nothing
        and get it. Collective: every rank calls it at the same point of its program."""
        if self.size == 1:
            return value
        data = json.dumps(value).encode() if self.leader else b""
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"siblings: {len(data)} bytes to share, more than {MAX_MESSAGE}")
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._bcast(n, "share (size)")
        size = int(n.item())
        if not 0 <= size <= MAX_MESSAGE:
            raise CommError(f"siblings: the leader shares {size} bytes, outside [0, {MAX_MESSAGE}]")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader else torch.empty(size, dtype=torch.uint8)
        if size:
            self._bcast(buf, "share")
        return value if self.leader else json.loads(buf.numpy().tobytes())

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (JSON), in rank order, on the leader; None on the followers."""
        if self.size == 1:
            return [value]
        assert self.group is not None
        data = json.dumps(value).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"siblings: {len(data)} bytes to gather, more than {MAX_MESSAGE}")
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(self.group.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]), "gather (sizes)")
        width = int(max(s.item() for s in sizes))
        if not 0 <= width <= MAX_MESSAGE:
            raise CommError(f"siblings: a rank gathers {width} bytes, outside [0, {MAX_MESSAGE}]")
        mine = torch.zeros(max(width, 1), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [mine]), "gather")
        if not self.leader:
            return None
        return [json.loads(p[:int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def all(self, flag: bool) -> bool:
        """``flag`` ANDed over the worker's ranks, on every rank."""
        if self.size == 1:
            return flag
        return self.sum([0.0 if flag else 1.0])[0] == 0  # no rank said no

    def sum(self, values: list[float]) -> list[float]:
        """``values`` summed elementwise over the worker's ranks (fp64), on every rank."""
        if self.size == 1:
            return list(values)
        assert self.group is not None
        t = torch.tensor(values, dtype=torch.float64)
        self._wait(self.group.allreduce([t]), "sum")
        return t.tolist()


ALONE = Siblings(None)  # a worker of one rank
