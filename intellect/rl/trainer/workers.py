"""The run's own RL inference workers: ``intellect worker`` processes started through a launcher.

A :class:`~intellect.launch.Launcher` decides where a worker runs: a subprocess of this machine
(:class:`~intellect.launch.LocalLauncher` of :data:`WORKER_MODULE`), whose key file is
``keys/<name>.key`` of the local run folder, made here on first use; or a launcher of
:class:`RemoteKeys` (e.g. flow runs of the ``rl-worker`` deployment), whose workers keep their key
on the machine they run on (:func:`host_key_file`) and announce its id (:func:`key_record`), which
:func:`start_workers` waits for (:func:`wait_key_id`). Either way a worker reaches the run only
through the submission service and pins the trainer's public key, so it believes only SHARDCAST
versions the trainer signed; the trainer knows it by its key id. :func:`await_done` waits for their
submissions of a step, reporting a worker that sends nothing in time as missing;
:func:`stop_workers` gives them time to finish their last step, then stops them with
:func:`intellect.launch.stop` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pydantic import BaseModel

from intellect.device import LOCAL_RANK_ENV
from intellect.launch import Handle, Launcher, stop
from intellect.rl.trainer.setup import local_run_dir
from intellect.trust.keys import SigningKey, VerifyKey

if TYPE_CHECKING:
    from intellect.rl.config import RLRunConfig

WORKER_MODULE = "intellect.rl.worker.worker"  # `python -m` it: `intellect worker` without the CLI around it
HOST_HOME = Path("~/.intellect")  # a worker host's own folder: keys/<run>/<name>.key, cache/<run>/<name>
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# arguments that name this machine's files or processes: a worker elsewhere picks its own
MACHINE_LOCAL = ("--key", "--cache", "--parent")


class WorkerResult(BaseModel):
    worker: str
    files: list[str]
    policy_step: int | None
    seconds: float
    missing: bool = False  # no done marker within workers.submission_timeout


@runtime_checkable
class RemoteKeys(Protocol):
    """A launcher whose workers make and keep their key where they run and announce its id:
    ``key_id(handle, timeout)`` waits up to ``timeout`` s for the id of the worker ``handle`` runs."""

    def key_id(self, handle: Handle, timeout: float) -> str: ...


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


def _host_path(kind: str, run_name: str, name: str, home: str | os.PathLike | None) -> Path:
    for what, value in (("run", run_name), ("worker", name)):
        if not _NAME.match(value) or value in (".", ".."):
            raise ValueError(f"not a {what} name for a path (letters, digits, '.', '_', '-'): {value!r}")
    return Path(home if home is not None else HOST_HOME).expanduser() / kind / run_name / name


def host_key_file(run_name: str, name: str, home: str | os.PathLike | None = None) -> Path:
    """Where a worker host keeps worker ``name``'s key for run ``run_name``: ``keys/<run>/<name>.key``
    under ``home`` (default ``~/.intellect``), so a worker restarted there keeps its id.

    >>> host_key_file("rl", "w0", home="/h").as_posix()
    '/h/keys/rl/w0.key'
    >>> host_key_file("rl", "../w0")
    Traceback (most recent call last):
    ValueError: not a worker name for a path (letters, digits, '.', '_', '-'): '../w0'
    """
    path = _host_path("keys", run_name, name, home)
    return path.with_name(f"{path.name}.key")


def host_cache(run_name: str, name: str, home: str | os.PathLike | None = None) -> Path:
    """A worker host's download cache of worker ``name`` for run ``run_name``: ``cache/<run>/<name>``.

    >>> host_cache("rl", "w0", home="/h").as_posix()
    '/h/cache/rl/w0'
    """
    return _host_path("cache", run_name, name, home)


def ensure_key(path: str | os.PathLike) -> SigningKey:
    """The key in ``path``, made there first (mode 0600, its new folders 0700) when there is none;
    two workers racing to make it both end up with the one that was written first."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            SigningKey.generate().save(path)
        except FileExistsError:
            pass
    return SigningKey.load(path)


def key_record(name: str, key: VerifyKey) -> dict[str, str]:
    """What a worker announces about itself: its name, key id and public key (nothing secret)."""
    return {"worker": name, "key_id": key.id, "public_key": key.hex}


def key_id_of(records: Sequence[Mapping[str, Any]], name: str) -> str | None:
    """The key id worker ``name`` announced in ``records`` (:func:`key_record` rows; None: not yet),
    checked against its public key; ``ValueError`` for an announcement that does not add up.

    >>> rec = key_record("w0", SigningKey.from_seed(bytes(32)).public)
    >>> key_id_of([{"other": 1}, rec], "w0") == rec["key_id"], key_id_of([rec], "w1")
    (True, None)
    >>> key_id_of([rec | {"key_id": "k" + "0" * 20}], "w0")
    Traceback (most recent call last):
    ValueError: worker w0 announced key id k00000000000000000000, not that of its public key
    """
    for rec in records:
        if rec.get("worker") != name or "key_id" not in rec:
            continue
        try:
            public = VerifyKey.from_hex(str(rec.get("public_key")))
        except ValueError:
            raise ValueError(f"worker {name} announced no valid public key") from None
        if public.id != rec["key_id"]:
            raise ValueError(f"worker {name} announced key id {rec['key_id']}, not that of its public key")
        return public.id
    return None


def wait_key_id(name: str, handle: Handle, records: Callable[[], Sequence[Mapping[str, Any]]], *,
                timeout: float, poll: float) -> str:
    """Worker ``name``'s key id once ``records()`` holds its announcement (polled every ``poll`` s);
    ``RuntimeError`` when ``handle`` ends first, ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = key_id_of(records(), name)
        if found is not None:
            return found
        code = handle.poll()
        if code is not None:
            raise RuntimeError(f"worker {name} ended (exit code {code}) before announcing its key id")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {name} announced no key id within {timeout:.0f} s")
        time.sleep(poll)


def worker_argv(cfg: RLRunConfig, name: str, url: str, trainer_key: str, key_file: Path,
                cache: Path | None = None, parent: int | None = None) -> list[str]:
    """The ``intellect worker`` arguments of worker ``name``: the service at ``url``, the pinned
    trainer key (hex), its key file, its download cache (default ``weights/<name>`` of the local run
    folder); it exits when process ``parent`` (default: this one) is gone."""
    cache = cache if cache is not None else local_run_dir(cfg).resolve() / "weights" / name
    return ["--run-url", url, "--key", str(key_file), "--trainer-key", trainer_key,
            "--cache", str(cache), "--threads", str(cfg.workers.threads),
            "--parent", str(os.getpid() if parent is None else parent)]


def parse_worker_argv(args: Sequence[str]) -> dict[str, str]:
    """:func:`worker_argv`'s arguments by flag; ``ValueError`` for anything else.

    >>> parse_worker_argv(["--run-url", "http://h:1", "--threads", "2"])
    {'--run-url': 'http://h:1', '--threads': '2'}
    """
    if len(args) % 2 or not all(a.startswith("--") for a in args[::2]):
        raise ValueError(f"not worker_argv arguments: {list(args)}")
    return dict(zip(args[::2], args[1::2]))


def deployment_parameters(cfg: RLRunConfig, name: str, args: Sequence[str]) -> dict[str, Any]:
    """The ``rl-worker`` flow's parameters for launch ``name`` with :func:`worker_argv` ``args``: the
    run config (storage credentials removed: a worker never reads run storage), the worker's name,
    the service URL and the trainer's public key. The machine-local arguments (:data:`MACHINE_LOCAL`)
    stay here: the worker's host picks its own key file, cache and parent."""
    a = parse_worker_argv(args)
    storage = cfg.storage.model_copy(update={"key": None, "secret": None})
    config = cfg.model_copy(update={"storage": storage}).model_dump(mode="json")
    return {"config": config, "worker": name, "url": a["--run-url"], "trainer_key": a["--trainer-key"],
            "run_name": cfg.run_name}


def start_workers(cfg: RLRunConfig, url: str, trainer_key: str, launcher: Launcher,
                  env: Mapping[str, str] | None = None) -> tuple[dict[str, Handle], dict[str, str]]:
    """One worker per name of ``cfg.workers.names`` through ``launcher`` (``env`` added to each one's
    environment); their handles and key ids. A local worker's key is made here, and worker ``i`` gets
    ``LOCAL_RANK`` ``i + 1``, so that on a machine with several GPUs the local workers spread over them
    and off the trainer's and validator's (rank 0; ``compute.device`` auto or cuda takes the GPU of the
    local rank modulo the visible count). A :class:`RemoteKeys` launcher's workers run on their own
    hosts: they make their own keys, whose ids are awaited (all of them within
    ``workers.submission_timeout`` s), and pick their own GPUs. A failed launch or a worker without a
    key id stops the ones started."""
    remote = launcher if isinstance(launcher, RemoteKeys) else None
    handles: dict[str, Handle] = {}
    ids: dict[str, str] = {}
    try:
        for i, name in enumerate(cfg.workers.names):
            path = worker_key_file(cfg, name).resolve()
            extra = dict(env or {})
            if remote is None:
                ids[name] = ensure_key(path).public.id
                extra.setdefault(LOCAL_RANK_ENV, str(i + 1))
            handles[name] = launcher.launch(name, worker_argv(cfg, name, url, trainer_key, path), extra)
        if remote is not None:
            deadline = time.monotonic() + cfg.workers.submission_timeout
            for name, h in handles.items():
                ids[name] = remote.key_id(h, max(deadline - time.monotonic(), 0.0))
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
