"""Where a DiLoCo worker lets a test break it: an injected :class:`Faults` object, no-op by default.

A worker calls each hook at the one point of its outer step where that fault belongs; production
passes :data:`NO_FAULTS`, so nothing outside the object (no environment variable, no file) can
turn a fault on. The reliability and attack tests pass their own (``tests/integration/diloco_faults.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Faults(Protocol):
    def pseudo_gradient(self, step: int, worker: str, pseudo: list[torch.Tensor]) -> None:
        """Called with the worker's pseudo-gradient before it is checked and all-reduced; may alter
        it in place (an admitted liar, a non-finite value)."""
        ...

    def before_allreduce(self, step: int, attempt: int, worker: str) -> None:
        """Called once every member is ready, before the attempt's group is built (a stall here
        holds up the collective, not the readiness wait)."""
        ...

    def ring(self, step: int, attempt: int, worker: str, rank: int) -> None:
        """Called on local rank ``rank`` of a worker once its ring's group is built, before its
        all-reduce; raising fails that ring alone (the worker's other rings run)."""
        ...

    def onboarding_state(self, step: int, worker: str, flat: torch.Tensor) -> None:
        """Called on the onboarding source with the state it is about to send to the members behind
        (:meth:`~intellect.diloco.outer.OuterState.flat`); may alter it in place (a source that lies)."""
        ...


class NoFaults:
    """Every hook does nothing."""

    def pseudo_gradient(self, step: int, worker: str, pseudo: list[torch.Tensor]) -> None:
        pass

    def before_allreduce(self, step: int, attempt: int, worker: str) -> None:
        pass

    def ring(self, step: int, attempt: int, worker: str, rank: int) -> None:
        pass

    def onboarding_state(self, step: int, worker: str, flat: torch.Tensor) -> None:
        pass


NO_FAULTS: Faults = NoFaults()
