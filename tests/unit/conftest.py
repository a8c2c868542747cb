"""Unit tests start no process, server or socket: a test here that does fails, with what it started.

The guard wraps each phase of a unit test (setup, call, teardown, so module fixtures are covered too)
and replaces, for that phase only, every way this codebase could start a process or reach a network:

- processes: ``subprocess.Popen`` (asyncio's subprocesses too), ``os.fork``/``forkpty``/``posix_spawn[p]``/
  ``system``, ``_posixsubprocess.fork_exec`` (multiprocessing's spawn and forkserver) and, for a clearer
  message, multiprocessing's ``Process.start``;
- sockets: ``bind``, ``connect``, ``connect_ex`` and ``sendto`` on Python sockets (urllib, httpx, boto3,
  uvicorn and asyncio's transports all use them);
- gloo and TCPStore, which open their sockets in C++ where the Python socket patch cannot see them.

Allowed: ``socket.socketpair()`` (asyncio's event loop wakes itself through one; on Linux it binds and
connects nothing, and a pair reaches no other process) and threads (they start no process).

A violation raises where it happens and is recorded too, so code that swallows the error (a retry
loop, a worker thread) still fails the test when the phase ends. Such a test belongs in
tests/integration/.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

_MOVE = "a unit test starts no process, server or socket; move this test to tests/integration/"


def _forbidding(what: str, seen: list[str], method: bool = False) -> Callable[..., Any]:
    """A stand-in that records and refuses the call; a method's ``self`` is left out of the message."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        shown = args[1:3] if method else args[:2]
        detail = f"{what}({', '.join([*map(repr, shown), *(f'{k}=...' for k in kwargs)])[:200]})"
        seen.append(detail)
        raise RuntimeError(f"{detail}: {_MOVE}")

    return refuse


@contextmanager
def forbid_processes_and_sockets(seen: list[str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, _forbidding(f"os.{name}", seen))
        mp.setattr(subprocess.Popen, "_execute_child", _forbidding("subprocess.Popen", seen, method=True))
        mp.setattr(_posixsubprocess, "fork_exec", _forbidding("fork_exec (multiprocessing)", seen))
        mp.setattr(multiprocessing.process.BaseProcess, "start", _forbidding("multiprocessing Process.start", seen))
        for name in ("bind", "connect", "connect_ex", "sendto"):
            mp.setattr(socket.socket, name, _forbidding(f"socket.{name}", seen, method=True))
        if dist.is_available():
            store = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]  (public, re-exported from torch._C)
            mp.setattr(dist, "TCPStore", _refusing_subclass(store, "torch.distributed.TCPStore", seen))
            mp.setattr(dist, "init_process_group", _forbidding("torch.distributed.init_process_group", seen))
            if dist.is_gloo_available():
                gloo = _refusing_subclass(dist.ProcessGroupGloo, "torch.distributed.ProcessGroupGloo", seen)
                mp.setattr(dist, "ProcessGroupGloo", gloo)
        yield


def _refusing_subclass(cls: type, what: str, seen: list[str]) -> type:
    """``cls`` whose construction is refused in ``__new__``, before an object exists: a pybind11 object
    whose ``__init__`` is refused is left without its C++ half, and freeing it takes the process down.
    A subclass keeps the class's attributes (``ProcessGroupGloo._Options``)."""
    return type(cls.__name__, (cls,), {"__new__": staticmethod(_forbidding(what, seen, method=True))})


def _guarded_phase(phase: str) -> Iterator[None]:
    seen: list[str] = []
    with forbid_processes_and_sockets(seen):
        result = yield
    if seen:
        raise pytest.fail.Exception(f"{phase} of a unit test started {'; '.join(seen)}: {_MOVE}", pytrace=False)
    return result


# Per-phase hooks (not a fixture): they cover module- and session-scoped fixtures too, and, being in this
# conftest, apply to the items under tests/unit/ only.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup() -> Iterator[None]:  # pluggy passes only the arguments named
    return (yield from _guarded_phase("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call() -> Iterator[None]:  # pluggy passes only the arguments named
    return (yield from _guarded_phase("the call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown() -> Iterator[None]:  # pluggy passes only the arguments named
    return (yield from _guarded_phase("teardown"))
