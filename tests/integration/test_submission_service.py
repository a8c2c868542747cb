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
from intellect.rl.wire.assignment import assign_prompts
from intellect.rl.wire.rollouts import submission_path
from intellect.rl.service.server import ServiceConfig, SubmissionService
from intellect.rl.worker.client import ServiceClient, ServiceError
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.requests import CONTENT_HEADER, sign_request

RUN = "run-a"
TASKS = [MathTask(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(64)]
INFO = {"run": RUN, "steps": 3, "async_level": 2}


@pytest.fixture
def make_service(tmp_path: Path):
    started: list[SubmissionService] = []

    def make(run_info=lambda: INFO, committed: int = -1, **cfg) -> SubmissionService:
        # raw registrations here bring no proof of work: test_rl_cherry_picking.py tests it
        cfg = {"registration_work_bits": 0, **cfg}
        svc = SubmissionService(ServiceConfig(**cfg), run=RUN, storage=RunStorage(str(tmp_path / "run")),
                                state_dir=tmp_path / "state", run_info=run_info, tasks=TASKS,
                                prompts_per_submission=4, committed=committed)
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
    whole or as ``chunks`` (chunked unless ``headers`` declare a content-length; stopped once the
    service answers); the JSON answer. The service
    closes the connection after a refusal, perhaps mid-body: what it answered is read all the same."""
    u = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"host: {u.hostname}", "connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    framed = chunks is not None and "content-length" not in (headers or {})
    if framed:
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
                    sock.sendall(b"%x\r\n" % len(c) + c + b"\r\n" if framed else c)
                else:
                    if framed:
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
        assert c.salt == svc.registry.salt(key.public.id) and len(c.salt) == 32
        want = [TASKS[i] for i in assign_prompts(len(TASKS), key.public.id, 1, 0, 4, c.salt)]
        assert c.assignment(1, 0) == [{"id": t.id, "prompt": t.prompt} for t in want]  # no answers
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
    assert _raw(svc.url, "GET", "/v1/health") == (200, {"ok": True, "run": RUN, "registration_work_bits": 0})


def test_signature_attacks_are_refused_and_store_nothing(make_service, tmp_path: Path) -> None:
    svc = make_service()
    key = SigningKey.generate()
    _client(svc, key)
    put = "/v1/submissions/0/0"
    cases = {
        "unsigned": (_raw(svc.url, "PUT", put, b"x"), 401, "unsigned"),
        # the signature covers the digest header: a body that does not hash to it is refused as it ends
        "tampered body": (_signed(svc.url, key, "PUT", put, b"x", send_body=b"y"), 400, "sha256_mismatch"),
        "tampered body and digest": (_raw(svc.url, "PUT", put, b"y", sign_request(key, "PUT", put, b"x", audience=RUN)
                                          | {CONTENT_HEADER: hashlib.sha256(b"y").hexdigest()}), 401, "bad_signature"),
        "no digest": (_raw(svc.url, "PUT", put, b"x", {k: v for k, v in sign_request(
            key, "PUT", put, b"x", audience=RUN).items() if k != CONTENT_HEADER}), 401, "unsigned"),
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
    # undeclared (chunked): an upload must declare its length, so nothing of it is read
    status, doc = _raw(svc.url, "PUT", path, headers=sign_request(c.key, "PUT", path, b"", audience=RUN),
                       chunks=iter([b"x" * 1024] * 4))
    assert (status, doc["reason"]) == (411, "length_required")
    # declared at the cap but not the signed digest: 64 MiB streamed from one reused buffer, while RSS
    # is sampled, then refused as it ends
    peak, stop = [_rss()], threading.Event()
    base = peak[0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    chunk, sent = os.urandom(1 << 20), 0

    def pieces():
        nonlocal sent
        for _ in range(64):
            yield chunk
            sent += len(chunk)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        status, doc = _raw(svc.url, "PUT", path, headers=sign_request(c.key, "PUT", path, b"", audience=RUN)
                           | {"content-length": str(64 << 20)}, chunks=pieces())
    finally:
        stop.set()
        sampler.join()
    assert (status, doc["reason"]) == (400, "sha256_mismatch")
    assert sent == 64 << 20
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
    svc = make_service(max_submissions_per_step=4, ahead=2, committed=0)
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
    # a committed step is closed: no uploads, assignments or done records for it or any before it
    for call in (lambda: c.submit(5, 0, b"x"), lambda: c.submit(2, 2, b"x"), lambda: c.assignment(5, 0),
                 lambda: c.finish(2, [], 0)):
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.status, e.value.reason) == (409, "closed")
    assert c.status(2)["submissions"] == [3]  # what a worker left at a closed step can still be read
    assert [r["reason"] for r in svc.refusals()][-4:] == ["closed"] * 4


def test_double_finish_with_other_content_is_refused(make_service, tmp_path: Path) -> None:
    svc = make_service(committed=0)
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


def test_uploads_read_at_once_are_bounded(make_service) -> None:
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


# --------------------------------------------------------------------- the red team's findings


def _open_upload(svc: SubmissionService, headers: dict, path: str, length: int, first: bytes = b"x") -> socket.socket:
    """A PUT whose head and first body bytes are sent, the rest held back."""
    u = urlsplit(svc.url)
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    sock.sendall(f"PUT {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {length}\r\n".encode()
                 + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n" + first)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    try:
        while piece := sock.recv(1 << 16):
            data += piece
    except (ConnectionResetError, TimeoutError):
        pass
    sock.close()
    status, _, rest = data.partition(b"\r\n\r\n")
    return int(status.split()[1]), json.loads(rest)


def test_upload_slots_cannot_be_held_with_a_public_key(make_service) -> None:
    """A junk signature under an admitted worker's public key is refused before its body is read, so
    16 such trickling PUTs hold no upload slot and the honest worker's uploads go through."""
    svc = make_service(max_concurrent_uploads=16)
    honest = _client(svc)
    socks = []
    for i in range(16):
        headers = {"x-intellect-key": honest.key.public.hex, "x-intellect-time": str(int(time.time() * 1000)),
                   "x-intellect-nonce": os.urandom(16).hex(), "x-intellect-signature": "00" * 64,
                   CONTENT_HEADER: "0" * 64}
        socks.append(_open_upload(svc, headers, f"/v1/submissions/0/{i}", 1_000_000))
    got = [_answer(s) for s in socks]
    assert {(status, doc["reason"]) for status, doc in got} == {(401, "bad_signature")}
    assert svc.uploads_reading == 0
    assert honest.submit(0, 0, b"honest").size == 6
    assert [r["reason"] for r in svc.refusals()] == ["bad_signature"] * 16


def test_a_slow_body_is_refused_and_frees_its_slot(make_service) -> None:
    svc = make_service(max_concurrent_uploads=2, upload_reserve=0, body_grace=0.5, min_body_rate=1024)
    slow, other = _client(svc), _client(svc)
    path = "/v1/submissions/0/0"
    body = b"y" * 100_000
    sock = _open_upload(svc, sign_request(slow.key, "PUT", path, body, audience=RUN), path, len(body))
    deadline = time.monotonic() + 10
    while svc.uploads_reading == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ServiceError) as e:  # one upload per key: the slow one holds only its own
        slow.submit(0, 1, b"x")
    assert (e.value.status, e.value.reason) == (503, "busy")
    assert other.submit(0, 0, b"meanwhile").size == 9
    t0 = time.monotonic()
    for _ in range(20):  # a byte every 0.2 s: far under 1 KiB/s
        try:
            sock.sendall(b"y")
        except OSError:
            break
        time.sleep(0.2)
        if select.select([sock], [], [], 0)[0]:
            break
    status, doc = _answer(sock)
    assert (status, doc["reason"]) == (408, "too_slow") and time.monotonic() - t0 < 4
    assert svc.uploads_reading == 0 and svc.submissions(0)[0].worker == other.worker
    assert slow.submit(0, 1, b"x").k == 1


def test_slow_heads_and_connection_floods_are_cut(make_service) -> None:
    svc = make_service(header_timeout=0.5, max_connections_per_prefix=3)
    c = _client(svc)
    u = urlsplit(svc.url)
    loris = socket.create_connection((u.hostname, u.port), timeout=10)
    loris.sendall(b"GET /v1/run HTTP/1.1\r\nhost: x\r\n")  # a head that never ends
    t0 = time.monotonic()
    assert loris.recv(1) == b"" and time.monotonic() - t0 < 3  # closed by the service
    loris.close()
    held = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(3)]
    extra = socket.create_connection((u.hostname, u.port), timeout=10)
    assert extra.recv(1) == b""  # over the per-address cap: closed at once
    extra.close()
    for s in held:
        s.close()
    deadline = time.monotonic() + 5
    while svc._connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.status(0)["done"] is False  # the address is served again
    reasons = [(r["reason"], r["status"]) for r in svc.refusals()]
    assert ("too_slow", 0) in reasons and ("busy", 0) in reasons


def test_past_steps_and_byte_budgets(make_service, tmp_path: Path) -> None:
    svc = make_service(committed=50, max_worker_step_bytes=2048)
    c = _client(svc)
    for step in (0, 49, 50):
        with pytest.raises(ServiceError) as e:
            c.submit(step, 0, b"x" * 1000)
        assert (e.value.status, e.value.reason) == (409, "closed")
    a = c.submit(51, 0, b"a" * 1500)
    with pytest.raises(ServiceError) as e:  # one worker's bytes per step are bounded
        c.submit(51, 1, b"b" * 1000)
    assert (e.value.status, e.value.reason) == (413, "quota")
    assert c.submit(51, 0, b"a" * 1500) == a  # a retry of what is stored is not charged again
    assert c.submit(52, 0, b"b" * 1000).step == 52  # the next step has its own budget
    assert _stored(tmp_path) == sorted([a.path, submission_path(52, c.worker, 0)])
    svc.stop()
    full = make_service(committed=50, min_free_bytes=1 << 44)  # a disk that cannot take another byte
    c = _client(full, c.key)
    with pytest.raises(ServiceError) as e:
        c.submit(51, 1, b"x")
    assert (e.value.status, e.value.reason) == (507, "disk_full")
    assert [r["reason"] for r in full.refusals()] == ["disk_full"]


def test_registration_is_bounded_in_total_and_idle_keys_expire(make_service) -> None:
    svc = make_service(registrations_per_minute_total=2, max_workers=2, worker_expiry=1.0)
    a, b, late = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    _client(svc, a).submit(0, 0, b"work")
    _client(svc, b)
    with pytest.raises(ServiceError) as e:  # the service-wide rate, whatever the address
        _client(svc, late)
    assert (e.value.status, e.value.reason) == (429, "rate_limited")
    svc.limiter = type(svc.limiter)(60, 60, 0)  # a minute later
    with pytest.raises(ServiceError) as e:
        _client(svc, late)
    assert (e.value.status, e.value.reason) == (503, "full")
    time.sleep(1.1)  # b stored nothing within worker_expiry: its place goes to a new key
    assert _client(svc, late).worker == late.public.id
    assert svc.workers() == [a.public.id, late.public.id]
    with pytest.raises(ServiceError) as e:
        ServiceClient(svc.url, b, audience=RUN, retries=0).status(0)
    assert e.value.reason == "not_registered"
    svc.stop()
    assert make_service().workers() == [a.public.id, late.public.id]  # the expiry is persisted


def test_one_key_cannot_fill_the_replay_guard(make_service) -> None:
    svc = make_service(replay_per_key=16)
    flood, honest = _client(svc), _client(svc)
    got = []
    for _ in range(20):
        try:
            flood.status(0)
            got.append("ok")
        except ServiceError as e:
            got.append(e.reason)
    assert got[:15] == ["ok"] * 15 and set(got[15:]) == {"busy"}  # its registration was the 16th
    assert honest.status(0)["done"] is False


def test_many_keys_of_one_address_share_its_uploads(make_service) -> None:
    svc = make_service(max_uploads_per_prefix=1)
    first, second = _client(svc), _client(svc)
    path = "/v1/submissions/0/0"
    sock = _open_upload(svc, sign_request(first.key, "PUT", path, b"held", audience=RUN), path, 4, b"he")
    deadline = time.monotonic() + 10
    while svc.uploads_reading == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ServiceError) as e:
        second.submit(0, 0, b"x")
    assert (e.value.status, e.value.reason) == (503, "busy") and "prefix" in e.value.detail
    sock.sendall(b"ld")
    assert _answer(sock)[0] == 201
    assert second.submit(0, 0, b"x").size == 1
