"""The one place a flow hands work to another flow: here, or on a work pool through its deployment.

``dispatch(rl_generate, {"config": cfg, "step": 3, "worker": "w0"}, cfg.dispatch)`` either calls the
flow in this process (``mode = "local"``, a sub-flow run: the one-machine default) or starts a flow
run of its deployment with ``run_deployment`` and waits for it, up to ``timeout`` seconds
(``mode = "deployments"``: the deployment's work pool decides which machine runs it). The choice is
configuration, not code: callers never look at the mode. Results travel through run storage and
the ledger, never through Prefect's result store, so a remote stage returns its ``FlowRun``.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from prefect import Flow
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from intellect.config import DispatchConfig


class DispatchError(RuntimeError):
    """A dispatched flow run did not complete (failed, crashed, cancelled or timed out)."""


def deployment_name(flow: Flow, cfg: DispatchConfig) -> str:
    """``flow-name/deployment-name`` for ``flow`` (``prefect.yaml`` names each deployment like its flow)."""
    return cfg.deployments.get(flow.name, f"{flow.name}/{flow.name}")


def dispatch(flow: Flow, parameters: dict[str, Any], cfg: DispatchConfig) -> Any:
    """Run ``flow(**parameters)`` where ``cfg`` says; the flow's return value (local) or its FlowRun."""
    if cfg.mode == "local":
        return flow(**parameters)
    name = deployment_name(flow, cfg)
    run = run_deployment(name=name, parameters=parameters, timeout=cfg.timeout, poll_interval=cfg.poll_interval,
                         as_subflow=True)
    if not isinstance(run, FlowRun):  # a coroutine only when called from async code, which no caller is
        raise TypeError(f"dispatch() must be called from sync code; run_deployment gave {type(run).__name__}")
    state = run.state
    if state is None or not state.is_final():
        raise DispatchError(f"{name}: flow run {run.name} ({run.id}) did not finish within {cfg.timeout:.0f} s "
                            f"(state {state.name if state else 'unknown'})")
    if not state.is_completed():
        raise DispatchError(f"{name}: flow run {run.name} ({run.id}) ended {state.name}: {state.message or ''}")
    return run


def dispatch_many(flow: Flow, parameter_sets: Sequence[dict[str, Any]], cfg: DispatchConfig) -> list[Any]:
    """:func:`dispatch` for each parameter set at once (threads), in order; the first failure is raised."""
    if not parameter_sets:
        return []
    with ThreadPoolExecutor(len(parameter_sets), thread_name_prefix=f"dispatch-{flow.name}") as pool:
        futures = [pool.submit(contextvars.copy_context().run, dispatch, flow, p, cfg) for p in parameter_sets]
        return [f.result() for f in futures]
