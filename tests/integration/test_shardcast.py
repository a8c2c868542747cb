"""SHARDCAST with real processes on 127.0.0.1: an origin, relays and clients, and every fault the issue lists.

Each server is ``python -m intellect.shardcast`` in its own process group, stopped (or killed) by PID.
"""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from intellect.http_server import bind
from intellect.shardcast.client import ShardcastClient, ShardcastError
from intellect.shardcast.config import ClientConfig, RelayConfig, ShardcastConfig
from intellect.shardcast.local import ServerProcess, start_local
from intellect.shardcast.manifest import ShardEntry
from intellect.shardcast.relay import Relay
from intellect.shardcast.server import Server
from intellect.shardcast.signing import Verifier, VersionSigner
from intellect.shardcast.store import VersionStore
from intellect.shardcast.wire import DeadlineMissed, ShardConnections, ShardError, download_shard, list_versions
from intellect.shardcast.writer import VersionWriter, publish_folder
from intellect.trust.keys import SigningKey

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
KEY = SigningKey.from_seed(b"\7" * 32)  # the trainer's signing key: relays and clients pin KEY.public
RELAY = ["--trainer-key", KEY.public.hex]  # what a relay process is started with


def checkpoint(folder: Path, mib: int, seed: int = 0) -> dict[str, bytes]:
    """A checkpoint-like folder: a small JSON, a big weights file, an empty file."""
    folder.mkdir(parents=True)
    rnd = __import__("random").Random(seed)
    files = {"config.json": b'{"hidden_size": 128}', "model.safetensors": rnd.randbytes(mib * MIB), "empty.txt": b""}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def assert_same(dest: Path, files: dict[str, bytes]) -> None:
    assert (dest / "STABLE").exists()
    for name, data in files.items():
        got = (dest / name).read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), name


def wait_complete(client: ShardcastClient, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vs = [ShardcastClient([r], client.cfg).versions().get(version) for r in client.relays]
        if all(vs):
            return
        time.sleep(0.05)
    raise TimeoutError(f"relays did not complete version {version}")


@pytest.fixture
def cdn(tmp_path):
    c = start_local(ShardcastConfig(local_relays=2), tmp_path / "cdn", KEY.public)
    yield c
    c.stop()
    assert not c.origin.alive() and not any(r.alive() for r in c.relays)


def fast(**kw) -> ClientConfig:
    return ClientConfig(**{"deadline": 60.0, "read_timeout": 5.0, "connect_timeout": 2.0, "seed": 0,
                           "trainer_key": KEY.public.hex, **kw})


def test_a_client_starts_before_the_origin_finishes_and_gets_exact_bytes(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 12)
    store = VersionStore(cdn.origin_dir)
    written = threading.Event()

    def publish_slowly():  # a trainer writing its checkpoint over ~1.5 s
        with VersionWriter(store, 1, shard_size=MIB, key=KEY) as w:
            for name in sorted(files):
                w.begin_file(name)
                data = files[name]
                for off in range(0, len(data), MIB):
                    w.write(data[off:off + MIB])
                    time.sleep(0.1)
        written.set()

    progress = []
    with ShardcastClient(cdn.relay_urls, fast()) as client:
        pub = threading.Thread(target=publish_slowly)
        pub.start()
        deadline = time.monotonic() + 30
        while 1 not in client.versions():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stats = client.fetch(1, tmp_path / "out" / "step_1",
                             progress=lambda done, total: progress.append((written.is_set(), done, total)))
        pub.join()
    assert_same(tmp_path / "out" / "step_1", files)
    before = [done for was_written, done, _ in progress if not was_written]
    # pipelined: most shards arrived while the origin was still writing the rest
    assert before and max(before) >= stats.shards // 2, progress
    assert progress[-1][2] == stats.shards == 13
    assert sum(stats.by_relay.values()) == 13 and len(stats.by_relay) == 2  # both relays served


def test_a_relay_killed_mid_transfer_leaves_the_others_to_finish(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 96)
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "ckpt", shard_size=MIB // 2, keep=5, key=KEY)
    victim = cdn.relays[0]
    with ShardcastClient(cdn.relay_urls, fast(parallel=2)) as client:
        wait_complete(client, 1)
        killed_at = []

        def kill_after_first_shards(done, _total):
            if done == 8 and not killed_at:
                victim.kill()
                killed_at.append(done)

        stats = client.fetch(1, tmp_path / "out", progress=kill_after_first_shards)
        assert killed_at and stats.shards == 193
        assert client.scheduler.scores[victim.url].failures >= 1 or stats.by_relay.get(victim.url, 0) < 100
    assert_same(tmp_path / "out", files)
    assert stats.by_relay[cdn.relays[1].url] > 193 // 2


def test_corrupt_shards_on_one_relay_are_detected_and_fetched_elsewhere(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 8)
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    with ShardcastClient(cdn.relay_urls, fast()) as client:
        wait_complete(client, 1)
        bad = VersionStore(cdn.relays[0].port_file.parent.parent / "relay0")
        for i in range(9):  # same size, wrong bytes: only the hash can tell
            p = bad.shard_path(1, i)
            p.write_bytes(bytes(len(p.read_bytes())))
        stats = client.fetch(1, tmp_path / "out")
        assert client.scheduler.scores[cdn.relays[0].url].failures >= 1 and stats.retries >= 1
        assert stats.by_relay == {cdn.relays[1].url: 9}
    assert_same(tmp_path / "out", files)


def test_whole_checkpoint_check_with_and_without_chaining_values(tmp_path):
    """Chained shards prove the whole SHA-256 without reading the files back; a manifest without chaining
    values (or ``reread``) takes the read-back path; a whole hash that contradicts the chain fails."""
    files = checkpoint(tmp_path / "ckpt", 3)
    store = VersionStore(tmp_path / "origin")
    for v in (1, 2, 3):
        publish_folder(store, v, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    m = store.manifest(2)
    assert all(s.chain for s in m.shards[:-1])
    sign = VersionSigner(KEY, 2, m.publication)  # the trainer itself wrote these, signed
    store.write_manifest(m.model_copy(update={"shards": [sign.shard(s.model_copy(update={"chain": None}))
                                                         for s in m.shards]}))
    m = store.manifest(3)
    wrong = hashlib.sha256(b"not it").hexdigest()
    store.write_manifest(m.model_copy(update={"sha256": wrong, "signature": VersionSigner(KEY, 3, m.publication).header(
        m.files, m.shard_size, m.total_size, wrong)}))
    server = Server(store, bind("127.0.0.1", 0)).start()
    try:
        with ShardcastClient([server.url], fast()) as client:
            for v in (1, 2):
                client.fetch(v, tmp_path / f"out{v}")
                assert_same(tmp_path / f"out{v}", files)
            with pytest.raises(ShardcastError, match="differs from the manifest's"):
                client.fetch(3, tmp_path / "out3")
            assert not (tmp_path / "out3").exists() and not list(tmp_path.glob(".tmp-*"))
        with ShardcastClient([server.url], fast(reread=True)) as client:
            client.fetch(1, tmp_path / "again")
        assert_same(tmp_path / "again", files)
    finally:
        server.stop()


def held(url: str, version: int = 1) -> list[int]:
    r = httpx.get(f"{url}/v/{version}/manifest")
    return [s["index"] for s in r.json()["shards"]] if r.status_code == 200 else []


def test_a_relay_does_not_pass_on_a_bad_shard_from_upstream(tmp_path):
    files = checkpoint(tmp_path / "ckpt", 4)
    origin_store = VersionStore(tmp_path / "origin")
    publish_folder(origin_store, 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY, link=False)  # shard files
    good = origin_store.shard_path(1, 2).read_bytes()
    origin_store.shard_path(1, 2).write_bytes(bytes(len(good)))  # bit rot on the origin's disk
    origin = ServerProcess("origin", tmp_path / "origin")
    relay = ServerProcess("relay", tmp_path / "relay", extra=["--upstream", origin.url, *RELAY])
    try:
        with ShardcastClient([relay.url], fast(deadline=3.0)) as client:
            deadline = time.monotonic() + 30
            while len(held(relay.url)) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
            assert held(relay.url) == [0, 1, 3, 4]  # never advertises what it could not verify
            with pytest.raises(ShardcastError, match="complete on no relay"):
                client.fetch(1, tmp_path / "out")
            assert not (tmp_path / "out").exists()
            origin_store.shard_path(1, 2).write_bytes(good)  # repaired: the relay picks it up on its next pass
            wait_complete(client, 1)
            client.fetch(1, tmp_path / "out")
        assert_same(tmp_path / "out", files)
    finally:
        relay.stop()
        origin.stop()


def wait_held(url: str, want: list[int], version: int = 1, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while held(url, version) != want:
        assert time.monotonic() < deadline, (held(url, version), want)
        time.sleep(0.05)


def test_a_restarted_relay_lists_on_and_a_version_rewritten_upstream_is_mirrored_anew(tmp_path):
    """The listing a relay follows and serves survives its restart (followers keep their place), and
    a version the origin withdrew and wrote again differently replaces the relay's copy."""
    rnd = __import__("random").Random(3)
    blob = rnd.randbytes(5 * MIB)
    store = VersionStore(tmp_path / "origin")
    origin = ServerProcess("origin", tmp_path / "origin")
    relay = ServerProcess("relay", tmp_path / "relay", extra=["--upstream", origin.url, *RELAY])
    w = VersionWriter(store, 1, shard_size=MIB, key=KEY)
    try:
        w.begin_file("model.safetensors")
        w.write(blob[:3 * MIB])
        wait_held(relay.url, [0, 1, 2])
        name = httpx.get(f"{relay.url}/v/1/manifest?since=0&listing=&wait=0", timeout=5).json()["listing"]
        relay.stop()
        w.write(blob[3 * MIB:])
        relay = ServerProcess("relay", tmp_path / "relay", extra=["--upstream", origin.url, *RELAY])
        wait_held(relay.url, [0, 1, 2, 3, 4])
        news = httpx.get(f"{relay.url}/v/1/manifest?since=3&listing={name}&wait=0", timeout=5).json()
        assert news["listing"] == name and sorted(s["index"] for s in news["shards"]) == [3, 4]  # listed on
        w.finish()
        with ShardcastClient([relay.url], fast()) as client:
            wait_complete(client, 1)
            client.fetch(1, tmp_path / "v1")
            assert (tmp_path / "v1" / "model.safetensors").read_bytes() == blob
            # version 2: two shards out, then the trainer's run dies and the version is written again
            first = VersionWriter(store, 2, shard_size=MIB, key=KEY)
            first.begin_file("model.safetensors")
            first.write(bytes(2 * MIB))
            wait_held(relay.url, [0, 1], version=2)
            first.abort()
            again = rnd.randbytes(3 * MIB)
            with VersionWriter(store, 2, shard_size=MIB, key=KEY) as w2:
                w2.begin_file("model.safetensors")
                w2.write(again)
            wait_complete(client, 2)
            client.fetch(2, tmp_path / "v2")
            assert (tmp_path / "v2" / "model.safetensors").read_bytes() == again
        assert "version 2 changed upstream; dropping the local copy" in relay.log_path.read_text()
    finally:
        relay.stop()
        origin.stop()


def test_a_folder_is_published_by_hard_links_and_a_file_changed_afterwards_is_refused(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 3)
    store = VersionStore(cdn.origin_dir)
    m = publish_folder(store, 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    weights = tmp_path / "ckpt" / "model.safetensors"
    linked = store.version_dir(1) / "files" / "model.safetensors"
    assert os.stat(linked).st_ino == os.stat(weights).st_ino  # no copy was made
    assert not list(store.version_dir(1).glob("shard_*")) and m.complete and len(m.shards) == 4
    with ShardcastClient(cdn.relay_urls, fast()) as client:
        wait_complete(client, 1)
        client.fetch(1, tmp_path / "out1")
    assert_same(tmp_path / "out1", files)

    # the trainer rewrites the weights in place (same inode): the origin refuses them from then on
    publish_folder(store, 2, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 100)
    for i in range(4):  # every shard holds weights bytes (the config is the first 20 bytes of the blob)
        r = httpx.get(f"{cdn.origin.url}/v/2/shard/{i}", timeout=5)
        assert r.status_code == 500 and "changed" in r.json()["error"], (i, r.text)


def test_a_folder_on_another_file_system_is_copied(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's folder")
    src = Path(__import__("tempfile").mkdtemp(dir=shm))
    try:
        files = checkpoint(src / "ckpt", 1)
        store = VersionStore(tmp_path / "origin")
        m = publish_folder(store, 1, src / "ckpt", shard_size=MIB // 2, keep=5, key=KEY)
        assert m.complete and not (store.version_dir(1) / "files").exists()
        assert b"".join(store.shard_path(1, s.index).read_bytes() for s in m.shards) == \
            files["config.json"] + files["empty.txt"] + files["model.safetensors"]
    finally:
        __import__("shutil").rmtree(src, ignore_errors=True)


def test_relays_keep_serving_when_the_origin_stops(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 4)
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    with ShardcastClient(cdn.relay_urls, fast()) as client:
        wait_complete(client, 1)
        cdn.origin.stop()
        time.sleep(0.5)  # several failed polls upstream
        assert client.complete_versions() == [1]
        client.fetch(1, tmp_path / "out")
    assert_same(tmp_path / "out", files)


def test_with_every_relay_down_the_client_fails_within_its_deadline_and_leaves_nothing(cdn, tmp_path):
    checkpoint(tmp_path / "ckpt", 2)
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    urls = cdn.relay_urls
    cdn.stop()
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    with ShardcastClient(urls, fast(deadline=2.0)) as client:
        with pytest.raises(ShardcastError) as e:
            client.fetch(1, out / "step_1")
    assert time.monotonic() - t0 < 4.0
    assert "not fetched within 2 s" in str(e.value) and "no relay listed the version" in str(e.value)
    assert "ConnectError" in str(e.value) or "connect" in str(e.value).lower()
    assert list(out.iterdir()) == []  # not even a temporary folder


def test_a_manifest_request_can_wait_for_the_next_shard(tmp_path):
    """The long poll relays and clients use while a version is written: the answer comes with the
    news, and carries only the news."""
    store = VersionStore(tmp_path / "origin")
    server = Server(store, bind("127.0.0.1", 0)).start()
    try:
        w = VersionWriter(store, 1, shard_size=4, key=KEY)
        w.begin_file("w")
        w.write(b"abcd")
        url = f"{server.url}/v/1/manifest"
        assert [s["index"] for s in httpx.get(url, timeout=5).json()["shards"]] == [0]
        first = httpx.get(f"{url}?since=0&listing=&wait=0", timeout=5).json()
        assert [s["index"] for s in first["shards"]] == [0] and first["since"] == 0 and first["listing"]
        got = {}
        ask = f"{url}?since=1&listing={first['listing']}"
        waiter = threading.Thread(target=lambda: got.update(httpx.get(f"{ask}&wait=10", timeout=20).json()))
        waiter.start()
        w.write(b"efgh")  # the second shard: the held request answers with it, and only it
        waiter.join(20)
        assert [s["index"] for s in got["shards"]] == [1] and got["since"] == 1 and not got["complete"]
        # another listing's position is no position here: the answer starts over
        other = httpx.get(f"{url}?since=1&listing=beef&wait=0", timeout=5).json()
        assert [s["index"] for s in other["shards"]] == [0, 1]
        w.finish()
        done = httpx.get(f"{ask.replace('since=1', 'since=2')}&wait=10", timeout=20).json()  # complete: no wait
        assert done["complete"] and done["since"] == 0 and [s["index"] for s in done["shards"]] == [0, 1]
        for bad in ["since=1", "since=x&listing=&wait=1", "since=1&listing=&wait=-1", "since=1&listing=&wait=nan",
                    "since=1&listing=&wait=99", "since=-1&listing=&wait=1", "after=1&wait=1"]:
            assert httpx.get(f"{url}?{bad}", timeout=5).status_code == 400, bad
        assert httpx.get(f"{server.url}/v/2/manifest?since=0&listing=&wait=1", timeout=5).status_code == 404
    finally:
        server.stop()


def test_a_versions_request_can_wait_for_the_next_version(tmp_path):
    """The long poll an idle relay makes: answered when a newer version is listed, one request a
    second at most while nothing happens (it polled 20 times a second before)."""
    store = VersionStore(tmp_path / "origin")
    server = Server(store, bind("127.0.0.1", 0)).start()
    try:
        url = f"{server.url}/versions"
        t0 = time.monotonic()
        assert httpx.get(f"{url}?newer=-1&wait=0.3", timeout=5).json() == {"versions": []}  # held, then answered
        assert time.monotonic() - t0 >= 0.25
        got = {}
        waiter = threading.Thread(target=lambda: got.update(httpx.get(f"{url}?newer=-1&wait=10", timeout=20).json()))
        waiter.start()
        time.sleep(0.2)
        with VersionWriter(store, 4, shard_size=4, key=KEY) as w:
            w.begin_file("w")
            w.write(b"abcd")
        waiter.join(20)
        assert [v["version"] for v in got["versions"]] == [4]
        assert [v["version"] for v in httpx.get(f"{url}?newer=3&wait=10", timeout=5).json()["versions"]] == [4]
        for bad in ["newer=1", "newer=x&wait=1", "newer=1&wait=11", "newer=-2&wait=1", "newer=1&wait=1&x=2"]:
            assert httpx.get(f"{url}?{bad}", timeout=5).status_code == 400, bad
    finally:
        server.stop()


def test_shard_requests_fail_cleanly_on_bad_answers():
    """What a misbehaving server can do to one shard request: each is a ShardError (the client then
    tries elsewhere), and a keep-alive connection the server dropped while idle is reopened silently."""

    body = b"0123456789"
    entry = ShardEntry(index=0, offset=0, size=10, sha256=hashlib.sha256(body).hexdigest())
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + body
    answers = [  # one per connection: the bytes sent, then whether to keep the connection open for the next
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n" + body + b"!", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", False),  # then closes mid-body
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456780", False),  # wrong bytes
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", True),  # then silent until the read timed out
        (ok, True),  # kept alive, then closed by the server while idle
        (ok, False),
    ]
    # an answer on a connection the server then closes says so: the client must not pool it (a reused
    # dead connection would fail with a reset instead of the answer this test expects)
    answers = [(a if keep else a.replace(b"\r\n", b"\r\nConnection: close\r\n", 1), keep) for a, keep in answers]
    listener = bind("127.0.0.1", 0)
    timed_out = threading.Event()

    def serve():
        for answer, linger in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)
                if linger and not timed_out.is_set():
                    timed_out.wait(10)
                elif linger:
                    time.sleep(0.2)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    base = "http://%s:%d" % listener.getsockname()[:2]
    conns = ShardConnections(connect_timeout=1.0, read_timeout=1.0, per_server=2)
    got = bytearray(10)

    def sink(pos, piece):
        got[pos: pos + len(piece)] = piece

    try:
        for expected in ["HTTP 404", "11 bytes announced", "5 of 10 bytes: the server closed",
                         "None bytes announced", "sha256 mismatch", "TimeoutError"]:
            with pytest.raises(ShardError, match=expected):
                download_shard(conns, base, 1, entry, sink, time.monotonic() + 10)
        timed_out.set()
        download_shard(conns, base, 1, entry, sink, time.monotonic() + 10)
        time.sleep(1)  # the server has closed the pooled connection by now
        got[:] = bytes(10)
        download_shard(conns, base, 1, entry, sink, time.monotonic() + 10)
        assert bytes(got) == body
    finally:
        conns.close()
        listener.close()
    t.join(5)
    with pytest.raises(ShardError, match="ConnectionRefusedError"):  # nobody listens any more
        download_shard(ShardConnections(1.0, 1.0, 1), base, 1, entry, sink, time.monotonic() + 10)


class _Dripping(http.server.BaseHTTPRequestHandler):
    """Forwards every request to ``upstream`` but sends shards a byte every 0.2 s, headers (``drip_head``)
    or body: each read succeeds within any read timeout, and a shard takes forever."""

    upstream = ""
    drip_head = False
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if "/shard/" not in self.path:
            r = httpx.get(self.upstream + self.path, timeout=10)
            self.send_response(r.status_code)
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)
            return
        r = httpx.get(self.upstream + self.path, timeout=10)
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(r.content)}\r\n\r\n".encode()
        data = (head + r.content) if self.drip_head else r.content
        if not self.drip_head:
            self.wfile.write(head)
        try:
            for i in range(len(data)):
                self.wfile.write(data[i: i + 1])
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the downloader gave up
            self.close_connection = True

    def log_message(self, *args):
        pass


def _drip_server(upstream: str, drip_head: bool = False) -> http.server.ThreadingHTTPServer:
    handler = type("Drip", (_Dripping,), {"upstream": upstream, "drip_head": drip_head})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("drip_head", [False, True], ids=["body", "headers"])
def test_a_server_dripping_a_shard_cannot_hold_a_download_past_its_deadline(tmp_path, drip_head):

    origin_store = VersionStore(tmp_path / "origin")
    checkpoint(tmp_path / "ckpt", 1)
    m = publish_folder(origin_store, 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    server = Server(origin_store, bind("127.0.0.1", 0)).start()
    drip = _drip_server(server.url, drip_head)
    conns = ShardConnections(connect_timeout=1.0, read_timeout=1.0, per_server=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match="deadline passed"):  # every read came within its 1 s timeout
            download_shard(conns, f"http://127.0.0.1:{drip.server_address[1]}", 1, m.shards[0],
                           lambda pos, piece: None, time.monotonic() + 1.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        conns.close()
        drip.shutdown()
        drip.server_close()
        server.stop()


def test_a_relay_abandons_a_dripping_upstream_and_mirrors_from_another(tmp_path):

    files = checkpoint(tmp_path / "ckpt", 4)
    origin_store = VersionStore(tmp_path / "origin")
    publish_folder(origin_store, 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    server = Server(origin_store, bind("127.0.0.1", 0)).start()
    drip = _drip_server(server.url)
    dripping = f"http://127.0.0.1:{drip.server_address[1]}"
    store = VersionStore(tmp_path / "relay")
    # a 1 MiB shard may take 1 s + 1 MiB / (1 MiB/s) = 2 s
    relay = Relay(store, RelayConfig(upstreams=[dripping, server.url], parallel=2, read_timeout=1.0,
                                     min_rate=MIB, trainer_key=KEY.public.hex), seed=0)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not ((m := store.manifest(1)) is not None and m.complete):
            assert time.monotonic() < deadline, "the relay did not mirror the version"
            time.sleep(0.05)
        assert relay.scheduler.scores[dripping].failures >= 1  # it was tried, held a thread for 2 s, and was left
        relay_server = Server(store, bind("127.0.0.1", 0)).start()
        try:
            with ShardcastClient([relay_server.url], fast()) as client:
                client.fetch(1, tmp_path / "out")
            assert_same(tmp_path / "out", files)
        finally:
            relay_server.stop()
    finally:
        stop.set()
        thread.join(10)
        relay.close()
        drip.shutdown()
        drip.server_close()
        server.stop()


def test_path_traversal_is_refused(cdn, tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    checkpoint(tmp_path / "ckpt", 1)
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    for base in [cdn.origin.url, *cdn.relay_urls]:
        for path in ["/v/1/shard/..%2F..%2F..%2Fsecret.txt", "/v/1/../../secret.txt", "/..%2F..%2Fsecret.txt",
                     "/v/1/manifest.json", "/v/-1/manifest", "/v/1/shard/1e3", "/v/99999999999/manifest",
                     "/v/1/shard/99999999", "/etc/passwd"]:
            r = httpx.get(base + path)
            assert r.status_code in (400, 404), (path, r.status_code)
            assert b"secret" not in r.content


def test_a_manifest_naming_a_file_outside_the_folder_is_rejected(tmp_path):
    """A hostile relay cannot make a client write outside its target folder."""
    evil = {"version": 1, "files": [{"name": "../escape", "offset": 0, "size": 4}], "shard_size": 4,
            "shards": [{"index": 0, "offset": 0, "size": 4, "sha256": hashlib.sha256(b"evil").hexdigest()}],
            "total_size": 4, "sha256": hashlib.sha256(b"evil").hexdigest(), "complete": True}
    store = VersionStore(tmp_path / "honest")
    store.version_dir(1).mkdir()
    (store.version_dir(1) / "manifest.json").write_text(json.dumps(evil))
    server = Server(store, bind("127.0.0.1", 0)).start()
    try:  # our own server does not serve what it cannot parse
        assert httpx.get(server.url + "/v/1/manifest", timeout=5).status_code == 404
        assert httpx.get(server.url + "/versions", timeout=5).json() == {"versions": []}
    finally:
        server.stop()
    body = json.dumps({**evil, "listing": "", "since": 0}).encode()

    class Hostile(http.server.BaseHTTPRequestHandler):  # any manifest question gets the evil one
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    try:
        with ShardcastClient([f"http://127.0.0.1:{hostile.server_address[1]}"], fast(deadline=1.0)) as client:
            with pytest.raises(ShardcastError, match="manifest"):
                client.fetch(1, tmp_path / "dest" / "step_1")
    finally:
        hostile.shutdown()
        hostile.server_close()
    assert not (tmp_path / "dest" / "escape").exists() and not (tmp_path / "escape").exists()


def test_eight_clients_at_once_on_one_host(cdn, tmp_path):
    files = checkpoint(tmp_path / "ckpt", 16)
    publish_folder(VersionStore(cdn.origin_dir), 3, tmp_path / "ckpt", shard_size=MIB, keep=5, key=KEY)
    relay_args = [a for url in cdn.relay_urls for a in ("--relay", url)]
    procs = [subprocess.Popen([sys.executable, "-m", "intellect.shardcast", "client", *relay_args, *RELAY,
                               "--dest", str(tmp_path / f"out{i}"), "--deadline", "120"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for i in range(8)]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert [p.returncode for p in procs] == [0] * 8, [r[1][-500:] for r in results]
    for i in range(8):
        assert_same(tmp_path / f"out{i}", files)


def test_origin_and_relays_keep_the_newest_five_versions(cdn, tmp_path):
    checkpoint(tmp_path / "ckpt", 1)
    store = VersionStore(cdn.origin_dir)
    with ShardcastClient(cdn.relay_urls, fast()) as client:
        for v in range(1, 8):
            publish_folder(store, v, tmp_path / "ckpt", shard_size=MIB // 4, keep=5, key=KEY)
            wait_complete(client, v)
        deadline = time.monotonic() + 10
        while True:
            listed = [sorted(ShardcastClient([u], fast()).versions()) for u in cdn.relay_urls]
            if listed == [[3, 4, 5, 6, 7]] * 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert listed == [[3, 4, 5, 6, 7]] * 2
    assert store.versions() == [3, 4, 5, 6, 7]


def test_the_intellect_command_runs_the_shardcast_client(capsys, tmp_path):
    from flows.cli import main  # noqa: PLC0415 - the flows layer (and Prefect) only for this test

    assert main(["shardcast", "client", "--relay", "http://127.0.0.1:9", "--dest", str(tmp_path / "x"),
                 "--deadline", "1", *RELAY]) == 1
    assert "holds a complete version" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


class _DrippingJson:
    """A server on 127.0.0.1 that answers every request (listings, manifests) a byte every 0.2 s, its
    headers (``head``) or its body: each read comes well within any read timeout, the answer never ends."""

    def __init__(self, head: bool):
        self.head, self.stop = head, threading.Event()
        self.listener = bind("127.0.0.1", 0)
        self.url = "http://%s:%d" % self.listener.getsockname()[:2]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        with conn:
            try:
                conn.recv(65536)
                if not self.head:
                    conn.sendall(head)
                for byte in (head if self.head else b" " * 1000):
                    if self.stop.wait(0.2):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:  # the reader gave up
                pass

    def close(self):
        self.stop.set()
        self.listener.close()


@pytest.fixture(params=[False, True], ids=["body", "headers"])
def dripping_json(request):
    d = _DrippingJson(head=request.param)
    yield d
    d.close()


@pytest.fixture
def honest(tmp_path):
    """An origin holding version 1 (1 MiB), served in this process; its files."""
    files = checkpoint(tmp_path / "ckpt", 1)
    store = VersionStore(tmp_path / "origin")
    publish_folder(store, 1, tmp_path / "ckpt", shard_size=MIB // 4, keep=5, key=KEY)
    server = Server(store, bind("127.0.0.1", 0)).start()
    yield server, files
    server.stop()


def test_a_relay_dripping_its_answers_delays_a_listing_only_to_its_deadline(dripping_json, honest, tmp_path):
    server, files = honest
    # a listing may take min(deadline, read_timeout + 1 MiB / min_rate) = 1 s + 1 s here
    with ShardcastClient([dripping_json.url, server.url], fast(read_timeout=1.0, min_rate=MIB, deadline=20.0)) as c:
        t0 = time.monotonic()
        assert c.versions() == {1: True}  # the honest relay's answer, though the other one never finishes
        assert 1.5 < time.monotonic() - t0 < 2.0 + 1.0
        assert c.scheduler.scores[dripping_json.url].failures == 1 and c.scheduler.scores[server.url].failures == 0
        stats = c.fetch(1, tmp_path / "out")
    assert set(stats.by_relay) == {server.url}
    assert_same(tmp_path / "out", files)


@pytest.mark.slow
def test_alone_a_dripping_relay_fails_each_call_within_its_deadline(dripping_json, tmp_path):

    conns = ShardConnections(connect_timeout=1.0, read_timeout=1.0, per_server=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineMissed, match="/versions: .*deadline"):  # each read came within 1 s
            list_versions(conns, dripping_json.url, Verifier(KEY.public.hex), MIB, time.monotonic() + 1.5)
        assert time.monotonic() - t0 < 1.5 + 0.5
    finally:
        conns.close()
    with ShardcastClient([dripping_json.url], fast(read_timeout=1.0, deadline=2.0)) as c:
        t0 = time.monotonic()
        assert c.versions() == {}  # within the client's deadline, the listing's cap here
        assert time.monotonic() - t0 < 2.0 + 1.0
        t0 = time.monotonic()
        with pytest.raises(ShardcastError, match="not fetched within 2 s .*manifest: .*deadline"):
            c.fetch(1, tmp_path / "out" / "step_1")
        assert time.monotonic() - t0 < 2.0 + 1.0
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_a_relay_lists_its_honest_upstream_despite_a_dripping_one(dripping_json, honest, tmp_path):

    server, files = honest
    store = VersionStore(tmp_path / "relay")
    relay = Relay(store, RelayConfig(upstreams=[dripping_json.url, server.url], read_timeout=1.0, min_rate=MIB,
                                     trainer_key=KEY.public.hex), seed=0)
    try:
        t0 = time.monotonic()
        relay.sync_once()  # both upstreams asked at once: the dripping one costs its 1 s + 1 s deadline
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert relay.scheduler.scores[dripping_json.url].failures >= 1
        deadline = time.monotonic() + 30
        while not ((m := store.manifest(1)) is not None and m.complete):
            assert time.monotonic() < deadline, "the relay did not mirror the version"
            relay.sync_once()
    finally:
        relay.close()
    relay_server = Server(store, bind("127.0.0.1", 0)).start()
    try:
        with ShardcastClient([relay_server.url], fast()) as c:
            c.fetch(1, tmp_path / "out")
        assert_same(tmp_path / "out", files)
    finally:
        relay_server.stop()
