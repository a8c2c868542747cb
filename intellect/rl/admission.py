"""Who may talk to the submission service, how its requests are read, and what it has stored.

* :class:`Refusal`: every refused request, with an HTTP status and a reason from :data:`REASONS`;
* :func:`precheck` and :func:`verify_digest`: a signed request checked in two halves, the header
  fields before the body is read (an unsigned, stale or unknown key costs no body read) and the
  signature once the body's sha256 is known (the body is hashed as it streams in, never held whole);
* :func:`parse_request`, :func:`parse_json`: a request's route, integers, query and JSON body read
  strictly, with a :class:`Refusal` for anything off-contract;
* :class:`RateLimiter`: token buckets per client address (an IPv6 client by its /64,
  :func:`address_bucket`) for open registration;
* :class:`Registry`: admitted workers, stored submissions and done records, persisted as an
  append-only, fsync'd JSON-lines file in a folder only the trainer writes, and reloaded on restart;
  a key that stored nothing within ``expire_after`` seconds of its admission gives its place up to
  a new one once the registry is full, so a registration flood cannot close a run for good.

A worker id is :func:`~intellect.trust.keys.key_id` of its public key; the service never takes a
name from a worker.

>>> limiter = RateLimiter(per_minute=2)
>>> [limiter.allow("10.0.0.1", now=0.0) for _ in range(3)], limiter.allow("10.0.0.2", now=0.0)
([True, True, False], True)
>>> limiter.allow("10.0.0.1", now=30.0)  # one token back after half a minute
True
>>> address_bucket("2001:db8::1") == address_bucket("2001:db8::ffff:2"), address_bucket("::ffff:10.0.0.1")
(True, '10.0.0.1')
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Iterable, Literal, Mapping, TypeVar, get_args
from urllib.parse import parse_qs

from pydantic import Field, ValidationError

from intellect.config import StrictModel

from intellect.trust.keys import BadKey, VerifyKey
from intellect.trust.requests import AuthError, RequestVerifier, parse_headers

Reason = Literal[
    # the signature layer (intellect.trust.requests.AuthError)
    "unsigned", "malformed", "stale", "bad_signature", "replay", "busy",
    # admission
    "not_registered", "not_allowed", "rate_limited", "full",
    # the request itself
    "bad_request", "not_found", "method", "too_large", "out_of_range", "too_far_ahead", "wrong_mode", "closed",
    "length_required", "too_slow", "sha256_mismatch",
    # budgets: the worker's bytes per step, the service's disk
    "quota", "disk_full",
    # the registry
    "exists", "unknown_file", "finished", "conflict",
    # the service's own failure (never the worker's doing)
    "internal",
]
REASONS: tuple[str, ...] = get_args(Reason)

_AUTH_STATUS = {"unsigned": 401, "malformed": 400, "stale": 401, "bad_signature": 401, "replay": 401, "busy": 503}
REGISTRY_FILE = "submissions.jsonl"


class Refusal(Exception):
    """A request the service refuses: answered ``status`` with ``{"reason": reason, "detail": detail}``."""

    def __init__(self, status: int, reason: Reason, detail: str):
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(f"{status} {reason}: {detail}")
        self.status, self.reason, self.detail = status, reason, detail[:500]

    @classmethod
    def auth(cls, e: AuthError) -> Refusal:
        return cls(_AUTH_STATUS.get(e.reason, 401), e.reason, e.detail)


# --------------------------------------------------------------------- signed requests in two halves


def precheck(headers: Mapping[str, str], window: float, now: float | None = None) -> VerifyKey:
    """The key a request claims, once its signature headers are well formed and its timestamp is
    fresh; :class:`AuthError` otherwise. Nothing is proved yet: :func:`verify_digest` does that."""
    return parse_headers(headers, window, now).key


def verify_digest(verifier: RequestVerifier, method: str, path: str, body_sha256: str,
                  headers: Mapping[str, str], now: float | None = None) -> VerifyKey:
    """:meth:`RequestVerifier.verify` for a body known by its sha256 (hex), not by its bytes, so a
    body never has to sit whole in memory."""
    return verifier.verify(method, path, None, headers, now, body_sha256=body_sha256)


# --------------------------------------------------------------------- reading requests

ROUTES = {  # name -> (method, number of integer path segments)
    "register": ("POST", 0), "run": ("GET", 0), "assignment": ("GET", 0), "status": ("GET", 0),
    "submissions": ("PUT", 2), "uploads": ("POST", 2), "done": ("POST", 1),
}
_INT = re.compile(r"0|[1-9][0-9]{0,17}")


class Empty(StrictModel):
    """The body of ``POST /v1/register``: ``{}`` (or nothing)."""


class UploadBody(StrictModel):
    """The body of ``POST /v1/uploads/N/K``: what the worker will upload to S3."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex sha256 of the file, lowercase.")
    size: int = Field(ge=1, le=1 << 40, description="Its size in bytes.")


class DoneBody(StrictModel):
    """The body of ``POST /v1/done/N``: the worker's done marker."""

    files: list[Annotated[str, Field(max_length=512)]] = Field(
        max_length=1 << 16, description="Its submissions of the step (paths the service returned), distinct.")
    policy_step: int = Field(ge=0, lt=1 << 62, description="The checkpoint they were generated with.")


_M = TypeVar("_M", bound=StrictModel)


def parse_json(model: type[_M], body: bytes) -> _M:
    """``body`` as ``model``, strictly (no type coercion); :class:`Refusal` ``bad_request`` otherwise.

    >>> parse_json(UploadBody, b'{"sha256": "' + b"0" * 64 + b'", "size": "3"}')
    Traceback (most recent call last):
    ...
    intellect.rl.admission.Refusal: 400 bad_request: invalid JSON body: size: Input should be a valid integer
    """
    try:
        return model.model_validate_json(body or b"{}", strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise Refusal(400, "bad_request", f"invalid JSON body: {where + ': ' if where else ''}{err['msg']}") from None


def parse_int(text: str, what: str) -> int:
    """A decimal integer without sign or leading zeros, at most 18 digits (an int64 and a valid ``k``).

    >>> parse_int("12", "step"), [_INT.fullmatch(t) is None for t in ("-1", "01", "1e3", "..", "")]
    (12, [True, True, True, True, True])
    """
    if not _INT.fullmatch(text):
        raise Refusal(400, "bad_request", f"{what} must be a decimal integer, got {text[:40]!r}")
    return int(text)


@dataclass
class Request:
    """A request as the service reads it, before anything in it is believed."""

    method: str
    signed_path: str  # exactly as it arrived: raw path, then ?query
    name: str
    args: list[int]
    query: dict[str, list[str]]
    headers: dict[str, str]
    client: str


def parse_request(scope) -> Request:
    """The route, integer path arguments, query and headers of an ASGI ``scope``; :class:`Refusal`
    for an unknown route or method, a segment that is not a plain integer (so no ``..``, sign or
    encoded slash reaches a file name), a malformed query or a repeated signature header."""
    raw = scope.get("raw_path") or scope["path"].encode()
    qs = scope.get("query_string", b"")
    path, query = raw.decode("latin-1"), qs.decode("latin-1")
    parts = path.split("/")
    if len(parts) < 3 or parts[:2] != ["", "v1"] or parts[2] not in ROUTES:
        raise Refusal(404, "not_found", f"no route {path[:100]!r}")
    method, n_args = ROUTES[parts[2]]
    if len(parts) != 3 + n_args:
        raise Refusal(404, "not_found", f"no route {path[:100]!r}")
    if scope["method"] != method:
        raise Refusal(405, "method", f"{parts[2]} takes {method}")
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        name = k.decode("latin-1").lower()
        if name.startswith("x-intellect-") and name in headers:
            raise Refusal(400, "malformed", f"header {name} given twice")
        headers[name] = v.decode("latin-1")
    try:
        q = parse_qs(query, keep_blank_values=True, strict_parsing=True, max_num_fields=8) if query else {}
    except ValueError as e:
        raise Refusal(400, "bad_request", f"malformed query: {e}") from None
    client = scope.get("client") or ("unknown", 0)
    args = [parse_int(a, "path segment") for a in parts[3:]]
    return Request(scope["method"], path + ("?" + query if query else ""), parts[2], args, q, headers, client[0])


def query_ints(req: Request, *names: str) -> list[int]:
    """The integer query parameters ``names``, each exactly once and nothing else."""
    if set(req.query) != set(names) or any(len(v) != 1 for v in req.query.values()):
        raise Refusal(400, "bad_request", f"query must be {'&'.join(n + '=<int>' for n in names)}, once each")
    return [parse_int(req.query[n][0], n) for n in names]


# --------------------------------------------------------------------- open registration


def address_bucket(address: str) -> str:
    """The unit a client address is counted in: an IPv4 address as is (also when IPv4-mapped), an
    IPv6 address by its /64, the smallest block one subscriber is routinely given; anything else
    (a Unix socket, ``unknown``) as is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)



class RateLimiter:
    """Token buckets of ``per_minute`` tokens per address, refilled continuously.

    At most ``max_addresses`` buckets are kept; past that, buckets that have refilled completely
    (indistinguishable from new ones) are dropped, and if none has, new addresses are refused
    rather than old buckets forgotten, which would let a flood reset its own limits.
    """

    def __init__(self, per_minute: int, max_addresses: int = 1 << 16):
        if per_minute < 1 or max_addresses < 1:
            raise ValueError("need per_minute >= 1 and max_addresses >= 1")
        self.burst, self.rate, self.max_addresses = float(per_minute), per_minute / 60.0, max_addresses
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)
        self._lock = threading.Lock()

    def allow(self, address: str, now: float | None = None) -> bool:
        """Take one token of ``address``'s bucket; False when it is empty."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if address not in self._buckets and len(self._buckets) >= self.max_addresses:
                full = [a for a, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst]
                for a in full:
                    del self._buckets[a]
                if len(self._buckets) >= self.max_addresses:
                    return False
            tokens, at = self._buckets.get(address, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
            if tokens < 1.0:
                self._buckets[address] = (tokens, now)
                return False
            self._buckets[address] = (tokens - 1.0, now)
            return True


# --------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class SubmissionRecord:
    """A submission the service stored (local storage) or handed an upload for (S3): ``path`` is
    :func:`~intellect.rl.rollouts.submission_path` of ``(step, worker, k)``, ``sha256`` (hex) and
    ``size`` are of the body the worker signed (local) or declared (S3), ``time`` is Unix seconds."""

    worker: str
    step: int
    k: int
    path: str
    sha256: str
    size: int
    time: float


#: Seconds allowed between the trainer's clock and the object store's when a presigned POST expires.
UPLOAD_CLOCK_MARGIN = 5.0


def uploads_settled_at(records: Iterable[SubmissionRecord], presign_expiry: float,
                       margin: float = UPLOAD_CLOCK_MARGIN) -> float:
    """When no presigned POST handed out for ``records`` can write any more (Unix seconds; 0 for none).

    A presigned POST can be used again until it expires, and every POST for a name expires at the
    end of the window its first declaration opened, so an S3 object is final from then on: the
    validator reads it after that, and what it validated is what the trainer later reads.

    >>> uploads_settled_at([SubmissionRecord("w", 1, 0, "p", "0" * 64, 10, 100.0)], 60, margin=5)
    165.0
    """
    return max((r.time + presign_expiry + margin for r in records), default=0.0)


@dataclass(frozen=True)
class DoneRecord:
    """A worker's statement that ``files`` (its submissions of ``step``) are all it has for that step."""

    worker: str
    step: int
    files: list[str]
    policy_step: int
    time: float


@dataclass(frozen=True)
class WorkerRecord:
    worker: str
    public: str  # hex Ed25519 public key
    time: float


@dataclass(frozen=True)
class ExpiredRecord:
    """An admitted key removed because it stored nothing in time (it may register again)."""

    worker: str
    time: float


_TYPES = {"worker": WorkerRecord, "submission": SubmissionRecord, "done": DoneRecord, "expired": ExpiredRecord}


def _record_from(doc: dict):
    kind = doc.pop("type", None)
    cls = _TYPES.get(kind)
    if cls is None or set(doc) != {f for f in cls.__dataclass_fields__}:
        raise ValueError(f"not a registry record: {kind!r} with {sorted(doc)}")
    return cls(**doc)


@dataclass
class _State:
    keys: dict[str, VerifyKey] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    admitted: dict[str, float] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)  # workers with a submission or done record
    subs: dict[int, list[SubmissionRecord]] = field(default_factory=dict)
    by_name: dict[tuple[int, str, int], SubmissionRecord] = field(default_factory=dict)
    done: dict[int, dict[str, DoneRecord]] = field(default_factory=dict)


class Registry:
    """What the service admitted and stored, in ``state_dir/submissions.jsonl`` (see the module doc).

    Each record is one JSON line, appended and fsync'd before the request that made it is
    answered, so an answered request survives a crash. A torn last line (a crash mid-append) is cut
    off on load; any other unreadable line means the trainer-only folder was tampered with, and
    loading fails loudly rather than forgetting what was stored.
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / REGISTRY_FILE
        self._lock = threading.Lock()
        self._s = _State()
        self._pending: set[tuple[int, str, int]] = set()
        self._load()
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        for n, line in enumerate(data[:end].splitlines(), 1):
            try:
                self._apply(_record_from(json.loads(line)))
            except (ValueError, TypeError, BadKey) as e:
                raise RuntimeError(f"{self.path}:{n}: unreadable registry record ({e})") from None
        if end != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())

    def _apply(self, rec) -> None:
        s = self._s
        if isinstance(rec, WorkerRecord):
            key = VerifyKey.from_hex(rec.public)
            if key.id != rec.worker:
                raise ValueError(f"worker {rec.worker} is not the id of its key")
            if rec.worker not in s.keys:
                s.keys[rec.worker] = key
                s.order.append(rec.worker)
                s.admitted[rec.worker] = rec.time
        elif isinstance(rec, ExpiredRecord):
            if rec.worker in s.keys and rec.worker not in s.active:
                del s.keys[rec.worker], s.admitted[rec.worker]
                s.order.remove(rec.worker)
        elif isinstance(rec, SubmissionRecord):
            s.subs.setdefault(rec.step, []).append(rec)
            s.by_name[(rec.step, rec.worker, rec.k)] = rec
            s.active.add(rec.worker)
        else:
            s.active.add(rec.worker)
            s.done.setdefault(rec.step, {})[rec.worker] = DoneRecord(rec.worker, rec.step, list(rec.files),
                                                                    rec.policy_step, rec.time)

    def _append(self, rec) -> None:
        line = json.dumps({"type": next(k for k, c in _TYPES.items() if isinstance(rec, c)), **asdict(rec)})
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._apply(rec)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    # ---------------------------------------------------------------- workers

    def key(self, worker: str) -> VerifyKey | None:
        with self._lock:
            return self._s.keys.get(worker)

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._s.order)

    def admit(self, key: VerifyKey, max_workers: int | None = None, expire_after: float | None = None,
              now: float | None = None) -> bool:
        """Admit ``key`` (True), or say it was admitted before (False); :class:`Refusal` ``full`` when
        ``max_workers`` are admitted already, after expiring the keys admitted more than
        ``expire_after`` seconds ago that never stored anything (oldest first, as many as it takes)."""
        now = time.time() if now is None else now
        with self._lock:
            s = self._s
            if key.id in s.keys:
                return False
            if max_workers is not None and len(s.order) >= max_workers and expire_after is not None:
                idle = [w for w in s.order if w not in s.active and s.admitted[w] < now - expire_after]
                for w in idle[:len(s.order) - max_workers + 1]:
                    self._append(ExpiredRecord(w, now))
            if max_workers is not None and len(s.order) >= max_workers:
                raise Refusal(503, "full", f"{max_workers} workers are admitted already")
            self._append(WorkerRecord(key.id, key.hex, now))
            return True

    # ---------------------------------------------------------------- submissions

    def submission(self, step: int, worker: str, k: int) -> SubmissionRecord | None:
        with self._lock:
            return self._s.by_name.get((step, worker, k))

    def stored_bytes(self, step: int, worker: str) -> int:
        """The bytes of ``worker``'s submissions at ``step`` (stored, or declared for S3)."""
        with self._lock:
            return sum(r.size for r in self._s.subs.get(step, []) if r.worker == worker)

    def submissions(self, step: int, worker: str | None = None) -> list[SubmissionRecord]:
        """The records of ``step`` in arrival order (only ``worker``'s, if given)."""
        with self._lock:
            return [r for r in self._s.subs.get(step, []) if worker is None or r.worker == worker]

    def claim(self, step: int, worker: str, k: int) -> SubmissionRecord | None:
        """Reserve the name ``(step, worker, k)`` for a write, or return its record if it has one.
        :class:`Refusal` ``finished`` after the worker's done record for ``step``, ``busy`` while
        another request is writing the name. :meth:`release` after."""
        with self._lock:
            name = (step, worker, k)
            if name in self._s.by_name:
                return self._s.by_name[name]
            if worker in self._s.done.get(step, {}):
                raise Refusal(409, "finished", f"step {step} is finished: no new submissions")
            if name in self._pending:
                raise Refusal(409, "busy", "another request is storing this submission")
            self._pending.add(name)
            return None

    def release(self, step: int, worker: str, k: int, record: SubmissionRecord | None = None) -> None:
        """End a :meth:`claim`: record ``record`` (persisted) or give the name back."""
        with self._lock:
            try:
                if record is not None:
                    self._append(record)
            finally:
                self._pending.discard((step, worker, k))

    # ---------------------------------------------------------------- done

    def done(self, step: int) -> dict[str, DoneRecord]:
        with self._lock:
            return dict(self._s.done.get(step, {}))

    def finish(self, record: DoneRecord) -> bool:
        """Record ``record`` (True); False when the same record exists; :class:`Refusal` ``conflict``
        when a different one does, ``unknown_file`` when it names a file the service does not hold
        for that worker and step, ``busy`` while one of them is being stored."""
        with self._lock:
            old = self._s.done.get(record.step, {}).get(record.worker)
            if old is not None:
                if (old.files, old.policy_step) == (record.files, record.policy_step):
                    return False
                raise Refusal(409, "conflict", f"step {record.step} was finished with other files or policy")
            held = {r.path for r in self._s.subs.get(record.step, []) if r.worker == record.worker}
            unknown = [f for f in record.files if f not in held]
            if unknown:
                raise Refusal(409, "unknown_file", f"not a submission of this worker at step {record.step}: "
                              f"{unknown[0][:200]!r}")
            if any(s == record.step and w == record.worker for s, w, _ in self._pending):
                raise Refusal(409, "busy", "a submission of this step is being stored")
            self._append(record)
            return True
