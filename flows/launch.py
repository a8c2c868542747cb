"""``intellect.launch.Launcher`` over Prefect deployments: each launched process is a flow run on a work pool.

:class:`DeploymentLauncher` starts a flow run of a deployment as a child of the current flow run,
with parameters made from the launch's name and argument list (``parameters``), and the launch's
environment as the run's ``env`` job variable (readable by whoever holds the Prefect API
credential); :class:`FlowRunHandle` polls and stops it through the API. A flow run that completes
reads as exit code ``0``, a cancelled one as ``-SIGTERM``, any other final state as ``failed``.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable
from uuid import UUID

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType
from prefect.client.schemas.sorting import ArtifactSort
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Cancelling

from flows.dispatch import deployment_name
from intellect.config import DispatchConfig


@dataclass
class FlowRunHandle:
    """A launched flow run: polled through the API at most every ``poll_interval`` s; stopped by
    cancelling it, which its process worker turns into SIGTERM (then SIGKILL)."""

    name: str
    flow_run_id: UUID
    poll_interval: float
    failed: int = 1  # the exit code of a flow run that ended in any final state but completed or cancelled
    _code: int | None = None
    _polled: float = float("-inf")

    def poll(self) -> int | None:
        if self._code is None and time.monotonic() - self._polled >= self.poll_interval:
            self._polled = time.monotonic()
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
            if state is not None and state.is_final():
                self._code = 0 if state.is_completed() else -signal.SIGTERM if state.is_cancelled() else self.failed
        return self._code

    def terminate(self) -> None:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.flow_run_id).state
            if state is None or state.is_final() or state.is_cancelling():
                return
            # a run no process worker has picked up yet has nobody to stop it: cancelled at once
            waiting = state.is_scheduled() or state.is_pending()
            client.set_flow_run_state(self.flow_run_id, Cancelled() if waiting else Cancelling(), force=True)

    def kill(self) -> None:
        self.terminate()  # the process worker escalates to SIGKILL when SIGTERM is not enough

    def table_rows(self) -> list[dict[str, Any]]:
        """Every row of the table artifacts the flow run has created so far, oldest first (rows
        that are not JSON objects are left out)."""
        with get_client(sync_client=True) as client:
            arts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id]),
                                               type=ArtifactFilterType(any_=["table"])),
                sort=ArtifactSort.CREATED_DESC)
        return [row for a in reversed(arts) for row in _rows(a.data)]


def _rows(data: Any) -> list[dict[str, Any]]:
    """The rows of a table artifact's data (Prefect stores a list-of-rows table as its JSON text).

    >>> _rows('[{"a": 1}, 2]'), _rows("not json"), _rows(None)
    ([{'a': 1}], [], [])
    """
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError:
            return []
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


class DeploymentLauncher:
    """Each launch a flow run of ``flow``'s deployment (named as ``dispatch`` says), a child of the
    current flow run; ``parameters(name, args)`` turns a launch into the flow's parameters, and
    ``job_variables`` go with every launch (e.g. ``{"devices": 2}`` on a GPU pool)."""

    def __init__(self, flow: Flow, dispatch: DispatchConfig,
                 parameters: Callable[[str, Sequence[str]], dict[str, Any]], failed: int = 1,
                 job_variables: Mapping[str, Any] | None = None):
        self.flow, self.dispatch, self.parameters, self.failed = flow, dispatch, parameters, failed
        self.job_variables = dict(job_variables or {})

    def launch(self, name: str, args: Sequence[str], env: Mapping[str, str]) -> FlowRunHandle:
        variables = {**self.job_variables, **({"env": dict(env)} if env else {})}
        fr = run_deployment(name=deployment_name(self.flow, self.dispatch), timeout=0, as_subflow=True,
                            parameters=self.parameters(name, args), job_variables=variables or None)
        run_id = fr.id  # pyright: ignore[reportAttributeAccessIssue] - a FlowRun when called from sync code
        return FlowRunHandle(name, run_id, self.dispatch.poll_interval, failed=self.failed)
