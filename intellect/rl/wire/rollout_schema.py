"""What a rollout is: one sample row, its Parquet schema, the bounds it must respect, its content hash.

Every row is one sample; the rows of one submission file (:mod:`intellect.rl.wire.rollouts`) share run,
step, policy step, worker and ``k``. Schema version 1 (:data:`SCHEMA`, version in the schema metadata
under :data:`VERSION_KEY`), no column nullable unless said:

===============  ==============  =============================================================
column           type            meaning
===============  ==============  =============================================================
run              string          run name
step             int64           training step the sample is for
policy_step      int64           checkpoint that generated it (see :mod:`intellect.rl.wire.lag`)
worker           string          canonical worker id
submission       int64           ``k``: index of this submission of the worker at this step
seed             uint64          sampling seed of the sample
prompt_id        string          task id of the prompt
group_id         int32           GRPO group within the submission; group ``j`` answers the
                                 ``j``-th assigned prompt (:mod:`intellect.rl.wire.assignment`)
prompt_tokens    list<int32>     prompt token ids (a :class:`Tokens` once read)
output_tokens    list<int32>     completion token ids (a :class:`Tokens` once read)
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
from typing import Any, Iterator, Literal, Sequence, get_args, overload

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
    """Bounds a submission must respect; everything outside them is rejected, not clipped.

    **Memory.** Reading one file holds at most ``max_file_bytes`` of it and its decoded columns, at
    most ``max_decoded_bytes`` by an estimate made from its verified page headers before anything is
    decompressed (rows keep views of those columns, never a Python object per token). With the
    defaults one file takes at most 512 MiB while it is read (256 MiB raw plus 256 MiB decoded), and
    the validator reads ``workers.validate_parallel`` files at once (4 by default): 2 GiB in all, a
    quarter of an 8 GiB validator, one worker's file at most a sixteenth.
    """

    vocab_size: int = Field(..., ge=1, le=2**31 - 1, description="Token ids must lie in [0, vocab_size).")
    max_rows: int = Field(default=4096, ge=1, le=1 << 20, description="Most samples in one submission.")
    max_prompt_tokens: int = Field(default=32768, ge=1, le=1 << 22, description="Longest prompt, in tokens.")
    max_output_tokens: int = Field(default=32768, ge=1, le=1 << 22, description="Longest completion, in tokens.")
    max_proof_bytes: int = Field(
        default=1 << 20, ge=0, le=1 << 30, description="Largest TOPLOC proof of one sample (258 bytes per 32 tokens)."
    )
    max_file_bytes: int = Field(default=256 << 20, ge=1024, le=1 << 40, description="Largest file, as stored.")
    max_decoded_bytes: int = Field(
        default=256 << 20, ge=1024, le=1 << 40,
        description="Largest size the file may decode to in memory (decompressed pages plus decoded arrays), "
        "estimated before decoding; about 8 bytes a token.",
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


class Tokens(Sequence[int]):
    """The token ids of one sample as read from a file: an immutable view of the decoded int32 column.

    Four bytes a token and no Python object per token (a tuple of ints takes nine times as much), so
    a read submission takes about what its decoded columns take, which the reader bounds before it
    decodes (``RolloutLimits.max_decoded_bytes``). It equals, and hashes like, the tuple of its ids:

    >>> t = Tokens([5, 6, 7])
    >>> t == (5, 6, 7), t[1:] == [6, 7], t[-1], hash(t) == hash((5, 6, 7)), t
    (True, True, 7, True, (5, 6, 7))
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: Sequence[int] | np.ndarray = ()) -> None:
        arr = np.asarray(ids, dtype=np.int32)
        if arr.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
        view = arr.view()  # a view of its own, so that read-only says nothing about the owner's array
        view.flags.writeable = False
        self._ids = view

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Tokens: ...
    def __getitem__(self, i: int | slice) -> int | Tokens:
        if isinstance(i, slice):
            return Tokens(self._ids[i])
        return int(self._ids[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __contains__(self, x: object) -> bool:
        return isinstance(x, (int, np.integer)) and bool((self._ids == x).any())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Tokens):
            return np.array_equal(self._ids, other._ids)
        if not isinstance(other, (tuple, list)):
            return NotImplemented
        if len(other) != len(self._ids):
            return False
        try:
            ids = np.asarray(other)
        except (ValueError, OverflowError):
            return False
        return ids.dtype.kind in "iub" and np.array_equal(self._ids, ids)

    def __hash__(self) -> int:
        return hash(tuple(self._ids.tolist()))

    def __repr__(self) -> str:
        return repr(tuple(self._ids.tolist()))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self._ids if dtype is None else self._ids.astype(dtype)

    def __reduce__(self) -> tuple:
        return Tokens, (np.array(self._ids),)


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
    prompt_tokens: Sequence[int]  # a tuple when built, a Tokens view when read
    output_tokens: Sequence[int]
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


TOKEN_COLUMNS = ("prompt_tokens", "output_tokens")


def rows_to_table(rows: Sequence[Rollout]) -> pa.Table:
    """The rows as a table of :data:`SCHEMA` (``TypeError``/``ArrowInvalid`` on ill-typed values)."""
    cols = [_token_column([getattr(r, f.name) for r in rows]) if f.name in TOKEN_COLUMNS
            else pa.array([getattr(r, f.name) for r in rows], type=f.type) for f in SCHEMA]
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def _token_column(values: list[Sequence[int]]) -> pa.Array:
    if not all(isinstance(v, Tokens) for v in values):
        return pa.array([tuple(v) for v in values], type=pa.list_(pa.int32()))
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate([np.asarray(v) for v in values]) if values else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat, type=pa.int32()))


def token_views(column: pa.Array | pa.ChunkedArray) -> list[Tokens]:
    """One :class:`Tokens` per row of a ``list<int32>`` column without nulls, viewing its buffers (no copy)."""
    chunks: list[Any] = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[Tokens] = []
    for chunk in chunks:  # pa.ListArray (pyarrow-stubs type a chunk as a plain Array)
        if chunk.null_count:
            raise ValueError("null token lists")
        offsets = chunk.offsets.to_numpy()  # absolute positions in .values, slicing included
        values = chunk.values.to_numpy(zero_copy_only=not chunk.values.null_count)
        out += [Tokens(values[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return out


def table_to_rows(table: pa.Table) -> list[Rollout]:
    """The table's rows; token columns become :class:`Tokens` views of the table's buffers."""
    cols: dict[str, list[Any]] = {name: token_views(table[name]) if name in TOKEN_COLUMNS else table[name].to_pylist()
            for name in SCHEMA.names}
    return [Rollout(**{name: cols[name][i] for name in SCHEMA.names}) for i in range(table.num_rows)]
