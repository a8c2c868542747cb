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

Devices: on a GPU pool (a template with a ``devices`` variable, 0..64, default 1) each flow run gets
``CUDA_VISIBLE_DEVICES`` from the worker alone, never from its job variables: that many of the
host's devices (``--devices``; :func:`infra.devices.host_devices`) that no other live run of this
worker holds, handed back when the run's process ends, however it ends. A run that asks for more
than are free stays SCHEDULED, first come first served, for this worker's next poll or another
host's worker; one that asks for more than the host has is crashed with the reason. A worker
without devices (a CPU host) starts GPU-pool runs on the CPU: ``CUDA_VISIBLE_DEVICES`` empty.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS
from prefect.utilities.processutils import setup_signal_handlers_worker
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult
from pydantic import Field

from infra.cluster import POOLS_DIR
from infra.devices import DeviceLease, host_devices

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    import anyio.abc
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse, WorkerFlowRunResponse


def _hex_key(what: str) -> dict[str, Any]:
    return {"type": "string", "pattern": "^[0-9a-f]{32,128}$", "description": f"{what} (hex)."}


# Every name the project's deployments pass (flows.launch.DeploymentLauncher: a diloco-worker's
# credentials, intellect.diloco.coordinator.worker_credentials, spelled out here because that module
# loads torch into every worker; the pool template test checks they agree) or an operator sets per
# deployment (unbuffered logs). None of them is read by the interpreter or the loader. Not
# CUDA_VISIBLE_DEVICES: the worker's device lease sets it, and a poster's value would share a GPU.
JOB_ENV: dict[str, dict[str, Any]] = {
    "PYTHONUNBUFFERED": {"type": "string", "enum": ["0", "1"], "description": "Unbuffered output (logs stream)."},
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


def requested_devices(template: dict[str, Any], deployment: dict[str, Any] | None,
                      flow_run: dict[str, Any] | None) -> int | None:
    """How many devices a flow run asks for: its own ``devices`` job variable, else its deployment's,
    else the template's default (Prefect's order of precedence); None where the pool has no
    ``devices`` variable. ``ValueError`` where the job variables are refused.

    >>> gpu = pool_template("gpu-diloco")
    >>> requested_devices(gpu, None, None), requested_devices(gpu, {"devices": 4}, {}), requested_devices(gpu, {"devices": 4}, {"devices": 2})
    (1, 4, 2)
    >>> print(requested_devices(pool_template("cpu"), {}, {}))
    None
    """
    spec = template["variables"]["properties"].get("devices")
    check_job_variables(template, deployment, "deployment")
    check_job_variables(template, flow_run, "flow run")
    if spec is None:
        return None
    return int({"devices": spec["default"], **(deployment or {}), **(flow_run or {})}["devices"])


class LockedJobConfiguration(ProcessJobConfiguration):
    """A process job configuration rendered from this checkout's template, after its check."""

    devices: int | None = Field(default=None, description="Devices the flow run asks for (GPU pools).")

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
        """Prefect's process worker with :class:`LockedJobConfiguration` and a :class:`DeviceLease` of
        ``devices``: a run is submitted only once its devices are leased to it (in the order the API
        lists the scheduled runs), gets them as ``CUDA_VISIBLE_DEVICES`` and gives them back when
        its limit slot is released, which Prefect does on every path a submitted run ends by."""

        type = "process"
        job_configuration = LockedJobConfiguration

        def __init__(self, *args: Any, devices: Sequence[str] = (), **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.lease = DeviceLease(devices)
            self._told_waiting: set[UUID] = set()  # runs whose wait is in their log already

        async def _devices_asked(self, flow_run: FlowRun) -> int | None:
            """What ``flow_run`` asks for; None where the lease has no say before submission: a pool
            without devices, refused job variables or a deleted deployment (submission then crashes
            or cancels the run with the reason)."""
            deployment = None
            if flow_run.deployment_id:
                try:
                    deployment = (await self.client.read_deployment(flow_run.deployment_id)).job_variables
                except ObjectNotFound:
                    return None
            try:
                asked = requested_devices(pool_template(self._work_pool_name), deployment, flow_run.job_variables)
            except ValueError:
                return None
            return None if asked is None or self.lease.refusal(asked) else asked

        async def _submit_scheduled_flow_runs(self, flow_run_response: list[WorkerFlowRunResponse]) -> list[FlowRun]:
            if not self.lease.devices:
                return await super()._submit_scheduled_flow_runs(flow_run_response)
            self._told_waiting &= {e.flow_run.id for e in flow_run_response}
            admitted: list[WorkerFlowRunResponse] = []
            leased: list[UUID] = []
            for entry in flow_run_response:
                run = entry.flow_run
                if run.id not in self._submitting_flow_run_ids and self.lease.held(run.id) is None:
                    asked = await self._devices_asked(run)
                    if asked is not None:
                        if self.lease.take(run.id, asked) is None:
                            self._tell_waiting(run, asked)
                            break  # first come, first served: later runs do not overtake it
                        leased.append(run.id)
                admitted.append(entry)
            submitted = await super()._submit_scheduled_flow_runs(admitted)
            ids = {r.id for r in submitted}
            for run_id in leased:
                if run_id not in ids:  # the flow-run limit held it back: it waits unleased
                    self.lease.release(run_id)
            return submitted

        def _tell_waiting(self, flow_run: FlowRun, asked: int) -> None:
            if flow_run.id not in self._told_waiting:
                self._told_waiting.add(flow_run.id)
                self.get_flow_run_logger(flow_run).info(
                    "flow run %s waits for devices: it asks for %d, %d of this worker's %d are free (%s)",
                    flow_run.id, asked, len(self.lease.free()), len(self.lease.devices), ",".join(self.lease.free()))

        def _grant(self, flow_run_id: UUID, count: int) -> tuple[str, ...]:
            if not self.lease.devices:
                return ()
            held = self.lease.held(flow_run_id)
            if held is not None and len(held) == count:
                return held
            self.lease.release(flow_run_id)  # not leased at its poll, or its job variables changed since
            try:
                grant = self.lease.take(flow_run_id, count)
            except ValueError as exc:
                raise ValueError(f"the flow run {exc}") from None
            if grant is None:
                raise RuntimeError(f"the flow run asks for {count} devices; {len(self.lease.free())} of this "
                                   f"worker's {len(self.lease.devices)} are free")
            return grant

        async def run(self, flow_run: FlowRun, configuration: ProcessJobConfiguration,
                      task_status: anyio.abc.TaskStatus[int] | None = None) -> ProcessWorkerResult:
            if isinstance(configuration, LockedJobConfiguration) and configuration.devices is not None:
                configuration.env["CUDA_VISIBLE_DEVICES"] = ",".join(self._grant(flow_run.id, configuration.devices))
            return await super().run(flow_run, configuration, task_status)

        def _release_limit_slot(self, flow_run_id: UUID) -> None:
            self.lease.release(flow_run_id)
            super()._release_limit_slot(flow_run_id)


async def _serve(pool: str, limit: int | None, name: str | None, devices: Sequence[str]) -> None:
    worker = LockedProcessWorker(name=name, work_pool_name=pool, limit=limit, create_pool_if_not_found=False,
                                 prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
                                 heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
                                 devices=devices)
    await worker.start(printer=print)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.pool_worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", required=True, help="A pool of infra/pools (the template checked against).")
    ap.add_argument("--limit", type=int, default=None, help="Flow runs at once (default: no limit).")
    ap.add_argument("--name", default=None, help="The worker's name (default: Prefect's).")
    ap.add_argument("--devices", default=None,
                    help="Devices this host lends its GPU pool's flow runs: indices or UUIDs, comma-separated; "
                         "'' for none (default: the worker's CUDA_VISIBLE_DEVICES if set, else every GPU "
                         "nvidia-smi lists, else none).")
    args = ap.parse_args(argv)
    template = pool_template(args.pool)  # a pool without a template here is refused before connecting
    devices: tuple[str, ...] = ()
    if "devices" in template["variables"]["properties"]:
        devices = host_devices(args.devices)
        print(f"devices lent to {args.pool} flow runs: {','.join(devices) or 'none (runs see no GPU)'}")
    elif args.devices:
        ap.error(f"pool {args.pool} takes no devices (its template has no devices variable)")
    # SIGTERM becomes SIGINT, which stops the worker and its flow runs as `prefect worker start` does
    setup_signal_handlers_worker(os.getpid(), "the process worker", print)
    try:
        asyncio.run(_serve(args.pool, args.limit, args.name, devices))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
