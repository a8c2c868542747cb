"""Per-peer credentials and write scopes on the real rendezvous server: what an admitted peer can
not do to the others or to the coordinator, and an idle-connection flood from an outsider."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from diloco_runs import run_cfg

from intellect.diloco.coordinator import (ALLREDUCE_KEY_ENV, PEER_KEY_ENV, SECRET_ENV, Coordinator, load_credentials,
                                          worker_args, worker_credentials, worker_launcher)
from intellect.diloco.membership import Membership, StoreLost, retire, scope
from intellect.diloco.protocol import AHEAD, KEEP_STEPS
from intellect.diloco.rendezvous import COORDINATOR, MAX_VALUE, QUOTA, RendezvousServer, peer_key
from intellect.diloco.rendezvous_client import RendezvousStore, StoreError
from intellect.diloco.transport import new_group

SECRET = bytes(range(32))


@pytest.fixture
def server():
    s = RendezvousServer(SECRET, "run", policy=scope)
    yield s
    s.stop()


def client(server, peer: str, key: bytes | None = None) -> RendezvousStore:
    """A peer holding only its own key, as a launched worker does."""
    return RendezvousStore("127.0.0.1", server.port, None, "run", peer=peer, timeout=3,
                           key=key or peer_key(SECRET, "run", peer))


def refused(fn, reason: str) -> str:
    with pytest.raises(StoreError) as e:
        fn()
    text = str(e.value)
    why = json.loads(text[text.index("{"):])
    assert why["reason"] == reason, why
    return why["detail"]


def honest_step(peers, t=0):
    """The rendezvous of one committed step by ``peers`` (the first leads), as workers write it."""
    for p, s in peers.items():
        s.set(f"arrive/{t}/{p}", "1")
    first = next(iter(peers.values()))
    assert json.loads(first.compare_set(f"members/{t}/0", "", json.dumps(list(peers)))) == list(peers)
    for p, s in peers.items():
        s.set(f"ready/{t}/0/{p}", "1")
        s.set(f"vote/{t}/0/{p}", "ok")
    assert first.compare_set(f"outcome/{t}/0", "", "commit") == b"commit"
    first.set("progress", json.dumps(t + 1))


def test_a_peer_speaks_only_as_itself_and_writes_only_its_own_keys(server):
    coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
    coord.set("launched/0", "alice")
    coord.set("launched/1", "mallory")
    coord.add("launched", 2)
    alice, mal = client(server, "alice"), client(server, "mallory")
    # mallory's key does not MAC a request in alice's name, nor the coordinator's
    refused(lambda: client(server, "alice", peer_key(SECRET, "run", "mallory")).set("hb/alice", "1"), "bad_mac")
    refused(lambda: client(server, COORDINATOR, peer_key(SECRET, "run", "mallory")).num_keys(), "bad_mac")
    # its own keys
    mal.add("hb/mallory", 1)
    mal.set("dead/mallory", "1")
    mal.delete_key("dead/mallory")
    for move in [lambda: mal.add("hb/alice", 1), lambda: mal.set("dead/alice", "1"),
                 lambda: mal.delete_key("hb/alice"), lambda: mal.set("arrive/0/alice", "1"),
                 lambda: mal.set("committed/0/alice", "0"), lambda: mal.set("left/0/alice", "1"),
                 lambda: mal.set("metrics/0/alice", "{}"), lambda: mal.set("ban/mallory/alice", "{}"),
                 lambda: mal.set("launched/0", "mallory"), lambda: mal.add("launched", 1),
                 lambda: mal.set("banned/alice", "{}"), lambda: mal.set("start", "7"),
                 lambda: mal.set("members/0/0", '["mallory"]'), lambda: mal.delete_key("launched/0")]:
        refused(move, "scope")
    assert server.refusals["scope"] == 14 and server.refused[-1][2:4] == ("mallory", "scope")
    # reads are open; a counter read creates nothing
    assert alice.get("launched/0") == b"alice" and mal.add("hb/nobody", 0) == 0 and not alice.check(["hb/nobody"])
    # gloo's keys: none outside a group's per-rank layout
    refused(lambda: mal.set("pg/0/0/0", "addr"), "scope")
    refused(lambda: alice.add("pg/0/0/count", 1), "scope")


def test_the_red_team_moves_of_an_admitted_peer_change_nothing(server):
    coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
    for i, w in enumerate(["alice", "bob", "mallory"]):
        coord.set(f"launched/{i}", w)
    coord.add("launched", 3)
    coord.set("start", "0")
    alice, bob, mal = client(server, "alice"), client(server, "bob"), client(server, "mallory")
    before = server.refusals["scope"]
    # /tmp/redteam/e3_peer_control.py, move by move
    assert "coordinator" in refused(lambda: mal.set("banned/alice", b'{"step":0,"by":"bob"}'), "scope")
    refused(lambda: mal.set("launched/0", b"mallory"), "scope")
    for a in range(4):  # outcomes of attempts nobody agreed on, ahead of time
        refused(lambda: mal.compare_set(f"outcome/1/{a}", b"", b"abort"), "scope")
    refused(lambda: mal.set("progress", b"999999"), "scope")
    refused(lambda: mal.set("progress", b"x"), "scope")
    # a future step's membership: mallory arrives ahead and proposes itself alone
    mal.set("arrive/2/mallory", "1")
    refused(lambda: mal.compare_set("members/2/0", "", '["mallory"]'), "scope")
    # an overwrite of a decision, or a ban by one peer, takes nothing either
    honest_step({"alice": alice, "bob": bob})
    assert mal.compare_set("outcome/0/0", "", "abort") == b"commit"  # decided: the decision comes back
    refused(lambda: mal.compare_set("outcome/0/0", "commit", "abort"), "scope")
    refused(lambda: mal.set("vote/0/0/mallory", "fail"), "scope")  # not a member of that attempt
    mal.set("ban/alice/mallory", json.dumps({"step": 0, "attempt": 0}))
    m = Membership("127.0.0.1", server.port, "alice", None, "run", 0.2, 1.5, key=peer_key(SECRET, "run", "alice"))
    try:
        names = ["alice", "bob", "mallory"]
        assert not m.banned("alice", names)  # a single record bans nobody
        assert m.progress() == 1 and alice.get("launched/0") == b"alice"
        assert not alice.check(["banned/alice"]) and not alice.check(["outcome/1/0"])
        # a majority of the attempt's members does ban
        bob.set("ban/mallory/bob", json.dumps({"step": 0, "attempt": 0}))
        assert not m.banned("mallory", names)  # mallory was not a member of 0/0: no attempt names it
        alice.set("ban/bob/alice", json.dumps({"step": 0, "attempt": 0}))
        assert not m.banned("bob", names)  # 1 of 2 members is no majority
    finally:
        m.close()
    assert server.refusals["scope"] - before == 11


def test_only_the_leader_of_a_commit_moves_progress_forward(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    honest_step({"alice": alice, "bob": bob}, t=0)
    assert "leader" in refused(lambda: bob.set("progress", "1"), "scope")
    refused(lambda: alice.set("progress", "2"), "scope")  # step 1 has not committed
    alice.set("progress", "1")  # the same again (a retried request) is fine
    # step 1: only a veteran proposes, and only from those that arrived
    alice.set("arrive/1/alice", "1")
    refused(lambda: alice.compare_set("members/1/0", "", '["alice", "bob"]'), "scope")  # bob has not arrived
    honest_step({"bob": bob, "alice": alice}, t=1)
    assert json.loads(alice.get("progress")) == 2
    refused(lambda: bob.set("progress", "1"), "scope")  # never back


def test_gloo_keys_are_written_once_by_their_rank_holder_after_the_attempt_is_ready(server):
    coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
    coord.set("start", "0")
    alice, bob, mal = client(server, "alice"), client(server, "bob"), client(server, "mallory")
    for p, s in (("alice", alice), ("bob", bob)):
        s.set(f"arrive/0/{p}", "1")
    alice.compare_set("members/0/0", "", '["alice", "bob"]')
    alice.set("ready/0/0/alice", "1")
    refused(lambda: mal.set("pg/0/0//0/0", "x"), "scope")  # not a member of the attempt
    refused(lambda: alice.set("pg/0/0//0/1", "x"), "scope")  # bob's rank
    assert "ready" in refused(lambda: alice.set("pg/0/0//0/0", "x"), "scope")  # before the group forms
    refused(lambda: mal.set("bw/0/col/0", "[1]"), "scope")
    refused(lambda: bob.set("pg/0/onboard//0/0", "x"), "scope")
    bob.set("ready/0/0/bob", "1")
    # the real groups form on what the rank holders write, and nobody writes a key twice
    groups = {}

    def form(rank, store):
        g = new_group(store, "pg/0/0", rank, 2, timeout=20)
        x = torch.full((4,), float(rank + 1))
        g.broadcast(x, 0).wait()
        groups[rank] = x.tolist()

    threads = [threading.Thread(target=form, args=(r, s)) for r, s in enumerate((alice, bob))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert groups == {0: [1.0] * 4, 1: [1.0] * 4}
    assert "once" in refused(lambda: alice.set("pg/0/0//0/0", "x"), "scope")
    alice.set("bw/0/col/0", "[1]")  # a boundary group's keys: its rank holder, after the members are decided
    refused(lambda: alice.set("bw/0/col/0", "[2]"), "scope")


def test_a_banned_peer_writes_nothing_and_no_peer_holds_more_than_its_quota():
    """The memory bound: one peer's keys and values (KEY_OVERHEAD per key counted) stay within QUOTA
    (2 MiB), each value within MAX_VALUE (16 KiB), per-step keys within the window around the run's
    step; measured as the process's RSS growth while one peer sends 740 KB metrics and then fills
    all it may."""
    server = RendezvousServer(SECRET, "run", policy=scope, prune=retire)
    try:
        coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
        coord.set("start", "0")
        w3, w0 = client(server, "w3"), client(server, "w0")
        rss0 = rss()
        for t in range(1500):  # the red team's 1,500 step numbers: only those around the run's step are taken
            if t > AHEAD:
                assert "steps 0-2" in refused(lambda: w3.set(f"metrics/{t}/w3", "{}"), "scope")
        for t in range(40):  # and no value over the cap
            refused(lambda: w3.set(f"metrics/{t % (AHEAD + 1)}/w3", "x" * 740_000), "quota")
        n, pad = 0, "y" * (MAX_VALUE - 64)
        while True:  # what it may still write: ban records, for any name
            try:
                w3.set(f"ban/x{n}/w3", json.dumps({"step": 0, "attempt": 0, "pad": pad}))
            except StoreError as e:
                assert e.reason == "quota", e
                break
            n += 1
        held = server.table.usage["w3"]
        assert n > 100 and QUOTA - MAX_VALUE - 1024 < held <= QUOTA, (n, held)
        grown = rss() - rss0
        assert grown < 4 * QUOTA, (grown, held)  # the whole process: table, nonces, allocator slack
        print(f"w3 holds {held} bytes of the store (quota {QUOTA}); RSS grew {grown / 2**20:.1f} MiB")
        # a ban revokes every write, and w0 is untouched
        coord.set("banned/w3", json.dumps({"by": "majority"}))
        for move in (lambda: w3.set("metrics/0/w3", "{}"), lambda: w3.add("hb/w3", 1),
                     lambda: w3.set("dead/w3", "1"), lambda: w3.delete_key("metrics/0/w3"),
                     lambda: w3.set("ban/w0/w3", json.dumps({"step": 0, "attempt": 0}))):
            refused(move, "banned")
        assert w3.get("banned/w3")  # reads go on: it learns it was banned
        w0.set("metrics/1/w0", "{}")
        # progress moves on: the steps left behind are dropped, and what they held with them
        coord.set("progress", str(KEEP_STEPS + 3))
        assert not w0.check(["metrics/1/w0"]) and w0.check(["ban/x0/w3"])
    finally:
        server.stop()


def rss() -> int:
    """This process's resident bytes, once freed heap went back to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_coordinator_reads_peer_values_defensively(tmp_path, caplog):
    cfg = run_cfg(tmp_path, run_name="defensive")
    c = Coordinator(cfg, worker_launcher(tmp_path / "logs"))
    try:
        for garbage in ("x", "1000000000", "-1", '"3"'):
            c.store.set("progress", garbage)
            assert c.progress() is None
        assert "progress" in c.ignored and "ignoring the value of progress" in caplog.text
        c.handles = {}
        c.store.set("metrics/0/w0", "not json")
        assert c.metrics(0) == []
        t0 = time.monotonic()
        c.store.set("progress", str(cfg.diloco.outer_steps))
        assert c.watch(timeout=0.5, on_commit=lambda *a: None) == {} and time.monotonic() - t0 < 5
        env = worker_credentials(c._secret, cfg.run_name, "w7")
        assert set(env) == {PEER_KEY_ENV, ALLREDUCE_KEY_ENV} and SECRET_ENV not in c.env
        assert c._secret.hex() not in json.dumps(env)
        assert load_credentials("w7", cfg.run_name, None, environ=env)[0] == peer_key(c._secret, cfg.run_name, "w7")
        with pytest.raises(ValueError, match="coordinator"):
            c.start_worker(COORDINATOR)
        with pytest.raises(StoreLost):  # w7's key speaks as w7 only
            Membership("127.0.0.1", c.port, "w8", None, cfg.run_name, key=bytes.fromhex(env[PEER_KEY_ENV]))
    finally:
        c.close()


FLOOD = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(n):
    try:
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
    except OSError:
        pass
print(len(socks), flush=True)
time.sleep(30)
"""


@pytest.mark.slow
def test_an_idle_connection_flood_is_refused_without_starving_the_peers():
    server = RendezvousServer(SECRET, "run", policy=scope, max_connections=32, header_timeout=2.0)
    flood = None
    try:
        coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
        assert coord.num_keys() == 0  # its kept-alive connection is open before the flood
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(server.port), "300"], stdout=subprocess.PIPE,
                                 text=True)
        assert int(flood.stdout.readline()) > 32  # the kernel accepted them all; the server keeps at most 32
        time.sleep(0.5)
        held = server._server.server_state.connections
        assert len(held) <= 33, len(held)
        assert server.refusals["too_many_connections"] >= 300 - 33
        coord.set("launched/0", "w0")  # the coordinator's own connection still serves
        fresh = client(server, "w0")  # and a new one gets a place: the oldest silent connection goes
        fresh.add("hb/w0", 1)
        assert coord.get("launched/0") == b"w0"
        time.sleep(3)  # past the header timeout every silent connection is closed
        assert server.refusals["header_timeout"] >= 1 and len(held) <= 3, (len(held), server.refusals)
        assert client(server, "w1").add("hb/w1", 1) == 1
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:  # one that never speaks
            s.settimeout(5)
            t0 = time.monotonic()
            assert s.recv(10) == b"" and time.monotonic() - t0 < 4  # closed by the server
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(timeout=10)
        server.stop()


def test_a_launched_worker_gets_its_own_keys_and_never_the_run_secret(tmp_path, monkeypatch):
    secret = bytes(range(1, 33))
    monkeypatch.setenv(SECRET_ENV, secret.hex())  # the coordinator's own environment holds the secret
    (tmp_path / "envdump.py").write_text(
        "import json, os\nprint(json.dumps({k: v for k, v in os.environ.items() if k.startswith('INTELLECT_DILOCO')}))\n")
    launcher = worker_launcher(tmp_path / "logs", module="envdump")
    env = {"PYTHONPATH": str(tmp_path), **worker_credentials(secret, "run", "w0")}
    handle = launcher.launch("w0", worker_args("w0", 0, "unused.json", "127.0.0.1:1"), env)
    handle.proc.wait(timeout=60)
    got = json.loads((tmp_path / "logs" / "w0.log").read_text().splitlines()[0])
    assert set(got) == {PEER_KEY_ENV, ALLREDUCE_KEY_ENV} and secret.hex() not in json.dumps(got)
    assert bytes.fromhex(got[PEER_KEY_ENV]) == peer_key(secret, "run", "w0")


def test_a_close_the_rendezvous_refuses_leaves_the_phase_open_and_the_member_running(server):
    # the quorum of a close is the step's members as the rendezvous counts them: a member whose own count
    # differs (an attempt's voters) is refused with a reason, and goes on as with quorum 1
    coord = client(server, COORDINATOR, peer_key(SECRET, "run", COORDINATOR))
    coord.set("start", "0")
    for i, p in enumerate(["alice", "bob", "carol"]):
        coord.set(f"launched/{i}", p)
    peers = {p: client(server, p) for p in ["alice", "bob", "carol"]}
    for p, s in peers.items():
        s.set(f"arrive/0/{p}", "1")
    peers["alice"].compare_set("members/0/0", "", json.dumps(list(peers)))
    peers["alice"].set("ready/0/0/alice", '{"tokens": 10, "seconds": 1.0}')
    m = Membership("127.0.0.1", server.port, "alice", None, "run", key=peer_key(SECRET, "run", "alice"))
    try:
        assert m.try_decide("close/0", "1") is None  # 1 of 3 done: below any quorum the default server counts
        assert not peers["alice"].check(["close/0"])
        assert m.try_decide("members/0/1", '["mallory"]') is None  # any policy refusal reads alike
        server.stop()
        with pytest.raises(StoreLost):
            m.try_decide("close/0", "1")  # a store that is gone is lost, as for every other call
    finally:
        m.close()
