"""Scripted faults for the DiLoCo reliability and attack tests, and the worker entry point that takes them.

A test builds a :class:`FaultPlan` and starts its run through :func:`faulty_launcher`: every worker
then runs ``python -m diloco_faults --faults <plan JSON> <coordinator.worker_args>``, which hands
:class:`ScriptedFaults` to ``coordinator.main``. Production workers never see this module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from intellect.diloco.coordinator import main, worker_launcher
from intellect.launch import Launcher, LocalProcess

HERE = Path(__file__).resolve().parent


class FaultPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lie_worker: str | None = None  # this worker lies in every step ...
    lie: Literal["const", "flip", "scale"] = "const"  # ... 1e6 everywhere, sign-flipped, or 100x
    nan_worker: str | None = None  # this worker's pseudo-gradient turns non-finite ...
    nan_step: int = -1  # ... at this outer step
    stall_worker: str | None = None  # this worker stalls inside the all-reduce (once every member is ready) ...
    stall_step: int = -1  # ... of this outer step, until killed
    stall_marker: str | None = None  # a folder: ``stalled-<step>-<worker>`` appears there when it stalls


def stall_marker(folder: str | os.PathLike, step: int, worker: str) -> Path:
    return Path(folder) / f"stalled-{step}-{worker}"


class ScriptedFaults:
    """The ``intellect.diloco.faults.Faults`` a :class:`FaultPlan` describes."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan

    def pseudo_gradient(self, step: int, worker: str, pseudo: list[torch.Tensor]) -> None:
        p = self.plan
        if p.lie_worker == worker:
            with torch.no_grad():
                for g in pseudo:
                    if p.lie == "const":
                        g.fill_(1e6)
                    elif p.lie == "flip":
                        g.neg_()
                    else:
                        g.mul_(100.0)
        if p.nan_worker == worker and p.nan_step == step:
            pseudo[0].view(-1)[0] = float("nan")

    def before_allreduce(self, step: int, attempt: int, worker: str) -> None:  # noqa: ARG002 - any attempt
        p = self.plan
        if p.stall_worker == worker and p.stall_step == step:
            if p.stall_marker is not None:
                stall_marker(p.stall_marker, step, worker).touch()
            while True:  # until the test kills this process
                time.sleep(1.0)


class FaultyLauncher:
    """Workers as local subprocesses running :func:`_main` with ``plan``."""

    def __init__(self, log_dir: str | os.PathLike, plan: FaultPlan):
        self.inner, self.plan = worker_launcher(log_dir, module="diloco_faults"), plan

    def launch(self, name: str, args: Sequence[str], env: Mapping[str, str]) -> LocalProcess:
        path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        return self.inner.launch(name, ["--faults", self.plan.model_dump_json(), *args], {**env, "PYTHONPATH": path})


def faulty_launcher(log_dir: str | os.PathLike, plan: FaultPlan | None) -> Launcher:
    """:class:`FaultyLauncher` for ``plan``; the production ``worker_launcher`` when there is none."""
    return worker_launcher(log_dir) if plan is None else FaultyLauncher(log_dir, plan)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--faults", required=True)
    args, rest = ap.parse_known_args(argv)
    return main(rest, faults=ScriptedFaults(FaultPlan.model_validate_json(args.faults)),
                prog="python -m diloco_faults")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
