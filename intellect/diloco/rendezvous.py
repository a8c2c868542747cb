"""The DiLoCo rendezvous: a key-value store over HTTP that authenticates every request.

Why not TCPStore. ``torch.distributed.TCPStore`` answers anyone who reaches its port: an
outsider could write ``progress`` (ending the run), ``dead/<w>`` (dropping a live worker),
squat the first-wins ``members/`` and ``outcome/`` keys, or register in ``launched/``, join
and receive the model. MAC'ing every *value* on a TCPStore (the other option) keeps forged
values out but not the outsider: it can still delete keys, overwrite good values with garbage
(readers then see them as absent and wait), squat every first-wins key before its proposer and
rewrite gloo's own rendezvous keys, which gloo writes unauthenticated. That leaves integrity
to the readers and availability to the network. Here no request without the run's credential
is served at all, so the only thing an outsider can do at the port is be refused.

gloo accepts any ``torch.distributed.Store``, a Python subclass included (through
``PrefixStore``): :class:`RendezvousStore` is one, and process groups are built on it exactly
as on a TCPStore (``transport.new_group``).

Protocol. ``POST /v1/<op>`` with a JSON body; ops are TCPStore's: ``set``, ``get`` (waits up
to a timeout for the key, as gloo's rendezvous needs), ``add``, ``compare_set``, ``check``,
``delete``, ``wait``, ``num_keys``, plus ``check_many`` (one round trip for the liveness polls).
A request carries ``x-intellect-time`` (ms), ``x-intellect-nonce`` and ``x-intellect-mac``:
an HMAC (:mod:`intellect.trust.mac`) under ``derive_key(secret, "rendezvous", run)`` over the
op, the body, the time, the nonce and the peer's name. The server refuses, with a recorded
reason (:attr:`RendezvousServer.refusals`), a request that is unsigned, malformed, stale
(outside ``window`` seconds of its clock: hosts need NTP), mis-MAC'd or replayed (its nonce
was seen within the window), or too large. Answers carry a MAC over the request's nonce and
the answer, so a process that takes over the port (or a forged answer on the wire) cannot
tell a worker anything either.

What it does not do. The secret is shared: every admitted worker can write every key, so
an admitted liar is bounded elsewhere (``robust.py``, the vote). Values and gloo's traffic
travel in clear: run it on a private network (WireGuard) or behind TLS.

>>> key = request_key(b"0" * 32, "run-a")
>>> t = request_tag(key, "set", b'{"key":"k"}', 1000, "ab" * 16, "w0")
>>> check_request(key, t, "set", b'{"key":"k"}', 1000, "ab" * 16, "w0")   # the request as MAC'd
True
>>> check_request(key, t, "add", b'{"key":"k"}', 1000, "ab" * 16, "w0")   # another op under its MAC
False
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import http.client
import json
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path

import torch.distributed as dist
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from intellect.shardcast.server import bind
from intellect.trust.mac import check, derive_key, tag
from intellect.trust.requests import AuthError, ReplayGuard

log = logging.getLogger("intellect.diloco")

SECRET_ENV = "INTELLECT_DILOCO_SECRET"  # hex; how the coordinator hands the secret to its own subprocesses
TIME_HEADER, NONCE_HEADER = "x-intellect-time", "x-intellect-nonce"
MAC_HEADER, PEER_HEADER = "x-intellect-mac", "x-intellect-peer"
_REQUEST, _ANSWER = "intellect/rendezvous/request/v1", "intellect/rendezvous/answer/v1"
MAX_BODY = 1 << 20  # gloo's values are addresses; the biggest of ours, a plan, is a few KB
MAX_KEY = 512
MAX_KEYS = 1 << 20
MAX_WAIT = 600.0
OPS = ("set", "get", "add", "compare_set", "check", "check_many", "delete", "wait", "num_keys")


class BadSecret(ValueError):
    """No usable run secret (missing, too short, or its file is readable by others)."""


def load_secret(secret_file: str | None, environ=os.environ) -> bytes | None:
    """The run secret: ``$INTELLECT_DILOCO_SECRET`` (hex), else ``secret_file`` (hex, mode 0600), else None."""
    text = environ.get(SECRET_ENV)
    where = SECRET_ENV
    if text is None and secret_file:
        path = Path(secret_file)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise BadSecret(f"{path}: secret file is accessible by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
        text, where = path.read_text()[:4096], str(path)
    if text is None:
        return None
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise BadSecret(f"{where}: the run secret is hex digits") from None
    if len(secret) < 16:
        raise BadSecret(f"{where}: the run secret needs at least 16 bytes (32 hex digits)")
    return secret


def write_secret(path: str | os.PathLike, secret: bytes) -> Path:
    """Write ``secret`` as hex to a new file created with mode 0600."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return path


def request_key(secret: bytes, run: str) -> bytes:
    return derive_key(secret, "rendezvous", run)


def request_tag(key: bytes, op: str, body: bytes, time_ms: int, nonce: str, peer: str) -> bytes:
    return tag(key, _REQUEST, op, body, time_ms, nonce, peer)


def check_request(key: bytes, got: bytes, op: str, body: bytes, time_ms: int, nonce: str, peer: str) -> bool:
    return check(key, got, _REQUEST, op, body, time_ms, nonce, peer)


def _b64(v: bytes) -> str:
    return base64.b64encode(v).decode()


def _unb64(s) -> bytes:
    if not isinstance(s, str):
        raise ValueError("a value is a base64 string")
    return base64.b64decode(s, validate=True)


def _to_bytes(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)  # gloo hands values over as lists of ints


# ---------------------------------------------------------------------- server


class _Table:
    """The keys and values, on the server's event loop; waiters wake on every write."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
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

    async def run(self, op: str, req: dict) -> dict:
        key = req.get("key")
        keys = req.get("keys")
        if op in ("set", "get", "add", "compare_set", "delete"):
            if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
                raise ValueError(f"a key is a string of 1-{MAX_KEY} characters")
        if op in ("check", "check_many", "wait"):
            if not (isinstance(keys, list) and 0 < len(keys) <= 4096
                    and all(isinstance(k, str) and 0 < len(k) <= MAX_KEY for k in keys)):
                raise ValueError("keys is a list of 1-4096 keys")
        timeout = min(max(float(req.get("timeout", 0.0)), 0.0), MAX_WAIT)
        if op == "set":
            self._room(key)
            self.data[key] = _unb64(req["value"])
            await self._wrote()
            return {}
        if op == "get":
            if key not in self.data and not await self._until([key], timeout):
                return {"missing": True}
            return {"value": _b64(self.data[key])}
        if op == "add":
            amount = req["amount"]
            if type(amount) is not int or abs(amount) > 1 << 62:
                raise ValueError("amount is an integer")
            self._room(key)
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            await self._wrote()
            return {"value": value}
        if op == "compare_set":  # TCPStore's semantics
            expected, desired = _unb64(req["expected"]), _unb64(req["desired"])
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self._room(key)
                self.data[key] = desired
                await self._wrote()
                return {"value": _b64(desired)}
            return {"value": _b64(expected if current is None else current)}
        if op == "check":
            return {"value": all(k in self.data for k in keys)}
        if op == "check_many":
            return {"value": [k in self.data for k in keys]}
        if op == "delete":
            return {"value": self.data.pop(key, None) is not None}
        if op == "wait":
            return {"value": await self._until(keys, timeout)}
        if op == "num_keys":
            return {"value": len(self.data)}
        raise ValueError(f"unknown op {op!r}")


class RendezvousServer:
    """The coordinator's store: uvicorn on ``host:port`` (0: a free port) in a daemon thread.

    ``refusals`` counts refused requests by reason; ``refused`` keeps the last 256 of them
    as ``(time, client address, peer name, reason, detail)``.
    """

    def __init__(self, secret: bytes, run: str, host: str = "127.0.0.1", port: int = 0, window: float = 60.0):
        self.key, self.window = request_key(secret, run), window
        self.guard = ReplayGuard(window)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.refused: collections.deque = collections.deque(maxlen=256)
        self.served = 0
        self._table: _Table | None = None
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(self._app(), http="h11", loop="asyncio", log_level="warning", access_log=False,
                                timeout_keep_alive=600, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                        name=f"rendezvous-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the rendezvous server did not start")
            time.sleep(0.01)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _refuse(self, request: Request, reason: str, detail: str, status: int = 401) -> Response:
        self.refusals[reason] += 1
        peer = request.headers.get(PEER_HEADER, "")[:64]
        client = request.client.host if request.client else "?"
        self.refused.append((time.time(), client, peer, reason, detail[:200]))
        if self.refusals[reason] <= 3 or self.refusals[reason] % 1000 == 0:
            log.warning("rendezvous: refused a request from %s (%r): %s: %s", client, peer, reason, detail)
        return Response(json.dumps({"reason": reason, "detail": detail}), status, media_type="application/json")

    def _app(self) -> Starlette:
        async def handle(request: Request) -> Response:
            if self._table is None:
                self._table = _Table()  # made on the server's own loop
            op = request.path_params["op"]
            if op not in OPS:
                return self._refuse(request, "malformed", f"unknown op {op[:32]!r}", 404)
            if int(request.headers.get("content-length") or 0) > MAX_BODY:
                return self._refuse(request, "too_large", "body over the cap", 413)
            body = bytearray()
            async for piece in request.stream():
                body += piece
                if len(body) > MAX_BODY:
                    return self._refuse(request, "too_large", "body over the cap", 413)
            body = bytes(body)
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
            if not check_request(self.key, got, op, body, time_ms, nonce, peer):
                return self._refuse(request, "bad_mac", "the MAC does not match the request")
            try:
                self.guard.admit(b"", nonce, now)
            except AuthError as e:
                return self._refuse(request, e.reason, e.detail)
            try:
                answer = await self._table.run(op, json.loads(body))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                return self._refuse(request, "malformed", f"{type(e).__name__}: {e}", 400)
            self.served += 1
            out = json.dumps(answer, separators=(",", ":")).encode()
            return Response(out, 200, media_type="application/json",
                            headers={MAC_HEADER: tag(self.key, _ANSWER, nonce, out).hex()})

        return Starlette(routes=[Route("/v1/{op}", handle, methods=["POST"])])

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()


# ---------------------------------------------------------------------- client


class StoreError(dist.DistStoreError):
    """The rendezvous refused a request, did not answer in time, or answered without its MAC.
    A ``DistStoreError``, as TCPStore's, so callers that catch ``dist.DistError`` (a gloo group
    whose peers never came) see the same type."""


class RendezvousStore(dist.Store):
    """A ``torch.distributed.Store`` client of :class:`RendezvousServer` (see the module docstring).

    Each thread gets its own kept-alive connection; every request and every answer is MAC'd.
    ``timeout`` bounds ``get`` and ``wait`` (as TCPStore's does) and every round trip.
    """

    def __init__(self, host: str, port: int, secret: bytes, run: str, peer: str = "",
                 timeout: float | datetime.timedelta = 30.0):
        super().__init__()
        self.host, self.port, self.peer = host, int(port), peer[:64]
        self.key = request_key(secret, run)
        self._timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        self._local = threading.local()

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self._timeout + 5)
            self._local.conn = conn
        return conn

    def call(self, op: str, **fields) -> dict:
        """One authenticated round trip; :class:`StoreError` when refused or unreachable."""
        body = json.dumps(fields, separators=(",", ":")).encode()
        for attempt in (0, 1):
            time_ms, nonce = int(time.time() * 1000), secrets.token_hex(16)
            mac = request_tag(self.key, op, body, time_ms, nonce, self.peer).hex()
            headers = {"content-type": "application/json", TIME_HEADER: str(time_ms), NONCE_HEADER: nonce,
                       PEER_HEADER: self.peer, MAC_HEADER: mac}
            conn = self._conn(fresh=attempt > 0)
            try:
                conn.request("POST", f"/v1/{op}", body, headers)
                resp = conn.getresponse()
                out = resp.read(MAX_BODY + 1)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                if attempt == 0:  # a kept-alive connection the server closed: once more on a new one
                    continue
                raise StoreError(f"rendezvous {self.host}:{self.port}: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._local.conn = None
                raise StoreError(f"rendezvous {self.host}:{self.port}: {e}") from e
            break
        if resp.status != 200:
            raise StoreError(f"rendezvous {self.host}:{self.port} refused {op}: {out[:300].decode(errors='replace')}")
        mac = resp.getheader(MAC_HEADER) or ""
        try:
            good = len(out) <= MAX_BODY and check(self.key, bytes.fromhex(mac), _ANSWER, nonce, out)
        except ValueError:
            good = False
        if not good:
            raise StoreError(f"rendezvous {self.host}:{self.port}: an answer to {op} without the run's MAC")
        return json.loads(out)

    # ---- the torch.distributed.Store interface (what gloo and PrefixStore call)

    def set(self, key: str, value) -> None:
        self.call("set", key=key, value=_b64(_to_bytes(value)))

    def get(self, key: str) -> bytes:
        out = self.call("get", key=key, timeout=self._timeout)
        if out.get("missing"):
            raise StoreError(f"rendezvous: timed out after {self._timeout} s waiting for key {key!r}")
        return _unb64(out["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self.call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return _unb64(self.call("compare_set", key=key, expected=_b64(_to_bytes(expected)),
                                desired=_b64(_to_bytes(desired)))["value"])

    def check(self, keys) -> bool:
        return bool(self.call("check", keys=list(keys))["value"])

    def check_many(self, keys) -> list[bool]:
        """Whether each of ``keys`` exists, in one round trip."""
        return [bool(v) for v in self.call("check_many", keys=list(keys))["value"]] if keys else []

    def delete_key(self, key: str) -> bool:
        return bool(self.call("delete", key=key)["value"])

    def num_keys(self) -> int:
        return int(self.call("num_keys")["value"])

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        if not self.call("wait", keys=list(keys), timeout=seconds)["value"]:
            raise StoreError(f"rendezvous: timed out after {seconds} s waiting for keys {list(keys)[:8]}")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
