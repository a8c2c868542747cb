"""The DiLoCo coordinator: hosts the rendezvous store, starts workers, watches them.

Workers are started through a :class:`Launcher` (local subprocesses by
default; the deployment work adds a work-pool launcher). The coordinator owns
nothing else: training state lives in the workers and in run storage, so a
killed coordinator loses no progress. Its workers notice the lost store and
stop; a new coordinator resumes from the newest outer checkpoint.

A worker process is ``python -m intellect.diloco.coordinator worker ...``;
it exits 0 when the run's outer steps are done, 3 when the store is lost,
4 when it failed, 5 when the run banned it (``robust.py``).

The run secret. The coordinator's rendezvous (``rendezvous.py``) admits only requests MAC'd
with the run secret. It is read from ``$INTELLECT_DILOCO_SECRET`` or ``diloco.secret_file``
(:func:`~intellect.diloco.rendezvous.load_secret`); without either the coordinator makes a
fresh one and hands it to the workers it launches in their environment (``env``), never in
the config, which travels as flow-run parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from intellect.config import DilocoRunConfig
from intellect.diloco.membership import StoreLost, connect_store
from intellect.diloco.rendezvous import SECRET_ENV, RendezvousServer, load_secret
from intellect.storage import RunStorage
from intellect.trust.mac import new_secret

EXIT_DONE, EXIT_STORE_LOST, EXIT_FAILED, EXIT_BANNED = 0, 3, 4, 5
log = logging.getLogger("intellect.diloco")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WorkerHandle(Protocol):
    worker: str

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    def launch(self, worker: str, index: int, config_path: str, store: str, env: dict[str, str]) -> WorkerHandle: ...


@dataclass
class LocalProcess:
    worker: str
    proc: subprocess.Popen

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    @property
    def pid(self) -> int:
        return self.proc.pid


class LocalLauncher:
    """Each worker as a subprocess of this machine; logs go to ``log_dir/<worker>.log``."""

    def __init__(self, log_dir: str | os.PathLike, module: str = "intellect.diloco.coordinator"):
        self.log_dir, self.module = Path(log_dir), module
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def launch(self, worker: str, index: int, config_path: str, store: str, env: dict[str, str]) -> LocalProcess:
        out = open(self.log_dir / f"{worker}.log", "ab")
        cmd = [sys.executable, "-m", self.module, "worker", "--config", config_path,
               "--worker", worker, "--index", str(index), "--store", store]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        out.close()
        return LocalProcess(worker, proc)


@dataclass
class Coordinator:
    """Start the store and the workers of a run; :meth:`watch` until they finish."""

    run: DilocoRunConfig
    launcher: Launcher
    env: dict[str, str] = field(default_factory=dict)
    handles: dict[str, WorkerHandle] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.run.diloco
        secret = load_secret(cfg.secret_file)
        if secret is None:  # the workers get it from us
            secret = new_secret()
            self.env = {**self.env, SECRET_ENV: secret.hex()}
        self.server = RendezvousServer(secret, self.run.run_name, cfg.store_host, cfg.store_port,
                                       window=cfg.rendezvous_window)
        self.port = self.server.port
        self.store = connect_store(cfg.store_host, self.port, 30.0, secret, self.run.run_name, "coordinator")
        self.storage = RunStorage.from_config(self.run.storage, self.run.run_name)
        self._tmp = tempfile.TemporaryDirectory(prefix="intellect-diloco-")
        self.config_path = str(Path(self._tmp.name) / "run.json")
        Path(self.config_path).write_text(self.run.model_dump_json())
        self.next_index = 0

    @property
    def address(self) -> str:
        return f"{self.run.diloco.store_host}:{self.port}"

    def start_worker(self, worker: str | None = None) -> WorkerHandle:
        index = self.next_index
        self.next_index += 1
        worker = worker or f"w{index}"
        slot = int(self.store.add("launched", 1)) - 1
        self.store.set(f"launched/{slot}", worker)  # founders wait for every launched worker
        handle = self.launcher.launch(worker, index, self.config_path, self.address, self.env)
        self.handles[worker] = handle
        return handle

    def start(self) -> None:
        from intellect.diloco.worker import init_run

        init_run(self.run, self.storage)
        for _ in range(self.run.diloco.workers):
            self.start_worker()

    def progress(self) -> int | None:
        return int(self.store.get("progress")) if self.store.check(["progress"]) else None

    def metrics(self, step: int, wait: float = 0.0) -> list[dict]:
        """Metrics of the members of ``step``, waiting up to ``wait`` s for all of them to report."""
        deadline = time.monotonic() + wait
        while True:
            out = {}
            for w in self.handles:
                key = f"metrics/{step}/{w}"
                if self.store.check([key]):
                    out[w] = json.loads(self.store.get(key))
            members = next(iter(out.values()), {}).get("members", [])
            if (members and set(members) <= set(out)) or time.monotonic() >= deadline:
                return [out[w] for w in members if w in out] or list(out.values())
            time.sleep(0.05)

    def watch(self, timeout: float, on_commit: Callable[[int, list[dict]], None] | None = None,
              poll: float = 0.2) -> dict[str, int | None]:
        """Wait until every worker exits or ``timeout``; returns exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        seen = self.progress() or 0
        while time.monotonic() < deadline:
            now = self.progress()
            while on_commit and now is not None and seen < now:
                seen += 1
                # members write their metrics right after the commit; a dead one never will
                on_commit(seen, self.metrics(seen - 1, wait=self.run.diloco.heartbeat_timeout))
            if all(h.poll() is not None for h in self.handles.values()):
                break
            time.sleep(poll)
        return {w: h.poll() for w, h in self.handles.items()}

    def stop(self, grace: float = 10.0) -> None:
        for h in self.handles.values():
            h.terminate()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(h.poll() is None for h in self.handles.values()):
            time.sleep(0.1)
        for h in self.handles.values():
            h.kill()

    def close(self) -> None:
        self.stop()
        self.store.close()
        self.server.stop()  # closes the server socket: any worker left sees StoreLost
        self._tmp.cleanup()


# ---------------------------------------------------------------------- worker entry


def worker_main(config_path: str, worker: str, index: int, store: str, step_runner=None) -> int:
    """Run one worker until the run is done; ``step_runner(w)`` runs one outer step."""
    from intellect.diloco.worker import Banned, DilocoWorker

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {worker} %(levelname)s %(message)s")
    run = DilocoRunConfig.model_validate_json(Path(config_path).read_text())
    host, port = store.rsplit(":", 1)
    w = None

    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(EXIT_FAILED)

    # In a flow run's process (the diloco-worker deployment) this may not be the main thread, where
    # only Prefect's own handler stops the run.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        secret = load_secret(run.diloco.secret_file)
        if secret is None:
            log.error("no run secret: set %s or diloco.secret_file", SECRET_ENV)
            return EXIT_FAILED
        w = DilocoWorker(run, worker, index, host, int(port), secret)
        while not w.done():
            r = step_runner(w) if step_runner else w.outer_step()
            log.info("step %d committed=%s members=%s loss=%.4f bytes=%d algorithm=%s digest=%s",
                     r.step, r.committed, r.members, r.inner_loss, r.bytes_sent, r.algorithm, r.digest[:12])
        return EXIT_DONE
    except StoreLost as e:
        log.error("stopping: %s", e)
        return EXIT_STORE_LOST
    except Banned as e:
        log.error("stopping: %s", e)
        return EXIT_BANNED
    finally:
        if w is not None:
            w.close()  # deathrattle: peers drop us at once instead of after the heartbeat timeout
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def main(argv: list[str] | None = None, step_runner=None, prog: str = "python -m intellect.diloco.coordinator") -> int:
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run one DiLoCo worker until the run is done")
    w.add_argument("--config", required=True)
    w.add_argument("--worker", required=True)
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--store", required=True, help="host:port of the rendezvous store")
    args = ap.parse_args(argv)
    return worker_main(args.config, args.worker, args.index, args.store, step_runner)


if __name__ == "__main__":
    sys.exit(main())
