"""The DuckDB ledger across processes: a writer killed inside a transaction, another process holding the file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from ledger_rows import counts, verdicts

from intellect.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"  # where the child imports ledger_rows from


_KILLED_WRITER = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from ledger_rows import verdicts
from intellect.ledger import Ledger
ledger = Ledger(sys.argv[1])
ledger.record_verdicts(1, verdicts(2))
def die(con, now):
    os._exit(3)  # the process dies inside the transaction, after the rollouts insert
Ledger._touch_workers = staticmethod(die)
ledger.record_verdicts(1, verdicts(4, worker="w2", seed0=10))
"""


def test_killed_process_leaves_only_committed_steps(tmp_path):
    path = tmp_path / "l.duckdb"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path), str(TESTS)], cwd=REPO)
    assert proc.returncode == 3
    ledger = Ledger(path)
    assert counts(ledger) == [(1, "accepted", None, 2)]
    assert ledger.record_verdicts(1, verdicts(4, worker="w2", seed0=10)).inserted == 4


_LOCK_HOLDER = r"""
import sys, time, duckdb
con = duckdb.connect(sys.argv[1])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.close()
"""


def test_waits_for_another_process_holding_the_file(tmp_path):
    path = tmp_path / "l.duckdb"
    with Ledger(path) as ledger:
        ledger.record_verdicts(1, verdicts(1))
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(path), "0.7"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(duckdb.IOException):
            Ledger(path, lock_timeout=0.1)
        t0 = time.monotonic()
        assert ledger.record_verdicts(1, verdicts(3)).inserted == 2  # reopened once the holder let go
        assert time.monotonic() - t0 > 0.2
    finally:
        holder.wait(timeout=10)
    ledger.close()
