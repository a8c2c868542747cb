"""``intellect smoke`` in a fresh process refuses a corpus that lacks its column: one line, exit code 2,
nothing started."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"content": f"def f{i}():\n    return {i}\n"}) + "\n" for i in range(40)))
    return path


def test_the_cli_prints_one_line_and_exits_2(tmp_path, corpus):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "smoke", "--config", "configs/pretrain-text.toml",
                          f'data.text.files=["{corpus}"]', f"model.tokenizer={tmp_path / 'tok'}",
                          f"storage.url=file://{tmp_path}/runs"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("intellect: data.text.files:") and "data.text.column" in lines[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tok").exists()  # nothing started
