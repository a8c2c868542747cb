"""Signed SHARDCAST versions against hostile relays, with real servers and processes on 127.0.0.1.

A hostile relay (a real HTTP server written here, in front of the honest origin) serves a forged
manifest, a version signed by another key (its own shards, with hashes that match them), an older
signed version under a newer number or as it is, truncated signatures, unsigned data, shard bytes
that are not the signed ones, or a 150 MB JSON answer. Clients never expose those bytes: beside an
honest relay they finish from it (exact files) and mark the hostile one bad with the reason; alone,
they fail with a clear ShardcastError within the deadline and leave nothing. A relay process whose
upstream is hostile mirrors and serves none of it.
"""

import hashlib
import http.server
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from http_stub import serve

from intellect.http_server import bind
from intellect.shardcast.client import ShardcastClient, ShardcastError
from intellect.shardcast.config import ClientConfig, RelayConfig
from intellect.shardcast.local import ServerProcess
from intellect.shardcast.relay import Relay
from intellect.shardcast.server import Server
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey

KIB = 1 << 10
ROOT = Path(__file__).resolve().parents[2]
KEY = SigningKey.from_seed(b"\x11" * 32)  # the trainer's
OTHER = SigningKey.from_seed(b"\x12" * 32)  # the attacker's
SHARD = 256 * KIB


def checkpoint(folder: Path, kib: int, seed: int) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    rnd = __import__("random").Random(seed)
    files = {"config.json": b'{"hidden_size": 64}', "model.safetensors": rnd.randbytes(kib * KIB)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def assert_exact(dest: Path, files: dict[str, bytes]) -> None:
    assert (dest / "STABLE").exists()
    assert sorted(p.name for p in dest.iterdir()) == sorted([*files, "STABLE"])
    for name, data in files.items():
        assert (dest / name).read_bytes() == data, name


def assert_nothing_left(parent: Path) -> None:
    """No checkpoint a reader could take: no STABLE, no folder, no temporary folder."""
    assert not parent.exists() or list(parent.iterdir()) == []


def cfg(**kw) -> ClientConfig:
    return ClientConfig(**{"deadline": 20.0, "read_timeout": 5.0, "connect_timeout": 2.0, "seed": 0,
                           "trainer_key": KEY.public.hex, **kw})


class Net:
    """The honest origin (a process) with versions 1 and 2, an honest relay (a process) mirroring it, and an
    origin of the attacker's (in this process) with its own version 2 signed by OTHER."""

    def __init__(self, root: Path):
        self.root = root
        self.files = {v: checkpoint(root / f"ckpt{v}", 600 + 100 * v, seed=v) for v in (1, 2)}
        store = VersionStore(root / "origin")
        for v in (1, 2):
            publish_folder(store, v, root / f"ckpt{v}", SHARD, keep=5, key=KEY)
        self.forged_files = checkpoint(root / "forged", 800, seed=99)
        self.other_store = VersionStore(root / "other")
        publish_folder(self.other_store, 2, root / "forged", SHARD, keep=5, key=OTHER)
        self.other = Server(self.other_store, bind("127.0.0.1", 0)).start()
        self.origin = ServerProcess("origin", root / "origin", log_dir=root / "logs")
        self.relay = ServerProcess("relay", root / "relay", log_dir=root / "logs",
                                   extra=["--upstream", self.origin.url, "--trainer-key", KEY.public.hex])
        with ShardcastClient([self.relay.url], cfg()) as c:
            deadline = time.monotonic() + 60
            while c.complete_versions() != [1, 2]:
                assert time.monotonic() < deadline, "the honest relay did not mirror versions 1 and 2"
                time.sleep(0.05)

    def stop(self) -> None:
        self.relay.stop()
        self.origin.stop()
        self.other.stop()


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    n = Net(tmp_path_factory.mktemp("signed"))
    yield n
    n.stop()
    assert not n.origin.alive() and not n.relay.alive()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


BOMB_BYTES = 150 << 20


class Hostile(http.server.BaseHTTPRequestHandler):
    """A relay in front of ``upstream`` that lies as ``mode`` says (see the module docstring)."""

    mode = ""
    upstream = ""
    other = ""

    def do_GET(self):
        try:
            self._answer()
        except OSError:  # the client hung up on a lie it refused
            self.close_connection = True

    def _answer(self):
        mode, path = self.mode, self.path
        if mode == "oversized" and "/shard/" not in path:
            return self._bomb()
        base = self.other if mode == "other_key" else self.upstream
        if (m := re.match(r"^/v/(\d+)/manifest(\?.*)?$", path)) and mode != "other_key":
            version, query = int(m.group(1)), m.group(2) or ""
            asked = version - 1 if mode.startswith("old_") else version
            r = httpx.get(f"{base}/v/{asked}/manifest{query}", timeout=10)
            if r.status_code != 200:
                return self._send(r.status_code, r.content)
            return self._send(200, json.dumps(self._lie(r.json(), version)).encode())
        if (m := re.match(r"^/v/(\d+)/shard/(\d+)$", path)) and mode != "other_key":
            version, index = int(m.group(1)), int(m.group(2))
            asked = version - 1 if mode.startswith("old_") else version
            r = httpx.get(f"{base}/v/{asked}/shard/{index}", timeout=10)
            body = r.content
            if mode == "forged_manifest":
                body = bytes(len(body))
            elif mode == "bad_bytes":
                body = bytes([body[0] ^ 1]) + body[1:]
            return self._send(r.status_code, body)
        r = httpx.get(base + path, timeout=10)
        return self._send(r.status_code, r.content)

    def _lie(self, d: dict, version: int) -> dict:
        mode = self.mode
        if mode == "forged_manifest":  # our own bytes (zeros), hashes that match them, the trainer's signatures
            for s in d["shards"]:
                s["sha256"], s["chain"] = _sha(bytes(s["size"])), None
            if d["sha256"]:
                d["sha256"] = _sha(bytes(d["total_size"]))
        elif mode == "truncated":
            d["signature"] = d["signature"][:100]
            for s in d["shards"]:
                s["signature"] = s["signature"][:100]
        elif mode == "unsigned":
            d["signature"] = d["publication"] = None
            for s in d["shards"]:
                s["signature"] = None
        elif mode == "old_renumbered":  # version 1's signed data as version 2
            d["version"] = version
        return d

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bomb(self) -> None:
        """150 MB of JSON with no length announced: only counting the bytes can stop it."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b'{"versions": [], "pad": "')
        piece = b"x" * (1 << 20)
        for _ in range(BOMB_BYTES >> 20):
            self.wfile.write(piece)
        self.wfile.write(b'"}')
        self.close_connection = True

    def log_message(self, *args):
        pass


def hostile(net: Net, mode: str):
    return serve(type(f"Hostile_{mode}", (Hostile,), {"mode": mode, "upstream": net.origin.url, "other": net.other.url}))


# what the client records for each lie
REASONS = {
    "forged_manifest": "bad_signature",
    "other_key": "bad_signature",
    "old_renumbered": "bad_signature",
    "old_as_is": "rollback",
    "truncated": "truncated_signature",
    "unsigned": "unsigned",
    "bad_bytes": "not the signed bytes",
    "oversized": "oversized",
}
MODES = list(REASONS)


@pytest.mark.parametrize("mode", MODES)
def test_beside_an_honest_relay_the_client_marks_a_hostile_one_bad_and_gets_exact_files(net, tmp_path, mode):
    # the first look waits up to poll_interval for every relay, so the liar is heard before shards start
    with hostile(net, mode) as url, ShardcastClient([url, net.relay.url], cfg(parallel=2, poll_interval=3.0)) as client:
        stats = client.fetch(2, tmp_path / "out" / "step_2")
        assert REASONS[mode] in client.bad[url], client.bad
        assert set(stats.by_relay) == {net.relay.url}  # no shard came from the liar
        assert client.complete_versions() == [1, 2]  # with other_key and oversized, its /versions is refused too
    assert_exact(tmp_path / "out" / "step_2", net.files[2])


@pytest.mark.parametrize("mode", MODES)
def test_alone_a_hostile_relay_fails_the_fetch_within_its_deadline_and_leaves_nothing(net, tmp_path, mode):
    out = tmp_path / "out"
    with hostile(net, mode) as url, ShardcastClient([url], cfg(deadline=10.0)) as client:
        t0 = time.monotonic()
        with pytest.raises(ShardcastError) as e:
            client.fetch(2, out / "step_2")
        assert time.monotonic() - t0 < 10.0 + 2.0
        assert "every relay served data that failed verification" in str(e.value) and REASONS[mode] in str(e.value)
        if mode in ("other_key", "oversized"):  # its /versions lies too (the others pass on the true one's)
            assert client.complete_versions() == [] and REASONS[mode] in client.bad[url]
    assert_nothing_left(out)


def relay_log(relay: ServerProcess) -> str:
    return relay.log_path.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_an_honest_relay_neither_mirrors_nor_serves_what_a_hostile_upstream_forged(net, tmp_path, mode):
    with hostile(net, mode) as url:
        only = ServerProcess("relay", tmp_path / "only", log_dir=tmp_path / "logs", name="only",
                             extra=["--upstream", url, "--trainer-key", KEY.public.hex])
        both = ServerProcess("relay", tmp_path / "both", log_dir=tmp_path / "logs", name="both",
                             extra=["--upstream", url, "--upstream", net.origin.url, "--trainer-key", KEY.public.hex])
        try:
            said = "mismatch" if mode == "bad_bytes" else "marked bad"
            deadline = time.monotonic() + 30
            while said not in relay_log(only):
                assert time.monotonic() < deadline, relay_log(only)[-2000:]
                time.sleep(0.05)
            time.sleep(0.5)  # a few more passes
            listed = httpx.get(f"{only.url}/versions", timeout=5).json()["versions"]
            served = httpx.get(f"{only.url}/v/2/manifest", timeout=5)
            if mode == "bad_bytes":  # the signed header is the trainer's; no shard that failed its hash is listed
                assert [v["shards"] for v in listed if v["version"] == 2] in ([], [0])
                assert served.status_code == 404 or served.json()["shards"] == []
            else:
                assert listed == [] and served.status_code == 404
            assert not list((tmp_path / "only").glob("v*/shard_*"))
            if mode != "bad_bytes":
                assert REASONS[mode] in relay_log(only)
            # beside the honest origin, the relay mirrors from it, and its readers get the exact files
            with ShardcastClient([both.url], cfg()) as client:
                deadline = time.monotonic() + 60
                while 2 not in client.complete_versions():
                    assert time.monotonic() < deadline, relay_log(both)[-2000:]
                    time.sleep(0.05)
                client.fetch(2, tmp_path / "out")
                assert client.bad == {}
            assert_exact(tmp_path / "out", net.files[2])
        finally:
            only.stop()
            both.stop()


_RSS_PROBE = textwrap.dedent("""
    import json, resource, sys
    from intellect.shardcast.client import ShardcastClient
    from intellect.shardcast.config import ClientConfig
    hostile, honest, key, out, manifest_cap, versions_cap = sys.argv[1:7]
    cfg = ClientConfig(trainer_key=key, deadline=60, seed=0, max_manifest_bytes=int(manifest_cap),
                       max_versions_bytes=int(versions_cap))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # everything imported
    with ShardcastClient([hostile, honest], cfg) as c:
        versions = c.complete_versions()
        stats = c.fetch(2, out + "/step_2")
        bad = dict(c.bad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kib": peak - base, "versions": versions, "bad": bad, "by_relay": stats.by_relay}))
""")


@pytest.mark.slow
def test_a_150_mb_json_answer_costs_the_client_little_memory_and_the_fetch_completes_beside_it(net, tmp_path):
    with hostile(net, "oversized") as url:
        r = subprocess.run([sys.executable, "-c", _RSS_PROBE, url, net.relay.url, KEY.public.hex, str(tmp_path),
                            *(str(ClientConfig.model_fields[f].default) for f in ("max_manifest_bytes",
                                                                                  "max_versions_bytes"))],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print("client peak RSS growth beside a 150 MB JSON answer:", got["growth_kib"], "KiB")
    # the whole body is 150 MB; the caps 8 MiB (manifests) and 1 MiB (/versions). With both caps raised to
    # 64 MiB the same probe grew by ~47 MB: the bound tells a capped read from a whole one
    assert got["growth_kib"] < 16 * 1024, got
    assert "oversized" in got["bad"][url] and got["versions"] == [1, 2] and set(got["by_relay"]) == {net.relay.url}
    assert_exact(tmp_path / "step_2", net.files[2])


def test_a_relay_does_not_serve_what_its_folder_holds_unverified(net, tmp_path):
    """Versions in a relay's folder from before (signed by another key, tampered with on disk) are dropped
    when it starts, not served as the trainer's."""
    store = VersionStore(tmp_path / "relay")
    publish_folder(store, 2, net.root / "forged", SHARD, keep=5, key=OTHER, link=False)
    publish_folder(store, 1, net.root / "ckpt1", SHARD, keep=5, key=KEY, link=False)
    m = store.manifest(1)
    store.write_manifest(m.model_copy(update={"shards": [m.shards[0].model_copy(update={"sha256": "0" * 64}),
                                                         *m.shards[1:]]}))
    relay = Relay(store, RelayConfig(upstreams=[net.origin.url], trainer_key=KEY.public.hex))
    try:
        assert store.versions() == []
    finally:
        relay.close()
