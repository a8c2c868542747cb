"""RunStorage against a real S3 API (a moto server on 127.0.0.1, see conftest.py).

The backend-independent contracts of tests/storage_contract.py run here unchanged with an S3
``store`` fixture.
"""

from __future__ import annotations

import socket
import time
import uuid

import boto3
import pytest
from storage_contract import CrashContract, StorageContract

from intellect.config import StorageConfig
from intellect.storage import RunStorage

# ~10 s in all: a moto server, a fresh S3 client per test, a writer subprocess
pytestmark = pytest.mark.slow


@pytest.fixture
def store(s3_storage: RunStorage) -> RunStorage:
    return s3_storage


class TestS3Contract(StorageContract, CrashContract):
    pass


def test_objects_land_under_the_run_prefix(store: RunStorage, bucket: str, s3_env: str) -> None:
    store.write_step(2, "checkpoints", {"m.bin": b"m"})
    listed = boto3.client("s3", endpoint_url=s3_env).list_objects_v2(Bucket=bucket)
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "runs/test/checkpoints/step_2/STABLE",
        "runs/test/checkpoints/step_2/m.bin",
    ]
    assert store.uri("checkpoints/step_2") == f"s3://{bucket}/runs/test/checkpoints/step_2"


def test_a_bounded_read_refuses_a_larger_object(store: RunStorage) -> None:
    store.write_bytes("a/blob", b"x" * 100)
    assert store.read_bytes("a/blob", 100) == b"x" * 100
    with pytest.raises(ValueError, match="over 99 bytes"):
        store.read_bytes("a/blob", 99)


def test_from_config_credentials_override_env(
    bucket: str, s3_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = StorageConfig(url=f"s3://{bucket}/runs/", endpoint_url=s3_env, key="cfg-key", secret="cfg-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    store = RunStorage.from_config(cfg, "smoke")
    assert store.url == f"s3://{bucket}/runs/smoke"
    assert (store.fs.endpoint_url, store.fs.key, store.fs.secret) == (s3_env, "cfg-key", "cfg-secret")
    assert "cfg-secret" not in repr(store)
    store.write_step(0, "checkpoints", {"m": b"m"})
    assert store.complete_steps("checkpoints") == [0]


def test_env_credentials_and_no_shared_instances(bucket: str, s3_env: str, monkeypatch) -> None:
    a = RunStorage(f"s3://{bucket}/r")
    assert (a.fs.endpoint_url, a.fs.key) == (s3_env, "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    b = RunStorage(f"s3://{bucket}/r")
    assert a.fs is not b.fs and b.fs.endpoint_url == "http://127.0.0.1:9"
    a.write_bytes("x", b"1")
    assert a.read_bytes("x") == b"1"


@pytest.mark.usefixtures("s3_env")
def test_missing_bucket_is_a_clear_error() -> None:
    store = RunStorage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/r")
    with pytest.raises(FileNotFoundError, match="bucket"):
        store.write_bytes("x", b"1")


@pytest.mark.usefixtures("s3_env")
def test_unresponsive_endpoint_times_out() -> None:
    # a socket that completes TCP handshakes (backlog) but never answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        store = RunStorage(
            "s3://bucket-x/r", endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.25, retries=1
        )
        start = time.monotonic()
        with pytest.raises(Exception, match="(?i)timeout|timed out"):
            store.read_bytes("x")
        assert time.monotonic() - start < 15
