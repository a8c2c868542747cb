"""The process group that carries traffic between workers: TCP with bounded, checked frames.

Why not gloo here. Gloo's TCP pair ends the receiving process (``std::terminate`` on an
``EnforceNotMet`` in its event loop) when a peer's message is longer than the receive posted for it,
and a malformed preamble does the same. Between workers the peers are admitted, not trusted: one
holding the run's credentials could kill every neighbour of every ring at will, and its message dies
with the receiver before any MAC is checked. Here a frame that announces more bytes than its receive
holds, or that is not a frame at all, fails that receive and closes that peer's connection: the
caller gets the usual ``RuntimeError`` (``transport.CommError`` one level up), drops the group, and the
step is retried or the member excluded as for a dead peer. Inside a worker (trusted siblings) gloo
and NCCL stay.

The surface is the part of ``ProcessGroup`` the rings use: :meth:`TcpGroup.send`, :meth:`TcpGroup.recv`
(a message may be shorter than its buffer, as with gloo: sealed channels carry their length),
:meth:`TcpGroup.broadcast` (exactly the buffer's size), ``rank()``, ``size()`` and ``options._timeout``.
Every call returns a :class:`Work` whose ``wait`` is bounded by the group's timeout.

Rendezvous: rank ``r`` listens, then sets ``0/<r>`` under the group's store prefix (the key gloo's
own rendezvous writes, so the run's rendezvous rules apply unchanged) to its address and a random
token; rank ``r`` connects to every lower rank and presents that rank's token and its own rank, and
accepts every higher one. A connection without the token is closed unread. Memory is bounded: a
frame's payload is only ever read into the buffer a receive posted, never into one the sender sized.

    >>> HEADER.size, HELLO.size
    (20, 24)
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hmac
import json
import os
import queue
import select
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import torch

__all__ = ["TcpGroup", "Work", "HEADER", "HELLO"]

HEADER = struct.Struct("<4sqQ")  # magic, tag, payload bytes
HELLO = struct.Struct("<4sI16s")  # magic, the connecting rank, the token of the rank it connects to
_FRAME, _GREET = b"ITF1", b"ITH1"
_BROADCAST_TAG = -1  # below every tag the rings use (they are >= 0)
_GREETING_S = 2.0  # seconds a new connection has to present its greeting
_TICK_MS = 500  # how often a reader idle on its socket looks at its deadlines
_KEY = "0/{}"  # gloo's per-rank rendezvous key under the group's prefix (membership._gloo's rule)


class Work:
    """One send, receive or broadcast: ``wait`` returns True once done, raises ``RuntimeError`` on
    failure or when ``timeout`` (default: the group's) passes."""

    def __init__(self, timeout: float, what: str, group: TcpGroup | None = None):
        self._done, self._error, self._timeout, self._what = threading.Event(), "", timeout, what
        self._group = group  # as with gloo, a work keeps its group (whose finalizer closes it) alive

    def _finish(self, error: str = "") -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        t = self._timeout if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        if not self._done.wait(t):
            raise RuntimeError(f"{self._what}: timed out after {t:.1f} s")
        if self._error:
            raise RuntimeError(f"{self._what}: {self._error}")
        return True


class _All(Work):
    """Done when every part is (a broadcast's sends from its root)."""

    def __init__(self, parts: list[Work], timeout: float, what: str, group: TcpGroup):
        super().__init__(timeout, what, group)
        self._parts = parts
        self._done.set()

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self._parts)

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        t = self._timeout if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        deadline = time.monotonic() + t
        for p in self._parts:
            p.wait(max(0.0, deadline - time.monotonic()))
        return True


@dataclass
class _Recv:
    buf: memoryview
    exact: bool
    work: Work


class _Peer:
    """One connection: a sender thread drains the send queue in order; a reader thread reads each
    frame's header, waits (bounded) for a receive of its tag, checks its length, then reads the
    payload straight into that receive's buffer. The first failure fails everything pending."""

    def __init__(self, sock: socket.socket, me: int, peer: int, timeout: float):
        self.sock, self.me, self.peer, self.timeout = sock, me, peer, timeout
        self.sends: queue.Queue[tuple[bytes, memoryview, Work] | None] = queue.Queue()
        self.recvs: dict[int, collections.deque[_Recv]] = collections.defaultdict(collections.deque)
        self.cond = threading.Condition()
        self.error = ""
        self.closing: float | None = None  # once the group is closed: when the reader gives up on the peer
        self.threads = [threading.Thread(target=target, name=f"tcp-group-{name}-{me}-{peer}", daemon=True)
                        for target, name in ((self._send_loop, "send"), (self._read_loop, "read"))]
        _LIVE.add(self)
        for t in self.threads:
            t.start()

    def fail(self, error: str, graceful: bool = False) -> None:
        """Fail everything pending. ``graceful`` (the group closed): only this side's half of the
        connection closes, after what was sent, so a peer still reading the last message gets all
        of it; the reader closes the socket at the peer's end of stream. Else it closes at once."""
        with self.cond:
            if self.error:
                return
            self.error = error
            self.closing = time.monotonic() + self.timeout
            pending = [r.work for q in self.recvs.values() for r in q]
            self.recvs.clear()
            self.cond.notify_all()
        for w in pending:
            w._finish(error)
        self.sends.put(None)
        try:
            self.sock.shutdown(socket.SHUT_WR if graceful else socket.SHUT_RDWR)
        except OSError:
            pass
        if not graceful:
            self.sock.close()

    def send(self, tag: int, payload: memoryview, work: Work) -> None:
        if self.error:
            work._finish(self.error)
            return
        self.sends.put((HEADER.pack(_FRAME, tag, payload.nbytes), payload, work))

    def recv(self, tag: int, buf: memoryview, exact: bool, work: Work) -> None:
        with self.cond:
            if self.error:
                work._finish(self.error)
                return
            self.recvs[tag].append(_Recv(buf, exact, work))
            self.cond.notify_all()

    def _send_loop(self) -> None:
        while (item := self.sends.get()) is not None:
            head, payload, work = item
            if self.error:
                work._finish(self.error)
                continue
            try:
                self.sock.sendall(head)
                self.sock.sendall(payload)
            except OSError as e:
                self.fail(f"send to rank {self.peer} failed: {e}")
                work._finish(self.error)
                continue
            work._finish()
        while True:  # after a failure: whatever is still queued fails too
            try:
                item = self.sends.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[2]._finish(self.error)

    def _read_exactly(self, view: memoryview, deadline: float | None) -> None:
        """Fill ``view`` from the socket. ``deadline``: a frame begun must end by then (a peer that
        stalls mid-message fails it); between frames the connection may idle, until the group is
        closed, after which it gets the group's timeout to end its side."""
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        while view.nbytes:
            if not poll.poll(_TICK_MS):
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"rank {self.peer} stalled in the middle of a message")
                if self.closing is not None and now > self.closing:
                    raise ConnectionError("the group was closed")
                continue
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionError(f"connection closed by rank {self.peer}")
            view = view[n:]

    def _read_loop(self) -> None:
        head = bytearray(HEADER.size)
        r: _Recv | None = None  # the receive a frame is being read into
        try:
            while True:
                self._read_exactly(memoryview(head), None)
                magic, tag, n = HEADER.unpack(head)
                if magic != _FRAME:
                    raise ValueError(f"rank {self.peer} sent a malformed frame")
                r = self._take(tag)
                if n > r.buf.nbytes or (r.exact and n != r.buf.nbytes):
                    raise ValueError(f"rank {self.peer} announced {n} bytes under tag {tag}, "
                                     f"{'not' if r.exact else 'more than'} the {r.buf.nbytes} its receive holds")
                self._read_exactly(r.buf[:n], time.monotonic() + self.timeout)
                r.work._finish()
                r = None
        except (OSError, ValueError, ConnectionError, TimeoutError) as e:
            error = str(e) or type(e).__name__
            if r is not None:
                r.work._finish(error)
            self.fail(error)
        finally:
            self.sock.close()

    def _take(self, tag: int) -> _Recv:
        """The oldest receive posted for ``tag``, waited for up to the group's timeout: a frame that
        nobody receives is never buffered."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while not self.recvs.get(tag):
                if self.error:
                    raise ConnectionError(self.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.peer} sent under tag {tag}, which nobody received "
                                       f"within {self.timeout:.0f} s")
                self.cond.wait(left)
            q = self.recvs[tag]
            r = q.popleft()
            if not q:
                del self.recvs[tag]
            return r


def _bytes(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("TcpGroup carries contiguous CPU tensors")
    return t.view(torch.uint8).numpy().data.cast("B") if t.numel() else memoryview(b"")


class _Options:
    def __init__(self, timeout: datetime.timedelta):
        self._timeout = timeout


class TcpGroup:
    """``size`` ranks under ``store`` (already prefixed for this group), this one ``rank``, bound to
    ``host``; blocks until every peer is connected or ``timeout`` seconds pass (``RuntimeError``)."""

    def __init__(self, store, rank: int, size: int, host: str, timeout: float):
        self._rank, self._size, self.timeout = rank, size, float(timeout)
        self.options = _Options(datetime.timedelta(seconds=self.timeout))
        self._peers: dict[int, _Peer] = {}
        token = os.urandom(16)
        deadline = time.monotonic() + self.timeout
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=max(8, size))
        socks: dict[int, socket.socket] = {}
        try:
            store.set(_KEY.format(rank), json.dumps({"host": host, "port": listener.getsockname()[1],
                                                     "token": token.hex()}))
            for peer in range(rank):
                socks[peer] = self._connect(store, peer, deadline)
            while len(socks) < size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"TcpGroup: ranks {sorted(set(range(size)) - set(socks) - {rank})} "
                                       f"did not connect within {self.timeout:.0f} s")
                listener.settimeout(left)
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                peer = self._greeted(conn, token, socks, deadline)
                if peer is None:
                    conn.close()
                else:
                    socks[peer] = conn
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            listener.close()
        for peer, s in socks.items():
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[peer] = _Peer(s, rank, peer, self.timeout)
        weakref.finalize(self, _close, list(self._peers.values())).atexit = False  # _stop_all does it

    def _connect(self, store, peer: int, deadline: float) -> socket.socket:
        try:
            addr = json.loads(store.get(_KEY.format(peer)))
            host, port, token = str(addr["host"]), int(addr["port"]), bytes.fromhex(addr["token"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"TcpGroup: rank {peer}'s address is malformed: {e}") from e
        if len(token) != 16 or not 0 < port < 65536:
            raise RuntimeError(f"TcpGroup: rank {peer}'s address is malformed (port or token)")
        s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        s.sendall(HELLO.pack(_GREET, self._rank, token))
        return s

    def _greeted(self, conn: socket.socket, token: bytes, socks: dict, deadline: float) -> int | None:
        """The rank a new connection speaks for, or None (no or a wrong token, a rank that does not
        connect to this one, or one already connected)."""
        # a peer greets as soon as it connects: a connection that says nothing costs the others little
        conn.settimeout(max(0.1, min(_GREETING_S, deadline - time.monotonic())))
        hello = bytearray(HELLO.size)
        try:
            view = memoryview(hello)
            while view.nbytes:
                n = conn.recv_into(view)
                if n == 0:
                    return None
                view = view[n:]
        except OSError:
            return None
        magic, peer, got = HELLO.unpack(hello)
        if magic != _GREET or not hmac.compare_digest(got, token):
            return None
        return peer if self._rank < peer < self._size and peer not in socks else None

    def rank(self) -> int:
        return self._rank

    def name(self) -> str:
        return "tcp"

    def size(self) -> int:
        return self._size

    def _peer(self, r: int) -> _Peer:
        if r == self._rank or r not in self._peers:
            raise ValueError(f"TcpGroup: rank {r} is not a peer of rank {self._rank} of {self._size}")
        return self._peers[r]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        (t,) = tensors
        work = Work(self.timeout, f"send to rank {dst} (tag {tag})", self)
        self._peer(dst).send(tag, _bytes(t), work)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        (t,) = tensors
        work = Work(self.timeout, f"recv from rank {src} (tag {tag})", self)
        self._peer(src).recv(tag, _bytes(t), False, work)
        return work

    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], root: int) -> Work:
        """``root``'s tensor into every rank's, which must be of the same size."""
        (t,) = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        what = f"broadcast from rank {root}"
        if self._rank != root:
            work = Work(self.timeout, what, self)
            self._peer(root).recv(_BROADCAST_TAG, _bytes(t), True, work)
            return work
        parts = []
        for r in range(self._size):
            if r != root:
                parts.append(Work(self.timeout, f"{what} to rank {r}"))
                self._peer(r).send(_BROADCAST_TAG, _bytes(t), parts[-1])
        return _All(parts, self.timeout, what, self)

    def close(self) -> None:
        """Close every connection (what pending work there is fails); the finalizer does it too."""
        _close(list(self._peers.values()))


def _close(peers: list[_Peer]) -> None:
    for p in peers:
        p.fail("the group was closed", graceful=True)


_LIVE: weakref.WeakSet[_Peer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Close every connection and let its threads end before the interpreter finalizes: a daemon
    thread that wakes from a socket call during finalization exits through ``pthread_exit``, whose
    forced unwind ends the process with ``std::terminate`` when it crosses a C++ frame."""
    peers = list(_LIVE)
    for p in peers:
        p.fail("the process is exiting")
    deadline = time.monotonic() + 2.0
    for p in peers:
        for t in p.threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
