"""The automation the cluster ships: tell someone when a worker's rejection rate passes the threshold.

``intellect-worker-rejections`` fires on every ``intellect.rl.worker.rejections-high`` event (emitted
by the RL flows when a worker's share of rejected samples in a step reaches
``RLRunConfig.alert_rejection_rate``), once per worker resource. Its action calls the webhook block
``intellect-alerts`` (Slack, a pager, any HTTP endpoint) with the run, worker, step and rate; with no
webhook configured it only records the trigger, which the dashboard's Automations page shows.
``python -m infra.cluster up --alert-webhook URL`` (or ``INTELLECT_ALERT_WEBHOOK``) creates both.
"""

from __future__ import annotations

from uuid import UUID

NAME = "intellect-worker-rejections"
WEBHOOK_BLOCK = "intellect-alerts"
EVENT = "intellect.rl.worker.rejections-high"  # flows.events.REJECTIONS_HIGH (infra does not import flows)
PAYLOAD = (
    '{"automation": "' + NAME + '", "event": "{{ event.event }}", '
    '"run": "{{ event.resource.get(\'intellect.run\') }}", "worker": "{{ event.resource.get(\'intellect.worker\') }}", '
    '"step": {{ event.payload.step }}, "rate": {{ event.payload.rate }}, "threshold": {{ event.payload.threshold }}}'
)


def create_automations(webhook_url: str | None = None) -> UUID:
    """Create (or replace) the automation, and its webhook block when ``webhook_url`` is given; its id.
    Runs against the API in the current Prefect settings."""
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.events.actions import CallWebhook, DoNothing
    from prefect.events.schemas.automations import EventTrigger, Posture

    if webhook_url:
        block_id = Webhook(url=webhook_url, method="POST", allow_private_urls=True).save(WEBHOOK_BLOCK, overwrite=True)
        actions = [CallWebhook(block_document_id=block_id, payload=PAYLOAD)]
    else:
        actions = [DoNothing()]
    try:
        Automation.read(name=NAME).delete()
    except ValueError:  # not there yet
        pass
    automation = Automation(
        name=NAME,
        description="A worker's share of rejected samples in an RL step reached RLRunConfig.alert_rejection_rate.",
        trigger=EventTrigger(expect={EVENT}, match={"prefect.resource.id": "intellect.rl.worker.*"},
                             for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1, within=0),
        actions=actions,
    ).create()
    return automation.id
