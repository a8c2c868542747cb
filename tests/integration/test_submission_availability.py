"""The submission service under availability attacks, on real sockets: an admitted attacker trickling
uploads into every slot, a connection flood from many address prefixes, a registration drain, and an
oversized declaration. Clients speak from distinct loopback addresses (127.x.y.z all reach 127.0.0.1
on Linux), so each attacker address is its own prefix to the service; the honest worker speaks from
127.0.0.1. Each attack runs while the honest worker works, and its calls are counted."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import pytest

from intellect.data.loaders import MathTask
from intellect.rl.config import RLRunConfig
from intellect.rl.wire.rollout_schema import MAX_ID_CHARS, Rollout
from intellect.rl.wire.rollouts import encode_submission
from intellect.rl.service.server import ServiceConfig, SubmissionService
from intellect.rl.worker.client import ServiceClient, ServiceError
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.requests import sign_request

RUN = "run-a"
TASKS = [MathTask(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(64)]
HONEST_UPLOADS, HONEST_CALLS = 6, 50


@pytest.fixture
def make_service(tmp_path: Path):
    started: list[SubmissionService] = []

    def make(cfg: ServiceConfig | None = None, **fields) -> SubmissionService:
        cfg = cfg or ServiceConfig(**{"registration_work_bits": 0, **fields})
        svc = SubmissionService(cfg, run=RUN, storage=RunStorage(str(tmp_path / "run")), state_dir=tmp_path / "state",
                                run_info=lambda: {"run": RUN}, tasks=TASKS, prompts_per_submission=4)
        svc.start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


def _connect(svc: SubmissionService, source: str, timeout: float = 5.0) -> socket.socket:
    u = urlsplit(svc.url)
    return socket.create_connection((u.hostname, u.port), timeout=timeout, source_address=(source, 0))


def _request(method: str, path: str, headers: dict, body: bytes = b"") -> bytes:
    """A request's bytes; its content-length that of ``body`` unless ``headers`` declare one."""
    headers = {"content-length": str(len(body))} | headers
    head = [f"{method} {path} HTTP/1.1", "host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """One JSON answer (its content-length read), the connection left as the service left it."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(1 << 16)
        if not piece:
            raise ConnectionError("closed before an answer")
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        piece = sock.recv(1 << 16)
        if not piece:
            break
        rest += piece
    return int(head.split()[1]), json.loads(rest[:length])


def _register(svc: SubmissionService, key: SigningKey, source: str) -> tuple[int, str | None]:
    body = b"{}"
    with _connect(svc, source) as sock:
        sock.sendall(_request("POST", "/v1/register", sign_request(key, "POST", "/v1/register", body,
                                                                          audience=RUN), body))
        status, doc = _answer(sock)
    return status, doc.get("reason")


def _honest_work(client: ServiceClient, uploads: int, calls: int, step: int = 0) -> tuple[int, int]:
    """(uploads stored, signed calls answered) of an honest worker, each call with the client's retries."""
    stored = answered = 0
    for k in range(uploads):
        try:
            client.submit(step, k, b"honest rollouts %d" % k)
            stored += 1
        except ServiceError:
            pass
    for _ in range(calls):
        try:
            client.status(step)
            answered += 1
        except ServiceError:
            pass
    return stored, answered


class Attack:
    """Threads running ``loop(stop)`` until :meth:`stop`; what they saw, by outcome."""

    def __init__(self, loops: list[Callable[[threading.Event], None]]):
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=f, args=(self.halt,), daemon=True) for f in loops]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(30)


def _trickler(svc: SubmissionService, key: SigningKey, source: str, size: int, rate: int, seen: list[str]):
    """Upload after upload of ``size`` bytes at ``rate`` bytes/s, a new one as soon as one ends."""

    def loop(halt: threading.Event) -> None:
        k = 0
        while not halt.is_set():
            body = os.urandom(size)
            path = f"/v1/submissions/0/{k}"
            k += 1
            try:
                with _connect(svc, source) as sock:
                    headers = sign_request(key, "PUT", path, body, audience=RUN) | {"content-length": str(size)}
                    sock.sendall(_request("PUT", path, headers))
                    sent, chunk = 0, max(1, rate // 20)
                    sock.settimeout(0.05)
                    while sent < size and not halt.is_set():
                        sock.sendall(body[sent:sent + chunk])
                        sent += chunk
                        try:  # an answer before the body is done: the service ended this upload
                            if sock.recv(1, socket.MSG_PEEK):
                                break
                        except (TimeoutError, BlockingIOError):
                            pass
                    sock.settimeout(5)
                    seen.append(str(_answer(sock)[1].get("reason", "stored")) if not halt.is_set() else "stopped")
            except (OSError, ConnectionError, ValueError):
                seen.append("connection")
                time.sleep(0.05)

    return loop


def test_trickled_uploads_leave_honest_uploads_and_calls_through(make_service) -> None:
    """16 keys from 2 addresses trickle uploads into every slot they can take; an honest worker with
    accepted samples (reserve) and one without (fair share) still store every upload and get every
    signed call answered, while the attacker's uploads are displaced (``busy``, recorded)."""
    size, rate = 64 << 10, 12 << 10  # above min_body_rate: each upload alone would hold its slot ~5 s
    svc = make_service(max_concurrent_uploads=16, upload_reserve=4, max_uploads_per_prefix=8,
                       max_submission_bytes=size, min_body_rate=8 << 10, body_grace=0.5,
                       registrations_per_minute=100)
    attackers = [(SigningKey.generate(), f"127.1.{1 + i % 2}.1") for i in range(16)]
    for key, source in attackers:
        assert _register(svc, key, source)[0] == 201
    seen: list[str] = []
    attack = Attack([_trickler(svc, key, source, size, rate, seen) for key, source in attackers])
    try:
        deadline = time.monotonic() + 20
        while svc.uploads_reading < 12 and time.monotonic() < deadline:  # every slot not reserved
            time.sleep(0.02)
        assert svc.uploads_reading >= 12
        veteran = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, timeout=10, retry_for=30)
        newcomer = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, timeout=10, retry_for=30)
        veteran.register()
        newcomer.register()
        svc.credit(veteran.worker)  # as the trainer does once a step of it was accepted
        assert _honest_work(veteran, HONEST_UPLOADS, HONEST_CALLS) == (HONEST_UPLOADS, HONEST_CALLS)
        assert _honest_work(newcomer, HONEST_UPLOADS, HONEST_CALLS) == (HONEST_UPLOADS, HONEST_CALLS)
        assert attack.threads[0].is_alive() and svc.uploads_reading >= 8  # the attack went on all along
    finally:
        attack.stop()
    displaced = [r for r in svc.refusals() if r["reason"] == "busy" and "displaced" in r["detail"]]
    assert displaced and {r["client"] for r in displaced} <= {"127.1.1.1", "127.1.2.1"}
    assert "too_slow" not in seen  # the attacker kept the rate: only the fair share ended its uploads


def _flooder(svc: SubmissionService, source: str, conns: int, seen: list[str]):
    """``conns`` kept-alive connections from ``source``, each asking /v1/health over and over, a closed
    one opened again at once."""

    def loop(halt: threading.Event) -> None:
        socks: list[socket.socket | None] = [None] * conns
        ask = _request("GET", "/v1/health", {})
        while not halt.is_set():
            for i in range(conns):
                try:
                    if socks[i] is None:
                        socks[i] = _connect(svc, source, timeout=2)
                    sock = socks[i]
                    assert sock is not None
                    sock.sendall(ask)
                    _answer(sock)
                except (OSError, ConnectionError, ValueError, StopIteration):
                    seen.append("closed")
                    if socks[i] is not None:
                        socks[i].close()  # type: ignore[union-attr]
                    socks[i] = None
            time.sleep(0.01)
        for s in socks:
            if s is not None:
                s.close()

    return loop


@pytest.mark.parametrize("places, reserve, per_prefix, credited", [(64, 8, 8, False), (16, 4, 1, True)])
def test_a_connection_flood_from_17_prefixes_leaves_signed_calls_through(make_service, places: int, reserve: int,
                                                                         per_prefix: int, credited: bool) -> None:
    """17 address prefixes hold every connection they can and keep them speaking; an honest worker's
    50 signed calls are all answered. With 64 places a flood prefix holds more than the honest one
    and loses a connection to it (fair share). With 16 places and one connection per flood prefix, no
    prefix holds more than a newcomer would, so only the reserve lets the honest worker in: its
    accepted samples made its prefix known."""
    svc = make_service(max_connections=places, connection_reserve=reserve, max_connections_per_prefix=8,
                       header_timeout=2.0)
    honest = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, timeout=10, retry_for=30)
    honest.register()
    if credited:
        svc.credit(honest.worker)
        honest.status(0)  # a credited key's call makes its prefix known
    seen: list[str] = []
    attack = Attack([_flooder(svc, f"127.2.{i}.1", per_prefix, seen) for i in range(1, 18)])
    try:
        def flooded() -> bool:  # all but the reserve is the flood's, and the honest keep-alive timed out
            return len(svc._guard.share) >= places - reserve and "127.0.0.0/24" not in svc._guard.open

        deadline = time.monotonic() + 20
        while not flooded() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert flooded()
        assert _honest_work(honest, 0, HONEST_CALLS) == (0, HONEST_CALLS)
    finally:
        attack.stop()
    assert seen  # the flood was refused connections
    assert any(r["reason"] == "too_many_connections" for r in svc.refusals())


def test_draining_registrations_from_few_prefixes_leaves_others_admitted(make_service) -> None:
    """3 prefixes register keys until refused; 5 honest registrations from another prefix are all
    admitted, and the run's total per minute still holds."""
    svc = make_service(registrations_per_minute=10, registrations_per_minute_total=30, registration_reserve=0.5)
    drained = {source: [_register(svc, SigningKey.generate(), source) for _ in range(15)]
               for source in ("127.4.1.1", "127.4.2.1", "127.4.3.1")}
    admitted = {source: sum(status == 201 for status, _ in got) for source, got in drained.items()}
    assert all(reason == "rate_limited" for got in drained.values() for status, reason in got if status != 201)
    assert sum(admitted.values()) <= 30 - 5  # the attackers did not reach into the rest of the reserve
    honest = [_register(svc, SigningKey.generate(), "127.0.0.1") for _ in range(5)]
    assert honest == [(201, None)] * 5
    assert len(svc.workers()) == sum(admitted.values()) + 5 <= 30
    assert any("kept for address prefixes" in r["detail"] for r in svc.refusals())


def test_a_declaration_larger_than_a_submission_of_the_run_is_refused(make_service) -> None:
    """The cap comes from the run's config (rows, tokens, proofs in the rollout schema): a file as large
    as an honest submission can be is stored, one byte more is refused before its body is read."""
    run = RLRunConfig(submission={"prompts_per_submission": 2, "group_size": 4, "max_tokens": 16})
    cfg = run.service_config(prompt_tokens=64).model_copy(update={"registration_work_bits": 0})
    cap = cfg.submission_cap()
    assert cap < 1 << 20 < cfg.max_body_bytes
    svc = make_service(cfg)
    c = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, timeout=10, retries=0)
    c.register()
    rows = [Rollout(RUN, 0, 0, c.worker, 0, i, "\U0001F600" * MAX_ID_CHARS, i // 4,
                    tuple(int.from_bytes(os.urandom(3)) for _ in range(64)),
                    tuple(int.from_bytes(os.urandom(3)) for _ in range(16)), "length", 1.0, 1.0, 0.0, 0.5, None,
                    os.urandom(258)) for i in range(8)]
    largest = encode_submission(rows)
    assert c.submit(0, 0, largest).size == len(largest) <= cap
    path = "/v1/submissions/0/1"
    with _connect(svc, "127.0.0.1") as sock:  # the head only: the cap is applied to the declaration
        headers = sign_request(c.key, "PUT", path, b"", audience=RUN) | {"content-length": str(cap + 1)}
        sock.sendall(_request("PUT", path, headers))
        status, doc = _answer(sock)
    assert (status, doc["reason"]) == (413, "too_large") and str(cap) in doc["detail"]
    refused = svc.refusals()[-1]
    assert (refused["reason"], refused["path"]) == ("too_large", path)
    assert svc.uploads_reading == 0 and len(svc.submissions(0)) == 1


def test_a_trickle_is_cut_as_soon_as_it_lags_its_rate(make_service) -> None:
    """A body must keep up with min_body_rate from its first byte: the grace to begin is no credit a
    trickle may spend later. Sent at an eighth of the rate, it is cut within a few KiB, where a
    grace counted as credit would have let it run to 5 s x 32 KiB/s."""
    svc = make_service(body_grace=5.0, min_body_rate=32 << 10, max_submission_bytes=1 << 20)
    c = ServiceClient(svc.url, SigningKey.generate(), audience=RUN, timeout=10, retries=0)
    c.register()
    path, body = "/v1/submissions/0/0", os.urandom(1 << 20)
    headers = sign_request(c.key, "PUT", path, body, audience=RUN) | {"content-length": str(len(body))}
    with _connect(svc, "127.0.0.1") as sock:
        sock.sendall(_request("PUT", path, headers) + body[:1024])
        sock.settimeout(0.25)
        sent = 1024
        while sent < 64 << 10:  # 1 KiB every 0.25 s: 4 KiB/s
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except TimeoutError:
                pass
            sock.sendall(body[sent:sent + 1024])
            sent += 1024
        sock.settimeout(5)
        status, doc = _answer(sock)
    assert (status, doc["reason"]) == (408, "too_slow")
    assert int(doc["detail"].split()[0]) < 16 << 10, doc["detail"]
    assert svc.uploads_reading == 0 and svc.submissions(0) == []
