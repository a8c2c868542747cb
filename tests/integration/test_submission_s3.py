"""The submission service over S3 (a moto server on 127.0.0.1, see conftest.py): workers upload with
presigned POSTs and hold no credentials; the service records the sha256 each worker declared.

moto 5 checks none of a POST policy's conditions (nor its signature): it stores any body, under any
key, that is POSTed to the bucket. Real S3 refuses a body outside ``content-length-range`` or under
another key; so these tests check the policy the service signs, and that whatever a store accepts
beyond it is caught by the sha256 the service recorded, the check the validator makes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest

from intellect.data.loaders import MathTask
from intellect.rl.service.registry import uploads_settled_at
from intellect.rl.wire.rollouts import RolloutLimits, RolloutRejected, load_submission, submission_path
from intellect.rl.service.server import ServiceConfig, SubmissionService
from intellect.rl.worker.client import ServiceClient, ServiceError
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.requests import sign_request

pytestmark = pytest.mark.slow  # a moto server and a worker subprocess

RUN = "run-s3"
TASKS = [MathTask(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(16)]


@pytest.fixture
def service(bucket: str, tmp_path: Path):
    svc = SubmissionService(ServiceConfig(max_body_bytes=1 << 20), run=RUN,
                            storage=RunStorage(f"s3://{bucket}/runs/{RUN}"), state_dir=tmp_path / "state",
                            run_info=lambda: {"run": RUN}, tasks=TASKS, prompts_per_submission=2)
    svc.start()
    yield svc
    svc.stop()


def _object(s3_env: str, bucket: str, rel: str) -> bytes:
    return boto3.client("s3", endpoint_url=s3_env).get_object(Bucket=bucket, Key=f"runs/{RUN}/{rel}")["Body"].read()


def _presign(svc: SubmissionService, key: SigningKey, step: int, k: int, sha: str, size: int) -> httpx.Response:
    body = json.dumps({"sha256": sha, "size": size}).encode()
    path = f"/v1/uploads/{step}/{k}"
    return httpx.post(svc.url + path, content=body, headers=sign_request(key, "POST", path, body, audience=RUN),
                      timeout=10)


_WORKER = """
import json, os, sys
from intellect.rl.worker.client import ServiceClient
from intellect.trust.keys import SigningKey
assert not [v for v in os.environ if v.startswith("AWS_")], "the worker must hold no storage credentials"
key = SigningKey.from_seed(bytes.fromhex(sys.argv[2]))
with ServiceClient(sys.argv[1], key, audience=sys.argv[3], timeout=10) as c:
    c.register()
    rec = c.submit(0, 0, b"rollouts of a credential-less worker")
    c.finish(0, [rec.path], 0)
    print(json.dumps({"path": rec.path, "status": c.status(0)}))
"""


def test_a_worker_without_credentials_uploads_by_presigned_post(service, bucket: str, s3_env: str) -> None:
    key = SigningKey.generate()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out = subprocess.run([sys.executable, "-c", _WORKER, service.url, key.seed().hex(), RUN], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got == {"path": submission_path(0, key.public.id, 0),
                   "status": {"step": 0, "submissions": [0], "done": True}}
    data = b"rollouts of a credential-less worker"
    assert _object(s3_env, bucket, got["path"]) == data
    (rec,) = service.submissions(0)
    assert (rec.sha256, rec.size, rec.worker) == (hashlib.sha256(data).hexdigest(), len(data), key.public.id)


def test_the_presigned_policy_pins_the_key_and_the_exact_size(service, bucket: str) -> None:
    c = ServiceClient(service.url, SigningKey.generate(), audience=RUN, retries=0)
    c.register()
    r = _presign(service, c.key, 1, 3, "ab" * 32, 1234)
    assert r.status_code == 201
    answer = r.json()
    policy = json.loads(base64.b64decode(answer["fields"]["policy"]))
    key = f"runs/{RUN}/{submission_path(1, c.worker, 3)}"
    assert answer["fields"]["key"] == key
    assert {"bucket": bucket} in policy["conditions"] and {"key": key} in policy["conditions"]
    assert ["content-length-range", 1234, 1234] in policy["conditions"]
    assert not [cond for cond in policy["conditions"] if isinstance(cond, list) and cond[0] == "starts-with"]
    expires = time.mktime(time.strptime(policy["expiration"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert 0 < expires - time.time() <= 900 + 5
    assert answer["record"]["sha256"] == "ab" * 32 and answer["record"]["size"] == 1234
    assert [k for k in answer["fields"] if "secret" in k.lower()] == []


def test_what_the_store_accepts_beyond_the_policy_is_caught_by_the_recorded_sha(service, bucket: str,
                                                                                 s3_env: str) -> None:
    c = ServiceClient(service.url, SigningKey.generate(), audience=RUN, retries=0)
    c.register()
    declared = b"the declared submission"
    answer = _presign(service, c.key, 0, 0, hashlib.sha256(declared).hexdigest(), len(declared)).json()
    rel = submission_path(0, c.worker, 0)
    # a body of another size under the presigned key (real S3: 400 EntityTooLarge / EntityTooSmall)
    r = httpx.post(answer["url"], data=answer["fields"], files={"file": ("f", b"something else entirely")})
    if r.status_code < 300:  # moto stores it
        (rec,) = service.submissions(0)
        assert hashlib.sha256(_object(s3_env, bucket, rel)).hexdigest() != rec.sha256
        with pytest.raises(RolloutRejected) as e:  # the validator's read, with what the service recorded
            load_submission(service.storage, rel, RolloutLimits(vocab_size=100), sha256=rec.sha256, size=rec.size)
        assert e.value.reason in ("sha256_mismatch", "size_mismatch")
    # the same policy with another key (real S3: 403, the policy names the key)
    other = submission_path(0, "k" + "0" * 20, 0)
    r = httpx.post(answer["url"], data=answer["fields"] | {"key": f"runs/{RUN}/{other}"},
                   files={"file": ("f", declared)})
    if r.status_code < 300:  # moto stores it, but no record names it: the trainer never reads it
        assert other not in [s.path for s in service.submissions(0)]
    assert [s.path for s in service.submissions(0)] == [rel]


def test_declarations_are_write_once(service) -> None:
    c = ServiceClient(service.url, SigningKey.generate(), audience=RUN, retries=0)
    c.register()
    sha = hashlib.sha256(b"x").hexdigest()
    assert _presign(service, c.key, 0, 0, sha, 1).status_code == 201
    assert _presign(service, c.key, 0, 0, sha, 1).status_code == 200  # the same again: a fresh POST
    for args, status, reason in [((0, 0, "cd" * 32, 1), 409, "exists"), ((0, 0, sha, 2), 409, "exists"),
                                 ((0, 1, sha, 2 << 20), 413, "too_large"), ((0, 1, "XY" * 32, 1), 400, "bad_request"),
                                 ((0, 1, sha, 0), 400, "bad_request"), ((9, 0, sha, 1), 409, "too_far_ahead")]:
        r = _presign(service, c.key, *args)
        assert (r.status_code, r.json()["reason"]) == (status, reason), args
    path = "/v1/submissions/0/1"
    r = httpx.put(service.url + path, content=b"x", headers=sign_request(c.key, "PUT", path, b"x", audience=RUN))
    assert (r.status_code, r.json()["reason"]) == (400, "wrong_mode")
    c.finish(0, [submission_path(0, c.worker, 0)], 0)
    with pytest.raises(ServiceError) as e:
        c.submit(0, 0, b"x")  # even the declared bytes: the step is finished
    assert e.value.reason == "finished"
    assert len(service.submissions(0)) == 1


def test_presigned_uploads_keep_to_open_steps_and_the_byte_quota(bucket: str, tmp_path: Path) -> None:
    service = SubmissionService(ServiceConfig(max_body_bytes=1 << 20, max_worker_step_bytes=3 << 20), run=RUN,
                                storage=RunStorage(f"s3://{bucket}/runs/{RUN}"), state_dir=tmp_path / "state",
                                run_info=lambda: {"run": RUN}, tasks=TASKS, prompts_per_submission=2)
    service.start()
    try:
        c = ServiceClient(service.url, SigningKey.generate(), audience=RUN, retries=0)
        c.register()
        sha = hashlib.sha256(b"x").hexdigest()
        assert _presign(service, c.key, 1, 0, sha, 1 << 20).status_code == 201
        service.set_committed(1)
        r = _presign(service, c.key, 1, 1, sha, 1)  # a committed step takes no new declarations
        assert (r.status_code, r.json()["reason"]) == (409, "closed")
        for k in range(3):  # declared bytes count like stored ones
            assert _presign(service, c.key, 2, k, sha, 1 << 20).status_code == 201
        assert _presign(service, c.key, 2, 0, sha, 1 << 20).status_code == 200  # a repeat is not charged
        r = _presign(service, c.key, 2, 3, sha, 1)
        assert (r.status_code, r.json()["reason"]) == (413, "quota")
        assert [x["reason"] for x in service.refusals()] == ["closed", "quota"]
    finally:
        service.stop()


def test_a_name_cannot_be_uploaded_after_the_window_its_declaration_opened(bucket: str, tmp_path: Path) -> None:
    """A presigned POST can be reused until it expires; a second ask for the same name must not open
    a new window, or a worker could rewrite its file after the validator read it."""
    svc = SubmissionService(ServiceConfig(presign_expiry=3), run=RUN, storage=RunStorage(f"s3://{bucket}/runs/{RUN}"),
                            state_dir=tmp_path / "state", run_info=lambda: {"run": RUN}, tasks=TASKS,
                            prompts_per_submission=2)
    svc.start()
    try:
        c = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, retries=0)
        c.register()

        def expiry(answer: dict) -> float:
            policy = json.loads(base64.b64decode(answer["fields"]["policy"]))
            return time.mktime(time.strptime(policy["expiration"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone

        first = _presign(svc, c.key, 0, 0, "cd" * 32, 10)
        assert first.status_code == 201
        time.sleep(1.2)
        again = _presign(svc, c.key, 0, 0, "cd" * 32, 10)
        assert again.status_code == 200
        assert expiry(again.json()) <= expiry(first.json())  # the same window, not a fresh one
        (rec,) = svc.submissions(0)
        assert uploads_settled_at([rec], svc.cfg.presign_expiry) >= expiry(first.json())
        time.sleep(3)
        late = _presign(svc, c.key, 0, 0, "cd" * 32, 10)
        assert late.status_code == 409 and late.json()["reason"] == "closed"
    finally:
        svc.stop()
