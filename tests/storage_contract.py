"""What every ``RunStorage`` backend must do, as test classes a backend's test module subclasses.

A subclass provides a ``store`` fixture rooted in an empty run: ``StorageContract`` needs nothing else
(tests/unit/test_storage_local.py, tests/integration/test_storage_s3.py); ``CrashContract`` SIGKILLs a
writer process, so only integration tests use it (test_storage_local_crash.py, test_storage_s3.py).
Imported by name (tests/ is on sys.path); tests/conftest.py registers it for assertion rewriting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from intellect.storage import STABLE, RunStorage

REPO = Path(__file__).resolve().parents[1]

# Writes a two-file step but hangs before the second file: the parent SIGKILLs it there.
_STEP_WRITER = r"""
import sys, time
from intellect.storage import RunStorage
url, ready = sys.argv[1], sys.argv[2]
original, calls = RunStorage.write_bytes, []
def write_bytes(self, rel, data):
    calls.append(rel)
    if len(calls) == 2:
        open(ready, "w").close()
        time.sleep(120)
    original(self, rel, data)
RunStorage.write_bytes = write_bytes
RunStorage(url).write_step(4, "checkpoints", {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000})
"""


def run_until_ready_then_kill(script: str, url: str, tmp_path: Path, timeout: float = 60) -> None:
    """Run ``script url ready`` in a subprocess, wait for it to touch ``ready``, then SIGKILL it."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, url, str(ready)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None:
                pytest.fail(f"writer exited early ({proc.returncode}): {proc.stdout.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail(f"writer not ready after {timeout}s")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


def make_tree(root: Path) -> dict[str, bytes]:
    files = {"config.json": b'{"a": 1}', "weights/model.safetensors": os.urandom(300_000), "weights/deep/x": b""}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class StorageContract:
    """Backend-independent behaviour; needs a ``store`` fixture rooted in an empty run."""

    def test_bytes_and_text_round_trip(self, store: RunStorage) -> None:
        store.write_bytes("a/b/c.bin", b"\x00\x01")
        store.write_text("notes.txt", "héllo")
        assert store.read_bytes("a/b/c.bin") == b"\x00\x01"
        assert store.read_text("notes.txt") == "héllo"
        store.write_bytes("a/b/c.bin", b"")
        assert store.read_bytes("a//b/./c.bin") == b""
        with pytest.raises(FileNotFoundError):
            store.read_bytes("missing.bin")

    def test_listdir_exists_delete(self, store: RunStorage) -> None:
        assert store.listdir() == [] and store.listdir("nowhere") == []
        store.write_bytes("d/x", b"1")
        store.write_bytes("d/sub/y", b"2")
        store.write_bytes("top", b"3")
        assert store.listdir() == ["d", "top"]
        assert store.listdir("d") == ["sub", "x"]
        assert store.exists("d") and store.exists("d/sub/y") and not store.exists("d/z")
        with pytest.raises(IsADirectoryError):
            store.delete("d")
        store.delete("top")
        store.delete("d", recursive=True)
        assert not store.exists("d") and not store.exists("top")
        with pytest.raises(FileNotFoundError):
            store.delete("top")

    def test_uri(self, store: RunStorage) -> None:
        assert store.uri("a/b") == store.url + "/a/b"
        assert store.uri("") == store.url

    def test_put_and_get_file_streamed(self, store: RunStorage, tmp_path: Path) -> None:
        src = tmp_path / "src.bin"
        src.write_bytes(os.urandom(3 << 20))
        store.put_file(src, "blobs/big.bin")
        dst = tmp_path / "out" / "big.bin"
        store.get_file("blobs/big.bin", dst)
        assert dst.read_bytes() == src.read_bytes()
        assert [p.name for p in dst.parent.iterdir()] == ["big.bin"]
        with pytest.raises(FileNotFoundError):
            store.get_file("blobs/missing.bin", tmp_path / "out" / "missing.bin")
        assert not (tmp_path / "out" / "missing.bin").exists()

    def test_put_and_get_dir(self, store: RunStorage, tmp_path: Path) -> None:
        files = make_tree(tmp_path / "ckpt")
        assert store.put_dir(tmp_path / "ckpt", "checkpoints/step_1") == sorted(files)
        dest = tmp_path / "dl" / "ckpt"
        store.get_dir("checkpoints/step_1", dest)
        assert read_tree(dest) == files
        # a second download replaces the folder as a whole and leaves no temp folders behind
        store.write_bytes("checkpoints/step_1/config.json", b"{}")
        store.get_dir("checkpoints/step_1", dest)
        assert read_tree(dest) == {**files, "config.json": b"{}"}
        assert [p.name for p in dest.parent.iterdir()] == ["ckpt"]
        with pytest.raises(FileNotFoundError):
            store.get_dir("checkpoints/step_9", tmp_path / "dl" / "none")
        assert not (tmp_path / "dl" / "none").exists()

    def test_steps_listing_and_marker(self, store: RunStorage, tmp_path: Path) -> None:
        assert store.complete_steps("checkpoints") == [] and store.latest_step("checkpoints") is None
        make_tree(tmp_path / "ckpt")
        for step in (10, 2, 1):
            store.write_step(step, "checkpoints", {"model": tmp_path / "ckpt", "meta.json": b"{}"})
        store.write_bytes("checkpoints/step_11/meta.json", b"{}")  # in progress: no STABLE
        store.write_bytes("checkpoints/notes.txt", b"not a step")
        store.write_bytes("checkpoints/step_x/meta.json", b"{}")
        store.write_step(5, "rollouts", {"r.parquet": b"p"})
        assert store.complete_steps("checkpoints") == [1, 2, 10]
        assert store.latest_step("checkpoints") == 10
        assert store.complete_steps("rollouts") == [5]
        assert store.is_stable(10, "checkpoints") and not store.is_stable(11, "checkpoints")
        marker = json.loads(store.read_text(f"{store.step_path(10, 'checkpoints')}/{STABLE}"))
        assert marker["step"] == 10 and marker["kind"] == "checkpoints" and marker["time"]
        assert marker["files"] == {
            "meta.json": 2, "model/config.json": 8, "model/weights/deep/x": 0, "model/weights/model.safetensors": 300_000
        }

    def test_write_step_never_rewrites_a_stable_step(self, store: RunStorage) -> None:
        store.write_step(1, "rollouts", {"r": b"v1"})
        with pytest.raises(FileExistsError):
            store.write_step(1, "rollouts", {"r": b"v2"})
        assert store.read_bytes("rollouts/step_1/r") == b"v1"
        with pytest.raises(ValueError, match="STABLE"):
            store.write_step(2, "rollouts", {STABLE: b"{}"})
        with pytest.raises(TypeError):
            store.write_step(2, "rollouts", {"r": "text is ambiguous"})
        with pytest.raises(FileNotFoundError):
            store.mark_stable(3, "rollouts")

    def test_crash_before_stable_leaves_step_invisible(self, store: RunStorage, monkeypatch) -> None:
        def crash(*_args, **_kwargs):
            raise RuntimeError("power cut")

        monkeypatch.setattr(store, "mark_stable", crash)
        with pytest.raises(RuntimeError):
            store.write_step(3, "checkpoints", {"a": b"a", "b": b"b"})
        assert store.exists("checkpoints/step_3/b")
        assert store.complete_steps("checkpoints") == [] and not store.is_stable(3, "checkpoints")
        monkeypatch.undo()
        store.write_step(3, "checkpoints", {"a": b"a", "b": b"b"})  # a retry completes it
        assert store.complete_steps("checkpoints") == [3]

    def test_retention(self, store: RunStorage) -> None:
        assert store.retain("checkpoints", 2) == []
        store.write_bytes("checkpoints/step_0/a", b"leftover of a crash")
        for step in range(1, 7):
            store.write_step(step, "checkpoints", {"a": b"%d" % step})
        store.write_bytes("checkpoints/step_3/extra", b"x")
        store.write_bytes("checkpoints/step_7/a", b"being written")
        store.write_step(1, "rollouts", {"r": b"r"})
        assert store.retain("checkpoints", 2) == [0, 1, 2, 3, 4]
        assert store.complete_steps("checkpoints") == [5, 6]
        assert store.listdir("checkpoints") == ["step_5", "step_6", "step_7"]
        assert store.read_bytes("checkpoints/step_7/a") == b"being written"
        assert store.complete_steps("rollouts") == [1]
        assert store.retain("checkpoints", 2) == []
        assert store.retain("checkpoints", 5) == []
        with pytest.raises(ValueError):
            store.retain("checkpoints", 0)

    def test_retention_matches_whole_step_names(self, store: RunStorage) -> None:
        for step in (1, 10, 11):
            store.write_step(step, "ck", {"a": b"%d" % step})
        assert store.retain("ck", 2) == [1]
        assert store.complete_steps("ck") == [10, 11]
        assert store.read_bytes("ck/step_10/a") == b"10"

    def test_concurrent_reader_never_sees_partial_content(self, store: RunStorage) -> None:
        size, versions = 1 << 19, 12
        store.write_bytes("hot.bin", bytes([0]) * size)
        seen: set[int] = set()
        errors: list[str] = []
        done = threading.Event()

        def reader() -> None:
            while not done.is_set():
                data = store.read_bytes("hot.bin")
                if len(data) != size or data.count(data[:1]) != size:
                    errors.append(f"torn read: {len(data)} bytes")
                    return
                seen.add(data[0])

        def wait_seen(v: int) -> None:
            # the reader must be mid-loop while each write happens, or there is nothing to race
            deadline = time.monotonic() + 10
            while v not in seen and not errors and time.monotonic() < deadline:
                time.sleep(0.001)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for v in range(1, versions):
                wait_seen(v - 1)
                store.write_bytes("hot.bin", bytes([v]) * size)
            wait_seen(versions - 1)
        finally:
            done.set()
            thread.join(timeout=60)
        assert not errors
        assert seen == set(range(versions))
        assert store.read_bytes("hot.bin") == bytes([versions - 1]) * size


class CrashContract:
    """A writer SIGKILLed mid-step leaves nothing a reader takes for complete; needs a ``store`` fixture."""

    def test_sigkill_mid_step_leaves_no_stable(self, store: RunStorage, tmp_path: Path) -> None:
        run_until_ready_then_kill(_STEP_WRITER, store.url, tmp_path)
        assert store.read_bytes("checkpoints/step_4/a.bin") == b"a" * 1000
        assert not store.exists("checkpoints/step_4/b.bin")
        assert not store.is_stable(4, "checkpoints")
        assert store.complete_steps("checkpoints") == [] and store.latest_step("checkpoints") is None
