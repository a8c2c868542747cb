"""A DiLoCo worker process whose every outer step is one Prefect flow run.

Started by the ``diloco-train`` flow's launcher as
``python -m flows.diloco_worker worker --config ... --worker w0 --index 0 --store host:port``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.artifacts import artifact_key
from intellect.diloco.coordinator import main
from intellect.diloco.worker import DilocoWorker
from tasks.diloco import run_phase


@flow(name="diloco-outer-step", flow_run_name="{worker_id}-step-{step}")
def diloco_outer_step(worker_id: str, step: int, run_name: str) -> dict:
    w = _RESIDENT[worker_id]
    report = asdict(w.outer_step(run_phase))
    create_table_artifact(
        key=artifact_key(run_name, f"{worker_id}-outer-step"),
        table=[{k: v for k, v in report.items() if k != "members"} | {"members": ",".join(report["members"])}],
        description=f"DiLoCo outer step {report['step']} on {worker_id}",
    )
    return report


_RESIDENT: dict[str, DilocoWorker] = {}


def run_step(w: DilocoWorker):
    _RESIDENT[w.worker] = w
    from intellect.diloco.worker import StepReport

    return StepReport(**diloco_outer_step(w.worker, w.step, w.run.run_name))


if __name__ == "__main__":
    sys.exit(main(step_runner=run_step, prog="python -m flows.diloco_worker"))
