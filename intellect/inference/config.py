"""Which inference engine a process generates with, and how it batches
(:func:`~intellect.inference.engines.make_engine`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from intellect.config import StrictModel

Scheduling = Literal["continuous", "static"]
#: torch: :class:`~intellect.inference.torch_engine.TorchEngine`, in the project's environment; vllm:
#: :class:`~intellect.inference.vllm_engine.VllmEngine`, in its own environment (``.venv-vllm``).
EngineKind = Literal["torch", "vllm"]


class EngineConfig(StrictModel):
    """The engine (``kind``) and its batching; none of the batching changes what a request decodes to
    beyond floating-point rounding (sampling noise depends only on seed and position)."""

    kind: EngineKind = Field(
        default="torch",
        description="torch: the project's own engine; vllm: vLLM (paged attention, CUDA graphs), which needs the "
                    "vLLM environment (`make venv-vllm`). Proofs of either pass the same torch validator.",
    )
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
                    "fixed batches of similar prompt length, each decoding until its longest row ends (the baseline). "
                    "torch only: vllm always batches continuously.",
    )
