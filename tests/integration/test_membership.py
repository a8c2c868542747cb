"""Membership over the real rendezvous server in this process: liveness, deathrattle, agreement, timeouts."""

import http.client
import http.server
import json
import secrets
import subprocess
import sys
import threading
import time

import pytest

from intellect.diloco.coordinator import free_port
from intellect.diloco.membership import Membership, MembershipTimeout, StoreLost, connect_store, scope
from intellect.diloco.protocol import Quorum
from intellect.diloco.rendezvous import (
    MAC_HEADER,
    MAX_BODY,
    NONCE_HEADER,
    PEER_HEADER,
    TIME_HEADER,
    RendezvousServer,
    peer_key,
    request_tag,
)
from intellect.diloco.rendezvous_client import RendezvousStore, StoreError

SECRET = bytes(range(32))


@pytest.fixture
def store():
    server = RendezvousServer(SECRET, "run", policy=scope)
    yield server.port, server
    server.stop()


def member(port, name, **kw):
    return Membership("127.0.0.1", port, name, SECRET, "run", heartbeat_interval=0.2, heartbeat_timeout=1.5,
                      store_timeout=5, startup_grace=2.5, **kw)


def test_heartbeat_deathrattle_and_timeout(store):
    port, _ = store
    a, b, c = member(port, "a"), member(port, "b"), member(port, "c")
    a.start_heartbeat()
    b.start_heartbeat()
    c.start_heartbeat()
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
    # the rendezvous takes proposals from those that arrived
    a.set("arrive/3/a", "1")
    b.set("arrive/3/b", "1")
    # the proposal's order (admission order) is kept, never the names' sort order
    qa, qb = Quorum(a, "a", 3), Quorum(b, "b", 3)
    assert qa.propose_members(0, ["b", "a", "b"]) == ["b", "a"]
    assert qb.propose_members(0, ["a"]) == ["b", "a"]
    assert qa.members(0) == qb.members(0) == ["b", "a"]
    assert qa.members(1) is None
    # outcomes come from members that voted
    a.set("vote/3/0/a", "ok")
    b.set("vote/3/0/b", "fail")
    assert b.decide("outcome/3/0", "abort") == "abort" and a.decide("outcome/3/0", "commit") == "abort"


def test_waits_are_bounded_and_skip_the_dead_and_the_departed(store):
    port, _ = store
    a, b = member(port, "a"), member(port, "b")
    a.start_heartbeat()
    b.start_heartbeat()
    b.set("arrive/0/b", "1")
    assert Quorum(b, "b", 0).propose_members(0, ["b"]) == ["b"]  # ready/ keys come from the attempt's members
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
    a.close()
    b.close()


def test_the_quorum_commits_only_when_every_member_voted_ok(store):
    port, _ = store
    a, b = member(port, "a"), member(port, "b")
    a.start_heartbeat()
    b.start_heartbeat()
    a.set("arrive/0/a", "1")
    b.set("arrive/0/b", "1")
    qa, qb = Quorum(a, "a", 0), Quorum(b, "b", 0)
    members = qa.propose_members(0, ["a", "b"])
    deadline = time.monotonic() + 10
    b.set("ready/0/0/b", "1")
    assert qa.ready(0, members, deadline) == (["a", "b"], [])
    plan = {"order": None, "algorithm": "direct", "estimates": {}}
    assert qa.plan(0, plan) == qb.plan(0, {**plan, "algorithm": "ring"}) == plan  # the first plan wins
    b.set("vote/0/0/b", "fail")
    assert not qa.should_commit(0, True, members, deadline)  # one fail: everyone aborts
    assert not qb.decide(0, True) and qa.voted(0, members) == ["a", "b"]
    assert qa.propose_members(1, ["a", "b"]) == ["a", "b"]
    b.set("vote/0/1/b", "ok")
    assert qa.should_commit(1, True, members, deadline) and qb.decide(1, False)  # decided: commit for both
    a.close()
    b.close()


SERVER = """
import sys, time
from intellect.diloco.rendezvous import RendezvousServer
s = RendezvousServer(bytes(range(32)), "run", port=int(sys.argv[1]))
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
        connect_store("127.0.0.1", free_port(), 0.5, SECRET, "run")


def test_a_peer_without_the_secret_is_refused_with_a_reason(store):
    port, server = store
    with pytest.raises(StoreLost, match="bad_mac"):
        connect_store("127.0.0.1", port, 2, b"not the run secret!", "run", "mallory")
    with pytest.raises(StoreLost, match="bad_mac"):  # the secret of another run
        connect_store("127.0.0.1", port, 2, SECRET, "other-run", "mallory")
    assert server.refusals["bad_mac"] == 2 and server.refused[-1][2:4] == ("mallory", "bad_mac")


def _raw(port: int, body: bytes, headers: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/v1/set", body, headers)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_replayed_stale_and_oversized_requests_are_refused(store):
    port, server = store
    key = peer_key(SECRET, "run", "w0")

    def signed(body: bytes, at: float) -> dict:
        ms, nonce = int(at * 1000), secrets.token_hex(16)
        return {TIME_HEADER: str(ms), NONCE_HEADER: nonce, PEER_HEADER: "w0",
                MAC_HEADER: request_tag(key, "set", body, ms, nonce, "w0").hex()}

    body = json.dumps({"key": "arrive/0/w0", "value": "MQ=="}).encode()
    headers = signed(body, time.time())
    assert _raw(port, body, headers)[0] == 200
    status, why = _raw(port, body, headers)  # the same request again
    assert status == 401 and json.loads(why)["reason"] == "replay"
    status, why = _raw(port, body, signed(body, time.time() - 3600))
    assert status == 401 and json.loads(why)["reason"] == "stale"
    big = json.dumps({"key": "k", "value": "A" * MAX_BODY}).encode()
    assert _raw(port, big, signed(big, time.time()))[0] == 413
    assert server.refusals == {"replay": 1, "stale": 1, "too_large": 1}


def test_an_answer_without_the_run_mac_is_not_believed():
    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"value": true}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StoreError, match="without the run's MAC"):
            RendezvousStore("127.0.0.1", httpd.server_address[1], SECRET, "run", timeout=2).check(["progress"])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_deathrattle_goes_out_after_a_request_interrupted_midway(store, monkeypatch):
    """SIGTERM raises SystemExit wherever the main thread is, possibly between sending a request and
    reading its answer: the deathrattle that follows must go out on a fresh connection."""
    port, _ = store
    a, b = member(port, "a"), member(port, "b")
    a.store.set("arrive/0/a", "1")  # the thread's kept-alive connection exists
    real = http.client.HTTPConnection.getresponse
    calls = {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise SystemExit(1)  # the request went out; its answer is never read
        return real(self, *args, **kwargs)

    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", interrupted)
    with pytest.raises(SystemExit):
        a.has("x")
    a.deathrattle()
    assert calls["n"] == 2 and b.store.check(["dead/a"])
    a.close()
    b.close()
