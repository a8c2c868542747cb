"""The online filter's request for more submissions of a step, as the service's status answer carries it.

``GET /v1/status?step=N`` answers a worker with a :class:`StepStatus`. While the trainer holds too few
validated samples with signal for step ``N`` (:mod:`intellect.rl.trainer.online_filter`), it opens
rounds of assignment: ``refill`` is the number of the newest one (0: none). A worker that has not yet
answered round ``refill`` of an open step adds its next submission (the next ``k`` of the existing
assignment protocol, drawn from its salt as every other one), also after its done record, until its
submissions reach the run's ``max_submissions`` (:func:`owes_submission`). The worker's claims count
for nothing: the trainer counts the validator's verdicts.

    >>> s = StepStatus(step=3, submissions=[0], done=True, open=True, refill=2)
    >>> owes_submission(s, answered=1, max_submissions=4), owes_submission(s, answered=2, max_submissions=4)
    (True, False)
    >>> owes_submission(s.model_copy(update={"open": False}), answered=0, max_submissions=4)
    False
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StepStatus(BaseModel):
    """What the service holds of the calling worker at a step, and whether the step wants more."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="The step asked about.")
    submissions: list[int] = Field(max_length=1 << 16, description="The worker's stored submission indices.")
    done: bool = Field(description="Whether the worker's done record of the step is stored.")
    open: bool = Field(default=True, description="Whether the step still takes submissions (not committed).")
    refill: int = Field(
        default=0, ge=0, le=1 << 20,
        description="The online filter's newest round of assignment at this step (0: none asked).",
    )


def owes_submission(status: StepStatus, answered: int, max_submissions: int) -> bool:
    """Whether a worker that answered rounds up to ``answered`` of ``status.step`` adds a submission now."""
    return status.open and status.refill > answered and len(status.submissions) < max_submissions
