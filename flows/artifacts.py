"""Artifact helpers shared by the flows: keys Prefect accepts, and publishing off the critical path."""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def artifact_key(run_name: str, suffix: str) -> str:
    """An artifact key for a run: Prefect allows lowercase letters, digits and dashes only.

    >>> artifact_key("RL_tiny.v2", "rl-step")
    'rl-tiny-v2-rl-step'
    """
    return f"{run_name.lower().replace('_', '-').replace('.', '-')}-{suffix}"


def synced(result: T | Coroutine[Any, Any, T]) -> T:
    """The result of a Prefect ``sync_compatible`` call (typed ``T | Coroutine``) made from sync code.

    Called from a synchronous flow or task such a function runs to completion and returns ``T``;
    a coroutine here would mean the call was made from async code, which must ``await`` it.

    >>> synced(3)
    3
    """
    if isinstance(result, Coroutine):
        result.close()
        raise TypeError("synced: a sync_compatible call returned a coroutine; await it in async code")
    return result


class BackgroundArtifacts:
    """Creates artifacts on one background thread, in the calling flow run's context.

    Each artifact is a synchronous API round trip (about 50 ms against a local server, measured
    with ``create_table_artifact``); a step loop that published inline would wait for it every
    step. Order is kept (one thread), a failed call is logged and does not stop the run, and
    :meth:`close` waits for what is queued.
    """

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter | None = None):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="artifacts")
        self._pending: list[Future] = []
        self._logger = logger or logging.getLogger(__name__)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        ctx = contextvars.copy_context()  # the flow run context, so the artifact links to this run
        for fut in [f for f in self._pending if f.done()]:
            self._pending.remove(fut)
            if fut.exception() is not None:
                self._logger.warning("publishing an artifact failed: %r", fut.exception())
        self._pending.append(self._pool.submit(ctx.run, fn, *args, **kwargs))

    def close(self, timeout: float = 60.0) -> None:
        """Wait up to ``timeout`` seconds for queued artifacts, then stop the thread."""
        deadline = time.monotonic() + timeout
        for fut in self._pending:
            try:
                fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:  # noqa: BLE001 - an artifact never fails the run
                self._logger.warning("publishing an artifact failed: %r", exc)
        self._pending = []
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "BackgroundArtifacts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
