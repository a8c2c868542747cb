"""Rollout files built to exhaust the reader's memory, each parsed in a fresh Python process.

The child reports its peak resident set (``VmHWM``) just before and just after the parse: the growth
must stay under 64 MiB, whatever the test process itself holds. The bombs are built in
tests/rollout_files.py; tests/unit/test_rollout_bombs.py checks the reasons in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rollout_files import BOMBS, LIMITS, make_rows

from intellect.rl.rollouts import REASONS, RolloutLimits, RolloutRejected, encode_submission, read_submission

REPO = Path(__file__).resolve().parents[2]
MAX_GROWTH = 64 << 20

# Parses one file in a fresh interpreter: warm up on an honest file, then measure the bomb alone.
CHILD = r"""
import json, sys
from intellect.rl.rollouts import RolloutLimits, RolloutRejected, read_submission
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
