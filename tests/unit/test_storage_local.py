"""RunStorage on local disk.

``StorageContract`` (tests/storage_contract.py) is the behaviour every backend must have; the crash
tests, which SIGKILL a writer process, are in tests/integration/test_storage_local_crash.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from storage_contract import StorageContract, read_tree

from intellect.config import StorageConfig
from intellect.storage import RunStorage, normalize_rel, parse_step, split_url


@pytest.fixture
def store(tmp_path: Path) -> RunStorage:
    return RunStorage(f"file://{tmp_path}/runs/test")


class TestLocalContract(StorageContract):
    pass


# ------------------------------------------------------------------ local specifics


def test_temp_files_are_hidden_and_not_published(store: RunStorage, tmp_path: Path) -> None:
    store.write_bytes("checkpoints/step_1/a", b"a")
    step_dir = Path(store.url.removeprefix("file://")) / "checkpoints" / "step_1"
    (step_dir / ".tmp-stray").write_bytes(b"junk")
    (step_dir.parent / ".tmp-step_9").mkdir()
    marker = store.mark_stable(1, "checkpoints")
    assert marker["files"] == {"a": 1}
    assert store.listdir("checkpoints/step_1") == ["STABLE", "a"]
    assert store.listdir("checkpoints") == ["step_1"]
    assert store.complete_steps("checkpoints") == [1]
    store.get_dir("checkpoints/step_1", tmp_path / "dl")
    assert sorted(read_tree(tmp_path / "dl")) == ["STABLE", "a"]


def test_failed_write_keeps_old_content_and_no_temp(store: RunStorage, monkeypatch) -> None:
    store.write_bytes("f", b"old")

    def broken_replace(_src, _dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.write_bytes("f", b"new")
    monkeypatch.undo()
    root = Path(store.url.removeprefix("file://"))
    assert [p.name for p in root.iterdir()] == ["f"]
    assert store.read_bytes("f") == b"old"


@pytest.mark.parametrize(
    "rel", ["../other", "a/../../b", "/etc/passwd", ".tmp-x", "a/.tmp-y/b", "a/*", "w?", "a\\b", "", "/"]
)
def test_bad_relative_paths_raise(store: RunStorage, rel: str) -> None:
    with pytest.raises(ValueError):
        store.write_bytes(rel, b"x")
    with pytest.raises(ValueError):
        normalize_rel(rel)


def test_relative_paths_are_normalized() -> None:
    assert normalize_rel("a//b/./c/") == "a/b/c"
    assert normalize_rel("", allow_empty=True) == ""
    with pytest.raises(TypeError):
        normalize_rel(Path("a"))  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["gs://bucket/x", "http://host/x", "s3://", "s3:///x", "file://", ""])
def test_bad_urls_raise(url: str) -> None:
    with pytest.raises(ValueError):
        RunStorage(url)


def test_url_forms(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert split_url("s3://bucket/a/b/") == ("s3", "bucket/a/b")
    assert RunStorage("runs/x").url == RunStorage("file://./runs/x").url == f"file://{tmp_path}/runs/x"
    assert RunStorage(f"file://{tmp_path}/r/").url == f"file://{tmp_path}/r"
    with pytest.raises(ValueError):
        RunStorage("s3://bucket/a/../b")


def test_parse_step_and_step_path(store: RunStorage) -> None:
    assert [parse_step(n) for n in ["step_0", "step_7", "step_12", "step_07", "step_-1", "step_ 1", "step_1x", "STABLE"]] == [
        0, 7, 12, None, None, None, None, None
    ]
    assert store.step_path(3, "checkpoints") == "checkpoints/step_3"
    for bad in (-1, True, "3", 1.0):
        with pytest.raises(ValueError):
            store.step_path(bad, "checkpoints")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.step_path(1, "../x")


def test_from_config_defaults_to_runs_folder_in_cwd(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = RunStorage.from_config(StorageConfig(), "smoke")
    assert store.url == f"file://{tmp_path}/runs/smoke"
    store.write_step(0, "checkpoints", {"m": b"m"})
    monkeypatch.chdir("/")  # the root was resolved once, at construction
    assert (tmp_path / "runs/smoke/checkpoints/step_0/STABLE").is_file()
    assert store.complete_steps("checkpoints") == [0]
    bare = RunStorage.from_config(StorageConfig(url=str(tmp_path / "elsewhere")), "r")
    assert bare.url == f"file://{tmp_path}/elsewhere/r"
    for bad in ("a/b", "..", "", ".tmp-r"):
        with pytest.raises(ValueError):
            RunStorage.from_config(StorageConfig(), bad)


def test_a_bounded_read_refuses_a_larger_file(store: RunStorage) -> None:
    store.write_bytes("a/blob", b"x" * 100)
    assert store.read_bytes("a/blob", 100) == b"x" * 100
    with pytest.raises(ValueError, match="over 99 bytes"):
        store.read_bytes("a/blob", 99)
