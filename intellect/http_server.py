"""HTTP serving for the servers that face other machines: a listening socket (:func:`bind`), uvicorn's
h11 protocol under connection bounds (:class:`ConnectionGuard`), and a uvicorn server of both
(:func:`guarded_server`, :func:`serve_in_thread`).

uvicorn alone lets a client open connections and never send a request, or send a request head a
byte at a time: a flood of either holds the process's descriptors. A guard applies the bounds of
its :class:`ConnectionLimits`, each server choosing its own:

* a request head must arrive in full within ``header_timeout`` seconds: the first of each connection
  and, with ``each_request``, every later one on a kept-alive connection too;
* at most ``per_address`` connections are open from one client address (as ``bucket`` groups
  addresses); one more is closed at once (``busy``);
* past ``evict_over`` open connections, a new one evicts the oldest that has not sent a byte (itself,
  when every other has spoken: ``too_many_connections``), so idle sockets cannot crowd out peers that
  are speaking;
* at most ``max_open`` connections are open, shared fairly among buckets (:class:`FairShare`): when
  all are taken, a new connection evicts one of the bucket holding the most, if that holds more than
  the newcomer's bucket would (its silent connections first, then those between requests), and is
  closed itself otherwise (``too_many_connections``); ``reserve`` of them only for buckets that
  ``trusted`` names, so a flood from more buckets than places still leaves known peers room.

Each connection a guard ends is reported to its ``report(client, reason, detail)``, the reason one of
:data:`DROPS`: ``idle`` (no byte of a head in time), ``too_slow`` (a head begun, not finished in
time), ``busy`` and ``too_many_connections``. A request's body is the app's to time: only it knows
the body's length.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Literal, TypeVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

__all__ = [
    "DROPS", "ConnectionGuard", "ConnectionLimits", "Drop", "FairShare", "bind", "guarded_server", "serve_in_thread",
    "url_of",
]

Drop = Literal["idle", "too_slow", "busy", "too_many_connections"]
DROPS: tuple[Drop, ...] = ("idle", "too_slow", "busy", "too_many_connections")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), bound before uvicorn starts so the port is known."""
    # proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it every answer sent in two writes (h11: head, then body; a shard's last partial
    # segment after sendfile) waits for the client's delayed ACK on a kept-alive connection
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it (Linux)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _same(address: str) -> str:
    return address


def _nobody(_bucket: str) -> bool:
    return False


_H = TypeVar("_H", bound=Hashable)


class FairShare(Generic[_H]):
    """``capacity`` places (connections, upload slots) shared max-min fairly among groups (address
    prefixes), ``reserve`` of them only for trusted holders. Single-threaded: its owner's event loop.

    When every place a newcomer may take is held, it may displace a holder of the group that holds
    the most, but only if that group holds more than the newcomer's would after the move: a group at
    or under its fair share is never displaced, and each move lowers the largest holding, so a flood
    from few groups cannot keep out a group that asks for its share. An untrusted newcomer displaces
    only untrusted holders: the reserve stays the trusted's.

    >>> share = FairShare(capacity=3, reserve=1)
    >>> share.add("a1", "a", trusted=False); share.add("a2", "a", trusted=False)
    >>> share.claim("a", trusted=False), share.claim("b", trusted=False), share.claim("b", trusted=True)
    ((False, None), (True, 'a'), (True, None))
    """

    def __init__(self, capacity: int, reserve: int = 0):
        if not 0 <= reserve < capacity:
            raise ValueError("need 0 <= reserve < capacity")
        self.capacity, self.reserve = capacity, reserve
        self.held: collections.Counter[str] = collections.Counter()  # places by group
        self._holders: dict[_H, tuple[str, bool]] = {}  # holder -> (group, trusted), oldest first
        self._untrusted = 0

    def __len__(self) -> int:
        return len(self._holders)

    def claim(self, group: str, trusted: bool) -> tuple[bool, str | None]:
        """Whether ``group`` may take a place now: ``(True, None)`` a free one, ``(True, g)`` once one of
        :meth:`displaceable` ``(g, trusted)`` is removed, ``(False, None)`` none."""
        if len(self._holders) < self.capacity and (trusted or self._untrusted < self.capacity - self.reserve):
            return True, None
        mine = self.held[group]
        counts = self.held if trusted else collections.Counter(g for g, t in self._holders.values() if not t)
        victims = [g for g, n in counts.items() if n and g != group and self.held[g] > mine + 1]
        if not victims:
            return False, None
        return True, max(victims, key=lambda g: (self.held[g], counts[g]))

    def displaceable(self, group: str, trusted: bool) -> list[_H]:
        """The holders of ``group`` a newcomer (``trusted`` or not) may displace, oldest first."""
        return [h for h, (g, t) in self._holders.items() if g == group and (trusted or not t)]

    def add(self, holder: _H, group: str, trusted: bool) -> None:
        self._holders[holder] = (group, trusted)
        self.held[group] += 1
        self._untrusted += not trusted

    def remove(self, holder: _H) -> None:
        """Give ``holder``'s place back (nothing when it holds none)."""
        entry = self._holders.pop(holder, None)
        if entry is None:
            return
        group, trusted = entry
        self._untrusted -= not trusted
        self.held[group] -= 1
        if self.held[group] <= 0:
            del self.held[group]


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds a :class:`ConnectionGuard` applies (see the module docstring)."""

    header_timeout: float
    each_request: bool = True
    per_address: int | None = None
    bucket: Callable[[str], str] = field(default=_same)
    evict_over: int | None = None
    max_open: int | None = None
    reserve: int = 0
    trusted: Callable[[str], bool] = field(default=_nobody)


class ConnectionGuard:
    """The connection bounds of one server: its :meth:`protocol` is what uvicorn serves with, and
    :attr:`open` counts its open connections by address bucket."""

    def __init__(self, limits: ConnectionLimits, report: Callable[[str, Drop, str], None]):
        self.limits, self.report = limits, report
        self.share: FairShare[GuardedH11] = FairShare(limits.max_open or 1 << 30, limits.reserve)
        self.open = self.share.held
        self.silent: dict[GuardedH11, None] = {}  # connections that have not sent a byte, oldest first

    def protocol(self) -> type[GuardedH11]:
        """uvicorn's h11 protocol under this guard's bounds."""
        return type("GuardedH11", (GuardedH11,), {"guard": self})


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol under :attr:`guard`'s bounds (:meth:`ConnectionGuard.protocol` sets it)."""

    guard: ConnectionGuard
    _bucket: str | None = None
    _timer: asyncio.TimerHandle | None = None
    _armed: RequestResponseCycle | None = None  # the request cycle when the head's deadline was set

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard, limits, client = self.guard, self.guard.limits, self._client()
        bucket = limits.bucket(client)
        if limits.per_address is not None and guard.open[bucket] >= limits.per_address:
            guard.report(client, "busy", f"{limits.per_address} connections from this address are open")
            transport.close()
            return
        trusted = limits.trusted(bucket)
        ok, heavy = guard.share.claim(bucket, trusted)
        if not ok:
            guard.report(client, "too_many_connections", f"{limits.max_open} connections are open, none of them "
                         "from an address holding more than this one's share")
            transport.close()
            return
        if heavy is not None:
            victim = min(guard.share.displaceable(heavy, trusted), key=GuardedH11._keep)
            guard.report(victim._client(), "too_many_connections",
                         f"{limits.max_open} connections are open and its address holds the most")
            victim._close()
        guard.share.add(self, bucket, trusted)
        self._bucket = bucket
        guard.silent[self] = None
        if limits.evict_over is not None and len(self.connections) > limits.evict_over:
            victim = next(iter(guard.silent))
            guard.report(victim._client(), "too_many_connections",
                         f"over {limits.evict_over} open connections, it had sent nothing")
            victim._close()
        self._arm()

    def _keep(self) -> int:
        """How much closing this connection costs: nothing sent yet, between requests, mid-request."""
        if self in self.guard.silent:
            return 0
        return 1 if self.cycle is None or self.cycle.response_complete else 2

    def data_received(self, data: bytes) -> None:
        self.guard.silent.pop(self, None)
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.guard.limits.each_request and not self.transport.is_closing():
            self._arm()  # the next request head has its own deadline

    def connection_lost(self, exc) -> None:
        guard = self.guard
        guard.silent.pop(self, None)
        if self._bucket is not None:
            guard.share.remove(self)
            self._bucket = None
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _client(self) -> str:
        return str((self.client or ("unknown",))[0])

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = self.cycle
        self._timer = self.loop.call_later(self.guard.limits.header_timeout, self._late)

    def _late(self) -> None:
        self._timer = None
        if self.cycle is not self._armed or self.transport.is_closing():
            return  # a head came in time
        timeout = self.guard.limits.header_timeout
        if self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]:
            self.guard.report(self._client(), "too_slow", f"no complete request head within {timeout:g} s")
        else:
            self.guard.report(self._client(), "idle", f"no request within {timeout:g} s")
        self._close()

    def _close(self) -> None:
        self.guard.silent.pop(self, None)
        if self._bucket is not None:  # its place is free now, not once the loop reports the close
            self.guard.share.remove(self)
            self._bucket = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_server(app: Any, guard: ConnectionGuard, *, keep_alive: float, **options: Any) -> uvicorn.Server:
    """A uvicorn server of ``app`` over ``guard``'s protocol: h11 on the stdlib loop (uvicorn's "auto"
    would pick httptools or uvloop wherever they happen to be installed), no lifespan, no access log,
    ``keep_alive`` seconds between requests; ``options`` are more of :class:`uvicorn.Config`'s."""
    # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from any local client as the
    # client's address, and a flood from 127.0.0.1 could name a fresh address per connection
    # log_config None: uvicorn's dictConfig would take logging's module lock while another thread (a
    # progress heartbeat logging through Prefect's API handler) holds that handler's: a deadlock
    options.setdefault("log_config", None)
    config = uvicorn.Config(app, http=guard.protocol(), loop="asyncio", lifespan="off", log_level="warning",
                            access_log=False, proxy_headers=False,
                            # uvicorn annotates an int, but uses it as a call_later delay: a float works
                            timeout_keep_alive=keep_alive,  # pyright: ignore[reportArgumentType]
                            **options)
    return uvicorn.Server(config)


def serve_in_thread(server: uvicorn.Server, sock: socket.socket, name: str, timeout: float) -> threading.Thread:
    """Run ``server`` on ``sock`` in a daemon thread named ``name``, once it accepts connections;
    RuntimeError when it has not started within ``timeout`` seconds."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start on {url_of(sock)} within {timeout:.0f} s")
        time.sleep(0.01)
    return thread
