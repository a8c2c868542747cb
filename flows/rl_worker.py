"""``rl-worker``: one ``intellect worker`` of an RL run, as a flow run on the machine of its work pool.

``rl-train`` with ``workers.launch = "deployments"`` starts each of its workers as a flow run of
the ``rl-worker`` deployment (``gpu-rollout``), a child of its own run, through
:class:`RLWorkerLauncher` (a :class:`~flows.launch.DeploymentLauncher`). The flow run keeps the
worker's key on its own machine (:func:`~intellect.rl.trainer.workers.host_key_file`:
``~/.intellect/keys/<run>/<name>.key``, made there on first use with mode 0600, or ``key_file``),
so a worker restarted on that host keeps its id. Before the worker starts, the flow announces the
key id with the public key (nothing secret) as a table artifact of its flow run
(``<run>-<name>-worker-key``); the launcher reads it through the API and checks that the id is the
public key's (:meth:`RLWorkerLauncher.key_id`), which is how the trainer learns whose submissions to
wait for. Then it runs the process :func:`~intellect.rl.trainer.workers.worker_argv` describes, its download
cache on that machine too (``~/.intellect/cache/<run>/<name>``, its log beside it), until it exits.

The flow returns the worker's exit status, 0; any other status fails the flow run (its log's tail
in the run's log). Cancelling the flow run stops the worker: the process worker's SIGTERM ends the
flow's wait, which stops the worker with :func:`intellect.launch.stop` (SIGTERM, then SIGKILL), and
the worker also exits by itself when the flow run's process is gone. The worker gets neither the
Prefect API's credentials nor storage credentials: it talks to the run only through the service.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.artifacts import artifact_key
from flows.launch import DeploymentLauncher, FlowRunHandle
from intellect.inference.engines import worker_python
from intellect.launch import Handle, LocalLauncher, stop
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.workers import (WORKER_MODULE, deployment_parameters, ensure_key, host_cache, host_key_file,
                                  key_record, wait_key_id, worker_argv)

ROOT = Path(__file__).resolve().parents[1]
POLL = 0.2  # seconds between looks at the worker process
STOP_GRACE = 10.0  # seconds a stopped worker gets after SIGTERM, and again after SIGKILL is sent
# the flow run's own credentials stay with it (the worker's door into the run is the service)
WITHHELD_PREFIXES = ("PREFECT_", "AWS_")
LOG_TAIL = 4000


def key_artifact(run_name: str, worker: str) -> str:
    """The artifact key of worker ``worker``'s announcement (one version per flow run).

    >>> key_artifact("rl_tiny", "W.0")
    'rl-tiny-w-0-worker-key'
    """
    return artifact_key(f"{run_name}-{worker}", "worker-key")


@flow(name="rl-worker", flow_run_name="{run_name}-{worker}")
def rl_worker(config: RLRunConfig, worker: str, url: str, trainer_key: str, key_file: str | None = None,
              cache: str | None = None, run_name: str = "") -> int:  # noqa: ARG001 - names the flow run
    """Worker ``worker`` of the run of ``config`` until its last step: the service at ``url``, the
    trainer's public key ``trainer_key`` (hex) pinned; its key in ``key_file`` and its checkpoints in
    ``cache`` on this machine (defaults under ``~/.intellect``). Its exit status."""
    logger = get_run_logger()
    # the defaults' paths check that the names are fit for paths and artifact keys
    default_key, default_cache = host_key_file(config.run_name, worker), host_cache(config.run_name, worker)
    key_path = Path(key_file).expanduser() if key_file else default_key
    key = ensure_key(key_path)
    create_table_artifact(key=key_artifact(config.run_name, worker), table=[key_record(worker, key.public)],
                          description=f"RL worker {worker} of {config.run_name}: its key id")
    logger.info("worker %s: key id %s (key file %s on this machine)", worker, key.public.id, key_path)
    cache_dir = Path(cache).expanduser() if cache else default_cache
    argv = worker_argv(config, worker, url, trainer_key, key_path, cache=cache_dir, parent=os.getpid())
    withhold = [k for k in os.environ if k.startswith(WITHHELD_PREFIXES)]
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = LocalLauncher(cache_dir.parent, WORKER_MODULE, withhold=withhold,
                         python=worker_python(config.workers.engine.kind)).launch(worker, argv, {"PYTHONPATH": pythonpath})
    try:
        code = _wait(proc)
    finally:
        if proc.poll() is None:  # the flow run is cancelled (SIGTERM) or failing: its worker goes too
            logger.warning("worker %s: the flow run is ending first, stopping the worker", worker)
            codes = stop([proc], grace=STOP_GRACE, kill_wait=STOP_GRACE)
            logger.warning("worker %s stopped: exit code %s", worker, codes[worker])
    if code != 0:
        tail = proc.log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        logger.error("worker %s exited with code %d; the end of its log %s:\n%s", worker, code, proc.log, tail)
        raise RuntimeError(f"RL worker {worker} exited with code {code}")
    logger.info("worker %s finished its last step", worker)
    return code


def _wait(proc: Handle) -> int:
    # a sleep loop rather than a blocking wait: the SIGTERM of a cancellation lands between sleeps
    while (code := proc.poll()) is None:
        time.sleep(POLL)
    return code


class RLWorkerLauncher(DeploymentLauncher):
    """Each launch a flow run of ``rl-worker`` (named as ``cfg.dispatch`` says), a child of the
    current flow run, with :func:`~intellect.rl.trainer.workers.deployment_parameters`; its workers keep
    their keys on their own machines (a :class:`~intellect.rl.trainer.workers.RemoteKeys` launcher)."""

    def __init__(self, cfg: RLRunConfig):
        super().__init__(rl_worker, cfg.dispatch, functools.partial(deployment_parameters, cfg))

    def key_id(self, handle: Handle, timeout: float) -> str:
        """The key id ``handle``'s flow run announced (checked against its public key), awaited up to
        ``timeout`` s: the flow run must first be picked up by a worker of the pool."""
        if not isinstance(handle, FlowRunHandle):
            raise TypeError(f"not a flow run this launcher started: {handle!r}")
        return wait_key_id(handle.name, handle, handle.table_rows, timeout=timeout, poll=handle.poll_interval)


def worker_launcher(cfg: RLRunConfig) -> RLWorkerLauncher | None:
    """rl-train's launcher of its workers: flow runs of ``rl-worker`` (``workers.launch =
    "deployments"``), or None for local processes (:func:`tasks.rl.start_workers`'s default)."""
    return RLWorkerLauncher(cfg) if cfg.workers.launch == "deployments" else None
