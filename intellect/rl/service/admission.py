"""Who may talk to the submission service and how its requests are read.

* :class:`Refusal`: every refused request, with an HTTP status and a reason from :data:`REASONS`;
* :func:`precheck` and :func:`verify_digest`: a signed request checked in two halves, the header
  fields before the body is read (an unsigned, stale or unknown key costs no body read) and the
  signature once the body's sha256 is known (the body is hashed as it streams in, never held whole);
* :func:`parse_request`, :func:`parse_json`: a request's route, integers, query and JSON body read
  strictly, with a :class:`Refusal` for anything off-contract;
* :func:`address_prefix`: the unit every per-client bound counts in (an IPv4 /24, an IPv6 /48);
* :class:`RateLimiter`, :class:`RegistrationLimiter`: token buckets per prefix, and the shared
  registration budget that a few prefixes cannot drain;
* :func:`submission_bytes`: the largest Parquet file a submission of a run can be, the cap on a
  declared upload.

What the service has admitted and stored is :class:`~intellect.rl.service.registry.Registry`'s.

A worker id is :func:`~intellect.trust.keys.key_id` of its public key; the service never takes a
name from a worker.

>>> limiter = RateLimiter(per_minute=2)
>>> [limiter.allow("10.0.0.1", now=0.0) for _ in range(3)], limiter.allow("10.0.0.2", now=0.0)
([True, True, False], True)
>>> limiter.allow("10.0.0.1", now=30.0)  # one token back after half a minute
True
>>> address_prefix("2001:db8:0:1::1") == address_prefix("2001:db8:0:2::1"), address_prefix("::ffff:10.0.0.1")
(True, '10.0.0.0/24')
"""

from __future__ import annotations

import ipaddress
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Mapping, TypeVar, get_args
from urllib.parse import parse_qs

import pyarrow as pa
from pydantic import Field, ValidationError

from intellect.config import StrictModel
from intellect.rl.wire.rollout_schema import MAX_ID_CHARS, SCHEMA
from intellect.trust.keys import VerifyKey
from intellect.trust.requests import AuthError, RequestVerifier, parse_headers

Reason = Literal[
    # the signature layer (intellect.trust.requests.AuthError)
    "unsigned", "malformed", "stale", "bad_signature", "replay", "busy",
    # admission
    "not_registered", "not_allowed", "rate_limited", "full", "work",
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
    intellect.rl.service.admission.Refusal: 400 bad_request: invalid JSON body: size: Input should be a valid integer
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


# --------------------------------------------------------------------- per-client bounds

PREFIX_V4, PREFIX_V6 = 24, 48


def address_prefix(address: str) -> str:
    """The unit a client is counted in: an IPv4 address by its /24 (also when IPv4-mapped), an IPv6
    address by its /48; anything else (a Unix socket, ``unknown``) as is.

    Fair shares split a bound among prefixes, so a prefix must be what one party cannot multiply
    cheaply. An IPv6 end site is routinely given a /48 (RFC 6177; a /56 at the least): counted by
    /64, one site would hold 65,536 shares. An IPv4 /24 is the smallest block routed on its own, and a
    rented block of addresses usually lies within one. Neighbours in one prefix (a lab, a cloud
    region's NAT) only share one share when the service is contended, since an unused share goes to
    whoever asks.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = PREFIX_V4 if ip.version == 4 else PREFIX_V6
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


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
            tokens = self.level(address, now)
            if tokens is None or tokens < 1.0:
                return False
            self._buckets[address] = (tokens - 1.0, now)
            return True

    def level(self, address: str, now: float) -> float | None:
        """The tokens in ``address``'s bucket at ``now``; None when a new bucket has no room (callers hold
        the lock)."""
        if address not in self._buckets and len(self._buckets) >= self.max_addresses:
            full = [a for a, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst]
            for a in full:
                del self._buckets[a]
            if len(self._buckets) >= self.max_addresses:
                return None
        tokens, at = self._buckets.get(address, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def take(self, address: str, tokens: float, now: float) -> None:
        """Set ``address``'s bucket to ``tokens`` minus one (callers hold the lock)."""
        self._buckets[address] = (tokens - 1.0, now)


class RegistrationLimiter:
    """New keys per prefix (``per_prefix`` a minute) and in total (``total`` a minute), the total
    shared so that a few prefixes cannot drain it: its last ``reserve`` tokens go only to prefixes
    that used less than half of their own allowance lately. Draining the reserve too takes about
    ``reserve / (per_prefix / 2)`` fresh prefixes a minute.

    >>> lim = RegistrationLimiter(per_prefix=4, total=6, reserve=3)
    >>> [lim.allow("a", now=0.0)[0] for _ in range(5)], [lim.allow("b", now=0.0)[0] for _ in range(4)]
    ([True, True, True, False, False], [True, True, False, False])
    >>> lim.allow("c", now=0.0)
    (True, '')
    """

    def __init__(self, per_prefix: int, total: int, reserve: int, max_prefixes: int = 1 << 16):
        if not 0 <= reserve < total:
            raise ValueError("need 0 <= reserve < total")
        self.per_prefix, self.total, self.reserve = per_prefix, total, reserve
        self._prefixes = RateLimiter(per_prefix, max_prefixes)
        self._shared = RateLimiter(total, max_addresses=1)
        self._lock = threading.Lock()

    def allow(self, prefix: str, now: float | None = None) -> tuple[bool, str]:
        """Take a token of ``prefix`` and of the shared budget: ``(True, "")``, or ``(False, why)``
        and nothing taken."""
        now = time.monotonic() if now is None else now
        with self._lock:
            own = self._prefixes.level(prefix, now)
            if own is None or own < 1.0:
                return False, f"at most {self.per_prefix} new keys per address prefix per minute"
            shared = self._shared.level("*", now)
            if shared is None or shared < 1.0:
                return False, f"at most {self.total} new keys per minute"
            if shared - 1.0 < self.reserve and self.per_prefix - own >= self.per_prefix / 2:
                return False, (f"the last {self.reserve} of the {self.total} new keys a minute are kept for address "
                               "prefixes that registered few keys lately")
            self._prefixes.take(prefix, own, now)
            self._shared.take("*", shared, now)
            return True, ""


# --------------------------------------------------------------------- the size of a submission

#: Parquet's own bytes besides the values, per page and column chunk: page headers with their statistics
#: (a writer keeps statistics of at most 4 KiB a value), the footer's chunk metadata, the page index.
PARQUET_CHUNK_OVERHEAD = 8 << 10
#: Pages per column chunk are at least one per this many bytes (pyarrow's data page size: 1 MiB).
PARQUET_PAGE_BYTES = 1 << 20


def submission_bytes(rows: int, prompt_tokens: int, output_tokens: int, proof_bytes: int) -> int:
    """The largest Parquet file of ``rows`` samples of :data:`~intellect.rl.wire.rollout_schema.SCHEMA`,
    each with at most ``prompt_tokens`` and ``output_tokens`` token ids and ``proof_bytes`` of proof:
    the cap on what a worker may declare.

    Per value, the schema's own width (a token id: 4 bytes), 4 bytes of offsets per list or binary
    value, 1 byte of repetition and definition levels (bit-packed, at most 2 bits each), strings at
    their longest UTF-8 (4 bytes a character); a column's dictionary page (at most a page) comes on
    top, and its indices are never wider than the values they stand for. Compression can only grow incompressible pages by a little (zstd: 1/256 + a few
    bytes a page), and every column chunk and page adds a bounded overhead.

    >>> submission_bytes(32, 100, 16, 0) < submission_bytes(32, 100, 16, 258) < submission_bytes(64, 100, 16, 258)
    True
    """
    columns = []
    for f in SCHEMA:
        if pa.types.is_list(f.type):
            most = prompt_tokens if f.name == "prompt_tokens" else output_tokens
            columns.append(most * (f.type.value_type.bit_width // 8 + 1) + 4 + 1)
        elif f.name == "proof":
            columns.append(proof_bytes + 4 + 1)
        elif pa.types.is_string(f.type):
            columns.append(4 * MAX_ID_CHARS + 4 + 1)
        else:
            columns.append(f.type.bit_width // 8 + 1)
    # a dictionary page holds up to a page of distinct values before the writer falls back to plain
    values = sum(rows * c + min(rows * c, PARQUET_PAGE_BYTES) for c in columns)
    pages = len(SCHEMA) + math.ceil(values / PARQUET_PAGE_BYTES)
    return values + values // 256 + pages * PARQUET_CHUNK_OVERHEAD
