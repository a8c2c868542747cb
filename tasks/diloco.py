"""Prefect tasks for the phases of a DiLoCo worker's outer step.

The worker (model, inner optimizer, outer state, process groups) lives in
its own long-lived process; each phase is a bound method run as one task, so
nothing heavy is serialized, hashed or retried by Prefect (a failed
collective is retried by the worker's own commit protocol, not here).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

PHASES = ("boundary", "inner-train", "all-reduce-commit", "checkpoint")


def _call(fn, *args):
    return fn(*args)


_TASKS = {name: task(name=name, cache_policy=NO_CACHE)(_call) for name in PHASES}


def run_phase(name: str, fn, *args):
    """Run phase ``name`` of the outer step as its own task run."""
    return _TASKS[name](fn, *args)
