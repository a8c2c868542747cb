"""RunStorage on local disk when its writer is SIGKILLed mid-step or mid-file (a writer subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_contract import CrashContract, run_until_ready_then_kill

from intellect.storage import RunStorage


@pytest.fixture
def store(tmp_path: Path) -> RunStorage:
    return RunStorage(f"file://{tmp_path}/runs/test")


class TestLocalCrash(CrashContract):
    pass


# Writes one big file but hangs at the fsync that precedes the rename.
_FILE_WRITER = r"""
import os, sys, time
from intellect.storage import RunStorage
url, ready = sys.argv[1], sys.argv[2]
def fsync(fd):
    open(ready, "w").close()
    time.sleep(120)
os.fsync = fsync
RunStorage(url).write_bytes("checkpoints/step_1/model.bin", b"x" * (8 << 20))
"""



def test_sigkill_mid_file_write_leaves_only_a_hidden_temp(store: RunStorage, tmp_path: Path) -> None:
    run_until_ready_then_kill(_FILE_WRITER, store.url, tmp_path)
    step_dir = Path(store.url.removeprefix("file://")) / "checkpoints" / "step_1"
    assert [p.name.startswith(".tmp-") for p in step_dir.iterdir()] == [True]
    assert store.listdir("checkpoints/step_1") == []
    assert not store.exists("checkpoints/step_1/model.bin")
    assert store.complete_steps("checkpoints") == []
    # the dead writer's step is older than the next complete one: retention clears it
    store.write_step(2, "checkpoints", {"model.bin": b"ok"})
    assert store.retain("checkpoints", 1) == [1]
    assert not step_dir.exists()
