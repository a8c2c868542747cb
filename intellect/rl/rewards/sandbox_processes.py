"""The process plumbing of a sandboxed run (:mod:`intellect.rl.rewards.sandbox`): feeding and
draining the sandboxes' pipes under one deadline, reading an exit status without reaping, killing a
process group, and cleaning up after the run.

Nothing here knows what runs in the processes or how they are contained.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time
from typing import IO, Callable


def finish(procs: list[subprocess.Popen], workdirs: list[str]) -> None:
    """Close every pipe of ``procs``, kill and reap those still running, remove ``workdirs``."""
    for proc in procs:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        if proc.returncode is None:
            kill_group(proc)
            proc.wait()
    for workdir in workdirs:
        shutil.rmtree(workdir, ignore_errors=True)


def pipes(proc: subprocess.Popen) -> tuple[IO[bytes], IO[bytes], IO[bytes]]:
    """stdin, stdout and stderr of a process started with all three piped."""
    if proc.stdin is None or proc.stdout is None or proc.stderr is None:
        raise RuntimeError("sandbox process started without pipes")
    return proc.stdin, proc.stdout, proc.stderr


def pump(
    feeds: dict[int, tuple[bytes, Callable[[], None]]], reads: dict[int, int], stop: int | None, deadline: float
) -> tuple[dict[int, bytes], bool]:
    """Feed stdins (closing each when fed) and drain ``reads`` (each up to its byte bound) until
    ``stop`` closes, every stream closes, or the deadline passes.

    Returns what was read per descriptor and whether the deadline passed first.
    """
    bufs = {fd: bytearray() for fd in reads}
    todo = {fd: memoryview(data) for fd, (data, _) in feeds.items()}
    with selectors.DefaultSelector() as sel:
        for fd in todo:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_WRITE)
        for fd in reads:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        timed_out = False
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd in todo:
                    try:
                        todo[fd] = todo[fd][os.write(fd, todo[fd][:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        todo[fd] = todo[fd][:0]
                    if not todo[fd]:
                        sel.unregister(fd)
                        feeds[fd][1]()
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    if fd == stop:
                        return {fd: bytes(b) for fd, b in bufs.items()}, False
                    continue
                buf = bufs[fd]
                if len(buf) < reads[fd]:
                    buf += chunk[: reads[fd] - len(buf)]
    return {fd: bytes(b) for fd, b in bufs.items()}, timed_out


def wait_exit(proc: subprocess.Popen, until: float) -> int | None:
    """The exit status of ``proc`` once it exits before ``until`` (left unreaped), else None."""
    while time.monotonic() < until:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        time.sleep(0.005)
    return None


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group of ``proc``; called while its leader is unreaped, so the id cannot be reused."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
