"""Presigned S3 uploads of the submission service: workers upload without holding storage credentials.

A POST is presigned for one key and exactly the declared size (its policy conditions, which real S3
enforces); the declared sha256 is recorded, and the validator compares the object with it. Every POST
for a name expires with the window its first declaration opened (``presign_expiry``): the validator
reads the object once that window is over (``uploads_settled_at``), so a re-upload cannot follow it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from intellect.rl.service.admission import Refusal, UploadBody
from intellect.rl.service.registry import Registry, SubmissionRecord
from intellect.rl.wire.rollouts import submission_path

if TYPE_CHECKING:
    from intellect.storage import RunStorage


class Presigner:
    """Presigned POSTs into ``storage`` (an S3 run storage), with the run's own credentials."""

    def __init__(self, storage: RunStorage, registry: Registry, expiry: int) -> None:
        self.storage, self.registry, self.expiry = storage, registry, expiry
        self._client = _client(storage)

    def presign(self, worker: str, step: int, k: int, want: UploadBody, refill: bool = False) -> tuple[int, dict]:
        """``(status, {"url", "fields", "record"})``: a POST for the name of submission ``k``; the first
        declaration of a name records it, a retry must declare the same sha256 and size."""
        rel = submission_path(step, worker, k)
        old = self.registry.claim(step, worker, k, refill)
        if old is not None and (old.sha256, old.size) != (want.sha256, want.size):
            raise Refusal(409, "exists", f"{rel} was declared already, with another sha256 or size")
        if old is not None and not refill and worker in self.registry.done(step):
            raise Refusal(409, "finished", f"step {step} is finished: no new uploads")
        rec, now = None, time.time()
        left = self.expiry if old is None else int(old.time + self.expiry - now)
        if left < 1:
            raise Refusal(409, "closed", f"the upload window of {rel} is over")
        try:
            bucket, _, obj = self.storage.uri(rel).removeprefix("s3://").partition("/")
            post = self._client.generate_presigned_post(
                Bucket=bucket, Key=obj, Conditions=[["content-length-range", want.size, want.size]],
                ExpiresIn=left)
            rec = old if old is not None else SubmissionRecord(worker, step, k, rel, want.sha256, want.size, now)
            return (200 if old else 201), {"url": post["url"], "fields": post["fields"], "record": asdict(rec)}
        finally:
            if old is None:
                self.registry.release(step, worker, k, rec)


def _client(storage: RunStorage) -> Any:
    import boto3  # noqa: PLC0415 - only S3 runs need it

    fs = storage.fs  # the run's own S3 credentials: they never leave this process
    return boto3.client(
        "s3", endpoint_url=fs.endpoint_url, aws_access_key_id=fs.key, aws_secret_access_key=fs.secret,
        aws_session_token=getattr(fs, "token", None), region_name=(fs.client_kwargs or {}).get("region_name"))
