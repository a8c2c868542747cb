"""The automation the cluster ships: tell someone when a worker's rejection rate passes the threshold.

``intellect-worker-rejections`` fires on every ``intellect.rl.worker.rejections-high`` event (emitted
by the RL flows when a worker's share of rejected samples in a step reaches
``RLRunConfig.alert_rejection_rate``), once per worker resource. Its action calls the webhook block
``intellect-alerts`` (Slack, a pager, any HTTP endpoint) with the run, worker, step and rate; with no
webhook configured it only records the trigger, which the dashboard's Automations page shows.
``python -m infra.cluster up --alert-webhook URL`` (or ``INTELLECT_ALERT_WEBHOOK``) creates both.
"""

from __future__ import annotations

from collections.abc import Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from pydantic import SecretStr

if TYPE_CHECKING:
    from prefect.events.actions import ActionTypesOrUnknown

T = TypeVar("T")

NAME = "intellect-worker-rejections"
WEBHOOK_BLOCK = "intellect-alerts"
EVENT = "intellect.rl.worker.rejections-high"  # flows.events.REJECTIONS_HIGH (infra does not import flows)
PAYLOAD = (
    '{"automation": "' + NAME + '", "event": "{{ event.event }}", '
    '"run": "{{ event.resource.get(\'intellect.run\') }}", "worker": "{{ event.resource.get(\'intellect.worker\') }}", '
    '"step": {{ event.payload.step }}, "rate": {{ event.payload.rate }}, "threshold": {{ event.payload.threshold }}}'
)


def _synced(value: T | Coroutine[Any, Any, T]) -> T:
    """The result of one of Prefect's sync-or-async methods, called from sync code (where it is never
    a coroutine: they return one only inside a running event loop or an async flow)."""
    if isinstance(value, Coroutine):
        value.close()
        raise TypeError("create_automations() must be called from sync code")
    return value


def create_automations(webhook_url: str | None = None) -> UUID:
    """Create (or replace) the automation, and its webhook block when ``webhook_url`` is given; its id.
    Runs against the API in the current Prefect settings."""
    # Prefect takes seconds to import: only `up` needs it, not `python -m infra.cluster status/down`.
    from prefect.automations import Automation  # noqa: PLC0415 - heavy, only for `up` (see above)
    from prefect.blocks.webhook import Webhook  # noqa: PLC0415 - heavy, only for `up`
    from prefect.events.actions import CallWebhook, DoNothing  # noqa: PLC0415 - heavy, only for `up`
    from prefect.events.schemas.automations import EventTrigger, Posture  # noqa: PLC0415 - heavy, only for `up`

    actions: list[ActionTypesOrUnknown]
    if webhook_url:
        webhook = Webhook(url=SecretStr(webhook_url), method="POST", allow_private_urls=True)
        block_id = _synced(webhook.save(WEBHOOK_BLOCK, overwrite=True))
        actions = [CallWebhook(block_document_id=block_id, payload=PAYLOAD)]
    else:
        actions = [DoNothing()]
    try:
        _synced(Automation.read(name=NAME)).delete()
    except ValueError:  # not there yet
        pass
    automation = _synced(Automation(
        name=NAME,
        description="A worker's share of rejected samples in an RL step reached RLRunConfig.alert_rejection_rate.",
        trigger=EventTrigger(expect={EVENT}, match={"prefect.resource.id": "intellect.rl.worker.*"},
                             for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1,
                             within=timedelta(0)),
        actions=actions,
    ).create())
    if automation.id is None:
        raise RuntimeError(f"the API created automation {NAME} without an id")
    return automation.id
