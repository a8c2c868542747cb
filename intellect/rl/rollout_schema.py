"""What a rollout is: one sample row, its Parquet schema, the bounds it must respect, its content hash.

Every row is one sample; the rows of one submission file (:mod:`intellect.rl.rollouts`) share run,
step, policy step, worker and ``k``. Schema version 1 (:data:`SCHEMA`, version in the schema metadata
under :data:`VERSION_KEY`), no column nullable unless said:

===============  ==============  =============================================================
column           type            meaning
===============  ==============  =============================================================
run              string          run name
step             int64           training step the sample is for
policy_step      int64           checkpoint that generated it (see :mod:`intellect.rl.lag`)
worker           string          canonical worker id
submission       int64           ``k``: index of this submission of the worker at this step
seed             uint64          sampling seed of the sample
prompt_id        string          task id of the prompt
group_id         int32           GRPO group within the submission; group ``j`` answers the
                                 ``j``-th assigned prompt (:mod:`intellect.rl.assignment`)
prompt_tokens    list<int32>     prompt token ids
output_tokens    list<int32>     completion token ids
finish_reason    string          ``stop`` (EOS) or ``length`` (hit the token limit)
reward           float32         reward trained on (task reward minus length penalty)
task_reward      float32         verifier's reward
length_penalty   float32         thinking-budget penalty
advantage        float32         group-normalized advantage
target_length    int32, null     thinking budget in tokens; null without a length reward
proof            binary          TOPLOC proofs of the output (may be empty)
===============  ==============  =============================================================

Anything off-contract is a :class:`RolloutRejected`, whose ``reason`` is one of :data:`REASONS`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Literal, Sequence, get_args

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from intellect.config import StrictModel

SCHEMA_VERSION = 1
VERSION_KEY = b"intellect.rollouts.schema_version"
FINISH_REASONS = ("stop", "length")
MAX_ID_CHARS = 256

Reason = Literal[
    "unreadable", "too_large", "version", "schema", "empty", "nan", "range", "identity", "wrong_step", "stale",
    "sha256_mismatch", "size_mismatch",
]
REASONS: tuple[str, ...] = get_args(Reason)

SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("policy_step", pa.int64(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("submission", pa.int64(), nullable=False),
        pa.field("seed", pa.uint64(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("group_id", pa.int32(), nullable=False),
        pa.field("prompt_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("output_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("task_reward", pa.float32(), nullable=False),
        pa.field("length_penalty", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("target_length", pa.int32(), nullable=True),
        pa.field("proof", pa.binary(), nullable=False),
    ],
    metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


class RolloutRejected(ValueError):
    """A submission that breaks the contract; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: Reason, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RolloutLimits(StrictModel):
    """Bounds a submission must respect; everything outside them is rejected, not clipped."""

    vocab_size: int = Field(..., ge=1, le=2**31 - 1, description="Token ids must lie in [0, vocab_size).")
    max_rows: int = Field(default=4096, ge=1, le=1 << 20, description="Most samples in one submission.")
    max_prompt_tokens: int = Field(default=32768, ge=1, le=1 << 22, description="Longest prompt, in tokens.")
    max_output_tokens: int = Field(default=32768, ge=1, le=1 << 22, description="Longest completion, in tokens.")
    max_proof_bytes: int = Field(
        default=1 << 20, ge=0, le=1 << 30, description="Largest TOPLOC proof of one sample (258 bytes per 32 tokens)."
    )
    max_file_bytes: int = Field(default=256 << 20, ge=1024, le=1 << 40, description="Largest file, as stored.")
    max_decoded_bytes: int = Field(
        default=1 << 30, ge=1024, le=1 << 40,
        description="Largest size the file may decode to in memory (decompressed pages plus decoded arrays).",
    )
    reward_min: float = Field(default=-10.0, ge=-1e6, le=1e6, description="Lowest allowed reward and task reward.")
    reward_max: float = Field(default=10.0, ge=-1e6, le=1e6, description="Highest allowed reward and task reward.")
    max_abs_advantage: float = Field(default=100.0, gt=0, le=1e6, description="Largest allowed |advantage|.")
    max_abs_length_penalty: float = Field(default=100.0, ge=0, le=1e6, description="Largest allowed |length penalty|.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "RolloutLimits":
        if self.reward_min >= self.reward_max:
            raise ValueError(f"reward_min ({self.reward_min}) must be < reward_max ({self.reward_max})")
        return self


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sample: a row of a rollout file (columns as in the module docstring)."""

    run: str
    step: int
    policy_step: int
    worker: str
    submission: int
    seed: int
    prompt_id: str
    group_id: int
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    finish_reason: str
    reward: float
    task_reward: float
    length_penalty: float
    advantage: float
    target_length: int | None = None
    proof: bytes = b""

    @property
    def content_hash(self) -> str:
        return content_hash(self.prompt_tokens, self.output_tokens, self.seed)


assert [f.name for f in fields(Rollout)] == SCHEMA.names


def content_hash(prompt_tokens: Sequence[int], output_tokens: Sequence[int], seed: int) -> str:
    """Hex sha256 of what a sample *is*: its seed, prompt and output tokens, nothing about who sent it.

    Two submissions with the same content hash are copies (honest workers draw different seeds);
    changing the seed to disguise a copy is the sampling check's job, not this hash's. The lengths are
    hashed too, so tokens cannot move between prompt and output unnoticed:

    >>> content_hash([1, 2], [3], 7) == content_hash([1], [2, 3], 7), len(content_hash([1], [2], 0))
    (False, 64)
    """
    h = hashlib.sha256(b"intellect/rollout-content/v1\0")
    h.update(int(seed).to_bytes(8, "big"))
    for tokens in (prompt_tokens, output_tokens):
        arr = np.asarray(tokens, dtype="<i4")
        h.update(len(arr).to_bytes(8, "big"))
        h.update(arr.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------- rows <-> tables


def rows_to_table(rows: Sequence[Rollout]) -> pa.Table:
    """The rows as a table of :data:`SCHEMA` (``TypeError``/``ArrowInvalid`` on ill-typed values)."""
    cols = [pa.array([getattr(r, f.name) for r in rows], type=f.type) for f in SCHEMA]
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def table_to_rows(table: pa.Table) -> list[Rollout]:
    out = []
    for d in table.to_pylist():
        d["prompt_tokens"] = tuple(d["prompt_tokens"])
        d["output_tokens"] = tuple(d["output_tokens"])
        out.append(Rollout(**d))
    return out
