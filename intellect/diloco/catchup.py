"""Non-blocking onboarding (``diloco.onboarding = "non_blocking"``): the members never wait for a joiner.

Blocking onboarding (INTELLECT-1's first mode, the default) makes every member wait at the boundary
for newcomers still starting up, then for the broadcast of the whole outer state. Non-blocking, as
INTELLECT-1's second mode:

1. Veterans propose a step's members without waiting for newcomers; a joiner is in as soon as it has
   arrived, behind (its ``COMMITTED`` count is older than the step).
2. In that step the joiner trains nothing and contributes nothing to the all-reduce (it relays and
   receives, as a member with a non-finite pseudo-gradient does), while the step's onboarding source
   (:func:`~intellect.diloco.protocol.onboarding_source`) sends it, in the background, the state the
   step starts from: ``theta_sync``, the outer momentum and the step count (:meth:`OuterState.flat`),
   rank *i* of the source to rank *i* of the joiner (shard to shard), over a group of two of their own
   (:func:`~intellect.diloco.protocol.catchup_group`, whose keys only they may write).
3. At the step's commit the joiner takes that state, then applies the step's average like everyone:
   it holds the members' ``theta_sync`` bit for bit and contributes from the next step on.

The source sends a snapshot taken at the boundary, so its own outer step never waits for the
transfer; only the joiner waits for it, at its own commit (a transfer slower than a whole inner
phase delays that joiner's vote, nobody else's training). A transfer that fails costs the joiner
the step: it leaves and rejoins.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
import torch.distributed as dist

from intellect.diloco.transport import CommError, new_group

__all__ = ["Transfer"]

log = logging.getLogger("intellect.diloco")


class Transfer:
    """One background send (``rank`` 0, the source) or receive (``rank`` 1, the joiner) of ``flat`` over
    a gloo group of two under ``prefix`` on the rendezvous ``store`` (whose client keeps a connection
    per thread), bounded by ``timeout`` seconds."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, flat: torch.Tensor,  # pyright: ignore[reportPrivateImportUsage]
                 timeout: float, name: str):
        self.flat, self.error = flat, ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, prefix, rank, timeout), name=name, daemon=True)
        self._thread.start()

    def _run(self, store, prefix: str, rank: int, timeout: float) -> None:
        try:
            group = new_group(store, prefix, rank, 2, timeout=timeout)
            group.broadcast(self.flat, 0).wait()
        except (CommError, dist.DistError, RuntimeError, ValueError) as e:
            self.error = str(e) or type(e).__name__
        finally:
            close: Callable[[], None] | None = getattr(store, "close", None)
            if close is not None:
                close()  # this thread's connection
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the transfer completed within ``timeout`` seconds (else :attr:`error` says why)."""
        if not self._done.wait(timeout):
            self.error = self.error or f"not done in {timeout:.0f} s"
            return False
        return not self.error
