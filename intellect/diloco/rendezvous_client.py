"""The DiLoCo rendezvous client: a ``torch.distributed.Store`` that speaks to
:class:`~intellect.diloco.rendezvous.RendezvousServer`, every request and answer MAC'd under the
peer's own key (the protocol: :mod:`intellect.diloco.rendezvous`).

gloo's groups are built on it as on a TCPStore (``transport.new_group``); the membership layer
reads and writes the protocol's keys through it (:mod:`intellect.diloco.membership`).
"""

from __future__ import annotations

import datetime
import http.client
import json
import secrets
import threading
import time

import torch.distributed as dist

from intellect.diloco.rendezvous import (
    MAC_HEADER,
    MAX_BODY,
    NONCE_HEADER,
    PEER_HEADER,
    TIME_HEADER,
    b64,
    check_answer,
    peer_key,
    request_tag,
    unb64,
)


def _to_bytes(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)  # gloo hands values over as lists of ints


class StoreError(dist.DistStoreError):
    """The rendezvous refused a request, did not answer in time, or answered without its MAC.
    A ``DistStoreError``, as TCPStore's, so callers that catch ``dist.DistError`` (a gloo group
    whose peers never came) see the same type. ``reason``: the server's refusal reason (``scope``,
    ``banned``, ``quota``...), "" when it did not answer."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def refusal_reason(answer: bytes) -> str:
    """The ``reason`` of a refusal's JSON body, "" when it has none."""
    try:
        why = json.loads(answer)
    except ValueError:
        return ""
    return str(why.get("reason", ""))[:32] if isinstance(why, dict) else ""


class RendezvousStore(dist.Store):  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C
    """A ``torch.distributed.Store`` client of :class:`~intellect.diloco.rendezvous.RendezvousServer`
    (the protocol: its module docstring).

    Each thread gets its own kept-alive connection; every request and every answer is MAC'd
    under ``key``, the peer's own (:func:`peer_key`; derived from ``secret`` when not given).
    ``timeout`` bounds ``get`` and ``wait`` (as TCPStore's does) and every round trip.
    """

    def __init__(self, host: str, port: int, secret: bytes | None, run: str, peer: str = "",
                 timeout: float | datetime.timedelta = 30.0, key: bytes | None = None):
        super().__init__()
        self.host, self.port, self.peer = host, int(port), peer[:64]
        if key is None:
            if secret is None:
                raise ValueError("a rendezvous client needs its peer key or the run secret")
            key = peer_key(secret, run, self.peer)
        self.key = key
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
            except BaseException:
                # e.g. SystemExit from a SIGTERM handler mid-request: the connection holds half an
                # exchange, and the deathrattle that follows must not be sent on it
                conn.close()
                self._local.conn = None
                raise
            break
        if resp.status != 200:
            raise StoreError(f"rendezvous {self.host}:{self.port} refused {op}: {out[:300].decode(errors='replace')}",
                             refusal_reason(out[:4096]))
        mac = resp.getheader(MAC_HEADER) or ""
        try:
            good = len(out) <= MAX_BODY and check_answer(self.key, bytes.fromhex(mac), nonce, out)
        except ValueError:
            good = False
        if not good:
            raise StoreError(f"rendezvous {self.host}:{self.port}: an answer to {op} without the run's MAC")
        return json.loads(out)

    # ---- the torch.distributed.Store interface (what gloo and PrefixStore call)

    def set(self, key: str, value) -> None:
        self.call("set", key=key, value=b64(_to_bytes(value)))

    def get(self, key: str) -> bytes:
        out = self.call("get", key=key, timeout=self._timeout)
        if out.get("missing"):
            raise StoreError(f"rendezvous: timed out after {self._timeout} s waiting for key {key!r}")
        return unb64(out["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self.call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return unb64(self.call("compare_set", key=key, expected=b64(_to_bytes(expected)),
                                desired=b64(_to_bytes(desired)))["value"])

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
