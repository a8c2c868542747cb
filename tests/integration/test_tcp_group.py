"""The group between workers (``intellect.diloco.tcp_group``) against peers that lie: a message longer
than its receive, bytes that are not a frame, a connection without the token, a frame nobody
receives. Each fails the receives it touches with a reason, at once or within the group's timeout,
and the process goes on (over gloo the first two end the receiving process: SIGABRT)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from intellect.diloco import transport
from intellect.diloco.allreduce import all_reduce_mean
from intellect.diloco.tcp_group import HEADER, HELLO, TcpGroup
from intellect.trust.mac import derive_key


def groups(n: int, timeout: float = 10.0, prefix: str = "g") -> tuple[list[TcpGroup], dist.Store]:  # pyright: ignore[reportPrivateImportUsage]
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    out: dict[int, object] = {}

    def build(r: int) -> None:
        try:
            out[r] = transport.new_group(store, prefix, r, n, timeout=timeout, hostname="127.0.0.1")
        except BaseException as e:  # noqa: BLE001 - reported below
            out[r] = e

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert all(isinstance(out.get(r), TcpGroup) for r in range(n)), out
    return [out[r] for r in range(n)], store  # pyright: ignore[reportReturnType]


def test_messages_arrive_by_tag_whatever_the_order_receives_are_posted():
    (a, b), _ = groups(2)
    xs = [torch.full((1000 * (i + 1),), float(i)) for i in range(3)]
    sends = [a.send([x], 1, tag) for tag, x in enumerate(xs)]
    bufs = [torch.zeros_like(x) for x in xs]
    recvs = [b.recv([bufs[tag]], 0, tag) for tag in (2, 0, 1)]
    for w in sends + recvs:
        assert w.wait(5)
    assert all(torch.equal(x, y) for x, y in zip(xs, bufs))
    # shorter than the buffer is a message (a sealed channel says its length), as with gloo
    short, buf = torch.ones(3), torch.zeros(5)
    a.send([short], 1, 9)
    assert b.recv([buf], 0, 9).wait(5) and buf.tolist() == [1, 1, 1, 0, 0]


def test_a_message_longer_than_its_receive_fails_it_and_the_receiver_lives():
    (a, b), _ = groups(2)
    buf = torch.zeros(10)
    later = torch.zeros(4)
    recv, pending = b.recv([buf], 0, 7), b.recv([later], 0, 8)
    a.send([torch.ones(1_000_000)], 1, 7)  # 4 MB against a 40-byte receive
    with pytest.raises(RuntimeError, match="announced 4000000 bytes under tag 7"):
        recv.wait(5)
    with pytest.raises(RuntimeError):  # the connection is dropped: what else was pending fails with it
        pending.wait(5)
    assert buf.eq(0).all()  # nothing of it was written anywhere
    with pytest.raises(RuntimeError):
        b.recv([buf], 0, 9).wait(1)  # and the peer stays cut off


class Padding:
    """A member's group that appends ``extra`` bytes to every message it sends."""

    def __init__(self, group: TcpGroup, extra: int):
        self.group, self.extra = group, extra

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        (t,) = tensors
        return self.group.send([torch.cat([t.view(torch.uint8).flatten(), torch.zeros(self.extra, dtype=torch.uint8)])],
                               dst, tag)


def test_a_member_that_sends_more_than_the_plan_fails_the_ring_not_the_process():
    """The attack gloo cannot survive: a member holding the ring's MAC key runs the all-reduce as
    everyone does, but every message it sends is 1 MB longer than its neighbour's receive."""
    (g0, g1), _ = groups(2)
    key = derive_key(b"r" * 32, "allreduce", "run", 0, 0)
    out: dict[int, BaseException | None] = {}

    def run(r: int, g) -> None:
        try:
            all_reduce_mean([torch.ones(1000)], g, mac_key=key, timeout=10)
            out[r] = None
        except BaseException as e:  # noqa: BLE001 - read below
            out[r] = e

    t = threading.Thread(target=run, args=(1, Padding(g1, 1 << 20)))
    t.start()
    run(0, g0)
    t.join(30)
    assert isinstance(out[0], RuntimeError) and "announced" in str(out[0]), out[0]


def forming(timeout: float) -> tuple[threading.Thread, dict[str, object], dict]:
    """Rank 0 of a group of two, forming in a thread (``built["g"]`` once formed), and the address
    and token it published for rank 1."""
    pstore = dist.PrefixStore("p/", dist.HashStore())  # pyright: ignore[reportPrivateImportUsage]
    built: dict[str, object] = {}
    t = threading.Thread(target=lambda: built.update(g=TcpGroup(pstore, 0, 2, "127.0.0.1", timeout)))
    t.start()
    while True:
        try:
            return t, built, json.loads(pstore.get("0/0"))
        except RuntimeError:
            time.sleep(0.05)


def with_raw_member(timeout: float) -> tuple[TcpGroup, socket.socket]:
    """Rank 0 of a group of two whose rank 1 is a bare socket; a stranger (no token) and then random
    bytes try to connect first, and both are closed unread: the group still forms."""
    t, built, addr = forming(timeout)
    for hello in (HELLO.pack(b"ITH1", 1, os.urandom(16)), os.urandom(HELLO.size)):
        with socket.create_connection((addr["host"], addr["port"])) as s:
            s.sendall(hello)
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the group
    member = socket.create_connection((addr["host"], addr["port"]))
    member.sendall(HELLO.pack(b"ITH1", 1, bytes.fromhex(addr["token"])))
    t.join(timeout)
    g = built["g"]
    assert isinstance(g, TcpGroup)
    return g, member


def test_bytes_that_are_not_a_frame_and_connections_without_the_token_change_nothing():
    g, member = with_raw_member(10.0)
    recv = g.recv([torch.zeros(4)], 1, 0)
    member.sendall(os.urandom(HEADER.size))  # an admitted peer's garbage where a frame should be
    with pytest.raises(RuntimeError, match="malformed frame"):
        recv.wait(5)
    member.close()


def test_a_peer_that_stalls_in_the_middle_of_a_message_fails_it_within_the_timeout():
    g, member = with_raw_member(2.0)
    recv = g.recv([torch.zeros(1000)], 1, 3)
    member.sendall(HEADER.pack(b"ITF1", 3, 4000) + b"\0" * 10)  # and then nothing, connection open
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="stalled in the middle of a message"):
        recv.wait(30)  # the reader's own deadline ends it, not this wait's
    assert time.monotonic() - start < 6
    member.close()


def test_a_frame_nobody_receives_fails_within_the_timeout_and_a_closed_peer_at_once():
    (a, b), _ = groups(2, timeout=2.0)
    a.send([torch.ones(4)], 1, 5)  # b never posts tag 5
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tag 5, which nobody received"):
        b.recv([torch.zeros(4)], 0, 6).wait(10)
    assert time.monotonic() - start < 5
    (c, d), _ = groups(2, timeout=30.0)
    recv = d.recv([torch.zeros(4)], 0, 0)
    start = time.monotonic()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        recv.wait(30)
    assert time.monotonic() - start < 5  # not the 30 s timeout


def test_a_broadcast_takes_exactly_the_buffers_size():
    (a, b, c), _ = groups(3)
    x = torch.arange(6, dtype=torch.float32)
    bufs = [torch.zeros(6), torch.zeros(6)]
    works = [b.broadcast(bufs[0], 0), c.broadcast([bufs[1]], 0), a.broadcast(x, 0)]
    for w in works:
        assert w.wait(5)
    assert all(torch.equal(x, y) for y in bufs)
    (s, r), _ = groups(2)
    short = r.broadcast(torch.zeros(6), 0)
    s.broadcast(torch.ones(3), 0)  # a source that sends less than the state
    with pytest.raises(RuntimeError, match="not the 24"):
        short.wait(5)


def test_a_rank_that_never_comes_fails_the_rendezvous_within_the_timeout():
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    store.set_timeout(__import__("datetime").timedelta(seconds=2))
    start = time.monotonic()
    with pytest.raises((RuntimeError, transport.CommError)):
        transport.new_group(store, "alone", 1, 2, timeout=2.0, hostname="127.0.0.1")  # rank 0 never sets its key
    with pytest.raises((RuntimeError, transport.CommError)):
        transport.new_group(store, "alone2", 0, 2, timeout=2.0, hostname="127.0.0.1")  # rank 1 never connects
    assert time.monotonic() - start < 10


def test_a_silent_connection_delays_the_rendezvous_by_at_most_the_greeting_time():
    t, built, addr = forming(30.0)
    silent = socket.create_connection((addr["host"], addr["port"]))  # connects first, never greets
    time.sleep(0.2)
    start = time.monotonic()
    member = socket.create_connection((addr["host"], addr["port"]))
    member.sendall(HELLO.pack(b"ITH1", 1, bytes.fromhex(addr["token"])))
    t.join(30)
    assert isinstance(built.get("g"), TcpGroup) and time.monotonic() - start < 4  # not the group's 30 s
    silent.close()
    member.close()
