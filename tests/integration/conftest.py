"""Shared integration fixtures: a real S3 API served by moto on 127.0.0.1, a bucket on it, a run folder in it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from intellect.storage import RunStorage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except OSError:
        return False
    return True


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _start_moto(log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start ``moto.server`` on a free port and return it with its URL once it answers HTTP."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            # most likely another process took the port between _free_port and bind
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        if _answers(url):
            return proc, url
        time.sleep(0.1)
    _stop(proc)
    raise TimeoutError(f"moto server did not answer on {url} within {timeout}s")


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL of a moto S3 server that lives for the whole test session."""
    log = tmp_path_factory.mktemp("moto") / "server.log"
    errors = []
    for _ in range(3):
        try:
            proc, url = _start_moto(log, timeout=30)
            break
        except (RuntimeError, TimeoutError) as e:
            errors.append(str(e))
    else:
        pytest.fail(f"could not start moto: {'; '.join(errors)}\n{log.read_text(errors='replace')[-4000:]}")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Dummy credentials and the moto endpoint in the environment (inherited by subprocesses)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    # keep the developer's ~/.aws out of it
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return moto_server


@pytest.fixture
def bucket(s3_env: str) -> str:
    """A fresh bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_storage(bucket: str) -> RunStorage:
    """A run folder in a fresh bucket of the moto server."""
    return RunStorage(f"s3://{bucket}/runs/test")
