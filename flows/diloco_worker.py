"""A DiLoCo worker process whose every outer step is one Prefect flow run.

Started by the ``diloco-train`` flow's launcher, either as a subprocess of its flow run
(``python -m flows.diloco_worker worker --config ... --worker w0 --index 0 --store host:port``) or as a
flow run of the ``diloco-worker`` deployment on a GPU pool (:func:`diloco_worker`), which runs the
same loop in the flow run's process.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.states import Cancelled

from flows.artifacts import artifact_key
from intellect.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, main, worker_main
from intellect.diloco.worker import DilocoWorker
from tasks.diloco import run_phase


@flow(name="diloco-outer-step", flow_run_name="{worker_id}-step-{step}")
def diloco_outer_step(worker_id: str, step: int, run_name: str) -> dict:
    w = _RESIDENT[worker_id]
    report = asdict(w.outer_step(run_phase))
    create_table_artifact(
        key=artifact_key(run_name, f"{worker_id}-outer-step"),
        table=[{k: v for k, v in report.items() if k not in ("members", "flagged", "banned")}
               | {k: ",".join(report[k]) for k in ("members", "flagged", "banned")}],
        description=f"DiLoCo outer step {report['step']} on {worker_id}",
    )
    return report


_RESIDENT: dict[str, DilocoWorker] = {}


def run_step(w: DilocoWorker):
    _RESIDENT[w.worker] = w
    from intellect.diloco.worker import StepReport

    return StepReport(**diloco_outer_step(w.worker, w.step, w.run.run_name))


@flow(name="diloco-worker", flow_run_name="{run_name}-{worker}")
def diloco_worker(config: DilocoRunConfig, worker: str, index: int, store: str, run_name: str = "") -> int:
    """One DiLoCo worker until the run is done (its outer steps are sub-flow runs). Cancelling the
    flow run stops it like SIGTERM: the deathrattle tells the peers at once."""
    with tempfile.TemporaryDirectory(prefix="intellect-diloco-worker-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(config.model_dump_json())
        try:
            code = worker_main(str(path), worker, index, store, step_runner=run_step)
        except SystemExit:  # SIGTERM: the process worker carrying out a cancellation (deathrattle sent)
            return Cancelled(message=f"DiLoCo worker {worker} left the run on SIGTERM")
    if code != EXIT_DONE:
        raise RuntimeError(f"DiLoCo worker {worker} stopped with exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(step_runner=run_step, prog="python -m flows.diloco_worker"))
