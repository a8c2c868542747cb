"""The submission service: the one door through which untrusted RL workers reach a run.

An ASGI app on uvicorn (h11, one asyncio loop, in a thread of the trainer's process), listening on
127.0.0.1 unless configured otherwise. Every request but ``/v1/health`` is signed with the worker's
key (:mod:`intellect.trust.requests`, audience = the run name); the worker id is
:func:`~intellect.trust.keys.key_id` of that key, never a name the worker sends. Routes::

    GET  /v1/health                     {"ok": true} (unsigned: for readiness probes)
    POST /v1/register                   admit the key: allowlist, or open with rate limits per address
                                        and in total
    GET  /v1/run                        the run's description (``run_info()``, served as is)
    GET  /v1/assignment?step=N&k=K      the tasks of submission K at an open step N, in group order, with
                                        their reference answers (see below)
    PUT  /v1/submissions/N/K            local storage: the body is the Parquet file; the service writes
                                        ``rollouts/step_N/<id>-K.parquet`` itself, once
    POST /v1/uploads/N/K                S3: {"sha256", "size"} -> a presigned POST for that one key and
                                        exactly that many bytes; the declared sha256 is recorded
    POST /v1/done/N                     {"files": [...], "policy_step": P}: the worker's done marker
    GET  /v1/status?step=N              {"submissions": [K, ...], "done": bool} of the calling worker

Every refusal is a 4xx (5xx only for the service's own trouble) with
``{"reason": ..., "detail": ...}``, the reason one of :data:`~intellect.rl.admission.REASONS`.

A request's signature is checked before its body is read: the signed message covers the body's
sha256, which the client also sends in ``x-intellect-content-sha256``, so a request signed by
anyone but the key's holder costs no body read and holds no upload slot; the body must then hash
to that digest (``sha256_mismatch``). An upload must declare its Content-Length. At most one
upload of each key and ``max_uploads_per_address`` of each address are read at once; a worker
stores at most ``max_worker_step_bytes`` per step; uploads being read hold at most
``max_spool_bytes`` together and must leave ``min_free_bytes`` on disk. Bodies are held to caps and
deadlines by :mod:`intellect.rl.service_http`, connections and request heads by
:mod:`intellect.http_server`. So a slow or
flooding client holds nothing for long. Steps are open from the one after the newest committed step
to ``ahead`` past it: a committed step is ``closed`` to uploads, done records and assignments.

Assignments carry each task's reference answer, which a worker needs to compute the rewards it
claims (the validator recomputes them): answers are public to every admitted worker, so the task
file of a run must never hold an evaluation split meant to stay held out.

What was stored is in :class:`~intellect.rl.registry.Registry` under ``state_dir``, which only the
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
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import uvicorn
from pydantic import Field, field_validator

from intellect.config import StrictModel
from intellect.data.loaders import task_row
from intellect.http_server import ConnectionGuard, ConnectionLimits, Drop, bind, guarded_server, serve_in_thread, url_of
from intellect.rl.admission import (
    DoneBody, Empty, RateLimiter, Refusal, Request, UploadBody, address_bucket, parse_json, parse_request, precheck,
    query_ints, verify_digest,
)
from intellect.rl.assignment import assign_prompts
from intellect.rl.registry import DoneRecord, Registry, SubmissionRecord
from intellect.rl.rollouts import submission_path
from intellect.rl.service_http import SPILL, Body, read_body, respond
from intellect.rl.service_s3 import Presigner
from intellect.trust.keys import VerifyKey
from intellect.trust.requests import CONTENT_HEADER, AuthError, ReplayGuard, RequestVerifier

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.storage import RunStorage

__all__ = ["DoneRecord", "ServiceConfig", "SubmissionRecord", "SubmissionService"]

log = logging.getLogger("intellect.rl.service")

_HEX64 = re.compile(r"[0-9a-f]{64}")


class ServiceConfig(StrictModel):
    """Where the submission service listens and what it admits."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255,
                      description="Listen address; 127.0.0.1 keeps the service on this machine.")
    port: int = Field(default=0, ge=0, le=65535, description="Listen port; 0 picks a free one.")
    admission: Literal["allowlist", "open"] = Field(
        default="open",
        description="allowlist: only the keys in `allowlist`; open: any key, registrations rate-limited.")
    allowlist: list[str] = Field(default_factory=list, max_length=1 << 16,
                                 description="Hex Ed25519 public keys admitted in allowlist mode.")
    registrations_per_minute: int = Field(
        default=10, ge=1, le=1 << 20,
        description="New keys admitted per client address (IPv6: per /64) per minute (open).")
    registrations_per_minute_total: int = Field(default=120, ge=1, le=1 << 24,
                                                description="New keys admitted per minute from all addresses (open).")
    max_workers: int = Field(default=10_000, ge=1, le=1 << 24, description="Most admitted workers.")
    worker_expiry: float = Field(default=3600.0, ge=1, le=365 * 86400,
                                 description="Seconds after which an admitted key that stored nothing may be "
                                             "dropped to admit a new one when `max_workers` are admitted.")
    max_body_bytes: int = Field(default=64 << 20, ge=1024, le=1 << 40, description="Largest upload (one Parquet file).")
    max_json_bytes: int = Field(default=64 << 10, ge=1024, le=SPILL, description="Largest JSON body.")
    max_concurrent_uploads: int = Field(default=16, ge=1, le=4096,
                                        description="Uploads read at once (one per key); more are refused as busy.")
    max_uploads_per_address: int = Field(default=8, ge=1, le=4096,
                                         description="Uploads read at once from one client address (IPv6: per /64).")
    max_worker_step_bytes: int = Field(default=512 << 20, ge=1024, le=1 << 44,
                                       description="Bytes one worker may store (or declare, S3) per step.")
    max_spool_bytes: int = Field(default=1 << 30, ge=1024, le=1 << 44,
                                 description="Declared bytes of the uploads being read at once.")
    min_free_bytes: int = Field(default=256 << 20, ge=0, le=1 << 44,
                                description="Free disk an upload must leave in the spool and local run storage.")
    min_body_rate: int = Field(default=64 << 10, ge=1, le=1 << 34,
                               description="Bytes per second a body must average after `body_grace`.")
    body_grace: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds a body may take before its rate counts.",
    )
    header_timeout: float = Field(default=10.0, gt=0, le=3600,
                                  description="Seconds a request head (line and headers) may take to arrive.")
    max_connections: int = Field(default=1024, ge=8, le=1 << 16, description="Open connections; more get 503.")
    max_connections_per_address: int = Field(default=64, ge=1, le=1 << 16,
                                             description="Open connections per client address (IPv6: per /64).")
    replay_per_key: int = Field(default=4096, ge=16, le=1 << 20,
                                description="Signed requests of one key remembered by the replay guard "
                                            "(2 x request_window); more are refused as busy.")
    request_window: float = Field(default=30.0, ge=1, le=3600,
                                  description="Seconds a signed request's timestamp may be off the service's clock.")
    max_submissions_per_step: int | None = Field(
        default=None, ge=1, le=1 << 16, description="Submissions per worker per step; None: an RL run's "
        "workers.max_submissions (RLRunConfig.service_config), 64 for a service started on its own.")
    ahead: int | None = Field(
        default=None, ge=0, le=1 << 20, description="Steps past the newest committed one a worker may submit for; "
        "None: an RL run's async_level + 1, 2 for a service started on its own.")
    presign_expiry: int = Field(
        default=120, ge=1, le=86400,
        description="Seconds a name's presigned POSTs stay valid, from its declaration (S3). The validator reads "
        "an object only after its window, so this is also the delay before a step's S3 files are validated.")

    @field_validator("allowlist")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [VerifyKey.from_hex(k.lower()).hex for k in keys]


class SubmissionService:
    """The service of one run (see the module docstring); :meth:`start` serves it in a thread."""

    def __init__(self, cfg: ServiceConfig, *, run: str, storage: RunStorage, state_dir: str | os.PathLike,
                 run_info: Callable[[], dict], tasks: Sequence[Task], prompts_per_submission: int,
                 committed: int = -1):
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
        self.limiter = RateLimiter(cfg.registrations_per_minute)
        self.limiter_total = RateLimiter(cfg.registrations_per_minute_total, max_addresses=1)
        self._allow = set(cfg.allowlist)
        self._committed = committed
        self._refusals: collections.deque[dict] = collections.deque(maxlen=1000)
        # uploads being read, their keys and declared bytes; connections per address (only the event
        # loop's thread touches these)
        self._reading, self._uploading, self._spooled = 0, set(), 0
        self._uploads_from: collections.Counter[str] = collections.Counter()
        self._guard = ConnectionGuard(ConnectionLimits(cfg.header_timeout, per_address=cfg.max_connections_per_address,
                                                       bucket=address_bucket), self._refused_connection)
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
        return self._reading

    def set_committed(self, step: int) -> None:
        """The newest committed step (-1: none): workers may work on steps ``step + 1`` to
        ``step + ahead``; ``step`` and those before it are closed."""
        self._committed = step

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
        # more than max_connections open get 503 (uvicorn's limit_concurrency)
        self._server = guarded_server(self.app, self._guard, keep_alive=min(5, int(cfg.header_timeout) or 1),
                                      interface="asgi3", limit_concurrency=cfg.max_connections,
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
            return 200, {"ok": True, "run": self.run}
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
        if req.name == "submissions":
            return await self._upload(req, key, receive, digest)
        body = await self._read(req, receive, self.cfg.max_json_bytes, digest)
        try:
            return await getattr(self, "_" + req.name)(req, key, body)
        finally:
            body.close()

    async def _upload(self, req: Request, key: VerifyKey, receive, digest: str) -> tuple[int, dict]:
        cfg = self.cfg
        if self._s3 is not None:
            raise Refusal(400, "wrong_mode", "S3 storage: ask POST /v1/uploads/N/K for a presigned POST")
        query_ints(req)
        k, step = self._k(req.args[1]), self._step(req.args[0])
        declared = req.headers.get("content-length")
        if declared is None:
            raise Refusal(411, "length_required", "an upload must declare its Content-Length")
        if not (declared.isascii() and declared.isdigit() and int(declared) <= cfg.max_body_bytes):
            raise Refusal(413, "too_large", f"body of {declared[:20]} bytes declared, at most {cfg.max_body_bytes}")
        size = int(declared)
        if size == 0:
            raise Refusal(400, "bad_request", "an empty submission")
        self._quota(key.id, step, k, size)
        if key.id in self._uploading:
            raise Refusal(503, "busy", "another upload of this key is being read; retry")
        over = self._spooled and self._spooled + size > cfg.max_spool_bytes  # alone, a body may take all of it
        if self._reading >= cfg.max_concurrent_uploads or over:
            raise Refusal(503, "busy", "too many uploads at once; retry")
        source = address_bucket(req.client)  # many keys of one address share its uploads
        if self._uploads_from[source] >= cfg.max_uploads_per_address:
            raise Refusal(503, "busy", "too many uploads from this address at once; retry")
        self._disk(size)
        self._reading, self._spooled = self._reading + 1, self._spooled + size
        self._uploading.add(key.id)
        self._uploads_from[source] += 1
        try:
            body = await self._read(req, receive, cfg.max_body_bytes, digest)
            try:
                return await self._submissions(req, key, body)
            finally:
                body.close()
        finally:
            self._reading, self._spooled = self._reading - 1, self._spooled - size
            self._uploading.discard(key.id)
            self._uploads_from[source] -= 1
            if self._uploads_from[source] <= 0:
                del self._uploads_from[source]

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
        parse_json(Empty, bytes(body.buf))
        new = False
        if self.registry.key(key.id) is None:
            if self.cfg.admission == "open" and not self.limiter.allow(address_bucket(req.client)):
                raise Refusal(429, "rate_limited", f"at most {self.cfg.registrations_per_minute} new keys "
                              "per address per minute")
            if self.cfg.admission == "open" and not self.limiter_total.allow("*"):
                raise Refusal(429, "rate_limited", f"at most {self.cfg.registrations_per_minute_total} new keys "
                              "per minute")
            new = await self._io(self.registry.admit, key, self.cfg.max_workers, self.cfg.worker_expiry)
            if new:
                log.info("admitted worker %s from %s", key.id, req.client)
        return (201 if new else 200), {"worker": key.id, "upload": "presigned" if self._s3 else "body"}

    async def _run(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        return 200, self._run_info()

    async def _assignment(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        step, k = query_ints(req, "step", "k")
        self._k(k)
        self._step(step)
        idx = assign_prompts(len(self.tasks), key.id, step, k, self.prompts_per_submission)
        tasks = [task_row(self.tasks[i]) for i in idx]
        return 200, {"step": step, "k": k, "tasks": tasks}

    async def _status(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        (step,) = query_ints(req, "step")
        self._step(step, closed_ok=True)  # a read: a restarted worker may ask what it left at a closed step
        held = sorted(r.k for r in self.registry.submissions(step, key.id))
        return 200, {"step": step, "submissions": held, "done": key.id in self.registry.done(step)}

    async def _submissions(self, req: Request, key: VerifyKey, body: Body) -> tuple[int, dict]:
        query_ints(req)
        step, k = self._step(req.args[0]), self._k(req.args[1])
        if body.size == 0:
            raise Refusal(400, "bad_request", "an empty submission")
        status, rec = await self._io(self._store, key.id, step, k, body)
        return status, asdict(rec)

    def _store(self, worker: str, step: int, k: int, body: Body) -> tuple[int, SubmissionRecord]:
        sha, rel = body.sha.hexdigest(), submission_path(step, worker, k)
        old = self.registry.claim(step, worker, k)
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
        if want.size > self.cfg.max_body_bytes:
            raise Refusal(413, "too_large", f"{want.size} bytes declared, at most {self.cfg.max_body_bytes}")
        self._quota(key.id, step, k, want.size)
        return await self._io(self._s3.presign, key.id, step, k, want)

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
