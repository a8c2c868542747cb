"""The M processes of one DiLoCo worker: its first starts the others, and none outlives another.

A worker of ``diloco.ranks_per_worker = M`` is started as one process (by the coordinator, or as a
flow run of the ``diloco-worker`` deployment), which becomes local rank 0, the *leader*
(:mod:`~intellect.diloco.siblings`). :meth:`WorkerRanks.start` hosts the worker's own store on
127.0.0.1 (its FSDP group and its siblings' groups rendezvous there; nothing of it leaves the
machine) and starts ranks 1..M-1 with the leader's own command line and environment (so its
credentials), plus :data:`WORKER_RANK_ENV`, :data:`LOCAL_STORE_ENV` and ``LOCAL_RANK`` = the leader's
``LOCAL_RANK`` + *i*: rank *i* takes the GPU after the leader's (one device per rank), the CPU
otherwise. :meth:`WorkerRanks.join` is the follower's side.

One worker, one fate, as torchrun's agent does it. The leader watches its followers (:meth:`watch`):
one that exits while the worker runs makes the leader stop (``KeyboardInterrupt`` in its main
thread, so its deathrattle goes out once on the way down) and :meth:`close` ends the rest. A
follower dies with its leader (``PR_SET_PDEATHSIG`` on Linux, and a poll of its parent as a
fallback), so a ``kill -9`` of any rank takes the whole worker out within a heartbeat, and the other
workers see one member leave.

    >>> follower_env({"LOCAL_RANK": "2", "PATH": "/bin"}, rank=1, store="127.0.0.1:5000", leader_pid=42)["LOCAL_RANK"]
    '3'
"""

from __future__ import annotations

import _thread
import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch.distributed as dist

from intellect.device import LOCAL_RANK_ENV

__all__ = ["LEADER_PID_ENV", "LOCAL_STORE_ENV", "WORKER_RANK_ENV", "WorkerRanks", "follower_env", "rank_of"]

log = logging.getLogger("intellect.diloco")

WORKER_RANK_ENV = "INTELLECT_DILOCO_RANK"  # this process's rank within its worker (unset: 0, the leader)
LOCAL_STORE_ENV = "INTELLECT_DILOCO_LOCAL_STORE"  # host:port of the worker's own store (the leader's)
LEADER_PID_ENV = "INTELLECT_DILOCO_LEADER_PID"  # the leader's pid: a follower stops when it is gone
_PR_SET_PDEATHSIG = 1


def rank_of(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank within its worker: 0 (the leader) unless a leader started it."""
    env = os.environ if environ is None else environ
    return int(env.get(WORKER_RANK_ENV, "0"))


def follower_env(environ: Mapping[str, str], rank: int, store: str, leader_pid: int) -> dict[str, str]:
    """The environment of follower ``rank``: the leader's, its rank, the worker's store, and the
    device after the leader's (``LOCAL_RANK``)."""
    base = int(environ.get(LOCAL_RANK_ENV, "0"))
    return {**environ, WORKER_RANK_ENV: str(rank), LOCAL_STORE_ENV: store, LEADER_PID_ENV: str(leader_pid),
            LOCAL_RANK_ENV: str(base + rank)}


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent poll below does it
        pass


@dataclass
class WorkerRanks:
    """This process's place in its worker: ``rank`` of ``size``, the worker's ``store``; the leader
    holds its followers' processes."""

    rank: int
    size: int
    store: dist.Store  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
    children: list[subprocess.Popen] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    lost: str = ""  # why the worker stopped: which rank died

    @classmethod
    def start(cls, size: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              timeout: float = 300.0) -> WorkerRanks:
        """The leader: host the worker's store and start ranks 1..``size``-1 as ``python <argv>`` in
        this process's environment plus ``env`` (the worker's credentials)."""
        store = dist.TCPStore("127.0.0.1", 0, size, True,  # pyright: ignore[reportPrivateImportUsage]
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
        address = f"127.0.0.1:{store.port}"
        base = {**os.environ, **(env or {})}
        children = [subprocess.Popen([sys.executable, *argv], env=follower_env(base, r, address, os.getpid()))
                    for r in range(1, size)]
        log.info("worker of %d ranks: started followers %s (store %s)", size, [c.pid for c in children], address)
        return cls(0, size, store, children)

    @classmethod
    def join(cls, size: int, environ: Mapping[str, str] | None = None, timeout: float = 300.0) -> WorkerRanks:
        """A follower (its rank and the worker's store from the leader's environment)."""
        env = os.environ if environ is None else environ
        _die_with_parent()
        leader = int(env.get(LEADER_PID_ENV, "0"))
        if leader and os.getppid() != leader:  # the leader died before the death signal was armed
            raise SystemExit(f"worker rank {rank_of(env)}: the leader (pid {leader}) is gone")
        rank = rank_of(env)
        if not 0 < rank < size:
            raise ValueError(f"worker rank {rank} outside [1, {size})")
        host, port = env[LOCAL_STORE_ENV].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, False,  # pyright: ignore[reportPrivateImportUsage]
                              timeout=datetime.timedelta(seconds=timeout))
        ranks = cls(rank, size, store)
        threading.Thread(target=ranks._watch_parent, args=(leader,), name="watch-leader", daemon=True).start()
        return ranks

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _watch_parent(self, leader: int) -> None:
        while not self._stop.wait(0.5):
            if leader and os.getppid() != leader:
                os._exit(1)  # the leader is gone: so is the worker

    def _exited(self) -> str:
        for r, c in enumerate(self.children, start=1):
            code = c.poll()
            if code is not None:
                return f"worker rank {r} (pid {c.pid}) exited with code {code}"
        return ""

    def watch(self, interval: float = 0.5) -> None:
        """The leader: stop this process (``KeyboardInterrupt`` in the main thread) when a follower
        exits before :meth:`close`."""
        def loop() -> None:
            while not self._stop.wait(interval):
                with self._lock:
                    if self._stop.is_set() or not (lost := self._exited()):
                        continue
                    self.lost = lost
                    self._stop.set()
                log.error("%s: the worker stops", lost)
                _thread.interrupt_main()
                return

        if self.children:
            threading.Thread(target=loop, name="watch-ranks", daemon=True).start()

    def casualty(self, wait: float = 2.0) -> str:
        """The leader, after an error: which follower died, if one did (waiting up to ``wait`` seconds
        for its exit to show: a sibling's death is what breaks the worker's collectives), else "".
        Stops :meth:`watch`, so the error is handled once."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                self.lost = self.lost or self._exited()
                if self.lost or time.monotonic() >= deadline:
                    self._stop.set()
                    return self.lost
            time.sleep(0.05)

    def close(self, grace: float = 10.0) -> None:
        """The leader: wait ``grace`` seconds for the followers to finish, then end them."""
        self._stop.set()
        deadline = time.monotonic() + grace
        for c in self.children:
            try:
                c.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.terminate()
        for c in self.children:
            try:
                c.wait(5)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
