"""Membership over a real TCPStore in this process: liveness, deathrattle, agreement, timeouts."""

import subprocess
import sys
import time

import pytest

from intellect.diloco.coordinator import free_port
from intellect.diloco.membership import Membership, MembershipTimeout, StoreLost, connect_store


@pytest.fixture
def store():
    port = free_port()
    master = connect_store("127.0.0.1", port, timeout=5, is_master=True)
    yield port, master
    del master


def member(port, name, **kw):
    return Membership("127.0.0.1", port, name, heartbeat_interval=0.2, heartbeat_timeout=1.5,
                      store_timeout=5, startup_grace=2.5, **kw)


def test_heartbeat_deathrattle_and_timeout(store):
    port, _ = store
    a, b, c = member(port, "a"), member(port, "b"), member(port, "c")
    a.start_heartbeat(), b.start_heartbeat(), c.start_heartbeat()
    time.sleep(0.5)
    assert a.live(["a", "b", "c"]) == ["a", "b", "c"]
    b.deathrattle()
    assert not a.alive("b")  # at once, not after the timeout
    c._stop.set()  # a crash: the heartbeat just stops
    c._beat.join()
    a.alive("c")
    time.sleep(1.8)
    assert not a.alive("c")
    never = "d"  # registered but never beat: startup grace, then dead
    assert a.alive(never)
    time.sleep(1.8)
    assert a.alive(never)  # still within the startup grace, past the heartbeat timeout
    time.sleep(1.0)
    assert not a.alive(never)
    for m in (a, b, c):
        m.close()


def test_first_proposal_wins_for_everyone(store):
    port, _ = store
    a, b = member(port, "a"), member(port, "b")
    assert a.propose_members(3, 0, ["b", "a"]) == ["a", "b"]
    assert b.propose_members(3, 0, ["b"]) == ["a", "b"]
    assert a.members(3, 0) == b.members(3, 0) == ["a", "b"]
    assert a.members(3, 1) is None
    assert b.decide("outcome/3/0", "abort") == "abort" and a.decide("outcome/3/0", "commit") == "abort"


def test_waits_are_bounded_and_skip_the_dead_and_the_departed(store):
    port, _ = store
    a, b = member(port, "a"), member(port, "b")
    a.start_heartbeat(), b.start_heartbeat()
    b.set("ready/0/0/b", "1")
    t0 = time.monotonic()
    present, absent = a.wait_for_keys("ready/0/0", ["a", "b", "c"], time.monotonic() + 0.5)
    assert present == ["b"] and absent == ["a", "c"] and time.monotonic() - t0 < 2
    b.leave(5)
    t0 = time.monotonic()
    present, absent = a.wait_for_keys("ready/5/0", ["b"], time.monotonic() + 10, step=5)
    assert absent == ["b"] and time.monotonic() - t0 < 1
    with pytest.raises(MembershipTimeout, match="never"):
        a.wait_until(lambda: False, time.monotonic() + 0.2, "never")
    a.close(), b.close()


SERVER = """
import sys, time
from intellect.diloco.membership import connect_store
s = connect_store("127.0.0.1", int(sys.argv[1]), timeout=5, is_master=True)
print("up", flush=True)
time.sleep(120)
"""


def test_lost_store_raises_instead_of_hanging():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        a = member(port, "a")
        a.start_heartbeat()
        time.sleep(0.6)  # the heartbeat thread has its own connection by now
        server.kill()
        server.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(StoreLost):
            while time.monotonic() - t0 < 10:
                a.has("x")
                time.sleep(0.05)
        assert time.monotonic() - t0 < 5
        with pytest.raises(StoreLost):  # the heartbeat thread notices too, within its store timeout
            a.wait_until(lambda: False, time.monotonic() + 10, "the heartbeat to fail")
        a.close()
    finally:
        server.kill()
    with pytest.raises(StoreLost, match="cannot reach"):
        connect_store("127.0.0.1", free_port(), timeout=0.5)
