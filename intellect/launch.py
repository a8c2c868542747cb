"""Start, watch and stop the processes a job runs besides its own.

A :class:`Launcher` starts a named process from an argument list and an environment overlay and
returns a :class:`Handle`; a job that supervises several (training workers, inference workers) sees
only these two protocols, so local subprocesses and remote runs (e.g. deployment flow runs, which
live outside ``intellect``) are interchangeable. :func:`stop` is the one shutdown rule: SIGTERM,
a grace period, then SIGKILL.

Exit codes follow :meth:`subprocess.Popen.poll`: ``None`` while running, the process's code when it
exited, ``-N`` when signal ``N`` ended it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Handle(Protocol):
    """One started process (or remote run), named as it was launched."""

    name: str

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts process ``name`` with ``args`` (its command line after the program) and ``env`` (added
    to, and overriding, whatever environment the launcher gives its processes)."""

    def launch(self, name: str, args: Sequence[str], env: Mapping[str, str]) -> Handle: ...


@dataclass
class LocalProcess:
    """A subprocess of this machine; ``log`` holds its stdout and stderr."""

    name: str
    proc: subprocess.Popen
    log: Path

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid


class LocalLauncher:
    """``python -m <module> <args>`` as a subprocess in its own session (a signal to this process
    group does not reach it); output appended to ``log_dir/<name>.log``.

    The child inherits this process's environment except the names in ``withhold`` (secrets that
    stay with the parent even when they came in its own environment), then ``env`` on top.

    >>> import tempfile
    >>> h = LocalLauncher(tempfile.mkdtemp(), "platform").launch("p0", [], {})
    >>> h.wait(timeout=60), h.log.name
    (0, 'p0.log')
    """

    def __init__(self, log_dir: str | os.PathLike, module: str, withhold: Iterable[str] = (),
                 cwd: str | os.PathLike | None = None, python: str | os.PathLike | None = None):
        self.log_dir, self.module, self.withhold = Path(log_dir), module, frozenset(withhold)
        self.cwd, self.python = cwd, str(python or sys.executable)  # python: another environment's interpreter
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def launch(self, name: str, args: Sequence[str], env: Mapping[str, str]) -> LocalProcess:
        path = self.log_dir / f"{name}.log"
        inherited = {k: v for k, v in os.environ.items() if k not in self.withhold}
        with open(path, "ab") as out:
            proc = subprocess.Popen([self.python, "-m", self.module, *args], stdout=out,
                                    stderr=subprocess.STDOUT, env={**inherited, **env}, cwd=self.cwd,
                                    start_new_session=True)
        return LocalProcess(name, proc, path)


def stop(handles: Iterable[Handle], grace: float = 10.0, kill_wait: float = 5.0,
         poll: float = 0.05) -> dict[str, int | None]:
    """SIGTERM every handle still running, wait up to ``grace`` s for them all to exit, SIGKILL the
    rest and wait up to ``kill_wait`` s more; their exit codes by name (None: still running, which
    only a remote handle that ignores kill can be)."""
    handles = list(handles)
    for h in handles:
        h.terminate()
    for sig_kill, wait in ((False, grace), (True, kill_wait)):
        if sig_kill:
            for h in handles:
                if h.poll() is None:
                    h.kill()
        deadline = time.monotonic() + wait
        while any(h.poll() is None for h in handles) and time.monotonic() < deadline:
            time.sleep(poll)
    return {h.name: h.poll() for h in handles}


class Throttle:
    """Slow process ``pid`` from outside, as a slower machine or a busy host would be: it runs ``run`` s out of
    every ``run + pause`` s (SIGSTOP, SIGCONT) until :meth:`stop`, which leaves it running. Every thread of
    the process stops alike, its heartbeat too. How the DiLoCo straggler tests and ``diloco_churn`` make one
    member ``(run + pause) / run`` times slower; no hook in the process itself."""

    def __init__(self, pid: int, run: float, pause: float):
        self.pid, self.run, self.pause = pid, run, pause
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"throttle-{pid}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.pause)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

