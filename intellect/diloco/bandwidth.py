"""Pairwise throughput between DiLoCo workers, measured over the all-reduce's own transport.

Every directed pair is probed once per new membership: in round-robin rounds
(the circle method, so each worker is busy with one peer at a time) the pair
exchanges a ping, then the sender pushes ``nbytes`` and the receiver times the
arrival. The receiver's column goes to the store; every worker reads the same
matrix and solves the same ring (``ring_order``), and under ``diloco.algorithm =
"auto"`` estimates the same algorithm times (``plan.choose_algorithm``), so
no one has to broadcast it, and no one decides it for the others: each member runs
its own computation (``plan.settle_plan``; only a restarted member that missed the
probe follows the plan first stored for the attempt).
"""

from __future__ import annotations

import json
import time
from typing import Sequence

import torch
import torch.distributed as dist

from intellect.diloco.ring_order import ring_order


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every unordered pair once (circle method).

    >>> round_robin(4)
    [[(0, 3), (1, 2)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]]
    >>> sum(len(r) for r in round_robin(5)) == 5 * 4 // 2
    True
    """
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    rounds: list[list[tuple[int, int]]] = []
    for _ in range(m - 1):
        pairs: list[tuple[int, int]] = []
        for i in range(m // 2):
            a, b = slots[i], slots[m - 1 - i]
            if a is not None and b is not None:  # None: the bye of an odd n
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        slots = [slots[0], slots[-1]] + slots[1:-1]
    return rounds


def probe_rates(group: dist.ProcessGroup, nbytes: int) -> list[float]:
    """Bytes/s this rank received from each other rank (0 on the diagonal).

    Collective: every rank of ``group`` must call it. Waits are bounded by the group's timeout.
    """
    rank, size = group.rank(), group.size()
    rates = [0.0] * size
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    ping = torch.zeros(1, dtype=torch.uint8)
    for rnd in round_robin(size):
        for a, b in rnd:
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            for sender in (a, b):
                if sender == rank:
                    group.recv([ping], peer, 0).wait()  # the receiver is ready: start the clock there
                    group.send([payload], peer, 1).wait()
                else:
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                    group.send([ping], peer, 0).wait()
                    t0 = time.perf_counter()
                    group.recv([buf], peer, 1).wait()
                    rates[peer] = nbytes / max(time.perf_counter() - t0, 1e-9)
    return rates


def solve_ring(columns: Sequence[Sequence[float]]) -> list[int]:
    """Ring order from receive rates: ``columns[j][i]`` is what j measured from i.

    >>> slow = [[0, 9, 9, 9], [9, 0, 9, 1], [9, 9, 0, 9], [9, 1, 9, 0]]   # 1<->3 is slow
    >>> solve_ring(slow)
    [0, 1, 2, 3]
    """
    n = len(columns)
    bw = [[columns[j][i] if i != j else 0.0 for j in range(n)] for i in range(n)]
    return ring_order(bw)


def measure_ring(
    group: dist.ProcessGroup,
    store: dist.Store,  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C
    key: str,
    nbytes: int,
) -> tuple[list[int], list[list[float]]]:
    """Probe, publish this rank's column under ``key/<rank>``, read all, solve; (order, columns)."""
    column = probe_rates(group, nbytes)
    store.set(f"{key}/{group.rank()}", json.dumps(column))
    columns = [json.loads(store.get(f"{key}/{r}")) for r in range(group.size())]
    return solve_ring(columns), columns
