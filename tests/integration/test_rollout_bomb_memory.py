"""Rollout files built to exhaust the reader's memory, each parsed in a fresh Python process.

The child reports its peak resident set (``VmHWM``) just before and just after the parse: the growth
must stay under 64 MiB for a refused file, and under the layout's decoding estimate (at most
``max_decoded_bytes``) plus 64 MiB for an accepted one, whatever the test process itself holds. The
bombs are built in tests/rollout_files.py; tests/unit/test_rollout_bombs.py checks the reasons in
this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_files import BOMBS, LIMITS, make_rows

from intellect.rl.wire.rollouts import (
    REASONS, SCHEMA, RolloutLimits, RolloutRejected, check_layout, encode_submission, read_submission, rows_to_table,
)

REPO = Path(__file__).resolve().parents[2]
MAX_GROWTH = 64 << 20

# Parses one file in a fresh interpreter: warm up on an honest file, then measure the bomb alone.
CHILD = r"""
import json, sys
from intellect.rl.wire.rollouts import RolloutLimits, RolloutRejected, read_submission
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
limits = RolloutLimits.model_validate_json(sys.argv[3])
read_submission(open(sys.argv[1], "rb").read(), limits)
data = open(sys.argv[2], "rb").read()
before = hwm()
try:
    rows = read_submission(data, limits)
    reason = "accepted:%d" % len(rows)
except RolloutRejected as e:
    reason = e.reason
print(json.dumps({"reason": reason, "growth": hwm() - before}))
"""


def parse_in_child(tmp_path: Path, data: bytes, limits: RolloutLimits) -> tuple[str, int]:
    honest, bomb = tmp_path / "honest.parquet", tmp_path / "bomb.parquet"
    honest.write_bytes(encode_submission(make_rows()))
    bomb.write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(honest), str(bomb), limits.model_dump_json()],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["reason"], got["growth"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BOMBS))
def test_bomb_is_rejected_within_a_memory_bound(tmp_path, name):
    build, limits = BOMBS[name]
    data = build()
    assert len(data) < limits.max_file_bytes
    reason, growth = parse_in_child(tmp_path, data, limits)
    assert reason in REASONS, reason
    assert growth < MAX_GROWTH, f"{name}: peak RSS grew by {growth / 2**20:.1f} MiB"
    with pytest.raises(RolloutRejected) as e:  # the same verdict in this process
        read_submission(data, limits)
    assert e.value.reason == reason


def test_honest_files_load_unchanged_and_cheaply(tmp_path):
    rows = [replace(r, reward=0.5, output_tokens=tuple(range(1, 13)), proof=bytes(range(256)) * 2)
            for r in make_rows(16)]
    data = encode_submission(rows)
    reason, growth = parse_in_child(tmp_path, data, LIMITS)
    assert reason == "accepted:16" and growth < MAX_GROWTH
    assert read_submission(data, LIMITS) == rows


def constant_tokens_file(path: Path, rows: int = 4096, tokens: int = 32000, per_group: int = 256) -> bytes:
    """``rows`` samples of ``tokens`` equal output tokens each: a few KB on disk, ~0.5 GB of int32 decoded."""
    one = rows_to_table(make_rows(1))
    values = pa.array(np.full(per_group * tokens, 31999, dtype=np.int32))
    chunk = {f.name: pa.concat_arrays([one[f.name].combine_chunks()] * per_group) for f in SCHEMA}
    chunk["output_tokens"] = pa.ListArray.from_arrays(pa.array(np.arange(per_group + 1, dtype=np.int32) * tokens),
                                                      values)
    table = pa.Table.from_arrays([chunk[f.name] for f in SCHEMA], schema=SCHEMA)
    with pq.ParquetWriter(path, SCHEMA, compression="zstd") as writer:
        for _ in range(rows // per_group):
            writer.write_table(table)
    return path.read_bytes()


@pytest.mark.slow
def test_a_file_within_every_limit_is_read_within_its_decoding_estimate(tmp_path):
    """4,096 rows of 32,000 tokens, vocabulary 32,000: every limit of the reader's defaults but the
    decoded size (1 GiB admits it), so it is read, within its estimate; the defaults refuse it."""
    data = constant_tokens_file(tmp_path / "wide.parquet")
    assert len(data) < 64 << 10
    admits = RolloutLimits(vocab_size=32000, max_decoded_bytes=1 << 30)
    estimate = check_layout(data, pq.ParquetFile(pa.BufferReader(data)).metadata, admits)
    reason, growth = parse_in_child(tmp_path, data, admits)
    assert reason == "accepted:4096"
    # the rows view the decoded int32 columns (0.5 GB): Python ints would take 9 times as much
    assert growth < estimate + MAX_GROWTH, f"peak RSS grew by {growth / 2**20:.0f} MiB, estimate {estimate >> 20} MiB"
    reason, growth = parse_in_child(tmp_path, data, RolloutLimits(vocab_size=32000))
    assert reason == "too_large" and growth < MAX_GROWTH, (reason, growth)
