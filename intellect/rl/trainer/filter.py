"""The offline difficulty filter (INTELLECT-2): sample ``k`` answers per prompt with the current
model and keep the prompts it solves sometimes but not often (pass rate in ``[1/8, 4/8]`` by
default): those are the ones whose GRPO groups carry signal.

Sample ``j`` of prompt ``p`` is drawn with the seed :func:`filter_seed` ``(seed, p, j)``, so a
chunk scored twice (a retried task) gives the same counts, and any chunking gives the same result.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import TYPE_CHECKING, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from intellect.data.loaders import task_row
from intellect.inference.protocol import Request
from intellect.inference.sampling import MAX_SEED, SamplingParams
from intellect.rl.worker.submission import (CodeTaskReward, RewardFn, completion_text, math_task_reward, prompt_tokens,
                                     task_rewards)

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.inference.protocol import InferenceEngine
    from intellect.rl.config import FilterConfig

# ``task``: the task as its task file row (loaders.task_row), as JSON
SCHEMA = pa.schema([("prompt_id", pa.string()), ("prompt", pa.string()), ("task", pa.string()),
                    ("k", pa.int32()), ("solved", pa.int32()), ("kept", pa.bool_())])


def filter_seed(seed: int, prompt_id: str, j: int) -> int:
    """Seed of sample ``j`` of ``prompt_id``: the first 8 bytes of sha256, top bit cleared.

    >>> filter_seed(0, "1+2", 0) == filter_seed(0, "1+2", 0) != filter_seed(0, "1+2", 1)
    True
    """
    msg = b"intellect/filter-seed/v1\0" + seed.to_bytes(8, "big") + prompt_id.encode() + b"\0" + j.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") & MAX_SEED


def solve_counts(engine: InferenceEngine, tokenizer, tasks: Sequence[Task], cfg: FilterConfig,
                 reward_fn: RewardFn = math_task_reward) -> list[int]:
    """How many of ``cfg.k`` samples of each task earn reward 1 (one batched ``generate`` call)."""
    reqs = [Request(prompt_tokens(tokenizer, t, cfg.prompt), filter_seed(cfg.seed, t.id, j)) for t in tasks for j in range(cfg.k)]
    outs = engine.generate(reqs, SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens))
    texts, each = [completion_text(tokenizer, o.tokens) for o in outs], [t for t in tasks for _ in range(cfg.k)]
    # the operator's own model needs no per-file budget; code rows share the sandbox pool
    if isinstance(reward_fn, CodeTaskReward):
        rewards = task_rewards(reward_fn, texts, each)
    else:
        rewards = [reward_fn(c, t) for c, t in zip(texts, each)]
    hits = [r >= 1.0 for r in rewards]
    return [sum(hits[i * cfg.k:(i + 1) * cfg.k]) for i in range(len(tasks))]


def scores_table(tasks: Sequence[Task], counts: Sequence[int], cfg: FilterConfig) -> pa.Table:
    return pa.table({
        "prompt_id": [t.id for t in tasks], "prompt": [t.prompt for t in tasks],
        "task": [json.dumps(task_row(t), ensure_ascii=False) for t in tasks],
        "k": pa.array([cfg.k] * len(tasks), pa.int32()), "solved": pa.array(list(counts), pa.int32()),
        "kept": [cfg.keeps(n) for n in counts],
    }, schema=SCHEMA)


def to_parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def from_parquet(data: bytes) -> pa.Table:
    table = pq.read_table(io.BytesIO(data))
    if not table.schema.equals(SCHEMA):
        raise ValueError(f"not a filter score file: schema {table.schema}")
    return table


def kept_tasks_jsonl(table: pa.Table) -> str:
    """The kept prompts as a task file of their kind (``load_tasks`` reads it back)."""
    return "".join(f"{row}\n" for row in table.filter(table["kept"])["task"].to_pylist())


def histogram(counts: Sequence[int], k: int) -> list[int]:
    """How many prompts were solved 0, 1, ..., k times.

    >>> histogram([0, 1, 1, 8], 8)
    [1, 2, 0, 0, 0, 0, 0, 0, 1]
    """
    h = [0] * (k + 1)
    for n in counts:
        h[n] += 1
    return h
