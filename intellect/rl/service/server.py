"""The submission service: the one door through which untrusted RL workers reach a run.

An ASGI app on uvicorn (h11, one asyncio loop, in a thread of the trainer's process), listening on
127.0.0.1 unless configured otherwise. Every request but ``/v1/health`` is signed with the worker's
key (:mod:`intellect.trust.requests`, audience = the run name); the worker id is
:func:`~intellect.trust.keys.key_id` of that key, never a name the worker sends. Routes::

    GET  /v1/health                     {"ok": true, "run", "registration_work_bits"} (unsigned: for
                                        readiness probes, and what a registration must prove)
    POST /v1/register                   {"work": nonce}: admit the key: allowlist, or open with a proof
                                        of work (:mod:`intellect.rl.wire.work`) and rate limits per address
                                        and in total; the answer carries the key's salt
    GET  /v1/run                        the run's description (``run_info()``, served as is)
    GET  /v1/assignment?step=N&k=K      the tasks of submission K at an open step N, in group order,
                                        without reference answers (see below); K only once 0..K-1
                                        of that step are stored
    PUT  /v1/submissions/N/K            local storage: the body is the Parquet file; the service writes
                                        ``rollouts/step_N/<id>-K.parquet`` itself, once
    POST /v1/uploads/N/K                S3: {"sha256", "size"} -> a presigned POST for that one key and
                                        exactly that many bytes; the declared sha256 is recorded
    POST /v1/done/N                     {"files": [...], "policy_step": P}: the worker's done marker
    GET  /v1/status?step=N              the calling worker's :class:`~intellect.rl.wire.refill.StepStatus`:
                                        its submissions, its done record, whether the step is open and
                                        the online filter's newest round of assignment at it

Every refusal is a 4xx (5xx only for the service's own trouble) with
``{"reason": ..., "detail": ...}``, the reason one of :data:`~intellect.rl.service.admission.REASONS`.

A request's signature is checked before its body is read: the signed message covers the body's
sha256, which the client also sends in ``x-intellect-content-sha256``, so a request signed by
anyone but the key's holder costs no body read and holds no upload slot; the body must then hash
to that digest (``sha256_mismatch``). An upload must declare its Content-Length, at most what a
submission of the run can be (``max_submission_bytes``, derived from the run's rows and tokens), and
its body must begin within ``body_grace`` and then arrive at ``min_body_rate``, so a slot is held
at most about that size over that rate (:func:`~intellect.rl.service.http.read_body`). Clients are counted by address prefix (:func:`~intellect.rl.service.admission.address_prefix`:
IPv4 /24, IPv6 /48). At most one upload of each key and ``max_uploads_per_prefix`` of each prefix
are read at once, ``max_concurrent_uploads`` in all, shared fairly among prefixes: when all are
taken, a prefix asking for its share displaces the newest upload of the prefix holding the most
(``busy``), and ``upload_reserve`` of them only keys with accepted samples may take (the trainer
names them, :meth:`SubmissionService.credit`). Connections are shared the same way
(``max_connections``, ``connection_reserve`` for the prefixes credited keys call from), and the
run's registrations per minute so that a few prefixes cannot drain them
(:class:`~intellect.rl.service.admission.RegistrationLimiter`). A worker stores at most
``max_worker_step_bytes`` per step; uploads being read hold at most ``max_spool_bytes`` together and
must leave ``min_free_bytes`` on disk. Bodies are held to caps and deadlines by
:mod:`intellect.rl.service.http`, connections and request heads by :mod:`intellect.http_server`. So
a slow or flooding client holds nothing for long, and never all of it. Steps are open from the one after the newest committed step
to ``ahead`` past it: a committed step is ``closed`` to uploads, done records and assignments.
A worker's done record ends its submissions of a step (``finished``), except while the trainer's online
filter asks for more of it (:meth:`SubmissionService.request_refill`): then any worker may add its next
submission, up to ``max_submissions_per_step``.

Assignments are drawn from the key's salt (:mod:`intellect.rl.wire.assignment`), which the registry
draws at admission and the registration answer returns: a key's prompts are unknown until it is
committed, and the validator derives the same ones from the registry. A key sees the prompts of
submission ``K`` only once it stored ``0 .. K-1`` of the step, so it cannot look ahead and file
only the draws it likes. Assignments carry no reference answers (no math answer, no code tests):
the validator recomputes every reward, so a worker needs none, and an answer in a worker's hands
could only help it fake an output (see docs/rl.md).

What was stored is in :class:`~intellect.rl.service.registry.Registry` under ``state_dir``, which only the
trainer writes; a restarted service reloads it and still refuses to write any name twice. Its
replay guard lives in memory, so a request captured in the last ``request_window`` seconds could be
sent again after a restart: every route is idempotent (a stored name answers its record, a done
record its equal), so such a replay changes nothing. Each refusal is logged and kept
(:meth:`SubmissionService.refusals`). Workers hold no storage credentials: the service writes local
files, and on S3 hands out presigned POSTs that real S3 limits to the one key and the exact size
(its policy conditions); the validator compares each file with the sha256 recorded here.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import uvicorn

from intellect.http_server import (
    ConnectionGuard, ConnectionLimits, Drop, bind, guarded_server, serve_in_thread, url_of,
)
from intellect.rl.service.admission import (
    DoneBody, Refusal, RegistrationLimiter, Request, UploadBody, address_prefix, parse_json, parse_request, precheck,
    query_ints, verify_digest,
)
from intellect.rl.wire import work
from intellect.rl.wire.assignment import assign_prompts
from intellect.rl.wire.refill import StepStatus
from intellect.rl.service.registry import DoneRecord, Registry, SubmissionRecord
from intellect.rl.wire.rollouts import submission_path
from intellect.rl.service.http import Body, UploadSlots, read_body, respond
from intellect.rl.service.config import ServiceConfig
from intellect.rl.service.s3 import Presigner
from intellect.rl.wire.work import RegisterBody
from intellect.trust import mac
from intellect.trust.keys import VerifyKey
from intellect.trust.requests import CONTENT_HEADER, AuthError, ReplayGuard, RequestVerifier

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.storage import RunStorage

__all__ = ["DoneRecord", "ServiceConfig", "SubmissionRecord", "SubmissionService"]

log = logging.getLogger("intellect.rl.service.server")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_SALT_DOMAIN = "intellect/worker-salt/v1"
KNOWN_PREFIXES = 4096  # address prefixes remembered as a credited key's (the reserved connections are theirs)


class SubmissionService:
    """The service of one run (see the module docstring); :meth:`start` serves it in a thread."""

    def __init__(self, cfg: ServiceConfig, *, run: str, storage: RunStorage, state_dir: str | os.PathLike,
                 run_info: Callable[[], dict], tasks: Sequence[Task], prompts_per_submission: int,
                 committed: int = -1, salt_key: bytes | None = None):
        if not 1 <= prompts_per_submission <= len(tasks):
            raise ValueError(f"cannot assign {prompts_per_submission} prompts from {len(tasks)} tasks")
        self.cfg, self.run, self.storage = cfg, run, storage
        self.ahead = cfg.ahead if cfg.ahead is not None else 2
        self.per_step = cfg.max_submissions_per_step if cfg.max_submissions_per_step is not None else 64
        self.tasks, self.prompts_per_submission = list(tasks), prompts_per_submission
        self._run_info = run_info
        self.registry = Registry(state_dir)
        self.spool = Path(state_dir) / "spool"
        self.spool.mkdir(mode=0o700, exist_ok=True)
        for stale in self.spool.glob("body-*"):  # bodies of requests a crash cut short
            stale.unlink()
        self.verifier = RequestVerifier(run, window=cfg.request_window,
                                        guard=ReplayGuard(cfg.request_window, per_key=cfg.replay_per_key))
        self.limiter = RegistrationLimiter(cfg.registrations_per_minute, cfg.registrations_per_minute_total,
                                           int(cfg.registration_reserve * cfg.registrations_per_minute_total))
        self._allow = set(cfg.allowlist)
        self._work_bits = cfg.registration_work_bits if cfg.admission == "open" else 0
        self._salt_key = salt_key  # a new key's salt: its keyed hash under this (None: random)
        self._committed = committed
        self._refill: dict[int, int] = {}  # step -> the online filter's newest round of assignment there
        self._refusals: collections.deque[dict] = collections.deque(maxlen=1000)
        # keys whose samples were accepted (credit), and the prefixes they called from lately: the
        # reserved upload slots and connections are theirs
        self._credited: set[str] = set()
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        # uploads being read, and connections (only the event loop's thread touches these)
        self._slots = UploadSlots(cfg.max_concurrent_uploads, min(cfg.upload_reserve, cfg.max_concurrent_uploads - 1),
                                  cfg.max_uploads_per_prefix, cfg.max_spool_bytes)
        self._guard = ConnectionGuard(ConnectionLimits(
            cfg.header_timeout, per_address=cfg.max_connections_per_prefix, bucket=address_prefix,
            max_open=cfg.max_connections, reserve=min(cfg.connection_reserve, cfg.max_connections - 1),
            trusted=self._known.__contains__,
        ), self._refused_connection)
        self._connections = self._guard.open
        self._s3 = Presigner(storage, self.registry, cfg.presign_expiry) if storage.scheme == "s3" else None
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="submission-io")
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock = None
        self.url = ""

    # ---------------------------------------------------------------- the trainer's side

    @property
    def committed(self) -> int:
        return self._committed

    @property
    def uploads_reading(self) -> int:
        """Uploads whose bodies are being read now (at most ``cfg.max_concurrent_uploads``)."""
        return len(self._slots)

    def credit(self, worker: str) -> None:
        """``worker`` had samples accepted (the trainer says so after validating a step): its uploads
        may take the reserved slots, and the prefixes it calls from the reserved connections. Kept in
        memory: after a restart, a key earns it again with its next accepted step."""
        self._credited.add(worker)

    def set_committed(self, step: int) -> None:
        """The newest committed step (-1: none): workers may work on steps ``step + 1`` to
        ``step + ahead``; ``step`` and those before it are closed."""
        self._committed = step
        for old in [s for s in self._refill if s <= step]:
            del self._refill[old]

    def request_refill(self, step: int) -> int:
        """Open a new round of assignment at open ``step`` (the online filter holds too few samples with
        signal): workers see it in their status answer and may add a submission after their done record.
        Returns the round's number (1, 2, ...)."""
        self._step(step)
        self._refill[step] = self._refill.get(step, 0) + 1
        return self._refill[step]

    def end_refill(self, step: int) -> None:
        """No more rounds at ``step``: a done record ends a worker's submissions there again."""
        self._refill.pop(step, None)

    def refill_round(self, step: int) -> int:
        """The newest round of assignment at ``step`` (0: none open)."""
        return self._refill.get(step, 0)

    def submissions(self, step: int) -> list[SubmissionRecord]:
        """What the service stored (or handed an upload for) at ``step``, in arrival order."""
        return self.registry.submissions(step)

    def done(self, step: int) -> dict[str, DoneRecord]:
        """The done records of ``step``, by worker id."""
        return self.registry.done(step)

    def workers(self) -> list[str]:
        """Admitted worker ids, in admission order (never sort ids: they can be ground for a prefix)."""
        return self.registry.workers()

    def worker_key(self, worker: str) -> str | None:
        """The hex public key of an admitted worker."""
        key = self.registry.key(worker)
        return key.hex if key else None

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 10.0) -> str:
        """Serve in a daemon thread; returns the base URL once the socket accepts connections."""
        self._sock = bind(self.cfg.host, self.cfg.port)
        self.url, cfg = url_of(self._sock), self.cfg
        # the guard keeps max_connections open; uvicorn's own limit (a 503 past it) only backs it up
        self._server = guarded_server(self.app, self._guard, keep_alive=min(5, int(cfg.header_timeout) or 1),
                                      interface="asgi3", limit_concurrency=2 * cfg.max_connections,
                                      h11_max_incomplete_event_size=32 << 10)
        try:
            self._thread = serve_in_thread(self._server, self._sock, f"submission-service-{self._sock.getsockname()[1]}",
                                           timeout)
        except RuntimeError:
            self.stop()
            raise
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._pool is None:
            return
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._pool.shutdown(wait=True)
        self._pool = None
        self.registry.close()

    # ---------------------------------------------------------------- HTTP

    async def app(self, scope, receive, send) -> None:
        await respond(scope, receive, send, self._handle, self._refused)

    def _refused(self, scope, r: Refusal) -> None:
        headers = dict(scope.get("headers") or [])
        key = headers.get(b"x-intellect-key", b"")[:64].decode("latin-1")
        entry = {"time": time.time(), "client": (scope.get("client") or ("unknown",))[0], "key": key,
                 "method": scope.get("method"), "path": scope.get("path", "")[:200], "status": r.status,
                 "reason": r.reason, "detail": r.detail}
        self._refusals.append(entry)
        log.info("refused %s %s from %s: %s %s (%s)", entry["method"], entry["path"], entry["client"], r.status,
                 r.reason, r.detail)

    def _refused_connection(self, client: str, reason: Drop, detail: str) -> None:
        if reason == "idle":  # no request came on it: closed, but nothing was refused
            return
        self._refusals.append({"time": time.time(), "client": client, "key": "", "method": None, "path": "",
                               "status": 0, "reason": reason, "detail": detail})
        log.info("closed a connection from %s: %s (%s)", client, reason, detail)

    def refusals(self) -> list[dict]:
        """The latest refused requests (at most 1,000), oldest first: time, client address, the key they
        named (unproven), method, path, status, reason and detail; a connection the service closed
        before a request was read (too many from its address, a late head) has status 0."""
        return list(self._refusals)

    async def _handle(self, scope, receive) -> tuple[int, dict]:
        if scope["method"] == "GET" and scope["path"] == "/v1/health":
            return 200, {"ok": True, "run": self.run, "registration_work_bits": self._work_bits}
        req = parse_request(scope)
        try:
            key = precheck(req.headers, self.cfg.request_window)
        except AuthError as e:
            raise Refusal.auth(e) from None
        self._admitted(req, key)
        digest = req.headers.get(CONTENT_HEADER)
        if digest is None:
            raise Refusal(401, "unsigned", f"missing {CONTENT_HEADER}")
        if not _HEX64.fullmatch(digest):
            raise Refusal(400, "malformed", f"{CONTENT_HEADER} must be 64 lowercase hex digits")
        try:  # proved before a byte of the body is read: only the key's holder can hold a slot
            verify_digest(self.verifier, req.method, req.signed_path, digest, req.headers)
        except AuthError as e:
            raise Refusal.auth(e) from None
        if key.id in self._credited:
            self._known[address_prefix(req.client)] = None
            self._known.move_to_end(address_prefix(req.client))
            while len(self._known) > KNOWN_PREFIXES:
                self._known.popitem(last=False)
        if req.name == "submissions":
            return await self._upload(req, key, receive, digest)
        body = await self._read(req, receive, self.cfg.max_json_bytes, digest)
        try:
            return await getattr(self, "_" + req.name)(req, key, body)
        finally:
            body.close()

    async def _upload(self, req: Request, key: VerifyKey, receive, digest: str) -> tuple[int, dict]:
        cfg, cap = self.cfg, self.cfg.submission_cap()
        if self._s3 is not None:
            raise Refusal(400, "wrong_mode", "S3 storage: ask POST /v1/uploads/N/K for a presigned POST")
        query_ints(req)
        k, step = self._k(req.args[1]), self._step(req.args[0])
        declared = req.headers.get("content-length")
        if declared is None:
            raise Refusal(411, "length_required", "an upload must declare its Content-Length")
        if not (declared.isascii() and declared.isdigit()):
            raise Refusal(400, "bad_request", f"Content-Length {declared[:20]!r} is not a byte count")
        size = self._declared(int(declared))
        self._quota(key.id, step, k, size)
        self._disk(size)
        slot = self._slots.take(key.id, address_prefix(req.client), size, trusted=key.id in self._credited)
        try:
            body = await read_body(receive, req.headers, cap=cap, digest=digest, spool=self.spool,
                                   grace=cfg.body_grace, rate=cfg.min_body_rate, cancel=slot.evicted)
            try:
                return await self._submissions(req, key, body)
            finally:
                body.close()
        finally:
            self._slots.give_back(slot)

    def _declared(self, size: int) -> int:
        """``size`` when a submission of this run can be that large."""
        cap = self.cfg.submission_cap()
        if size > cap:
            raise Refusal(413, "too_large", f"{size} bytes declared: a submission of this run is at most {cap} "
                          "bytes (its rows and tokens in the rollout schema, service.max_submission_bytes)")
        if size == 0:
            raise Refusal(400, "bad_request", "an empty submission")
        return size

    def _quota(self, worker: str, step: int, k: int, size: int) -> None:
        if self.registry.submission(step, worker, k) is not None:
            return  # a retry of a stored name adds nothing
        held = self.registry.stored_bytes(step, worker)
        if held + size > self.cfg.max_worker_step_bytes:
            raise Refusal(413, "quota", f"{held} bytes stored at step {step}, {size} more would pass "
                          f"the {self.cfg.max_worker_step_bytes} bytes a worker may store per step")

    def _disk(self, size: int) -> None:
        paths = [self.spool, self.storage.local_path("")]
        for path in filter(None, paths):
            while not path.exists() and path != path.parent:
                path = path.parent
            free = shutil.disk_usage(path).free
            if free - 2 * size < self.cfg.min_free_bytes:  # spooled, then stored
                raise Refusal(507, "disk_full", f"{free} bytes free: an upload of {size} would leave "
                              f"less than {self.cfg.min_free_bytes}")

    def _admitted(self, req: Request, key: VerifyKey) -> None:
        if self.cfg.admission == "allowlist" and key.hex not in self._allow:
            raise Refusal(403, "not_allowed", f"key {key.id} is not on the run's allowlist")
        if req.name != "register" and self.registry.key(key.id) is None:
            raise Refusal(403, "not_registered", f"key {key.id} is not registered: POST /v1/register first")

    async def _read(self, req: Request, receive, cap: int, digest: str) -> Body:
        """The body of ``req``, at most ``cap`` bytes and hashing to ``digest``, at this run's body rate."""
        return await read_body(receive, req.headers, cap=cap, digest=digest, spool=self.spool,
                               grace=self.cfg.body_grace, rate=self.cfg.min_body_rate)

    async def _io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _step(self, step: int, closed_ok: bool = False) -> int:
        if step <= self._committed and not closed_ok:
            raise Refusal(409, "closed", f"step {step} is closed: the newest committed step is {self._committed}")
        if step > self._committed + self.ahead:
            raise Refusal(409, "too_far_ahead", f"step {step}: the newest committed step is {self._committed}, "
                          f"and workers may be at most {self.ahead} ahead")
        return step

    def _k(self, k: int) -> int:
        if k >= self.per_step:
            raise Refusal(400, "out_of_range", f"submission index {k}: at most "
                          f"{self.per_step} per step (0..{self.per_step - 1})")
        return k

    # ---------------------------------------------------------------- routes

    async def _register(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        proof = parse_json(RegisterBody, bytes(body.buf))
        new = False
        if self.registry.key(key.id) is None:
            if not work.check(self.run, key.raw, proof.work, self._work_bits):
                raise Refusal(403, "work", f"a new key must bring a proof of {self._work_bits} bits of work "
                              "(intellect.rl.wire.work) in its registration")
            if self.cfg.admission == "open":
                ok, why = self.limiter.allow(address_prefix(req.client))
                if not ok:
                    raise Refusal(429, "rate_limited", why)
            salt = None if self._salt_key is None else mac.tag(self._salt_key, _SALT_DOMAIN, key.hex)
            new = await self._io(functools.partial(self.registry.admit, key, self.cfg.max_workers,
                                                   self.cfg.worker_expiry, salt=salt))
            if new:
                log.info("admitted worker %s from %s", key.id, req.client)
        salt = self.registry.salt(key.id)
        if salt is None:  # expired between the admission and now: it may register again
            raise Refusal(503, "full", "the key's admission expired; register again")
        return (201 if new else 200), {"worker": key.id, "upload": "presigned" if self._s3 else "body",
                                       "salt": salt.hex()}

    async def _run(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        return 200, self._run_info()

    async def _assignment(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        step, k = query_ints(req, "step", "k")
        self._k(k)
        self._step(step)
        held = {r.k for r in self.registry.submissions(step, key.id)}
        if not held.issuperset(range(k)):
            raise Refusal(409, "out_of_range", f"submission {k} of step {step}: store submissions 0..{k - 1} "
                          "first (a key may not look ahead at later draws)")
        salt = self.registry.salt(key.id)
        if salt is None:
            raise Refusal(403, "not_registered", f"key {key.id} is not registered: POST /v1/register first")
        idx = assign_prompts(len(self.tasks), key.id, step, k, self.prompts_per_submission, salt)
        tasks = [{"id": self.tasks[i].id, "prompt": self.tasks[i].prompt} for i in idx]  # never the answers
        return 200, {"step": step, "k": k, "tasks": tasks}

    async def _status(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        (step,) = query_ints(req, "step")
        self._step(step, closed_ok=True)  # a read: a restarted worker may ask what it left at a closed step
        held = sorted(r.k for r in self.registry.submissions(step, key.id))
        return 200, StepStatus(step=step, submissions=held, done=key.id in self.registry.done(step),
                               open=step > self._committed,
                               refill=self.refill_round(step)).model_dump(exclude_defaults=True)

    async def _submissions(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        step, k = self._step(req.args[0]), self._k(req.args[1])
        if body.size == 0:
            raise Refusal(400, "bad_request", "an empty submission")
        status, rec = await self._io(self._store, key.id, step, k, body)
        return status, asdict(rec)

    def _store(self, worker: str, step: int, k: int, body: Body) -> tuple[int, SubmissionRecord]:
        sha, rel = body.sha.hexdigest(), submission_path(step, worker, k)
        old = self.registry.claim(step, worker, k, refill=self.refill_round(step) > 0)
        if old is not None:
            if (old.sha256, old.size) == (sha, body.size):
                return 200, old  # a retry of what is stored: nothing is written
            raise Refusal(409, "exists", f"{rel} is stored already, with other content")
        rec = None
        try:
            if self.storage.exists(rel):
                if not self._same_file(rel, sha):
                    raise Refusal(409, "exists", f"{rel} exists in run storage")
            else:
                body.store(self.storage, rel)
            rec = SubmissionRecord(worker, step, k, rel, sha, body.size, time.time())
            return 201, rec
        finally:
            self.registry.release(step, worker, k, rec)

    def _same_file(self, rel: str, sha: str) -> bool:
        """Whether the unrecorded file ``rel`` (a crash between its write and its record) has ``sha``."""
        path = self.storage.local_path(rel)
        if path is None or path.stat().st_size > self.cfg.max_body_bytes:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest() == sha

    async def _uploads(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        if self._s3 is None:
            raise Refusal(400, "wrong_mode", "local storage: PUT the file to /v1/submissions/N/K")
        step, k = self._step(req.args[0]), self._k(req.args[1])
        want = parse_json(UploadBody, bytes(body.buf))
        self._quota(key.id, step, k, self._declared(want.size))
        return await self._io(self._s3.presign, key.id, step, k, want, self.refill_round(step) > 0)

    async def _done(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        step = self._step(req.args[0])
        got = parse_json(DoneBody, bytes(body.buf))
        if len(got.files) > self.per_step or len(set(got.files)) != len(got.files):
            raise Refusal(400, "bad_request", f"files must be distinct, at most {self.per_step}")
        if got.policy_step > step:
            raise Refusal(400, "out_of_range", f"policy step {got.policy_step} is after step {step}")
        rec = DoneRecord(key.id, step, list(got.files), got.policy_step, time.time())
        new = await self._io(self.registry.finish, rec)
        return (201 if new else 200), {"worker": key.id, "step": step, "done": True}
