"""A DiLoCo worker process whose every outer step is one live Prefect flow run of five tasks.

Started by the ``diloco-train`` flow's launcher, either as a subprocess of its flow run
(``python -m flows.diloco_worker`` + ``coordinator.worker_args``) or as a flow run of the
``diloco-worker`` deployment on a GPU pool (:func:`diloco_worker`). Either way the worker's loop
(``DilocoWorker.run_until_done``) hands each outer step to :func:`driver`'s ``drive``: one
``diloco-outer-step`` flow run named ``<worker>-step-<t>`` whose body calls the worker's phases as
task runs, in order, each shown while it runs::

    boundary -> inner -> reduce -> commit -> checkpoint

then the step's table artifact (its all-reduce, compute utilization, tokens, tokens/s and MFU among the
columns). The library provides the phases and never calls Prefect; this module only wires them.

- A worker excluded from the step (``sync.Excluded``: it arrived late, its onboarding or the step's
  attempts failed) shows the phase that found it **Failed** with the reason, an ``abandon`` task run
  (it reverts and rejoins at a later boundary), and the flow run in a Completed-type state named
  **Excluded** with the reason as its message: the run goes on as designed, so the step is not a
  failure that alerts anyone (Failed) nor something a user stopped (Cancelled), and its name and
  message say what happened.
- A crash in a phase fails its task run and the flow run with the traceback, and the exception stops
  the worker process as without Prefect (``coordinator.worker_main``'s exit codes).
- Every phase runs in the thread that drives the worker (the rendezvous client is not thread-safe,
  and the collectives of a process are issued from one thread, in order): Prefect runs a sync task
  called from a sync flow in the calling thread, and :func:`run_phase` refuses to run anywhere else.
  A phase is not idempotent (collectives, commits): no retries, no cached results.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Callable, TypeVar

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.states import Completed

from flows.artifacts import artifact_key
from flows.progress import show_progress
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, main, parse_worker_args, worker_main
from intellect.diloco.report import StepReport
from intellect.diloco.worker import DilocoWorker

T = TypeVar("T")
OUTER_STEP = "diloco-outer-step"  # the flow of one outer step
EXCLUDED = "Excluded"  # the name of the state of a step the worker was excluded from
LISTS = ("members", "flagged", "banned")  # joined with commas in the table
HIDDEN = ("data_sketch",)  # hashes for comparing workers' reads: in the metrics series, not the table


def table_row(report: dict) -> dict:
    """A step report as one table row: lists joined, the shard as ``i/n``, the data sketch left out.

    >>> table_row({"step": 1, "members": ["w0", "w1"], "flagged": [], "banned": [], "shard": [1, 2],
    ...            "data_sketch": ["ab"]})
    {'step': 1, 'shard': '1/2', 'members': 'w0,w1', 'flagged': '', 'banned': ''}
    """
    row = {k: v for k, v in report.items() if k not in LISTS + HIDDEN}
    if "shard" in row:
        row["shard"] = "/".join(str(x) for x in row["shard"])
    return row | {k: ",".join(report.get(k, [])) for k in LISTS}


def run_phase(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` as the task run ``name`` of the current flow run, in the calling thread, never retried
    or cached (a phase issues collectives and commits: running it twice, or elsewhere, is wrong)."""
    caller = threading.get_ident()

    def phase() -> T:
        if threading.get_ident() != caller:
            raise RuntimeError(f"the {name} phase ran off the thread that drives the worker")
        return fn()

    phase.__name__ = phase.__qualname__ = name  # its task key: one per phase, not one for all
    return task(name=name, task_run_name=name, cache_policy=NO_CACHE, retries=0, persist_result=False)(phase)()


def _rename(name: str) -> None:
    """Rename the current flow run (a joiner learns its step only at the boundary)."""
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None and ctx.flow_run.name != name:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, name=name)


def driver(run_name: str) -> Callable[[DilocoWorker], StepReport]:
    """What ``worker_main`` runs each outer step with: one ``diloco-outer-step`` flow run of its phases."""

    def drive(w: DilocoWorker) -> StepReport:
        report = w.begin()

        # the worker is no flow parameter (the API would store it): the body closes over it
        @flow(name=OUTER_STEP, flow_run_name="{worker_id}-step-{step}", validate_parameters=False)
        def diloco_outer_step(worker_id: str, step: int, run_name: str):
            """One outer step of one worker, its phases as task runs, and its row as a table artifact."""
            def phase(name: str, fn: Callable[[], T]) -> T:
                out = run_phase(name, fn)
                if name == "boundary" and report.step != step:  # a joiner's step is the run's, known only now
                    _rename(f"{worker_id}-step-{report.step}")
                return out

            w.outer_step(phase, report)
            create_table_artifact(key=artifact_key(run_name, f"{worker_id}-outer-step"),
                                  table=[table_row(asdict(report))],
                                  description=f"DiLoCo outer step {report.step} on {worker_id}")
            return Completed(name=EXCLUDED, message=report.excluded) if report.excluded else None

        diloco_outer_step(w.worker, w.step, run_name)
        return report

    return drive


@flow(name="diloco-worker", flow_run_name="{run_name}-{worker}")
def diloco_worker(config: DilocoRunConfig, worker: str, index: int, store: str,
                  run_name: str = "") -> int:  # noqa: ARG001 - names the flow run (flow_run_name)
    """One DiLoCo worker until the run is done (its outer steps are sub-flow runs, :func:`driver`).
    Cancelling the flow run stops it: the process worker's SIGTERM is Prefect's to handle (it marks
    the run cancelled), and the deathrattle tells the peers at once on the way out."""
    show_progress(config.logging)
    with tempfile.TemporaryDirectory(prefix="intellect-diloco-worker-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(config.model_dump_json())
        code = worker_main(str(path), worker, index, store, sigterm=False, drive=driver(config.run_name))
    if code != EXIT_DONE:
        raise RuntimeError(f"DiLoCo worker {worker} stopped with exit code {code}")
    return code


def _main(argv: list[str]) -> int:
    prog = "python -m flows.diloco_worker"
    args = parse_worker_args(argv, prog)
    if args.cmd != "worker":  # a contributor's join, the identity: as the coordinator's own entry point
        return main(argv, prog=prog)
    run = DilocoRunConfig.model_validate_json(Path(args.config).read_text())
    show_progress(run.logging)
    return worker_main(args.config, args.worker, args.index, args.store, drive=driver(run.run_name))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
