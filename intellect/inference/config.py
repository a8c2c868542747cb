"""How the torch engine batches generation (:class:`~intellect.inference.torch_engine.TorchEngine`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from intellect.config import StrictModel

Scheduling = Literal["continuous", "static"]


class EngineConfig(StrictModel):
    """Batching of :meth:`TorchEngine.generate`; none of it changes what a request decodes to
    beyond floating-point rounding (sampling noise depends only on seed and position)."""

    max_batch_size: int = Field(
        default=64, ge=1, le=4096,
        description="Most rows of one forward: requests decoding at once, and rows of a prefill batch.",
    )
    kv_budget_tokens: int | None = Field(
        default=None, ge=1, le=1 << 36,
        description="Bound on the KV cache, in tokens summed over rows: a request reserves len(prompt) + "
                    "max_tokens, and joins only while the running rows' reservations leave room for it (static: batches "
                    "are cut to fit). One request always runs, even alone over the bound. None: only max_batch_size "
                    "bounds it.",
    )
    scheduling: Scheduling = Field(
        default="continuous",
        description="continuous: a finished row leaves at once and a waiting request takes its slot; static: "
                    "fixed batches of similar prompt length, each decoding until its longest row ends (the baseline).",
    )
