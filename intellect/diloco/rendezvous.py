"""The DiLoCo rendezvous: a key-value store over HTTP that authenticates every request.

Why not TCPStore: it answers anyone who reaches its port, so an outsider could end the run
(``progress``), drop live workers (``dead/``), squat the first-wins decisions or join
(``launched/``); MAC'ing the values instead still lets it delete, garble and squat keys,
gloo's own included. Here no request without the run's credential is served at all. The keys
and who may write them are :mod:`intellect.diloco.protocol`'s. This module holds the wire format and
the server; the client, :class:`~intellect.diloco.rendezvous_client.RendezvousStore`, is a
``torch.distributed.Store``, so gloo's groups are built on it as on a TCPStore (``transport.new_group``).

Protocol. ``POST /v1/<op>`` with a JSON body; ops are TCPStore's (``set``, ``get``, which waits
up to a timeout for the key as gloo's rendezvous needs, ``add``, ``compare_set``, ``check``,
``delete``, ``wait``, ``num_keys``) plus ``check_many``. A request carries ``x-intellect-peer``,
``-time`` (ms), ``-nonce`` and ``-mac``: an HMAC (:mod:`intellect.trust.mac`) over the op, body,
time, nonce and peer name under that *peer's own key*, :func:`peer_key`. Only the server (the
coordinator) holds the run secret and derives any peer's key; a worker holds its own key only
(``coordinator.worker_credentials``), so it can speak as nobody else. The server refuses, with a
recorded reason (:attr:`RendezvousServer.refusals`), a request that is unsigned, malformed, stale
(outside ``window`` s of its clock: hosts need NTP), mis-MAC'd, replayed, too large, or a write
its ``policy`` does not allow that peer (``scope``). Answers carry a MAC under the same peer key
over the request's nonce and the answer, so whoever takes over the port cannot tell a worker anything.

Connections. At most ``max_connections`` (and a quarter of the process's descriptors); past
that a new one evicts the oldest that has sent nothing yet, so idle sockets cannot exhaust the
descriptors; one that has not begun a request within ``header_timeout`` s is closed, a refused
request closes its connection, and every request has a deadline.

Bounds. A peer's value is at most ``max_value`` bytes and the keys it wrote, with their values, at
most ``quota`` bytes (counted with :data:`KEY_OVERHEAD` per key, what a key costs the process beyond
its bytes), so whatever one peer writes, it holds at most ``quota`` bytes of the coordinator's
memory; the coordinator's own writes count against nobody. ``prune`` (the protocol's
``membership.retire``) names keys to drop after a write, e.g. the steps the run has left behind.

Contributors. ``POST /v1/join`` is the admission exchange (:mod:`intellect.diloco.admission`):
an Ed25519-signed request from a key on the run's allowlist, answered with that contributor's own
credentials, sealed to it; every other op is MAC'd as above.

What it does not do. Values and gloo's traffic travel in clear: run it on a private network
(WireGuard) or behind TLS. Reads are open to every admitted peer.

>>> key = peer_key(b"0" * 32, "run-a", "w0")
>>> t = request_tag(key, "set", b'{"key":"k"}', 1000, "ab" * 16, "w0")
>>> check_request(key, t, "set", b'{"key":"k"}', 1000, "ab" * 16, "w0")   # the request as MAC'd
True
>>> check_request(key, t, "add", b'{"key":"k"}', 1000, "ab" * 16, "w0")   # another op under its MAC
False
>>> check_request(peer_key(b"0" * 32, "run-a", "w1"), t, "set", b'{"key":"k"}', 1000, "ab" * 16, "w0")
False
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import resource
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from intellect.http_server import ConnectionGuard, ConnectionLimits, Drop, bind, guarded_server, serve_in_thread
from intellect.trust.mac import check, derive_key, tag
from intellect.trust.requests import AuthError, ReplayGuard

log = logging.getLogger("intellect.diloco")

COORDINATOR = "coordinator"  # the peer name the run secret's holder speaks as; no worker may take it
TIME_HEADER, NONCE_HEADER = "x-intellect-time", "x-intellect-nonce"
MAC_HEADER, PEER_HEADER = "x-intellect-mac", "x-intellect-peer"
_REQUEST, _ANSWER = "intellect/rendezvous/request/v1", "intellect/rendezvous/answer/v1"
MAX_BODY = 1 << 20  # gloo's values are addresses; the biggest of ours, a plan, is a few KB
MAX_VALUE = 16 << 10  # one value a peer writes: a metrics record, a plan, gloo's address list of 64 ranks fit
QUOTA = 2 << 20  # bytes of keys and values one peer may hold in the store (KEY_OVERHEAD per key included)
KEY_OVERHEAD = 256  # what one more key costs the process beyond its bytes (dict slot, str and bytes objects)
MAX_NONCES = 1 << 20  # nonces remembered (2 x window s), all peers together
MAX_KEY = 512
MAX_KEYS = 1 << 20
MAX_WAIT = 600.0
OPS = ("set", "get", "add", "compare_set", "check", "check_many", "delete", "wait", "num_keys")
WRITES = ("set", "add", "compare_set", "delete")
MAX_CONNECTIONS = 512
HEADER_TIMEOUT = 10.0  # s for a new connection to begin its request
KEEP_ALIVE = 30.0  # s between requests; a client reconnects once on a closed kept-alive connection
ACCEPT_BATCH = 64  # connections accepted per wake-up (and the listen queue)


def peer_key(secret: bytes, run: str, peer: str) -> bytes:
    """The key that MACs ``peer``'s rendezvous requests (and the server's answers to them)."""
    return derive_key(secret, "peer", run, peer)


def allreduce_root(secret: bytes, run: str) -> bytes:
    """The root of the all-reduce MAC keys: every member holds it (a member must check the others'
    messages), so it is derived apart from the run secret, which opens the rendezvous as anyone."""
    return derive_key(secret, "allreduce-root", run)


def request_tag(key: bytes, op: str, body: bytes, time_ms: int, nonce: str, peer: str) -> bytes:
    return tag(key, _REQUEST, op, body, time_ms, nonce, peer)


def check_request(key: bytes, got: bytes, op: str, body: bytes, time_ms: int, nonce: str, peer: str) -> bool:
    return check(key, got, _REQUEST, op, body, time_ms, nonce, peer)


def answer_tag(key: bytes, nonce: str, answer: bytes) -> bytes:
    return tag(key, _ANSWER, nonce, answer)


def check_answer(key: bytes, got: bytes, nonce: str, answer: bytes) -> bool:
    return check(key, got, _ANSWER, nonce, answer)


def b64(v: bytes) -> str:
    """A value as a request body carries it: base64."""
    return base64.b64encode(v).decode()


def unb64(s) -> bytes:
    """A value as a request body carries it (base64) decoded; ``ValueError`` when it is not."""
    if not isinstance(s, str):
        raise ValueError("a value is a base64 string")
    return base64.b64decode(s, validate=True)


# ---------------------------------------------------------------------- server


class OverQuota(ValueError):
    """A write over a peer's value cap or store quota (refused as ``quota``)."""


def _cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + KEY_OVERHEAD


class _Table:
    """The keys and values, on the server's event loop; waiters wake on every write.

    ``owner`` names the peer whose write each key's bytes count against (``usage``); the
    coordinator's own keys count against nobody."""

    def __init__(self, max_value: int = MAX_VALUE, quota: int = QUOTA):
        self.data: dict[str, bytes] = {}
        self.owner: dict[str, str] = {}
        self.usage: collections.Counter[str] = collections.Counter()
        self.max_value, self.quota = max_value, quota
        self.changed = asyncio.Condition()

    async def _wrote(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _until(self, keys: list[str], timeout: float) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: all(k in self.data for k in keys)), timeout)
                return True
            except asyncio.TimeoutError:
                return False

    def _room(self, key: str) -> None:
        if key not in self.data and len(self.data) >= MAX_KEYS:
            raise ValueError("the store is full")

    def charge(self, peer: str, key: str, value: bytes) -> None:
        """Whether ``peer`` may store ``value`` at ``key``: :class:`OverQuota` if the value is over
        ``max_value`` or would take ``peer`` past its ``quota``; nothing is charged yet."""
        if peer == COORDINATOR:
            return
        if len(value) > self.max_value:
            raise OverQuota(f"a value is at most {self.max_value} bytes (got {len(value)})")
        old = _cost(key, self.data[key]) if self.owner.get(key) == peer else 0
        if self.usage[peer] - old + _cost(key, value) > self.quota:
            raise OverQuota(f"{peer} holds {self.usage[peer]} bytes of the store; the quota is {self.quota}")

    def put(self, peer: str, key: str, value: bytes) -> None:
        self._room(key)
        self.drop(key)
        self.data[key] = value
        if peer != COORDINATOR:
            self.owner[key] = peer
            self.usage[peer] += _cost(key, value)

    def drop(self, key: str) -> bool:
        value = self.data.pop(key, None)
        owner = self.owner.pop(key, None)
        if owner is not None and value is not None:
            self.usage[owner] -= _cost(key, value)
            if self.usage[owner] <= 0:
                del self.usage[owner]
        return value is not None

    async def run(self, op: str, req: dict, peer: str = COORDINATOR) -> dict:
        key = req.get("key")
        keys = req.get("keys")
        if op in ("set", "get", "add", "compare_set", "delete"):
            if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
                raise ValueError(f"a key is a string of 1-{MAX_KEY} characters")
        if op in ("check", "check_many", "wait"):
            if not (isinstance(keys, list) and 0 < len(keys) <= 4096
                    and all(isinstance(k, str) and 0 < len(k) <= MAX_KEY for k in keys)):
                raise ValueError("keys is a list of 1-4096 keys")
        key, keys = key if isinstance(key, str) else "", keys if isinstance(keys, list) else []  # checked above
        timeout = min(max(float(req.get("timeout", 0.0)), 0.0), MAX_WAIT)
        if op == "set":
            value = unb64(req["value"])
            self.charge(peer, key, value)
            self.put(peer, key, value)
            await self._wrote()
            return {}
        if op == "get":
            if key not in self.data and not await self._until([key], timeout):
                return {"missing": True}
            return {"value": b64(self.data[key])}
        if op == "add":
            amount = req["amount"]
            if type(amount) is not int or abs(amount) > 1 << 62:
                raise ValueError("amount is an integer")
            if amount == 0 and key not in self.data:  # a read of a counter: it creates nothing
                return {"value": 0}
            value = int(self.data.get(key, b"0")) + amount
            if amount:
                self.charge(peer, key, str(value).encode())
                self.put(peer, key, str(value).encode())
                await self._wrote()
            return {"value": value}
        if op == "compare_set":  # TCPStore's semantics
            expected, desired = unb64(req["expected"]), unb64(req["desired"])
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self.charge(peer, key, desired)
                self.put(peer, key, desired)
                await self._wrote()
                return {"value": b64(desired)}
            return {"value": b64(expected if current is None else current)}
        if op == "check":
            return {"value": all(k in self.data for k in keys)}
        if op == "check_many":
            return {"value": [k in self.data for k in keys]}
        if op == "delete":
            return {"value": self.drop(key)}
        if op == "wait":
            return {"value": await self._until(keys, timeout)}
        if op == "num_keys":
            return {"value": len(self.data)}
        raise ValueError(f"unknown op {op!r}")


class RendezvousServer:
    """The coordinator's store: uvicorn on ``host:port`` (0: a free port) in a daemon thread.

    ``policy(peer, op, request, data)`` says whether ``peer`` may make the write ``op``
    (``request``: its decoded body; ``data``: the table, read-only): None when it may, else
    the reason, refused as ``scope`` (or a ``(reason, detail)`` pair). None: every authenticated
    peer writes every key. ``prune(key, data)``: the keys to drop after ``key`` was written.
    ``admission``: what answers ``POST /v1/join`` (``admission.Admission``; None: no contributors).
    ``refusals`` counts refused requests (and dropped connections) by reason; ``refused``
    keeps the last 256 refused requests as ``(time, client address, peer name, reason, detail)``.
    """

    def __init__(self, secret: bytes, run: str, host: str = "127.0.0.1", port: int = 0, window: float = 60.0,
                 policy=None, max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT,
                 max_value: int = MAX_VALUE, quota: int = QUOTA, prune=None, admission=None):
        self.secret, self.run, self.window, self.policy = secret, run, window, policy
        self.max_value, self.quota, self.prune, self.admission = max_value, quota, prune, admission
        # a quarter of the process's descriptors at most, accepted in batches of ACCEPT_BATCH: a flood
        # meets eviction before the process runs out of descriptors
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        cap = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, max(16, soft // 4))
        self.max_connections, self.header_timeout = cap, header_timeout
        self._keys: dict[str, bytes] = {}
        # one peer's nonces take at most a quarter of the guard, so no peer's flood makes the others busy
        self.guard = ReplayGuard(window, capacity=MAX_NONCES, per_key=MAX_NONCES // 4)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.refused: collections.deque = collections.deque(maxlen=256)
        self.served = 0
        self._table: _Table | None = None
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        # the header timeout holds for a connection's first request head; between requests a kept-alive
        # connection is bounded by KEEP_ALIVE
        guard = ConnectionGuard(ConnectionLimits(header_timeout, each_request=False, evict_over=cap), self._dropped)
        self._server = guarded_server(self._app(), guard, keep_alive=KEEP_ALIVE, backlog=ACCEPT_BATCH)
        self._thread = serve_in_thread(self._server, self.sock, f"rendezvous-{self.port}", 30)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def key_of(self, peer: str) -> bytes:
        key = self._keys.get(peer)
        if key is None:
            key = peer_key(self.secret, self.run, peer)
            if len(self._keys) < 4096:
                self._keys[peer] = key
        return key

    def _dropped(self, client: str, reason: Drop, detail: str) -> None:
        # a connection that did not send its first request head in time, whether it began one or not
        self._count("header_timeout" if reason in ("idle", "too_slow") else reason)

    def _count(self, reason: str) -> None:
        self.refusals[reason] += 1
        if self.refusals[reason] <= 3 or self.refusals[reason] % 1000 == 0:
            log.warning("rendezvous: dropped a connection: %s (%d so far)", reason, self.refusals[reason])

    def _refuse(self, request: Request, reason: str, detail: str, status: int = 401, close: bool = True) -> Response:
        self.refusals[reason] += 1
        peer = request.headers.get(PEER_HEADER, "")[:64]
        client = request.client.host if request.client else "?"
        self.refused.append((time.time(), client, peer, reason, detail[:200]))
        if self.refusals[reason] <= 3 or self.refusals[reason] % 1000 == 0:
            log.warning("rendezvous: refused a request from %s (%r): %s: %s", client, peer, reason, detail)
        # closed after the answer, so a refused client holds no connection; not while the client may
        # still be sending a body we did not read: closing under it breaks its send, not its request
        return Response(json.dumps({"reason": reason, "detail": detail}), status, media_type="application/json",
                        headers={"connection": "close"} if close else None)

    @property
    def table(self) -> _Table:
        if self._table is None:
            self._table = _Table(self.max_value, self.quota)  # made on the server's own loop
        return self._table

    async def _body(self, request: Request) -> bytes | Response:
        try:
            length = int(request.headers.get("content-length") or 0)
        except ValueError:
            return self._refuse(request, "malformed", "content-length is not a number", 400)
        if length > MAX_BODY:
            return self._refuse(request, "too_large", "body over the cap", 413, close=False)
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_BODY:
                return self._refuse(request, "too_large", "body over the cap", 413, close=False)
        return bytes(body)

    async def _join(self, request: Request) -> Response:
        if self.admission is None:
            return self._refuse(request, "not_admitted", "this run admits no contributors", 403)
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        try:  # no await between the verdict and the admission it writes
            out, headers, admitted = self.admission.admit(dict(request.headers), body, self.table.data)
        except PermissionError as e:  # AuthError (the signature) or admission.Refusal (the allowlist)
            reason, detail = getattr(e, "reason", "refused"), getattr(e, "detail", str(e))
            return self._refuse(request, reason, detail, 403 if reason in ("not_admitted", "banned") else 401)
        for key, value in admitted.items():
            self.table.put(COORDINATOR, key, value)
        if admitted:
            await self.table._wrote()
        self.served += 1
        return Response(out, 200, media_type="application/json", headers=headers)

    def _app(self) -> Starlette:
        async def handle(request: Request) -> Response:
            try:  # a request's deadline: its longest wait plus time to read the body
                return await asyncio.wait_for(serve(request), MAX_WAIT + 30)
            except asyncio.TimeoutError:
                return self._refuse(request, "deadline", "the request ran past its deadline", 408)

        async def serve(request: Request) -> Response:
            table = self.table
            op = request.path_params["op"]
            if op == "join":
                return await self._join(request)
            if op not in OPS:
                return self._refuse(request, "malformed", f"unknown op {op[:32]!r}", 404)
            body = await self._body(request)
            if isinstance(body, Response):
                return body
            h = request.headers
            time_s, nonce, mac, peer = h.get(TIME_HEADER), h.get(NONCE_HEADER), h.get(MAC_HEADER), h.get(PEER_HEADER, "")
            if time_s is None or nonce is None or mac is None:
                return self._refuse(request, "unsigned", "no MAC headers")
            try:
                if len(time_s) > 16 or len(nonce) != 32 or len(mac) != 64 or len(peer) > 64:
                    raise ValueError("bad field length")
                time_ms, got = int(time_s), bytes.fromhex(mac)
                int(nonce, 16)
            except ValueError as e:
                return self._refuse(request, "malformed", str(e))
            now = time.time()
            if abs(time_ms / 1000 - now) > self.window:
                return self._refuse(request, "stale", f"timestamp {time_ms / 1000 - now:+.0f} s off")
            key = self.key_of(peer)
            if not check_request(key, got, op, body, time_ms, nonce, peer):
                return self._refuse(request, "bad_mac", "the MAC does not match the request under that peer's key")
            try:
                self.guard.admit(peer.encode(), nonce, now)
            except AuthError as e:
                return self._refuse(request, e.reason, e.detail)
            try:
                req = json.loads(body)
                if not isinstance(req, dict):
                    raise ValueError("the body is a JSON object")
                # checked and run with no await in between: the table cannot change under the verdict
                why = self.policy(peer, op, req, table.data) if self.policy and op in WRITES else None
                if why is not None:
                    reason, why = why if isinstance(why, tuple) else ("scope", why)
                    return self._refuse(request, reason, why, 403)
                answer = await table.run(op, req, peer)
                if self.prune is not None and op in WRITES:
                    for old in self.prune(req["key"], table.data):
                        table.drop(old)
            except OverQuota as e:
                return self._refuse(request, "quota", str(e), 413)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                return self._refuse(request, "malformed", f"{type(e).__name__}: {e}", 400)
            self.served += 1
            out = json.dumps(answer, separators=(",", ":")).encode()
            return Response(out, 200, media_type="application/json",
                            headers={MAC_HEADER: answer_tag(key, nonce, out).hex()})

        return Starlette(routes=[Route("/v1/{op}", handle, methods=["POST"])])

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
