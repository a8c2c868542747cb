"""The run's own RL inference workers: ``intellect worker`` processes started through a launcher.

Each worker has its own key file (``keys/<name>.key`` of the local run folder, made on first use)
and reaches the run only through the submission service; it pins the trainer's public key, so it
believes only SHARDCAST versions the trainer signed. A :class:`~intellect.launch.Launcher` decides
where a worker runs (:class:`~intellect.launch.LocalLauncher` of :data:`WORKER_MODULE`: a subprocess
of this machine); :func:`await_done` waits for their submissions of a step, reporting a worker that
sends nothing in time as missing; :func:`stop_workers` gives them time to finish their last step,
then stops them with :func:`intellect.launch.stop` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from pydantic import BaseModel

from intellect.launch import Handle, Launcher, stop
from intellect.rl.setup import local_run_dir
from intellect.trust.keys import SigningKey

if TYPE_CHECKING:
    from intellect.rl.config import RLRunConfig

WORKER_MODULE = "intellect.rl.worker"  # `python -m` it: `intellect worker` without the CLI around it


class WorkerResult(BaseModel):
    worker: str
    files: list[str]
    policy_step: int | None
    seconds: float
    missing: bool = False  # no done marker within workers.submission_timeout


def await_done(names: Sequence[str], finished: Callable[[], Mapping[str, WorkerResult]], *, timeout: float,
               poll: float, stopping: threading.Event | None = None,
               on_missing: Callable[[list[str]], None] = lambda missing: None) -> list[WorkerResult]:
    """Each of ``names``' result as ``finished()`` reports it, polled every ``poll`` s; a worker not
    reported within ``timeout`` s is returned ``missing`` (and passed to ``on_missing``), so the step
    goes on without it. ``RuntimeError`` at the first poll after ``stopping`` is set.

    >>> out = await_done(["a", "b"], lambda: {"a": WorkerResult(worker="a", files=["f"], policy_step=0,
    ...                  seconds=0.0)}, timeout=0.05, poll=0.01)
    >>> [(r.worker, r.missing) for r in out]
    [('a', False), ('b', True)]
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    done: dict[str, WorkerResult] = {}
    while True:
        done |= {w: r for w, r in finished().items() if w in names and w not in done}
        if len(done) == len(names):
            break
        if stopping is not None and stopping.is_set():
            raise RuntimeError("the run is stopping: no longer waiting for submissions")
        if time.monotonic() > deadline:
            missing = [w for w in names if w not in done]
            on_missing(missing)
            done |= {w: WorkerResult(worker=w, files=[], policy_step=None, seconds=time.perf_counter() - t0,
                                     missing=True) for w in missing}
            break
        time.sleep(poll)
    return [done[w] for w in names]


def worker_key_file(cfg: RLRunConfig, name: str) -> Path:
    """The key file of local worker ``name`` (``keys/<name>.key`` of the local run folder)."""
    return local_run_dir(cfg) / "keys" / f"{name}.key"


def worker_argv(cfg: RLRunConfig, name: str, url: str, trainer_key: str, key_file: Path) -> list[str]:
    """The ``intellect worker`` arguments of local worker ``name``: the service at ``url``, the pinned
    trainer key (hex), its download cache ``weights/<name>``; it exits when this process is gone."""
    local = local_run_dir(cfg).resolve()
    return ["--run-url", url, "--key", str(key_file), "--trainer-key", trainer_key,
            "--cache", str(local / "weights" / name), "--threads", str(cfg.workers.threads),
            "--parent", str(os.getpid())]


def start_workers(cfg: RLRunConfig, url: str, trainer_key: str, launcher: Launcher,
                  env: Mapping[str, str] | None = None) -> tuple[dict[str, Handle], dict[str, str]]:
    """One worker per name of ``cfg.workers.names`` through ``launcher`` (``env`` added to each one's
    environment); their handles and key ids. A failed launch stops the ones started."""
    handles: dict[str, Handle] = {}
    ids: dict[str, str] = {}
    try:
        for name in cfg.workers.names:
            path = worker_key_file(cfg, name).resolve()
            if not path.exists():
                SigningKey.generate().save(path)
            ids[name] = SigningKey.load(path).public.id
            handles[name] = launcher.launch(name, worker_argv(cfg, name, url, trainer_key, path), dict(env or {}))
    except BaseException:
        stop_workers(handles, grace=0.0)
        raise
    return handles, ids


def stop_workers(handles: Mapping[str, Handle], grace: float = 10.0, term_grace: float = 5.0,
                 poll: float = 0.05) -> dict[str, int | None]:
    """Wait up to ``grace`` s for the workers to finish (they exit 0 after the run's last step), then
    :func:`intellect.launch.stop` the rest: SIGTERM, up to ``term_grace`` s, SIGKILL, up to
    ``term_grace`` s more; exit codes by worker name (None: still running after all that).

    >>> stop_workers({}, grace=0.0)
    {}
    """
    deadline = time.monotonic() + grace
    while any(h.poll() is None for h in handles.values()) and time.monotonic() < deadline:
        time.sleep(poll)
    codes = stop([h for h in handles.values() if h.poll() is None], grace=term_grace, kill_wait=term_grace,
                 poll=poll)
    return {w: codes.get(h.name, h.poll()) for w, h in handles.items()}
