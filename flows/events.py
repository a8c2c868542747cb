"""Prefect events the flows emit, for the dashboard's event feed and for automations.

* ``intellect.rl.submissions.rejected``: a worker's submissions of a step had rejected samples
  (resource ``intellect.rl.worker.<run>.<worker>``; payload: step, accepted, rejected, rate).
* ``intellect.rl.worker.rejections-high``: the same, when the worker's rejection rate in the step
  reached ``RLRunConfig.alert_rejection_rate``; the automation ``intellect-worker-rejections``
  (``infra/automations.py``) reacts to it.
* ``intellect.diloco.membership-changed``: the members of a committed DiLoCo outer step differ
  from the previous one's (resource ``intellect.diloco.run.<run>``; payload: joined, left).

An event that cannot be sent is logged by Prefect and dropped: monitoring never fails a run.
"""

from __future__ import annotations

from prefect.events import emit_event

REJECTED = "intellect.rl.submissions.rejected"
REJECTIONS_HIGH = "intellect.rl.worker.rejections-high"
MEMBERSHIP = "intellect.diloco.membership-changed"


def worker_resource(run: str, worker: str) -> dict[str, str]:
    return {"prefect.resource.id": f"intellect.rl.worker.{run}.{worker}", "prefect.resource.name": worker,
            "intellect.run": run, "intellect.worker": worker}


def emit_rejections(run: str, step: int, counts: dict[str, tuple[int, int]], alert_rate: float) -> list[str]:
    """One event per worker with rejected samples in ``step`` (``counts``: worker -> (accepted, rejected)),
    plus the alert event where the rate reaches ``alert_rate``; the workers alerted."""
    alerted = []
    for worker, (accepted, rejected) in sorted(counts.items()):
        if not rejected:
            continue
        rate = rejected / (accepted + rejected)
        payload = {"step": step, "accepted": accepted, "rejected": rejected, "rate": round(rate, 4)}
        emit_event(REJECTED, resource=worker_resource(run, worker), payload=payload)
        if rate >= alert_rate:
            emit_event(REJECTIONS_HIGH, resource=worker_resource(run, worker),
                       payload=payload | {"threshold": alert_rate})
            alerted.append(worker)
    return alerted


def emit_membership(run: str, step: int, members: list[str], previous: list[str] | None) -> bool:
    """The membership event when ``members`` of outer step ``step`` differ from ``previous``."""
    if previous is None or set(members) == set(previous):
        return False
    emit_event(MEMBERSHIP, resource={"prefect.resource.id": f"intellect.diloco.run.{run}", "intellect.run": run},
               payload={"step": step, "members": sorted(members), "joined": sorted(set(members) - set(previous)),
                        "left": sorted(set(previous) - set(members))})
    return True
