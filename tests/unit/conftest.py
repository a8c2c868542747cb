"""Unit-test fixtures: a run on a real S3 API (the integration suite's moto server)."""

import importlib.util
import os
import uuid
from pathlib import Path

import boto3
import pytest

from intellect.storage import RunStorage


@pytest.fixture(scope="module")
def s3_storage(tmp_path_factory):
    """A run on a real S3 API: the integration suite's moto server on 127.0.0.1, stopped by PID."""
    path = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location("integration_conftest", path)
    assert spec is not None and spec.loader is not None
    moto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moto)
    proc, url = moto._start_moto(tmp_path_factory.mktemp("moto") / "server.log", timeout=30)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        bucket = f"test-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
        yield RunStorage(f"s3://{bucket}/runs/test", endpoint_url=url)
    finally:
        moto._stop(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
