"""A DiLoCo worker process whose every outer step is recorded as one Prefect flow run.

Started by the ``diloco-train`` flow's launcher, either as a subprocess of its flow run
(``python -m flows.diloco_worker`` + ``coordinator.worker_args``) or as a flow run of the
``diloco-worker`` deployment on a GPU pool (:func:`diloco_worker`). The worker drives its own loop
(``DilocoWorker.run_until_done``); this module only observes: after each outer step, :func:`report_step`
records it as a ``diloco-outer-step`` flow run with the step's table artifact (its all-reduce,
compute utilization, tokens, tokens/s and MFU among the columns).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.artifacts import artifact_key
from flows.progress import show_progress
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, main, parse_worker_args, worker_main
from intellect.diloco.report import StepReport

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


@flow(name="diloco-outer-step", flow_run_name="{worker_id}-step-{step}")
def diloco_outer_step(worker_id: str, step: int, run_name: str, report: dict) -> dict:
    """The record of one outer step of one worker: its report as a table artifact."""
    create_table_artifact(
        key=artifact_key(run_name, f"{worker_id}-outer-step"),
        table=[table_row(report)],
        description=f"DiLoCo outer step {step} on {worker_id}",
    )
    return report


def observer(run_name: str):
    """What ``worker_main`` calls after each outer step: one ``diloco-outer-step`` flow run."""

    def report_step(r: StepReport) -> None:
        diloco_outer_step(r.worker, r.step, run_name, asdict(r))

    return report_step


@flow(name="diloco-worker", flow_run_name="{run_name}-{worker}")
def diloco_worker(config: DilocoRunConfig, worker: str, index: int, store: str,
                  run_name: str = "") -> int:  # noqa: ARG001 - names the flow run (flow_run_name)
    """One DiLoCo worker until the run is done (its outer steps are recorded as sub-flow runs).
    Cancelling the flow run stops it: the process worker's SIGTERM is Prefect's to handle (it marks
    the run cancelled), and the deathrattle tells the peers at once on the way out."""
    show_progress(config.logging)
    with tempfile.TemporaryDirectory(prefix="intellect-diloco-worker-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(config.model_dump_json())
        code = worker_main(str(path), worker, index, store, observe=observer(config.run_name), sigterm=False)
    if code != EXIT_DONE:
        raise RuntimeError(f"DiLoCo worker {worker} stopped with exit code {code}")
    return code


def _main(argv: list[str]) -> int:
    prog = "python -m flows.diloco_worker"
    run = DilocoRunConfig.model_validate_json(Path(parse_worker_args(argv, prog).config).read_text())
    show_progress(run.logging)
    return main(argv, observe=observer(run.run_name), prog=prog)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
