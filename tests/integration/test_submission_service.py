"""The submission service on a real uvicorn socket (127.0.0.1), with real keys and local run storage:
the honest round trip, then each attack of a worker, each refused with its reason and nothing stored."""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from intellect.data.loaders import MathTask
from intellect.rl.assignment import assign_prompts
from intellect.rl.rollouts import submission_path
from intellect.rl.service import ServiceConfig, SubmissionService
from intellect.rl.service_client import ServiceClient, ServiceError
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.requests import sign_request

RUN = "run-a"
TASKS = [MathTask(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(64)]
INFO = {"run": RUN, "steps": 3, "async_level": 2}


@pytest.fixture
def make_service(tmp_path: Path):
    started: list[SubmissionService] = []

    def make(run_info=lambda: INFO, **cfg) -> SubmissionService:
        svc = SubmissionService(ServiceConfig(**cfg), run=RUN, storage=RunStorage(str(tmp_path / "run")),
                                state_dir=tmp_path / "state", run_info=run_info, tasks=TASKS,
                                prompts_per_submission=4)
        svc.start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


def _stored(tmp_path: Path) -> list[str]:
    root = tmp_path / "run"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _raw(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None, *,
         chunks=None) -> tuple[int, dict]:
    """One request on its own connection, ``path`` sent verbatim (httpx would normalize it), the body
    whole or as ``chunks`` (chunked, stopped once the service answers); the JSON answer. The service
    closes the connection after a refusal, perhaps mid-body: what it answered is read all the same."""
    u = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"host: {u.hostname}", "connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if chunks is not None:
        head.append("transfer-encoding: chunked")
    elif "content-length" not in (headers or {}):
        head.append(f"content-length: {len(body)}")
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    try:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            if chunks is None:
                sock.sendall(body)
            else:
                for c in chunks:
                    if select.select([sock], [], [], 0)[0]:
                        break
                    sock.sendall(b"%x\r\n" % len(c) + c + b"\r\n")
                else:
                    sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the service closed the connection: its answer is still in the receive queue
        answer = b""
        try:
            while piece := sock.recv(1 << 16):
                answer += piece
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    status, _, rest = answer.partition(b"\r\n\r\n")
    return int(status.split()[1]), json.loads(rest)


def _signed(url: str, key: SigningKey, method: str, path: str, body: bytes = b"", *, send_method: str | None = None,
            send_path: str | None = None, send_body: bytes | None = None, **sign) -> tuple[int, dict]:
    headers = sign_request(key, method, path, body, audience=sign.pop("audience", RUN), **sign)
    return _raw(url, send_method or method, send_path or path, body if send_body is None else send_body, headers)


def _client(svc: SubmissionService, key: SigningKey | None = None) -> ServiceClient:
    c = ServiceClient(svc.url, key or SigningKey.generate(), audience=RUN, timeout=10, retries=0)
    c.register()
    return c


def test_honest_round_trip(make_service, tmp_path: Path) -> None:
    svc = make_service()
    key = SigningKey.generate()
    with ServiceClient(svc.url, key, audience=RUN, timeout=10) as c:
        assert c.register() == key.public.id == c.register()  # idempotent
        assert c.run_info() == INFO
        want = [TASKS[i] for i in assign_prompts(len(TASKS), key.public.id, 1, 0, 4)]
        assert c.assignment(1, 0) == [{"id": t.id, "prompt": t.prompt, "answer": t.answer} for t in want]
        assert c.status(1) == {"step": 1, "submissions": [], "done": False}
        rec = c.submit(1, 0, b"parquet bytes")
        assert (rec.worker, rec.step, rec.k, rec.size) == (key.public.id, 1, 0, 13)
        assert rec.path == submission_path(1, key.public.id, 0)
        assert rec.sha256 == hashlib.sha256(b"parquet bytes").hexdigest()
        assert c.submit(1, 0, b"parquet bytes") == rec  # a retry answers what is stored
        c.finish(1, [rec.path], 0)
        c.finish(1, [rec.path], 0)
        assert c.status(1) == {"step": 1, "submissions": [0], "done": True}
    assert (tmp_path / "run" / rec.path).read_bytes() == b"parquet bytes"
    assert svc.submissions(1) == [rec] and svc.workers() == [key.public.id]
    assert svc.done(1)[key.public.id].files == [rec.path] and svc.done(1)[key.public.id].policy_step == 0
    assert svc.worker_key(key.public.id) == key.public.hex
    assert _raw(svc.url, "GET", "/v1/health") == (200, {"ok": True, "run": RUN})


def test_signature_attacks_are_refused_and_store_nothing(make_service, tmp_path: Path) -> None:
    svc = make_service()
    key = SigningKey.generate()
    _client(svc, key)
    put = "/v1/submissions/0/0"
    cases = {
        "unsigned": (_raw(svc.url, "PUT", put, b"x"), 401, "unsigned"),
        "tampered body": (_signed(svc.url, key, "PUT", put, b"x", send_body=b"y"), 401, "bad_signature"),
        "tampered path": (_signed(svc.url, key, "PUT", put, b"x", send_path="/v1/submissions/0/1"), 401, "bad_signature"),
        "tampered method": (_signed(svc.url, key, "POST", "/v1/uploads/0/0", b"x", send_method="PUT",
                                    send_path=put), 401, "bad_signature"),
        "stale": (_signed(svc.url, key, "PUT", put, b"x", now=time.time() - 120), 401, "stale"),
        "future": (_signed(svc.url, key, "PUT", put, b"x", now=time.time() + 120), 401, "stale"),
        "another run": (_signed(svc.url, key, "PUT", put, b"x", audience="run-b"), 401, "bad_signature"),
        "unregistered key": (_signed(svc.url, SigningKey.generate(), "PUT", put, b"x"), 403, "not_registered"),
        "unregistered done": (_signed(svc.url, SigningKey.generate(), "POST", "/v1/done/0", b"{}"), 403,
                              "not_registered"),
    }
    for name, ((status, doc), want_status, want_reason) in cases.items():
        assert (status, doc["reason"]) == (want_status, want_reason), name
        assert doc["detail"], name
    assert _stored(tmp_path) == [] and svc.submissions(0) == []
    assert [r["reason"] for r in svc.refusals()] == [reason for _, _, reason in cases.values()]  # each recorded


def test_a_captured_request_cannot_be_replayed(make_service, tmp_path: Path) -> None:
    svc = make_service()
    key = SigningKey.generate()
    _client(svc, key)
    headers = sign_request(key, "PUT", "/v1/submissions/0/0", b"mine", audience=RUN)
    assert _raw(svc.url, "PUT", "/v1/submissions/0/0", b"mine", headers)[0] == 201
    status, doc = _raw(svc.url, "PUT", "/v1/submissions/0/0", b"mine", headers)
    assert (status, doc["reason"]) == (401, "replay")
    status, doc = _raw(svc.url, "PUT", "/v1/submissions/0/1", b"mine", headers)  # the headers, elsewhere
    assert (status, doc["reason"]) == (401, "bad_signature")
    done = json.dumps({"files": [submission_path(0, key.public.id, 0)], "policy_step": 0}).encode()
    headers = sign_request(key, "POST", "/v1/done/0", done, audience=RUN)
    assert _raw(svc.url, "POST", "/v1/done/0", done, headers)[0] == 201
    assert _raw(svc.url, "POST", "/v1/done/0", done, headers)[1]["reason"] == "replay"
    assert _stored(tmp_path) == [submission_path(0, key.public.id, 0)]


def test_allowlist_admits_only_listed_keys(make_service) -> None:
    listed, other = SigningKey.generate(), SigningKey.generate()
    svc = make_service(admission="allowlist", allowlist=[listed.public.hex])
    assert _client(svc, listed).worker == listed.public.id
    c = ServiceClient(svc.url, other, audience=RUN, retries=0)
    for call in (c.register, c.run_info, lambda: c.status(0)):
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.status, e.value.reason) == (403, "not_allowed")
    assert svc.workers() == [listed.public.id]


def test_open_registration_is_rate_limited_per_address(make_service) -> None:
    svc = make_service(registrations_per_minute=5)
    keys = [SigningKey.generate() for _ in range(8)]
    got = []
    for key in keys:
        path, body = "/v1/register", b"{}"
        headers = sign_request(key, "POST", path, body, audience=RUN) | {"x-forwarded-for": f"10.9.0.{len(got)}"}
        status, doc = _raw(svc.url, "POST", path, body, headers)  # a spoofed forwarding header changes nothing
        got.append((status, doc.get("reason")))
    assert got == [(201, None)] * 5 + [(429, "rate_limited")] * 3
    assert svc.workers() == [k.public.id for k in keys[:5]]
    assert _client(svc, keys[0]).worker == keys[0].public.id  # an admitted key is not charged again


def test_names_are_chosen_by_the_service(make_service, tmp_path: Path) -> None:
    svc = make_service()
    honest, attacker = _client(svc), _client(svc)
    theirs = honest.submit(0, 0, b"honest work")
    for path, status, reason in [
        ("/v1/submissions/../../verdicts/0", 404, "not_found"),
        ("/v1/submissions/0/..%2F..%2Fverdicts", 400, "bad_request"),
        ("/v1/submissions/0/0%2F..", 400, "bad_request"),
        ("/v1/submissions/-1/0", 400, "bad_request"),
        ("/v1/submissions/0/00", 400, "bad_request"),
        ("/v1/submissions/0/1e3", 400, "bad_request"),
        ("/v1/submissions/0/99999999999999999999", 400, "bad_request"),
        (f"/v1/submissions/0/0?worker={honest.worker}", 400, "bad_request"),
        ("/v1/submissions/0/0/x", 404, "not_found"),
        ("/v1/submissions/0/64", 400, "out_of_range"),
        ("/v2/submissions/0/0", 404, "not_found"),
    ]:
        got = _signed(svc.url, attacker.key, "PUT", path, b"forged")
        assert (got[0], got[1]["reason"]) == (status, reason), path
    mine = attacker.submit(0, 0, b"forged")  # the same (step, k) as the honest file: its own name
    assert mine.path == submission_path(0, attacker.worker, 0) != theirs.path
    with pytest.raises(ServiceError) as e:
        attacker.submit(0, 0, b"forged again")
    assert (e.value.status, e.value.reason) == (409, "exists")
    with pytest.raises(ServiceError) as e:  # a done record naming another worker's file
        attacker.finish(0, [theirs.path], 0)
    assert e.value.reason == "unknown_file"
    assert (tmp_path / "run" / theirs.path).read_bytes() == b"honest work"
    assert (tmp_path / "run" / mine.path).read_bytes() == b"forged"
    assert _stored(tmp_path) == sorted([theirs.path, mine.path])


def test_concurrent_writes_of_one_name_store_one(make_service, tmp_path: Path) -> None:
    svc = make_service()
    c = _client(svc)

    def put(i: int):
        try:
            return c.submit(0, 0, b"version %d" % i).sha256
        except ServiceError as e:
            return e.reason

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(put, range(6)))
    winners = [g for g in got if g not in ("exists", "busy")]
    assert len(winners) == 1
    assert hashlib.sha256((tmp_path / "run" / submission_path(0, c.worker, 0)).read_bytes()).hexdigest() == winners[0]
    assert len(svc.submissions(0)) == 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_an_oversized_body_is_refused_as_it_streams(make_service, tmp_path: Path) -> None:
    svc = make_service()  # the default cap: 64 MiB
    c = _client(svc)
    path = "/v1/submissions/0/0"
    # declared: refused before a byte of the body is read
    headers = sign_request(c.key, "PUT", path, b"", audience=RUN) | {"content-length": str(200 << 20)}
    status, doc = _raw(svc.url, "PUT", path, headers=headers)
    assert (status, doc["reason"]) == (413, "too_large")
    # undeclared (chunked): 200 MB streamed from one reused buffer, while RSS is sampled
    peak, stop = [_rss()], threading.Event()
    base = peak[0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    chunk, sent = os.urandom(1 << 20), 0

    def pieces():
        nonlocal sent
        for _ in range(200):
            yield chunk
            sent += len(chunk)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        status, doc = _raw(svc.url, "PUT", path, headers=sign_request(c.key, "PUT", path, b"", audience=RUN),
                           chunks=pieces())
    finally:
        stop.set()
        sampler.join()
    assert (status, doc["reason"]) == (413, "too_large")
    assert 64 << 20 <= sent < 200 << 20  # the service stopped reading at its cap
    assert peak[0] - base < 32 << 20, f"RSS grew {(peak[0] - base) / 2**20:.1f} MiB"
    assert _stored(tmp_path) == [] and svc.submissions(0) == []
    assert list((tmp_path / "state" / "spool").iterdir()) == []  # the spooled part is gone
    with pytest.raises(ServiceError) as e:  # through the client: refused on its declared length
        c.submit(0, 0, os.urandom((64 << 20) + 1))
    assert (e.value.status, e.value.reason) == (413, "too_large")
    assert c.submit(0, 0, b"fine").size == 4  # and the service still serves


def test_malformed_and_oversized_json_is_refused(make_service) -> None:
    svc = make_service()
    c = _client(svc)
    rel = c.submit(0, 0, b"x").path
    for body, status, reason in [
        (b"{not json", 400, "bad_request"),
        (b"[]", 400, "bad_request"),
        (json.dumps({"files": [rel], "policy_step": "0"}).encode(), 400, "bad_request"),
        (json.dumps({"files": [rel], "policy_step": 0, "extra": 1}).encode(), 400, "bad_request"),
        (json.dumps({"files": [rel, rel], "policy_step": 0}).encode(), 400, "bad_request"),
        (json.dumps({"files": [rel], "policy_step": 1}).encode(), 400, "out_of_range"),
        (json.dumps({"files": ["x" * 600], "policy_step": 0}).encode(), 400, "bad_request"),
        (json.dumps({"files": [rel] * 20000, "policy_step": 0}).encode(), 413, "too_large"),
        (b"\xff\xfe" * 100, 400, "bad_request"),
    ]:
        got = _signed(svc.url, c.key, "POST", "/v1/done/0", body)
        assert (got[0], got[1]["reason"]) == (status, reason), body[:60]
    assert svc.done(0) == {}
    # a huge body without a declared length: refused once past the cap
    big = b'{"files": ["' + b"a" * (1 << 20) + b'"], "policy_step": 0}'
    headers = sign_request(c.key, "POST", "/v1/done/0", big, audience=RUN)
    status, doc = _raw(svc.url, "POST", "/v1/done/0", headers=headers,
                       chunks=(big[i:i + 4096] for i in range(0, len(big), 4096)))
    assert (status, doc["reason"]) == (413, "too_large")
    assert c.status(0)["done"] is False


def test_step_and_k_bounds(make_service) -> None:
    svc = make_service(max_submissions_per_step=4, ahead=2)
    c = _client(svc)
    for call in (lambda: c.submit(3, 0, b"x"), lambda: c.assignment(3, 0), lambda: c.status(3),
                 lambda: c.finish(3, [], 0)):
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.status, e.value.reason) == (409, "too_far_ahead")
    for call in (lambda: c.submit(0, 4, b"x"), lambda: c.assignment(0, 4)):
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.status, e.value.reason) == (400, "out_of_range")
    assert c.submit(2, 3, b"x").k == 3
    svc.set_committed(5)
    assert c.submit(7, 0, b"x").step == 7 and svc.committed == 5


def test_double_finish_with_other_content_is_refused(make_service, tmp_path: Path) -> None:
    svc = make_service()
    c = _client(svc)
    a, b = c.submit(2, 0, b"a"), c.submit(2, 1, b"b")
    c.finish(2, [a.path], 1)
    c.finish(2, [a.path], 1)  # the same record again is a no-op
    for files, policy in [([a.path], 0), ([a.path, b.path], 1), ([b.path], 1)]:
        with pytest.raises(ServiceError) as e:
            c.finish(2, files, policy)
        assert (e.value.status, e.value.reason) == (409, "conflict")
    with pytest.raises(ServiceError) as e:
        c.submit(2, 2, b"late")
    assert e.value.reason == "finished"
    assert (svc.done(2)[c.worker].files, svc.done(2)[c.worker].policy_step) == ([a.path], 1)
    assert _stored(tmp_path) == sorted([a.path, b.path])


def test_a_restarted_service_remembers_and_still_writes_once(make_service, tmp_path: Path) -> None:
    svc = make_service()
    key = SigningKey.generate()
    c = _client(svc, key)
    rec = c.submit(0, 0, b"first")
    c.finish(0, [rec.path], 0)
    captured = sign_request(key, "PUT", "/v1/submissions/1/0", b"one", audience=RUN)
    assert _raw(svc.url, "PUT", "/v1/submissions/1/0", b"one", captured)[0] == 201
    before = (svc.workers(), svc.submissions(0), svc.submissions(1), svc.done(0))
    svc.stop()
    again = make_service()
    assert (again.workers(), again.submissions(0), again.submissions(1), again.done(0)) == before
    c2 = ServiceClient(again.url, key, audience=RUN, retries=0)
    with pytest.raises(ServiceError) as e:
        c2.submit(1, 0, b"other")
    assert e.value.reason == "exists"
    target = tmp_path / "run" / submission_path(1, key.public.id, 0)
    mtime = target.stat().st_mtime_ns
    # the replay guard starts empty, but every call is idempotent: a replay stores nothing new
    assert _raw(again.url, "PUT", "/v1/submissions/1/0", b"one", captured)[0] == 200
    assert target.read_bytes() == b"one" and target.stat().st_mtime_ns == mtime
    with pytest.raises(ServiceError) as e:
        c2.submit(0, 1, b"late")
    assert e.value.reason == "finished"
    # a file in storage without a record (a crash between write and record): never overwritten
    leftover = RunStorage(str(tmp_path / "run"))
    leftover.write_bytes(submission_path(1, key.public.id, 1), b"crashed")
    with pytest.raises(ServiceError) as e:
        c2.submit(1, 1, b"different")
    assert e.value.reason == "exists"
    assert c2.submit(1, 1, b"crashed").sha256 == hashlib.sha256(b"crashed").hexdigest()  # adopted as is
    assert len(again.submissions(1)) == 2


def test_a_failing_handler_is_an_answer_not_a_crash(make_service) -> None:
    def broken() -> dict:
        raise KeyError("no run info yet")

    svc = make_service(run_info=broken)
    c = _client(svc)
    with pytest.raises(ServiceError) as e:
        c.run_info()
    assert (e.value.status, e.value.reason) == (500, "internal")
    assert c.status(0)["done"] is False


def test_uploads_read_at_once_are_bounded(make_service, tmp_path: Path) -> None:
    svc = make_service(max_concurrent_uploads=1)
    c = _client(svc)
    u = urlsplit(svc.url)
    path = "/v1/submissions/0/0"
    headers = sign_request(c.key, "PUT", path, b"slow", audience=RUN)
    slow = socket.create_connection((u.hostname, u.port), timeout=10)  # a body that trickles in
    slow.sendall(f"PUT {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n".encode()
                 + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\nsl")
    deadline = time.monotonic() + 10
    while svc.uploads_reading == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ServiceError) as e:
        c.submit(0, 1, b"x")
    assert (e.value.status, e.value.reason) == (503, "busy")
    slow.sendall(b"ow")
    slow.settimeout(10)
    assert slow.recv(1 << 16).startswith(b"HTTP/1.1 201")
    slow.close()
    assert c.submit(0, 1, b"x").k == 1
