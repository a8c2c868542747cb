"""Prefect events about DiLoCo members that the robust all-reduce caught (``intellect.diloco.robust``).

* ``intellect.diloco.member-flagged``: a majority of an outer step's members reported a worker's
  contributions as outliers (resource ``intellect.diloco.worker.<run>.<worker>``; payload: step,
  members).
* ``intellect.diloco.member-banned``: the worker was flagged in ``diloco.exclude_after`` committed
  steps and is left out of the run from the next boundary on (payload: step).

As with :mod:`flows.events`, an event that cannot be sent is logged by Prefect and dropped.
"""

from __future__ import annotations

from prefect.events import emit_event

FLAGGED = "intellect.diloco.member-flagged"
BANNED = "intellect.diloco.member-banned"


def member_resource(run: str, worker: str) -> dict[str, str]:
    return {"prefect.resource.id": f"intellect.diloco.worker.{run}.{worker}", "prefect.resource.name": worker,
            "intellect.run": run, "intellect.worker": worker}


def emit_outliers(run: str, step: int, metrics: list[dict]) -> list[str]:
    """Events for the workers flagged or banned in committed outer step ``step`` (``metrics``: the
    members' step reports; they agree, so the first one that says anything is used); the flagged."""
    report = next((m for m in metrics if m.get("flagged") or m.get("banned")), None)
    if report is None:
        return []
    members = report.get("members", [])
    for w in report.get("flagged", []):
        emit_event(FLAGGED, resource=member_resource(run, w), payload={"step": step, "members": members})
    for w in report.get("banned", []):
        emit_event(BANNED, resource=member_resource(run, w), payload={"step": step})
    return list(report.get("flagged", []))
