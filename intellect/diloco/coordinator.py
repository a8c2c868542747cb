"""The DiLoCo coordinator: hosts the rendezvous store, starts workers, watches them.

Workers are started through an ``intellect.launch.Launcher`` (local subprocesses:
:func:`worker_launcher`, their output in the run folder's ``logs/<worker>.log``,
:func:`worker_log_dir`; a work-pool launcher plugs into the same protocol). Workers that share
this machine get ``LOCAL_RANK`` (their index modulo the run's workers, times
``diloco.ranks_per_worker``), so each takes GPUs of its own (``intellect.device.resolve_device``;
a worker of M ranks starts its other M-1 itself: :mod:`~intellect.diloco.worker_ranks`). The coordinator owns
nothing else: training state lives in the workers and in run storage, so a killed coordinator
loses no progress. Its workers notice the lost store and stop; a new coordinator resumes from the
newest outer checkpoint.

A worker process is ``python -m intellect.diloco.coordinator`` + :func:`worker_args`; it exits 0
when the run's outer steps are done, 3 when the store is lost, 4 when it failed, 5 when the run
banned it (``robust.py``).

The run secret and the workers' keys. Only the coordinator holds the run secret, read from
``$INTELLECT_DILOCO_SECRET`` or ``diloco.secret_file``
(:func:`load_secret`), else made fresh. Each worker it launches
gets, in its environment (``env``, never the config, which travels as flow-run parameters),
only its own rendezvous key and the all-reduce root
(:func:`worker_credentials`): it can speak to the rendezvous as
itself alone, and the rendezvous lets it write only its own keys (``membership.scope``). A
worker started some other way takes the same two variables; given the run secret instead (its
``secret_file``), it derives its own keys, but then holds what lets it speak as anyone.
Contributors (``diloco.contributors``, public keys) never hold either: each joins with its own
Ed25519 key (``join``, :mod:`intellect.diloco.admission`) and gets its own credentials sealed to it.

Everything a worker writes is read here defensively: a malformed ``progress`` or metrics
record is ignored with a logged reason, and no loop runs on a peer-written number unbounded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from intellect.device import LOCAL_RANK_ENV
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.faults import NO_FAULTS, Faults
from intellect.diloco.admission import Admission, JoinError, coordinator_identity, join
from intellect.diloco.membership import RefusedBanned, StoreLost, connect_store, retire, scope
from intellect.diloco.protocol import BAN, BANNED, LAUNCHED, METRICS, PROGRESS, START, ban_votes, read_count, read_names
from intellect.diloco.rendezvous import COORDINATOR, RendezvousServer, allreduce_root, peer_key
from intellect.launch import Handle, Launcher, LocalLauncher, stop
from intellect.storage import RunStorage
from intellect.trust.keys import BadKey, SigningKey, VerifyKey
from intellect.trust.mac import new_secret

if TYPE_CHECKING:
    from intellect.diloco.report import StepReport
    from intellect.diloco.worker import DilocoWorker

EXIT_DONE, EXIT_STORE_LOST, EXIT_FAILED, EXIT_BANNED = 0, 3, 4, 5
log = logging.getLogger("intellect.diloco")

SECRET_ENV = "INTELLECT_DILOCO_SECRET"  # hex; the run secret, for the coordinator only
PEER_KEY_ENV = "INTELLECT_DILOCO_PEER_KEY"  # hex; a worker's own rendezvous key (worker_credentials)
ALLREDUCE_KEY_ENV = "INTELLECT_DILOCO_ALLREDUCE_KEY"  # hex; the root of the all-reduce MAC keys


class BadSecret(ValueError):
    """No usable run secret (missing, too short, or its file is readable by others)."""


def load_secret(secret_file: str | None, environ=os.environ) -> bytes | None:
    """The run secret: ``$INTELLECT_DILOCO_SECRET`` (hex), else ``secret_file`` (hex, mode 0600), else None."""
    text = environ.get(SECRET_ENV)
    where = SECRET_ENV
    if text is None and secret_file:
        path = Path(secret_file)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise BadSecret(f"{path}: secret file is accessible by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
        text, where = path.read_text()[:4096], str(path)
    if text is None:
        return None
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise BadSecret(f"{where}: the run secret is hex digits") from None
    if len(secret) < 16:
        raise BadSecret(f"{where}: the run secret needs at least 16 bytes (32 hex digits)")
    return secret


def worker_credentials(secret: bytes, run: str, worker: str) -> dict[str, str]:
    """The environment the coordinator hands worker ``worker``: its own peer key and the all-reduce
    root, never the run secret."""
    if worker == COORDINATOR:
        raise ValueError(f"no worker may be named {COORDINATOR!r}")
    return {PEER_KEY_ENV: peer_key(secret, run, worker).hex(), ALLREDUCE_KEY_ENV: allreduce_root(secret, run).hex()}


def load_credentials(worker: str, run: str, secret_file: str | None = None,
                     environ=os.environ) -> tuple[bytes, bytes] | None:
    """A worker's ``(peer key, all-reduce root)``: from ``$INTELLECT_DILOCO_PEER_KEY`` and
    ``$INTELLECT_DILOCO_ALLREDUCE_KEY`` (what the coordinator hands the workers it launches),
    else derived from the run secret (:func:`load_secret`: a worker that holds it can speak as
    any peer, so give remote workers their :func:`worker_credentials` instead); None: neither."""
    peer, root = environ.get(PEER_KEY_ENV), environ.get(ALLREDUCE_KEY_ENV)
    if peer is not None or root is not None:
        try:
            keys = bytes.fromhex((peer or "").strip()), bytes.fromhex((root or "").strip())
        except ValueError:
            raise BadSecret(f"{PEER_KEY_ENV} and {ALLREDUCE_KEY_ENV} are hex digits") from None
        if any(len(k) < 16 for k in keys):
            raise BadSecret(f"both {PEER_KEY_ENV} and {ALLREDUCE_KEY_ENV} are needed, 16 bytes or more")
        return keys
    secret = load_secret(secret_file, environ)
    return None if secret is None else (peer_key(secret, run, worker), allreduce_root(secret, run))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


WORKER_MODULE = "intellect.diloco.coordinator"  # ``python -m`` it with :func:`worker_args`
CREDENTIAL_ENVS = (SECRET_ENV, PEER_KEY_ENV, ALLREDUCE_KEY_ENV)


def worker_args(worker: str, index: int, config_path: str, store: str) -> list[str]:
    """The command line of one worker process (:func:`main`); :func:`parse_worker_args` reads it back."""
    return ["worker", "--config", config_path, "--worker", worker, "--index", str(index), "--store", store]


LOGS = "logs"  # run storage folder of the workers' output, <worker>.log


def worker_log_dir(storage: RunStorage) -> Path | None:
    """``logs/`` in the run folder when the run is stored on this machine (local workers append their
    output there directly), else None: log to a local folder and :func:`save_logs` it at the end."""
    return storage.local_path(LOGS)


def save_logs(storage: RunStorage, log_dir: str | os.PathLike) -> list[str]:
    """Copy the workers' logs in ``log_dir`` to the run's ``logs/`` (remote storage); returns what was copied."""
    if storage.local_path(LOGS) == Path(log_dir):
        return []
    return storage.put_dir(log_dir, LOGS)


def worker_launcher(log_dir: str | os.PathLike, module: str = WORKER_MODULE) -> LocalLauncher:
    """Workers as subprocesses of this machine, logs in ``log_dir/<worker>.log``. The run secret and
    the coordinator's own keys stay here even when they came in its environment: a worker gets only
    the credentials :class:`Coordinator` hands it."""
    return LocalLauncher(log_dir, module, withhold=CREDENTIAL_ENVS)


@dataclass
class Coordinator:
    """Start the store and the workers of a run; :meth:`watch` until they finish.

    ``local_ranks``: the workers share this machine (a local launcher), so each gets ``LOCAL_RANK``
    = its index modulo ``diloco.workers``; False for workers on hosts of their own (deployments),
    whose rank on their node is theirs to know."""

    run: DilocoRunConfig
    launcher: Launcher
    env: dict[str, str] = field(default_factory=dict)
    handles: dict[str, Handle] = field(default_factory=dict)
    local_ranks: bool = True

    def __post_init__(self) -> None:
        cfg = self.run.diloco
        self._secret = load_secret(cfg.secret_file) or new_secret()
        self.env = {k: v for k, v in self.env.items() if k != SECRET_ENV}
        # contributors get the config the workers get: the storage secret dumps masked
        admission = Admission(self._secret, self.run.run_name, cfg.contributors, self.run.model_dump_json(),
                              cfg.rendezvous_window) if cfg.contributors else None
        self.server = RendezvousServer(self._secret, self.run.run_name, cfg.store_host, cfg.store_port,
                                       window=cfg.rendezvous_window, policy=partial(scope, quorum=cfg.quorum), prune=retire, admission=admission)
        self.port = self.server.port
        if admission is not None:
            log.info("coordinator: %d contributors may join %s at %s with --coordinator-key %s",
                     len(cfg.contributors), self.run.run_name, self.address, self.identity.hex)
        self.store = connect_store(cfg.store_host, self.port, 30.0, self._secret, self.run.run_name, COORDINATOR)
        self.ignored: dict[str, str] = {}  # key -> why a value read from it was ignored (logged once)
        self.storage = RunStorage.from_config(self.run.storage, self.run.run_name)
        self._tmp = tempfile.TemporaryDirectory(prefix="intellect-diloco-")
        self.config_path = str(Path(self._tmp.name) / "run.json")
        Path(self.config_path).write_text(self.run.model_dump_json())
        self.next_index = 0
        self._launched: list[str] = []  # launched/<i>, as far as it was read

    @property
    def address(self) -> str:
        return f"{self.run.diloco.store_host}:{self.port}"

    @property
    def identity(self) -> VerifyKey:
        """The public key contributors pin (``--coordinator-key``): it signs their join answers."""
        return coordinator_identity(self._secret, self.run.run_name).public

    def admitted(self) -> list[str]:
        """Every worker admitted so far, in admission order: the ones started here and the
        contributors that joined (``launched/``)."""
        n = min(read_count(self.store.add(LAUNCHED.under(), 0)) or 0, 1 << 16)
        # launched/<i> is written once (here or by an admission): only the new ones are read
        new = list(range(len(self._launched), n))
        there = self.store.check_many([LAUNCHED(i) for i in new])
        if all(there):
            self._launched += [self.store.get(LAUNCHED(i)).decode() for i in new]
        return list(dict.fromkeys([*self.handles, *self._launched]))

    def start_worker(self, worker: str | None = None) -> Handle:
        index = self.next_index
        self.next_index += 1
        worker = worker or f"w{index}"
        env = {**self.env, **worker_credentials(self._secret, self.run.run_name, worker)}  # refuses "coordinator"
        if self.local_ranks:
            # the first device of the worker's slot: its M ranks take M devices from there
            env[LOCAL_RANK_ENV] = str(index % self.run.diloco.workers * self.run.diloco.ranks_per_worker)
        slot = int(self.store.add(LAUNCHED.under(), 1)) - 1
        self.store.set(LAUNCHED(slot), worker)  # founders wait for every launched worker
        handle = self.launcher.launch(worker, worker_args(worker, index, self.config_path, self.address), env)
        self.handles[worker] = handle
        return handle

    def announce_start(self, step: int) -> None:
        """The founders' step (the newest checkpoint): the members' per-step keys are taken around it
        until the first commit (``membership.scope``)."""
        self.store.set(START(), json.dumps(step))

    def start(self) -> None:
        from intellect.diloco.outer import init_run  # noqa: PLC0415 - torch loads only where it is used

        self.announce_start(init_run(self.run, self.storage))
        for _ in range(self.run.diloco.workers):
            self.start_worker()

    def _ignore(self, key: str, why: str) -> None:
        if key not in self.ignored and len(self.ignored) < 4096:
            log.warning("coordinator: ignoring the value of %s: %s", key, why)
        self.ignored.setdefault(key, why)

    def progress(self) -> int | None:
        """The committed outer steps the leader announced (None: none yet or unreadable), at most the run's."""
        if not self.store.check([PROGRESS()]):
            return None
        value = read_count(self.store.get(PROGRESS()), 0, self.run.diloco.outer_steps)
        if value is None:
            self._ignore(PROGRESS(), f"not a count of 0-{self.run.diloco.outer_steps} steps")
        return value

    def promote_bans(self) -> list[str]:
        """Write ``banned/<w>`` for each admitted worker a majority of an attempt's members recorded a
        ban of (``membership.ban_votes``); returns the ones newly banned."""
        names = self.admitted()
        records = [(w, BAN(w, v)) for w in names for v in names if v != w]
        there = self.store.check_many([k for _, k in records])
        recorded = {w for (w, _), present in zip(records, there) if present}
        out = []
        for w in names:
            if w not in recorded or self.store.check([BANNED(w)]):
                continue
            if ban_votes(lambda k: self.store.get(k) if self.store.check([k]) else None, w, names):
                self.store.set(BANNED(w), json.dumps({"by": "majority"}))
                out.append(w)
        return out

    def metrics(self, step: int, wait: float = 0.0) -> list[dict]:
        """Metrics of the members of ``step``, waiting up to ``wait`` s for all of them to report."""
        deadline = time.monotonic() + wait
        names = self.admitted()
        while True:
            out = {}
            for w in names:
                key = METRICS(step, w)
                if self.store.check([key]):
                    try:
                        record = json.loads(self.store.get(key))
                    except ValueError:
                        record = None
                    if isinstance(record, dict) and read_names(record.get("members", [])) is not None:
                        out[w] = record
                    else:
                        self._ignore(key, "not a metrics record")
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
            now = self.progress()  # at most the run's outer steps: the loop below is bounded
            self.promote_bans()
            while on_commit and now is not None and seen < now:
                seen += 1
                # members write their metrics right after the commit; a dead one never will
                on_commit(seen, self.metrics(seen - 1, wait=self.run.diloco.heartbeat_timeout))
            if all(h.poll() is not None for h in self.handles.values()):
                break
            time.sleep(poll)
        return {w: h.poll() for w, h in self.handles.items()}

    def stop(self, grace: float = 10.0) -> None:
        stop(self.handles.values(), grace)

    def close(self) -> None:
        self.stop()
        self.store.close()
        self.server.stop()  # closes the server socket: any worker left sees StoreLost
        self._tmp.cleanup()


# ---------------------------------------------------------------------- worker entry


def worker_main(config_path: str, worker: str, index: int, store: str,
                observe: Callable[[StepReport], None] | None = None, faults: Faults = NO_FAULTS,
                sigterm: bool = True, keys: tuple[bytes, bytes] | None = None,
                drive: Callable[[DilocoWorker], StepReport] | None = None,
                follower_argv: Sequence[str] | None = None) -> int:
    """Run one worker until the run is done (:meth:`DilocoWorker.run_until_done`); ``observe`` sees each
    outer step's report, ``drive`` runs each one; ``faults`` is what a test injects (production: none). ``sigterm``: SIGTERM
    ends the worker with ``EXIT_FAILED``; False leaves SIGTERM to whoever handles it (in a flow run,
    Prefect, which cancels the run): either way the deathrattle goes out on the way down. ``keys``:
    its (rendezvous key, all-reduce root), as a contributor's join gives them; None: from
    :func:`load_credentials`.

    A worker of ``diloco.ranks_per_worker`` M > 1: this process is its leader (rank 0) unless a leader
    started it (:mod:`~intellect.diloco.worker_ranks`); the leader starts the M-1 followers as
    ``python <follower_argv>`` (default: this module's worker command) with the worker's credentials,
    and stops (``EXIT_FAILED``) when one of them dies. Only the leader observes and drives steps."""
    from intellect.diloco.worker import Banned, DilocoWorker  # noqa: PLC0415 - as in Coordinator.start
    from intellect.diloco.worker_ranks import WorkerRanks, rank_of  # noqa: PLC0415 - torch, as above

    run = DilocoRunConfig.model_validate_json(Path(config_path).read_text())
    size, rank = run.diloco.ranks_per_worker, rank_of()
    name = worker if size == 1 else f"{worker}/{rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    host, port = store.rsplit(":", 1)
    w = None
    ranks = None
    done = False

    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(EXIT_FAILED)

    # only the main thread may install a handler
    main_thread = sigterm and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        keys = keys or load_credentials(worker, run.run_name, run.diloco.secret_file)
        if keys is None:
            log.error("no credentials: set %s and %s (or %s, or diloco.secret_file)", PEER_KEY_ENV,
                      ALLREDUCE_KEY_ENV, SECRET_ENV)
            return EXIT_FAILED
        if size > 1 and rank == 0:
            argv = follower_argv or ["-m", WORKER_MODULE, *worker_args(worker, index, config_path, store)]
            ranks = WorkerRanks.start(size, argv, {PEER_KEY_ENV: keys[0].hex(), ALLREDUCE_KEY_ENV: keys[1].hex()},
                                      timeout=run.diloco.boundary_timeout)
            ranks.watch()
        elif size > 1:
            ranks = WorkerRanks.join(size, timeout=run.diloco.boundary_timeout)
        w = DilocoWorker(run, worker, index, host, int(port), key=keys[0], allreduce_key=keys[1], faults=faults,
                         ranks=ranks)
        if rank == 0:
            w.run_until_done(observe, drive)
        else:
            w.run_until_done()
        done = True
        return EXIT_DONE
    except (Banned, RefusedBanned) as e:
        log.error("stopping: %s", e)
        return EXIT_BANNED
    except StoreLost as e:
        log.error("stopping: %s", e)
        return EXIT_STORE_LOST
    except (KeyboardInterrupt, Exception):
        # one rank down takes the worker out: whatever broke (a collective with the dead rank, the
        # watch's interrupt), the leader says which and stops
        if ranks is None or not ranks.leader or not (lost := ranks.casualty()):
            # logged here, not only on stderr at exit: a reduction thread still inside gloo can abort the
            # interpreter's teardown before the traceback is printed
            log.exception("stopping on an unexpected error")
            raise
        log.error("stopping: %s", lost)
        return EXIT_FAILED
    finally:
        if w is not None:
            w.close(finished=done)  # deathrattle: peers drop us at once instead of after the heartbeat timeout
        if ranks is not None and ranks.leader:
            ranks.close(grace=10.0 if done else 0.0)
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def contributor_main(store: str, run: str, key_file: str, coordinator_key: str) -> int:
    """A contributor's worker: join ``run`` at ``store`` with the key in ``key_file``, trusting the
    coordinator whose public key is ``coordinator_key`` (hex), then work until the run is done."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    host, port = store.rsplit(":", 1)
    try:
        joined = join(host, int(port), run, SigningKey.load(key_file), VerifyKey.from_hex(coordinator_key))
    except (JoinError, BadKey, OSError) as e:
        log.error("cannot join %s at %s: %s", run, store, e)
        return EXIT_BANNED if isinstance(e, JoinError) and e.reason == "banned" else EXIT_FAILED
    log.info("joined %s as %s (admission index %d)", run, joined.worker, joined.index)
    with tempfile.TemporaryDirectory(prefix="intellect-diloco-contributor-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(joined.config)
        return worker_main(str(path), joined.worker, joined.index, store, keys=(joined.key, joined.allreduce_root))


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run one DiLoCo worker until the run is done")
    w.add_argument("--config", required=True)
    w.add_argument("--worker", required=True)
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--store", required=True, help="host:port of the rendezvous store")
    j = sub.add_parser("join", help="a contributor: join a run with its own key (listed in diloco.contributors) "
                       "and work until the run is done")
    j.add_argument("--store", required=True, help="host:port of the run's rendezvous")
    j.add_argument("--run", required=True, help="the run's name")
    j.add_argument("--key", required=True, help="this contributor's key file (intellect worker keygen)")
    j.add_argument("--coordinator-key", required=True, help="the coordinator's public key, 64 hex digits")
    i = sub.add_parser("identity", help="print the coordinator's public key of a run (what contributors pin)")
    i.add_argument("--run", required=True)
    i.add_argument("--secret-file", required=True)
    return ap


def parse_worker_args(argv: list[str], prog: str = "python -m intellect.diloco.coordinator") -> argparse.Namespace:
    """:func:`worker_args` read back: ``config``, ``worker``, ``index``, ``store``."""
    return _parser(prog).parse_args(argv)


def main(argv: list[str] | None = None, observe: Callable[[StepReport], None] | None = None,
         prog: str = "python -m intellect.diloco.coordinator", faults: Faults = NO_FAULTS,
         follower_argv: Sequence[str] | None = None) -> int:
    """The worker's command line (:func:`worker_args`), a contributor's ``join`` or ``identity``.
    ``follower_argv``: how the worker's other ranks are started (default: this module's worker)."""
    args = parse_worker_args(sys.argv[1:] if argv is None else argv, prog)
    if args.cmd == "join":
        return contributor_main(args.store, args.run, args.key, args.coordinator_key)
    if args.cmd == "identity":
        secret = load_secret(args.secret_file, environ={})
        if secret is None:
            return EXIT_FAILED
        print(coordinator_identity(secret, args.run).public.hex)
        return EXIT_DONE
    return worker_main(args.config, args.worker, args.index, args.store, observe, faults, follower_argv=follower_argv)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is closed by now; the interpreter's own teardown would run the destructors of gloo
    # groups whose peer died (a sibling rank, a worker), each waiting out its timeout
    os._exit(code)
