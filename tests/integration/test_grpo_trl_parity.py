"""The GRPO loss against TRL's, run by a script in TRL's own virtual environment (benchmarks/peers/trl)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_parity_with_trl():
    """benchmarks/grpo_loss_parity.py against TRL's own _compute_loss, where its venv was set up."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks/peers/trl/venv/bin/python").exists():
        pytest.skip("no TRL venv: bash benchmarks/peers/trl/setup.sh")
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks/grpo_loss_parity.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "ALL PASS" in out.stdout, out.stdout + out.stderr
