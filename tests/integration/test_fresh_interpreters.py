"""What workers and validators compute independently must not depend on the process: the arithmetic
stream and the prompt assignment come out the same in a fresh interpreter, whatever its hash seed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from intellect.config import DataConfig
from intellect.data import batch_texts, train_stream
from intellect.rl.wire.assignment import assign_prompts

REPO = Path(__file__).resolve().parents[2]


def test_stream_is_stable_across_processes():
    code = (
        "from intellect.config import DataConfig; from intellect.data import train_stream, batch_texts;"
        "print(batch_texts(train_stream(DataConfig(seed=5)), 20))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(batch_texts(train_stream(DataConfig(seed=5)), 20))


def test_same_in_a_fresh_interpreter_with_another_hash_seed():
    code = "from intellect.rl.wire.assignment import assign_prompts as a; print(a(1000, 'w-1', 3, 2, 16))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env={"PYTHONHASHSEED": s}, capture_output=True, text=True, check=True
        ).stdout.strip()
        for s in ("0", "12345")
    }
    assert outs == {str(assign_prompts(1000, "w-1", 3, 2, 16))}
