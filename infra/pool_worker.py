"""The process worker of the cluster's pools: Prefect's, with each flow run's job variables checked on
the worker host against the pool's template from this checkout.

    python -m infra.pool_worker --pool gpu-rollout --limit 2 [--name gpu-rollout-host3]

A process worker starts ``python -m prefect.engine`` with the flow run's ``env`` job variable in its
environment, and several variables run code of the sender's choosing before the engine's first
line: ``PYTHONPATH`` (a ``sitecustomize.py`` on it), ``LD_PRELOAD`` (a library's constructor),
``PYTHONWARNINGS`` (imports the module a warning category names); ``PREFECT_API_URL`` makes the
engine load its flow, and the pull steps it runs, from another API. So the pools' ``env`` takes only
the names of :data:`JOB_ENV`, with their values constrained, and there is no ``working_dir`` (the
engine's directory is the first entry of its import path).

The server validates job variables against the pool's schema when it creates a deployment or a flow
run of one (HTTP 422), but not on every route: ``POST /flow_runs/`` with a ``deployment_id`` and
``PATCH /deployments/<id>`` store any job variables. :class:`LockedProcessWorker` therefore checks
the deployment's and the flow run's job variables itself, against :func:`pool_template` (this
checkout's, never the server's copy, which an API client may replace), renders the flow run's
configuration from that template, and crashes a run whose variables it refuses with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS
from prefect.utilities.processutils import setup_signal_handlers_worker
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

from infra.cluster import POOLS_DIR

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse


def _hex_key(what: str) -> dict[str, Any]:
    return {"type": "string", "pattern": "^[0-9a-f]{32,128}$", "description": f"{what} (hex)."}


# Every name the project's deployments pass (flows.launch.DeploymentLauncher: a diloco-worker's
# credentials, intellect.diloco.coordinator.worker_credentials, spelled out here because that module
# loads torch into every worker; the pool template test checks they agree) or an operator sets per
# deployment (GPU pinning, unbuffered logs). None of them is read by the interpreter or the loader.
JOB_ENV: dict[str, dict[str, Any]] = {
    "PYTHONUNBUFFERED": {"type": "string", "enum": ["0", "1"], "description": "Unbuffered output (logs stream)."},
    "CUDA_VISIBLE_DEVICES": {"type": "string", "pattern": "^[A-Za-z0-9,-]*$", "maxLength": 512,
                             "description": "GPUs the flow run sees: indices or UUIDs, comma-separated."},
    "INTELLECT_DILOCO_PEER_KEY": _hex_key("A DiLoCo worker's own rendezvous key"),
    "INTELLECT_DILOCO_ALLREDUCE_KEY": _hex_key("The DiLoCo run's all-reduce MAC root"),
}


def pool_template(pool: str) -> dict[str, Any]:
    """The base job template of ``pool``: ``infra/pools/<pool>.json`` with its ``env`` variable made
    the :data:`JOB_ENV` allowlist (the file gives only its default)."""
    path = POOLS_DIR / f"{pool}.json"
    if not path.is_file():
        raise ValueError(f"no template for pool {pool!r} in {POOLS_DIR}")
    template = json.loads(path.read_text())
    env = template["variables"]["properties"]["env"]
    env.update({"title": "Environment Variables", "type": "object", "properties": copy.deepcopy(JOB_ENV),
                "additionalProperties": False,
                "description": f"Environment variables of the flow run, only these: {', '.join(JOB_ENV)}."})
    return template


def check_job_variables(template: dict[str, Any], job_variables: dict[str, Any] | None, whose: str) -> None:
    """Raise ``ValueError`` (with the reason) unless ``job_variables`` satisfy ``template``'s schema."""
    try:
        validate(dict(job_variables or {}), template["variables"], raise_on_error=True, preprocess=True,
                 ignore_required=True)
    except ValidationError as exc:
        raise ValueError(f"the {whose}'s job variables are refused by this worker's pool template: {exc}") from None


class LockedJobConfiguration(ProcessJobConfiguration):
    """A process job configuration rendered from this checkout's template, after its check."""

    @classmethod
    async def resolve_for_flow_run(cls, flow_run: FlowRun, *, client: PrefectClient, work_pool: WorkPool,
                                   worker_name: str, worker_id: UUID | None = None,
                                   deployment: DeploymentResponse | None = None) -> LockedJobConfiguration:
        template = pool_template(work_pool.name)
        if deployment is None and flow_run.deployment_id:
            deployment = await client.read_deployment(flow_run.deployment_id)
        check_job_variables(template, deployment.job_variables if deployment else None, "deployment")
        check_job_variables(template, flow_run.job_variables, "flow run")
        pinned = work_pool.model_copy(update={"base_job_template": template})
        return await super().resolve_for_flow_run(flow_run, client=client, work_pool=pinned, worker_name=worker_name,
                                                  worker_id=worker_id, deployment=deployment)


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # it takes over the "process" type in this process, as it should

    class LockedProcessWorker(ProcessWorker):
        """Prefect's process worker with :class:`LockedJobConfiguration`."""

        type = "process"
        job_configuration = LockedJobConfiguration


async def _serve(pool: str, limit: int | None, name: str | None) -> None:
    worker = LockedProcessWorker(name=name, work_pool_name=pool, limit=limit, create_pool_if_not_found=False,
                                 prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
                                 heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()))
    await worker.start(printer=print)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.pool_worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", required=True, help="A pool of infra/pools (the template checked against).")
    ap.add_argument("--limit", type=int, default=None, help="Flow runs at once (default: no limit).")
    ap.add_argument("--name", default=None, help="The worker's name (default: Prefect's).")
    args = ap.parse_args(argv)
    pool_template(args.pool)  # a pool without a template here is refused before connecting
    # SIGTERM becomes SIGINT, which stops the worker and its flow runs as `prefect worker start` does
    setup_signal_handlers_worker(os.getpid(), "the process worker", print)
    try:
        asyncio.run(_serve(args.pool, args.limit, args.name))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
