"""Weight patches through real SHARDCAST servers on 127.0.0.1: an origin process, relay processes, clients.

A chain of 20 versions with an anchor every 5 rebuilds bit-exact at a client that follows it and at
one that joins at version 13 (from the anchor at 10); relays keep the bases of the patches they serve.
A patch the trainer signed but that does not rebuild (indices out of range, a lying base digest, a
rebuilt digest that is not the signed one, bytes beyond its tensors, a base no relay holds) is refused
with its reason and leaves the client as it was. A relay that serves a patch's shards tampered, or its
header with another base (a newer one, itself, an older one), as full, or with another rebuilt digest,
is marked bad and the patch comes from the other relay.
"""

import http.server
import json
import re
import time
from pathlib import Path

import httpx

import numpy as np
import pytest
import safetensors.numpy as stn

from intellect.shardcast.client import ShardcastClient, VersionRefused
from intellect.shardcast.config import ClientConfig, ShardcastConfig
from intellect.shardcast.header import PATCH_ENCODING, Lineage
from intellect.shardcast.local import start_local
from intellect.shardcast.origin import Origin
from intellect.shardcast.patch import INDEX, checkpoint_digest, make_patch
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey
from http_stub import serve

KEY = SigningKey.from_seed(b"\x31" * 32)
SHARD = 4 << 10
PATCH = PATCH_ENCODING


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"embed": rng.standard_normal((128, 64)).astype(np.float16),
            "w": rng.standard_normal((64, 64)).astype(np.float32)}


def step(tensors: dict[str, np.ndarray], seed: int, share: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {k: v.copy() for k, v in tensors.items()}
    for t in out.values():
        flat = t.reshape(-1)
        flat[rng.random(flat.size) < share] += np.asarray(0.01, t.dtype)
    return out


def save(folder: Path, tensors: dict[str, np.ndarray], sidecar: bool = True) -> Path:
    """A checkpoint folder; with ``sidecar``, as the trainer writes it (a trainer-only file the origin leaves out)."""
    folder.mkdir(parents=True)
    stn.save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"hidden_size": 64}')
    if sidecar:
        (folder / "optimizer.pt").write_bytes(b"trainer only")
    return folder


def cfg(**kw) -> ClientConfig:
    return ClientConfig(**{"deadline": 60.0, "read_timeout": 5.0, "connect_timeout": 2.0, "seed": 0,
                           "trainer_key": KEY.public.hex, **kw})


def wait_listed(urls: list[str], version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(ShardcastClient([u], cfg()).versions().get(version) for u in urls):
            return
        time.sleep(0.05)
    raise TimeoutError(f"relays did not complete version {version}")


@pytest.fixture
def cdn(tmp_path):
    c = start_local(ShardcastConfig(local_relays=2, keep=2), tmp_path / "cdn", KEY.public)
    yield c
    c.stop()


def relay_store(cdn, i: int) -> VersionStore:
    return VersionStore(cdn.origin_dir.parent / f"relay{i}")


def test_twenty_versions_with_an_anchor_every_five_rebuild_bit_exact_and_a_late_joiner_starts_at_the_anchor(
        cdn, tmp_path):
    origin = Origin(cdn.origin_dir, shard_size=SHARD, keep=2, anchor_every=5)
    w, sizes = weights(), {}
    with ShardcastClient(cdn.relay_urls, cfg()) as steady:
        for v in range(20):
            w = step(w, v)
            folder = save(tmp_path / "trainer" / f"step_{v}", w)
            p = origin.publish(folder, v, KEY)
            sizes[v] = p.bytes
            assert (p.encoding, p.base) == (("full", None) if v % 5 == 0 else (PATCH, v - 1))
            wait_listed(cdn.relay_urls, v)
            dest = tmp_path / "steady" / f"step_{v}"
            stats = steady.fetch(v, dest)
            assert stats.bytes == p.bytes  # it holds the base: only the patch comes down
            assert sorted(x.name for x in dest.iterdir()) == ["STABLE", "config.json", "model.safetensors"]
            assert checkpoint_digest(dest) == checkpoint_digest(folder)
            assert (dest / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
            if v == 13:
                with ShardcastClient(cdn.relay_urls, cfg()) as late:
                    got = late.fetch(13, tmp_path / "late" / "step_13")
                assert got.bytes == sum(sizes[i] for i in (10, 11, 12, 13))  # the anchor and the patches after it
                assert checkpoint_digest(tmp_path / "late" / "step_13") == checkpoint_digest(folder)
                assert not [p for p in (tmp_path / "late").iterdir() if p.name.startswith(".tmp-")]
    assert all(sizes[v] < 0.2 * sizes[v - v % 5] for v in sizes if v % 5)
    # newest two kept, with the bases of the patches among them, down to the anchor
    for store in (VersionStore(cdn.origin_dir), relay_store(cdn, 0), relay_store(cdn, 1)):
        assert store.versions() == [15, 16, 17, 18, 19]


def out_of_range(patch: Path) -> None:
    index = json.loads((patch / INDEX).read_text())
    f = next(f for f in index["files"] if f["op"] == "tensors")
    t = f["tensors"][0]
    diff = (patch / f["source"]).read_bytes()
    import zlib  # noqa: PLC0415 - only this attack packs indices

    packed = zlib.compress(np.asarray([10**6] + [1] * (t["count"] - 1), np.uint32).tobytes())
    (patch / f["source"]).write_bytes(packed + diff[t["index_bytes"]:])
    t.update(width=4, index_bytes=len(packed))
    (patch / INDEX).write_text(json.dumps(index))


def lying_base(patch: Path) -> None:
    index = json.loads((patch / INDEX).read_text())
    index["base_digest"] = "0" * 64
    (patch / INDEX).write_text(json.dumps(index))


def grown(patch: Path) -> None:
    diff = next(p for p in patch.iterdir() if p.name.startswith("diff."))
    diff.write_bytes(diff.read_bytes() + bytes(1 << 20))


# attack -> (reason, spoil the patch folder, the digest the trainer signs as the rebuilt one)
SIGNED_BUT_WRONG = {
    "indices_out_of_range": ("out_of_range", out_of_range, None),
    "a_base_digest_that_lies": ("base_mismatch", lying_base, None),
    "a_rebuilt_digest_other_than_the_signed_one": ("digest_mismatch", lambda p: None, "e" * 64),
    "patch_files_bigger_than_their_tensors": ("oversized", grown, None),
}


@pytest.mark.parametrize("attack", sorted(SIGNED_BUT_WRONG))
def test_a_signed_patch_that_does_not_rebuild_is_refused_and_the_client_is_unchanged(cdn, tmp_path, attack):
    reason, spoil, signed = SIGNED_BUT_WRONG[attack]
    origin = Origin(cdn.origin_dir, shard_size=SHARD, keep=5, anchor_every=5)
    base = save(tmp_path / "t0", weights(), sidecar=False)  # a patch made by hand, of inference files only
    origin.publish(base, 0, KEY)
    new = save(tmp_path / "t1", step(weights(), 1), sidecar=False)
    make_patch(base, new, tmp_path / "patch", checkpoint_digest(base))
    spoil(tmp_path / "patch")
    publish_folder(VersionStore(cdn.origin_dir), 1, tmp_path / "patch", SHARD, 5, key=KEY, skip=frozenset(),
                   lineage=Lineage(encoding=PATCH, base=0, checkpoint_digest=signed or checkpoint_digest(new)))
    wait_listed(cdn.relay_urls, 1)
    with ShardcastClient(cdn.relay_urls, cfg()) as client:
        client.fetch(0, tmp_path / "w" / "step_0")
        frames = dict(client._frames)
        with pytest.raises(VersionRefused) as e:
            client.fetch(1, tmp_path / "w" / "step_1")
        assert e.value.reason == reason, e.value
        assert client._frames == frames and not client.bad  # the trainer signed it: no relay is to blame
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["step_0"]
    assert checkpoint_digest(tmp_path / "w" / "step_0") == checkpoint_digest(base)


def test_a_patch_whose_base_no_relay_holds_is_refused_at_once(cdn, tmp_path):
    base = save(tmp_path / "t0", weights(), sidecar=False)
    new = save(tmp_path / "t1", step(weights(), 1), sidecar=False)
    make_patch(base, new, tmp_path / "patch", checkpoint_digest(base))
    publish_folder(VersionStore(cdn.origin_dir), 7, tmp_path / "patch", SHARD, 5, key=KEY, skip=frozenset(),
                   lineage=Lineage(encoding=PATCH, base=6, checkpoint_digest=checkpoint_digest(new)))
    wait_listed(cdn.relay_urls, 7)
    with ShardcastClient(cdn.relay_urls, cfg()) as client:
        t0 = time.monotonic()
        with pytest.raises(VersionRefused, match="base_missing"):
            client.fetch(7, tmp_path / "w" / "step_7")
        assert time.monotonic() - t0 < 30 and not client._frames
    assert not list((tmp_path / "w").iterdir())


def test_a_relay_serving_tampered_patch_shards_is_marked_bad_and_the_patch_comes_from_the_other(cdn, tmp_path):
    origin = Origin(cdn.origin_dir, shard_size=1 << 10, keep=5, anchor_every=5)
    base = save(tmp_path / "t0", weights())
    new = save(tmp_path / "t1", step(weights(), 1, share=0.2))  # a patch of ~10 shards, so both relays serve some
    origin.publish(base, 0, KEY)
    assert origin.publish(new, 1, KEY).encoding == PATCH
    wait_listed(cdn.relay_urls, 1)
    with ShardcastClient(cdn.relay_urls, cfg()) as client:
        client.fetch(0, tmp_path / "w" / "step_0")
        bad = relay_store(cdn, 0)
        m = bad.manifest(1)
        assert m is not None and m.lineage.base == 0
        for s in m.shards:  # same size, wrong bytes: only the signed hashes can tell
            p = bad.shard_path(1, s.index)
            p.write_bytes(bytes(p.stat().st_size))
        stats = client.fetch(1, tmp_path / "w" / "step_1")
        assert cdn.relays[0].url in client.bad and set(stats.by_relay) == {cdn.relays[1].url}
    assert checkpoint_digest(tmp_path / "w" / "step_1") == checkpoint_digest(new)


class LineageLiar(http.server.BaseHTTPRequestHandler):
    """A relay in front of an honest one that rewrites the lineage of version ``target`` in every header."""

    upstream, target, lie = "", 0, {}

    def do_GET(self):
        r = httpx.get(self.upstream + self.path, timeout=10)
        body = r.content
        if r.status_code == 200 and (self.path.startswith("/versions") or re.match(r"^/v/\d+/manifest", self.path)):
            d = json.loads(body)
            for h in d.get("versions", [d]):
                if h["version"] == self.target:
                    h["lineage"] = {**h["lineage"], **self.lie}
            body = json.dumps(d).encode()
        try:
            self.send_response(r.status_code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client hung up on a lie it refused
            self.close_connection = True

    def log_message(self, *args):
        pass


def liar(upstream: str, target: int, lie: dict):
    return serve(type("Liar", (LineageLiar,), {"upstream": upstream, "target": target, "lie": lie}))


# lie -> what the client records: a header that cannot be (a base not older) does not even parse
LINEAGE_LIES = {
    "a_newer_base": ({"base": 4}, "malformed"),
    "itself_as_base": ({"base": 3}, "malformed"),
    "an_older_base": ({"base": 1}, "bad_signature"),
    "full_not_a_patch": ({"encoding": "full", "base": None}, "bad_signature"),
    "another_rebuilt_digest": ({"checkpoint_digest": "d" * 64}, "bad_signature"),
}


@pytest.mark.parametrize("lie", sorted(LINEAGE_LIES))
def test_a_relay_that_lies_about_a_patch_s_base_or_encoding_is_marked_bad(cdn, tmp_path, lie):
    change, reason = LINEAGE_LIES[lie]
    origin = Origin(cdn.origin_dir, shard_size=SHARD, keep=5, anchor_every=5)
    w = weights()
    for v in range(4):
        w = step(w, v)
        origin.publish(save(tmp_path / "t" / f"step_{v}", w), v, KEY)
    wait_listed(cdn.relay_urls, 3)
    with liar(cdn.relay_urls[0], 3, change) as url, \
            ShardcastClient([url, cdn.relay_urls[1]], cfg(poll_interval=3.0)) as client:
        client.fetch(2, tmp_path / "w" / "step_2")  # from the anchor at 0, through the liar's honest answers
        stats = client.fetch(3, tmp_path / "w" / "step_3")
        assert reason in client.bad[url], client.bad
        assert set(stats.by_relay) == {cdn.relay_urls[1]}
    assert checkpoint_digest(tmp_path / "w" / "step_3") == checkpoint_digest(tmp_path / "t" / "step_3")
