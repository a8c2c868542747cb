"""A local Prefect cluster: a server on 127.0.0.1, the work pools of ``prefect.yaml``, one process worker per pool.

    python -m infra.cluster up [--port 4200] [--state .cluster]   # server, pools, workers; writes .cluster/env
    python -m infra.cluster deploy                                # prefect --no-prompt deploy --all against it
    python -m infra.cluster status
    python -m infra.cluster down                                  # SIGTERM each process group, then SIGKILL

``source .cluster/env`` points the ``prefect`` CLI and ``intellect`` at the cluster. The API
answers only requests that carry the cluster's auth string: ``<state>/api-auth``, a random secret
created once with mode 0600 and reused. The server gets it as ``PREFECT_SERVER_API_AUTH_STRING``;
workers, ``<state>/env`` (mode 0600) and :func:`api_settings` hand it to clients as
``PREFECT_API_AUTH_STRING``; the UI asks for it on its login page. ``up`` also creates the automation
``intellect-worker-rejections`` (``infra/automations.py``). The server keeps its database in
``<state>/prefect-home`` (SQLite; Postgres for more than one worker host, see ``docs/deploy.md``),
analytics off. Pools come from ``infra/pools/<pool>.json`` (base job templates for process
workers, their ``env`` an allowlist: ``infra/pool_worker.py``) and are created through the API; each
worker is ``python -m infra.pool_worker``, which checks every flow run's job variables against the
template of this checkout before it starts the run. Every process runs in its own
session (``setsid``): one SIGTERM to its group stops it, which a job started with ``&`` from a
script would ignore (its SIGINT is ignored, and the worker turns SIGTERM into SIGINT). PID files
are in ``<state>/pids``; ``down`` stops by PID and leaves nothing running.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from infra.automations import create_automations
from infra.devices import host_devices
from infra.procs import alive

ROOT = Path(__file__).resolve().parents[1]
POOLS_DIR = Path(__file__).with_name("pools")
POOLS = ("cpu", "gpu-rollout", "gpu-train", "gpu-diloco", "validator")
# how many flow runs a worker of each pool runs at once on one host; a GPU pool's is raised to the host's
# device count (pool_limit), and its device lease (infra/devices.py) decides which run gets which devices
LIMITS = {"cpu": 4, "gpu-rollout": 2, "gpu-train": 1, "gpu-diloco": 2, "validator": 1}


def pool_limit(pool: str, devices: tuple[str, ...]) -> int:
    """The flow runs a worker of ``pool`` runs at once on a host with ``devices``: a GPU pool's runs are
    bounded by the devices they lease (a DiLoCo worker of 4 ranks takes 4 of 8), not by a count that
    would leave GPUs idle; the others keep :data:`LIMITS`.

    >>> pool_limit("gpu-diloco", tuple("01234567")), pool_limit("gpu-diloco", ()), pool_limit("cpu", ("0",))
    (8, 2, 4)
    """
    return max(LIMITS[pool], len(devices)) if pool.startswith("gpu-") else LIMITS[pool]
AUTH_FILE = "api-auth"


def _write_private(path: Path, text: str, exclusive: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_TRUNC
    with os.fdopen(fd, "w") as f:
        f.write(text)


def auth_string(state: Path) -> str:
    """The cluster's API auth string (``user:secret``, Basic auth): created once, then read back.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> s = auth_string(d); s.startswith("intellect:") and s == auth_string(d)
    True
    >>> oct((d / AUTH_FILE).stat().st_mode & 0o777)
    '0o600'
    """
    path = state / AUTH_FILE
    if not path.exists():
        state.mkdir(parents=True, exist_ok=True)
        try:
            _write_private(path, f"intellect:{secrets.token_urlsafe(32)}\n", exclusive=True)
        except FileExistsError:  # another `up` created it first: use theirs
            pass
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} is readable by others; chmod 600 it (or delete it for a new secret)")
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"{path} is empty; delete it for a new secret")
    return secret


def cluster_env(state: Path, port: int) -> dict[str, str]:
    """The environment every process of the cluster, and every client of it, runs with (the server
    adds ``PREFECT_SERVER_API_AUTH_STRING``, see :func:`server_env`)."""
    return {
        "PREFECT_API_AUTH_STRING": auth_string(state),
        "PREFECT_HOME": str(state / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
        "INTELLECT_ROOT": str(ROOT),
    }


def server_env(env: dict[str, str]) -> dict[str, str]:
    """The server's environment: the clients' plus the setting that makes it demand the auth string."""
    return {**env, "PREFECT_SERVER_API_AUTH_STRING": env["PREFECT_API_AUTH_STRING"]}


@contextmanager
def api_settings(env: dict[str, str]) -> Iterator[None]:
    """Prefect clients made inside the block talk to the cluster of ``env`` (its URL and auth string)."""
    # Prefect takes seconds to import: `status` and `down` never need it.
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings  # noqa: PLC0415 - heavy

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"],
                             PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}):
        yield


def _pids(state: Path) -> Path:
    d = state / "pids"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _spawn(name: str, argv: list[str], env: dict[str, str], state: Path) -> int:
    log = open(state / "logs" / f"{name}.log", "ab")
    p = subprocess.Popen(argv, env={**os.environ, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    (_pids(state) / f"{name}.pid").write_text(f"{p.pid}\n")
    return p.pid


def wait_healthy(api_url: str, timeout: float, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.read().strip() == b"true":
                    return
        except OSError:
            pass
        if pid is not None and not alive(pid):
            raise RuntimeError("the Prefect server exited; see its log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prefect server at {api_url} not healthy within {timeout:.0f} s")
        time.sleep(0.5)


def create_pools(env: dict[str, str], pools: tuple[str, ...] = POOLS, devices: tuple[str, ...] = ()) -> None:
    """Create (or update) each pool from its base job template, with its concurrency limit
    (:func:`pool_limit` of this host's ``devices``)."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - heavy, see api_settings
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate  # noqa: PLC0415 - heavy
    from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415 - heavy

    from infra.pool_worker import pool_template  # noqa: PLC0415 - imports Prefect

    with api_settings(env), get_client(sync_client=True) as client:
        for name in pools:
            template = pool_template(name)
            desc = template["variables"].get("description")
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template,
                                                       description=desc, concurrency_limit=pool_limit(name, devices)))
            except ObjectAlreadyExists:
                client.update_work_pool(name, WorkPoolUpdate(base_job_template=template, description=desc,
                                                             concurrency_limit=pool_limit(name, devices)))


def up(state: Path, port: int, timeout: float = 180.0, pools: tuple[str, ...] = POOLS,
       alert_webhook: str | None = None) -> dict[str, str]:
    """Server, pools, the rejection automation (calling ``alert_webhook`` if given), one worker per pool."""
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)  # the database, the auth string and the env file are the keys to every worker host
    (state / "logs").mkdir(exist_ok=True)
    if running(state):
        raise RuntimeError(f"a cluster is already running from {state} (python -m infra.cluster down)")
    env = cluster_env(state, port)
    prefect = str(Path(sys.executable).with_name("prefect"))
    pid = _spawn("server", [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 server_env(env), state)
    try:
        wait_healthy(env["PREFECT_API_URL"], timeout, pid)
        devices = host_devices(None)
        create_pools(env, pools, devices)
        with api_settings(env):
            create_automations(alert_webhook)
        for name in pools:
            start_worker(state, env, name, pool_limit(name, devices))
    except BaseException:
        down(state)
        raise
    _write_private(state / "env", "".join(f"export {k}={v}\n" for k, v in env.items()))
    return env


def start_worker(state: Path, env: dict[str, str], pool: str, limit: int) -> int:
    """One process worker of ``pool`` (an existing pool with a template in ``infra/pools``), in its own
    session (:mod:`infra.pool_worker`); its PID."""
    return _spawn(f"worker-{pool}", [sys.executable, "-m", "infra.pool_worker", "--pool", pool, "--limit", str(limit),
                                     "--name", f"{pool}-local"], env, state)


def deploy(state: Path, timeout: float = 600.0) -> None:
    """``prefect --no-prompt deploy --all`` from the repository root, against the cluster."""
    env = load_env(state)
    prefect = str(Path(sys.executable).with_name("prefect"))
    subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env={**os.environ, **env}, cwd=ROOT, check=True,
                   timeout=timeout)


def load_env(state: Path) -> dict[str, str]:
    out = {}
    for line in (state / "env").read_text().splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        out[k] = v
    return out


def running(state: Path) -> dict[str, int]:
    """Processes of the cluster still alive, by name."""
    d = state / "pids"
    if not d.exists():
        return {}
    out = {}
    for f in sorted(d.glob("*.pid")):
        pid = int(f.read_text())
        if alive(pid):
            out[f.stem] = pid
    return out


def down(state: Path, grace: float = 20.0) -> dict[str, int]:
    """SIGTERM every process group of the cluster (workers first), SIGKILL what outlives ``grace``."""
    procs = running(state)
    order = sorted(procs, key=lambda n: n == "server")  # workers before the server they report to
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for name in order:
            try:
                os.killpg(procs[name], sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(alive(procs[n]) for n in order) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not any(alive(procs[n]) for n in order):
            break
    for f in _pids(state).glob("*.pid"):
        f.unlink()
    return procs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "deploy", "status", "down"])
    ap.add_argument("--state", default=str(ROOT / ".cluster"), help="PID files, logs, the server's database.")
    ap.add_argument("--port", type=int, default=4200, help="Port of the Prefect server on 127.0.0.1.")
    ap.add_argument("--alert-webhook", default=os.environ.get("INTELLECT_ALERT_WEBHOOK"),
                    help="URL the rejection automation POSTs to (default: INTELLECT_ALERT_WEBHOOK; none: record only).")
    args = ap.parse_args(argv)
    state = Path(args.state).resolve()
    if args.command == "up":
        env = up(state, args.port, alert_webhook=args.alert_webhook)
        print(f"cluster up: {env['PREFECT_API_URL']} (UI http://127.0.0.1:{args.port}, its login asks for the "
              f"contents of {state / AUTH_FILE}); `source {state}/env`")
    elif args.command == "deploy":
        deploy(state)
    elif args.command == "status":
        print(json.dumps(running(state)))
    else:
        print(f"stopped: {json.dumps(down(state))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
