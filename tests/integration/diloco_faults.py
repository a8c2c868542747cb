"""Scripted faults for the DiLoCo reliability and attack tests, and the worker entry point that takes them.

A test builds a :class:`FaultPlan` and starts its run through :func:`faulty_launcher`: every worker
then runs ``python -m diloco_faults --faults <plan JSON> <coordinator.worker_args>``, which hands
:class:`ScriptedFaults` to ``coordinator.main``. Production workers never see this module.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import load_credentials, main, parse_worker_args, worker_launcher
from intellect.diloco.protocol import PLAN
from intellect.diloco.rendezvous_client import RendezvousStore
from intellect.launch import Launcher, LocalProcess

HERE = Path(__file__).resolve().parent


class FaultPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lie_worker: str | None = None  # this worker lies in every step ...
    # ... 1e6 everywhere, sign-flipped, 100x, or honest plus lie_scale x its own norm along one
    # fixed unit direction (direction(lie_seed, shapes): the same in every step)
    lie: Literal["const", "flip", "scale", "direction"] = "const"
    lie_scale: float = 1.5
    lie_seed: int = 1234
    lie_keep_norm: bool = False  # direction: scaled back to the honest pseudo-gradient's norm
    fail_ring: list | None = None  # [step, attempt, worker, local rank]: that ring fails once (workers of several ranks)
    plan_worker: str | None = None  # this worker decides every attempt's plan/ key first ...
    plan: str = '{"algorithm": "ring", "order": null, "estimates": {}}'  # ... as this JSON
    nan_worker: str | None = None  # this worker's pseudo-gradient turns non-finite ...
    nan_step: int = -1  # ... at this outer step
    stall_worker: str | None = None  # this worker stalls inside the all-reduce (once every member is ready) ...
    stall_step: int = -1  # ... of this outer step, until killed
    stall_marker: str | None = None  # a folder: ``stalled-<step>-<worker>`` appears there when it stalls
    onboard_lie_worker: str | None = None  # as the onboarding source, this worker ("*": any) sends other weights ...
    onboard_lies: int = 0  # ... the first this many times it is: one element moved by 1 ...
    onboard_lie: Literal["theta", "momentum"] = "theta"  # ... of theta_sync or of the momentum


def direction(seed: int, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The direction attack's fixed unit vector, one tensor per parameter (unit over all of them)."""
    g = torch.Generator().manual_seed(seed)
    u = [torch.randn(s, generator=g) for s in shapes]
    norm = math.sqrt(sum(float((t * t).sum()) for t in u))
    return [t / norm for t in u]


def stall_marker(folder: str | os.PathLike, step: int, worker: str) -> Path:
    return Path(folder) / f"stalled-{step}-{worker}"


class ScriptedFaults:
    """The ``intellect.diloco.faults.Faults`` a :class:`FaultPlan` describes."""

    def __init__(self, plan: FaultPlan, board: RendezvousStore | None = None):
        self.plan, self.board = plan, board  # board: the worker's own rendezvous client (plan_worker)
        self.lies_told = 0

    def _decide_plan(self, step: int, attempt: int, worker: str) -> None:
        # the plan race: the first compare_set on plan/<t>/<a> wins; whether anyone runs it is the question
        if self.plan.plan_worker == worker and self.board is not None:
            try:
                self.board.compare_set(PLAN(step, attempt), "", self.plan.plan)
            except Exception:  # noqa: BLE001 - refused (not a member of the attempt): the race is lost
                pass

    def pseudo_gradient(self, step: int, worker: str, pseudo: list[torch.Tensor]) -> None:
        p = self.plan
        self._decide_plan(step, 0, worker)  # before this worker marks ready: first on attempt 0
        if p.lie_worker == worker and p.lie == "direction":
            with torch.no_grad():
                norm = math.sqrt(sum(float((g * g).sum()) for g in pseudo))
                for g, u in zip(pseudo, direction(p.lie_seed, [g.shape for g in pseudo])):
                    g.add_(u, alpha=p.lie_scale * norm)
                if p.lie_keep_norm:
                    now = math.sqrt(sum(float((g * g).sum()) for g in pseudo))
                    for g in pseudo:
                        g.mul_(norm / now)
        elif p.lie_worker == worker:
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

    def ring(self, step: int, attempt: int, worker: str, rank: int) -> None:
        if self.plan.fail_ring == [step, attempt, worker, rank]:
            raise RuntimeError(f"injected: {worker}'s ring {rank} fails at step {step} attempt {attempt}")

    def onboarding_state(self, step: int, worker: str, flat: torch.Tensor) -> None:
        if self.plan.onboard_lie_worker in (worker, "*") and self.lies_told < self.plan.onboard_lies:
            self.lies_told += 1
            flat[0 if self.plan.onboard_lie == "theta" else (len(flat) - 2) // 2] += 1.0  # OuterState.flat's layout

    def before_allreduce(self, step: int, attempt: int, worker: str) -> None:
        p = self.plan
        self._decide_plan(step, attempt, worker)
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
    plan = FaultPlan.model_validate_json(args.faults)
    board = None
    if plan.plan_worker is not None:  # a client of the worker's own key, as any member could make
        w = parse_worker_args(rest)
        run = DilocoRunConfig.model_validate_json(Path(w.config).read_text())
        keys = load_credentials(w.worker, run.run_name, run.diloco.secret_file)
        host, port = w.store.rsplit(":", 1)
        if keys is not None:
            board = RendezvousStore(host, int(port), None, run.run_name, peer=w.worker, key=keys[0])
    # a worker's other ranks run the same faults (a liar lies on every shard)
    return main(rest, faults=ScriptedFaults(plan, board), prog="python -m diloco_faults",
                follower_argv=["-m", "diloco_faults", *argv])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
