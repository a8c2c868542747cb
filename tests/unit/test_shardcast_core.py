"""SHARDCAST's pure parts and its on-disk store: manifests, relay choice, the origin's shard writer."""

import ast
import doctest
import hashlib
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from intellect.shardcast import assembly, chain, choice, client, manifest, origin, relay, signing, store, wire, writer
from intellect.shardcast.choice import RelayScore, Scheduler, observe_failure, observe_success, pick, weights
from intellect.shardcast.manifest import FileEntry, Manifest, ManifestDelta, ManifestView, ShardEntry
from intellect.shardcast.signing import Verifier, VersionSigner
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import VersionWriter, publish_folder
from intellect.trust.keys import SigningKey

KEY = SigningKey.from_seed(b"\1" * 32)  # the trainer's


@pytest.mark.parametrize("mod", [assembly, chain, choice, manifest, origin, signing, store, wire, writer])
def test_doctests(mod):
    assert doctest.testmod(mod).failed == 0


# ------------------------------------------------------------------ manifests

H = "a" * 64


def test_manifest_rejects_names_that_leave_the_folder():
    for bad in ["../model.safetensors", "a/b", ".hidden", "", "x" * 300, "/etc/passwd", ".tmp-x"]:
        with pytest.raises(ValidationError):
            FileEntry(name=bad, offset=0, size=1)


def test_manifest_checks_its_layout():
    files = [FileEntry(name="a", offset=0, size=10)]
    ok = Manifest(version=1, files=files, shards=[ShardEntry(index=0, offset=0, size=8, sha256=H),
                                                   ShardEntry(index=1, offset=8, size=2, sha256=H)],
                  shard_size=8, total_size=10, sha256=H, complete=True)
    assert [s.index for s in ok.holding({0}).shards] == [0] and not ok.holding({0}).complete
    with pytest.raises(ValidationError, match="starts at"):
        Manifest(version=1, files=[FileEntry(name="a", offset=3, size=1)])
    with pytest.raises(ValidationError, match="every shard"):
        Manifest(version=1, files=files, shards=ok.shards[:1], shard_size=8, total_size=10, sha256=H, complete=True)
    with pytest.raises(ValidationError, match="needs total_size"):
        Manifest(version=1, files=files, shards=ok.shards, shard_size=8, complete=True)
    with pytest.raises(ValidationError, match="ends past"):
        Manifest(version=1, files=[FileEntry(name="a", offset=0, size=9)],
                 shards=[ShardEntry(index=1, offset=8, size=8, sha256=H)], shard_size=8)
    with pytest.raises(ValidationError, match="does not fit"):
        Manifest(version=1, files=files, shards=[ShardEntry(index=1, offset=7, size=2, sha256=H)], shard_size=8)
    with pytest.raises(ValidationError):
        Manifest(version=1, files=files, shards=[ShardEntry(index=0, offset=0, size=8, sha256="not-hex")])
    with pytest.raises(ValidationError, match="extra"):
        Manifest.model_validate({"version": 1, "surprise": True})
    assert ok.shard(1).size == 2 and ok.holding({1}).shard(0) is None and ok.shard(5) is None
    with pytest.raises(ValidationError, match="index order"):  # lookups bisect, so the order is part of the format
        Manifest(version=1, files=files, shards=ok.shards[::-1], shard_size=8)
    with pytest.raises(ValidationError, match="mid-block"):  # a chaining value exists only on block boundaries
        Manifest(version=1, files=files, shards=[ShardEntry(index=0, offset=0, size=8, sha256=H, chain=H)],
                 shard_size=8)


def test_segments_cross_file_boundaries_and_skip_empty_files():
    m = Manifest(version=0, files=[FileEntry(name="a", offset=0, size=3), FileEntry(name="empty", offset=3, size=0),
                                   FileEntry(name="b", offset=3, size=9)],
                 shards=[ShardEntry(index=i, offset=4 * i, size=min(4, 12 - 4 * i), sha256=H) for i in range(3)],
                 shard_size=4, total_size=12, sha256=H, complete=True)
    assert [list(m.segments(s)) for s in m.shards] == [
        [("a", 0, 3), ("b", 0, 1)], [("b", 1, 4)], [("b", 5, 4)]]


# ------------------------------------------------------------------ relay choice


def test_a_failure_moves_the_success_rate_not_the_bandwidth():
    s = {"r": RelayScore(bandwidth=50e6)}
    observe_failure(s, "r", alpha=0.3, heal=0.0)  # after 30 s: a failure carries no duration
    # the package folds its 30 s timeout into the bandwidth EMA as if it were 30 MB/s
    assert s["r"].bandwidth == 50e6 and s["r"].success == pytest.approx(0.7) and s["r"].failures == 1


def test_a_failed_relay_heals_and_is_tried_again():
    s = {"good": RelayScore(bandwidth=1e8), "bad": RelayScore(bandwidth=1e8)}
    for _ in range(20):
        observe_failure(s, "bad", alpha=0.3, heal=0.0)
    assert s["bad"].success < 1e-3
    for _ in range(50):  # 50 good downloads elsewhere: bad regains 0.5 of success through healing
        observe_success(s, "good", nbytes=1e8, seconds=1, alpha=0.3, heal=0.01)
    assert s["bad"].success == pytest.approx(0.5, abs=0.01)
    rng = random.Random(1)
    picks = [pick(s, ["good", "bad"], rng) for _ in range(3000)]
    assert 0.25 < picks.count("bad") / len(picks) < 0.42  # weight 0.5 vs 1.0 -> 1/3


def test_pick_follows_bandwidth_and_never_leaves_the_candidates():
    s = {"a": RelayScore(bandwidth=3e8), "b": RelayScore(bandwidth=1e8), "c": RelayScore(bandwidth=1e12)}
    rng = random.Random(0)
    picks = [pick(s, ["a", "b"], rng) for _ in range(4000)]
    assert set(picks) == {"a", "b"} and 0.71 < picks.count("a") / 4000 < 0.79
    with pytest.raises(ValueError):
        pick(s, [], rng)


def test_pick_spreads_a_clients_downloads_over_its_relays():
    # a measured 3:1 faster relay, but the picker already has 5 downloads in flight there and none at
    # the other: 3/6 against 1/1, so the idle relay is picked 2 times in 3
    s = {"a": RelayScore(bandwidth=3e8), "b": RelayScore(bandwidth=1e8)}
    rng = random.Random(2)
    picks = [pick(s, ["a", "b"], rng, load={"a": 5}) for _ in range(3000)]
    assert 0.62 < picks.count("b") / 3000 < 0.71
    # filling 4 slots from scratch, counting each pick as in flight: never all 4 on one relay as
    # often as independent draws would put them there (0.75^4 + 0.25^4 = 32%)
    same = 0
    for _ in range(2000):
        load = {"a": 0, "b": 0}
        for _ in range(4):
            load[pick(s, ["a", "b"], rng, load)] += 1
        same += 4 in load.values()
    assert same / 2000 < 0.13  # 9.8% expected


def test_every_weight_stays_positive_and_unmeasured_relays_are_tried_early():
    s = {"dead": RelayScore(success=0.0, bandwidth=1e9), "new": RelayScore(), "known": RelayScore(bandwidth=2e8)}
    w = weights(s)
    assert w["dead"] > 0 and w["new"] == 1e9 and w["known"] == 2e8  # new: the best bandwidth measured


def test_a_failed_try_means_one_thing_however_long_it_took(monkeypatch):
    """A download that failed after the whole budget, one that failed at once, and a listing that
    missed its deadline each move the success rate the same way and never the bandwidth."""
    clock = [100.0]
    monkeypatch.setattr(choice.time, "monotonic", lambda: clock[0])
    fails = {}
    for how in ("slow", "fast", "listing"):
        sched = Scheduler(["r", "other"], alpha=0.3, heal=0.01, seed=0)
        sched.scores["r"].bandwidth = 50e6
        if how == "listing":
            sched.penalize("r")
        else:
            t = sched.start("shard", ["r"])
            clock[0] += 30.0 if how == "slow" else 0.001
            assert sched.failed(t) == 1 and sched.load["r"] == 0
        fails[how] = sched.scores["r"]
    assert fails["slow"] == fails["fast"] == fails["listing"]
    assert fails["slow"].bandwidth == 50e6 and fails["slow"].failures == 1
    assert fails["slow"].success == pytest.approx(0.7 + 0.01)
    sched = Scheduler(["r"], alpha=0.5, heal=0.0)  # a success is timed from start to close
    t = sched.start("shard", ["r"])
    clock[0] += 2.0
    sched.succeeded(t, 100e6)
    assert sched.scores["r"].bandwidth == 50e6 and sched.load["r"] == 0


def test_the_scheduler_retries_elsewhere_counts_load_and_closes_each_try_once():
    sched = Scheduler(["a", "b"], alpha=0.3, heal=0.0, seed=3)
    first = sched.start(("v1", 0), ["a", "b"])
    assert sched.load[first.relay] == 1
    assert sched.failed(first) == 1
    assert sched.failed(first) == 1 and sched.scores[first.relay].failures == 1  # a second close does nothing
    second = sched.start(("v1", 0), ["a", "b"])
    assert second.relay != first.relay  # a retry goes to a relay not tried yet
    sched.abandon(second)  # given up: nothing learned, no load left
    assert sched.scores[second.relay] == RelayScore() and sched.load == {"a": 0, "b": 0}
    third = sched.start(("v1", 0), ["a", "b"])  # both tried: any candidate again
    assert third.relay in ("a", "b") and sched.tries(("v1", 0)) == 3
    sched.succeeded(third, 1e6)
    other = sched.start(("v1", 1), ["a"])  # another shard keeps its own tries
    assert other.relay == "a" and sched.tries(("v1", 1)) == 1
    sched.forget([("v1", 0), ("v1", 1)])
    assert sched.tries(("v1", 0)) == 0 and sched.load["a"] == 1  # forgetting tries leaves the load in flight
    with pytest.raises(ValueError):
        sched.start(("v1", 2), [])


def test_client_and_relay_share_the_http_layer_and_the_scheduler_not_each_other():
    def imports(mod):
        tree = ast.parse(Path(mod.__file__).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    for mod in (client, relay):
        assert {"intellect.shardcast.wire", "intellect.shardcast.choice"} <= imports(mod)
    assert "intellect.shardcast.client" not in imports(relay) and "intellect.shardcast.relay" not in imports(client)


# ------------------------------------------------------------------ store and writer


def test_writer_publishes_each_shard_as_it_fills(tmp_path):
    st = VersionStore(tmp_path)
    w = VersionWriter(st, version=7, shard_size=4, key=KEY)
    w.begin_file("weights.bin")
    w.write(b"0123456789")
    m = st.manifest(7)
    assert not m.complete and [s.index for s in m.shards] == [0, 1] and m.files[0].size is None
    assert st.shard_path(7, 1).read_bytes() == b"4567"
    assert m.shards[1].sha256 == hashlib.sha256(b"4567").hexdigest()
    m = w.finish()
    assert m.complete and m.total_size == 10 and m.sha256 == hashlib.sha256(b"0123456789").hexdigest()
    assert [s.size for s in m.shards] == [4, 4, 2]
    with pytest.raises(FileExistsError):
        VersionWriter(st, version=7, shard_size=4, key=KEY)


def test_a_chained_hash_resumes_anywhere_on_a_block_boundary():
    rng = random.Random(0)
    blob = rng.randbytes(10_000)
    for _ in range(20):
        cut = rng.randrange(0, len(blob) // 64) * 64
        head = chain.ChainedSha256()
        head.update(memoryview(blob)[:cut])
        tail = chain.ChainedSha256(head.chain(), cut)
        for a, b in zip([cut, cut + 7, cut + 900], [cut + 7, cut + 900, len(blob)]):  # uneven pieces
            tail.update(blob[a:b])
        assert tail.hexdigest() == hashlib.sha256(blob).hexdigest() and tail.length == len(blob)
    h = chain.ChainedSha256()
    h.update(b"x")
    assert h.chain() is None  # mid-block: no chaining value to read
    for bad in [(None, 64), ("0" * 64, 65), ("0" * 64, -64), ("00", 64)]:
        with pytest.raises(ValueError):
            chain.ChainedSha256(*bad)


@pytest.mark.parametrize("shard_size,write", [(1 << 12, 3000), (1 << 12, 1 << 20), (100, 333)])
def test_each_shard_checks_on_its_own_by_chaining_values(tmp_path, shard_size, write):
    """The writer's chaining values: shard i is checked from shard i-1's value alone, and the last value
    finished off is the whole blob's SHA-256 (shards that end mid-block carry none)."""
    rng = random.Random(1)
    st = VersionStore(tmp_path)
    with VersionWriter(st, 1, shard_size, KEY) as w:
        w.begin_file("w")
        blob = b""
        while len(blob) < 3 * shard_size + 77:
            piece = rng.randbytes(write)  # pieces at or above the writer's threaded size hash on helpers
            w.write(piece)
            blob += piece
    m = st.manifest(1)
    for s in m.shards:
        data = st.shard_path(1, s.index).read_bytes()
        assert s.sha256 == hashlib.sha256(data).hexdigest()
        start = manifest.chain_before(m, s)
        if (s.offset + s.size) % 64:
            assert s.chain is None
        elif start is None:  # the previous shard ended mid-block
            assert shard_size % 64
        else:
            h = chain.ChainedSha256(start, s.offset)
            h.update(data)
            assert h.chain() == s.chain
    assert (m.shards[-1].chain is None) == (len(blob) % 64 != 0)
    if shard_size % 64 == 0:
        assert all(s.chain for s in m.shards[:-1])
        last = chain.ChainedSha256(manifest.chain_before(m, m.shards[-1]), m.shards[-1].offset)
        last.update(st.shard_path(1, m.shards[-1].index).read_bytes())
        assert last.hexdigest() == m.sha256 == hashlib.sha256(blob).hexdigest()


def test_a_failed_publish_leaves_no_version(tmp_path):
    st = VersionStore(tmp_path)
    with pytest.raises(RuntimeError):
        with VersionWriter(st, version=1, shard_size=4, key=KEY) as w:
            w.begin_file("a")
            w.write(b"123456")
            raise RuntimeError("trainer died")
    assert st.versions() == [] and not st.version_dir(1).exists()
    with pytest.raises(ValueError, match="one plain path component"):
        VersionWriter(st, version=2, shard_size=4, key=KEY).begin_file("../escape")


def test_retention_keeps_the_newest_versions(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x" * 10)
    (src / "STABLE").write_text("{}")  # the storage marker is not part of a version
    st = VersionStore(tmp_path / "origin")
    for v in range(1, 8):
        m = publish_folder(st, v, src, shard_size=4, keep=5, key=KEY)
    assert st.versions() == [3, 4, 5, 6, 7]
    assert [f.name for f in m.files] == ["model.safetensors"]


def test_store_names_only_come_from_integers(tmp_path):
    st = VersionStore(tmp_path)
    with pytest.raises(ValueError):
        st.shard_path(-1, 0)
    with pytest.raises(ValueError):
        st.shard_path(1, 10**8)
    assert st.shard_path(3, 2).relative_to(st.root).as_posix() == "v3/shard_00002.bin"


_PUBLICATIONS: dict[tuple, str] = {}


def _delta(m: Manifest, listing: str = "ab", since: int = 0, shards=None) -> ManifestDelta:
    """``m`` as a server answers it, signed by the trainer: one writing per version and layout."""
    pub = _PUBLICATIONS.setdefault((m.version, m.shard_size), signing.new_publication())
    sign = VersionSigner(KEY, m.version, pub)
    shards = m.shards if shards is None else shards
    return ManifestDelta(**m.model_dump(exclude={"shards", "publication", "signature"}), listing=listing, since=since,
                         publication=pub, signature=sign.header(m.files, m.shard_size, m.total_size, m.sha256),
                         shards=[sign.shard(e) for e in shards])


def _view(version: int) -> ManifestView:
    return ManifestView(version, Verifier(KEY.public))


def test_a_view_unites_relays_that_each_hold_different_shards():
    full = Manifest(version=2, files=[FileEntry(name="w", offset=0, size=12)], shard_size=4,
                    shards=[ShardEntry(index=i, offset=4 * i, size=4, sha256=H) for i in range(3)],
                    total_size=12, sha256=H, complete=True)
    early = full.model_copy(update={"files": [FileEntry(name="w", offset=0)], "complete": False,
                                    "total_size": None, "sha256": None})
    view = _view(2)
    assert [s.index for s in view.apply("a", _delta(early.holding({0, 1})))] == [0, 1]
    assert [s.index for s in view.apply("b", _delta(early.holding({2}), "cd"))] == [2]
    assert [s.index for s in view.manifest().shards] == [0, 1, 2] and not view.manifest().complete
    assert view.holders == {0: ["a"], 1: ["a"], 2: ["b"]} and view.query("b") == "since=1&listing=cd"
    # an answer must follow the last one asked for; a new listing name starts over
    with pytest.raises(ValueError):
        view.apply("b", _delta(early.holding({2}), "cd", since=5, shards=[]))
    # later, a has everything: the view completes; a relay that lies about a hash is left out
    assert view.apply("a", _delta(full, "")) == [] and view.manifest().complete and view.manifest().sha256 == H
    assert view.complete_at("a") and not view.complete_at("b")
    liar = early.holding({0}).model_copy(update={"shards": [full.shards[0].model_copy(update={"sha256": "b" * 64})]})
    with pytest.raises(ValueError, match="differs"):
        view.apply("c", _delta(liar, "ef"))
    assert view.holders == {0: ["a"], 1: ["a"], 2: ["b", "a"]} and "c" not in view.servers()
    # a relay whose watch failed is dropped: it holds nothing until it answers again, from the start
    view.drop("b")
    assert view.holders[2] == ["a"] and view.query("b") == "since=0&listing="


def test_a_complete_listing_overrules_what_relays_listed_before():
    early = Manifest(version=1, files=[FileEntry(name="w", offset=0)], shard_size=4,
                     shards=[ShardEntry(index=i, offset=4 * i, size=4, sha256=H) for i in range(2)])
    view = _view(1)
    view.apply("liar", _delta(early.model_copy(update={"shards": [early.shards[0].model_copy(
        update={"sha256": "c" * 64})]}), "aa"))
    full = early.model_copy(update={"files": [FileEntry(name="w", offset=0, size=8)], "total_size": 8,
                                    "sha256": H, "complete": True})
    signed = _delta(full, "")
    assert [s.index for s in view.apply("origin", signed)] == [0, 1]  # 0 anew: the liar's is gone
    assert view.manifest().shards == signed.shards and view.holders == {0: ["origin"], 1: ["origin"]}
    assert "liar" not in view.servers()


def test_a_version_written_anew_in_another_layout_replaces_the_view():
    """The origin withdrew a half-written version and wrote it again with another shard size."""
    old = Manifest(version=1, files=[FileEntry(name="w", offset=0)], shard_size=4,
                   shards=[ShardEntry(index=0, offset=0, size=4, sha256=H)])
    view = _view(1)
    view.apply("origin", _delta(old, "aa"))
    new = Manifest(version=1, files=[FileEntry(name="w", offset=0, size=8)], shard_size=8, total_size=8, sha256=H,
                   complete=True, shards=[ShardEntry(index=0, offset=0, size=8, sha256="d" * 64)])
    with pytest.raises(ValueError, match="layout"):  # from another server, it contradicts the view
        view.apply("relay", _delta(new, ""))
    view.apply("origin", _delta(new.model_copy(update={"complete": False, "total_size": None, "sha256": None}), "bb"))
    assert view.manifest().shard_size == 8 and view.entries[0].sha256 == "d" * 64 and view.holders == {0: ["origin"]}


def test_a_version_being_written_grows_by_appends_not_rewrites(tmp_path):
    """Each new shard is one line appended to the listing: rewriting a manifest that lists every shard
    at every shard would make a version's cost quadratic in its shard count."""
    st = VersionStore(tmp_path)
    w = VersionWriter(st, 1, shard_size=4, key=KEY)
    w.begin_file("w")
    w.write(b"abcd")
    head = st.version_dir(1) / store.MANIFEST
    inode = head.stat().st_ino
    w.write(b"efgh" * 50)
    assert head.stat().st_ino == inode  # the header was written once
    assert [s.index for s in st.manifest(1).shards] == list(range(51)) and not st.manifest(1).complete
    d = st.delta(1, 0, "")
    assert d.listing and d.since == 0 and len(d.shards) == 51
    assert [s.index for s in st.delta(1, 50, d.listing).shards] == [50]
    assert st.delta(1, 50, "feed").since == 0  # another listing's position: from the start
    # a line still being appended is read once it is whole
    with open(st.version_dir(1) / store.LISTING, "ab") as f:
        f.write(b'{"index": 51, "offset": 204, "size": 4, ')
    assert len(st.manifest(1).shards) == 51
    other = VersionStore(tmp_path)  # another process's view reads the same
    assert [s.index for s in other.delta(1, 49, d.listing).shards] == [49, 50]
    with open(st.version_dir(1) / store.LISTING, "ab") as f:
        f.write(b'"sha256": "%s"}\n' % (b"0" * 64))
    assert len(st.manifest(1).shards) == 52 and st.delta(1, 51, d.listing).shards[0].index == 51
    # a line that is not a shard ends the listing there, with a warning, not an error
    with open(st.version_dir(1) / store.LISTING, "ab") as f:
        f.write(b'{"index": "x"}\n')
    assert len(VersionStore(tmp_path).manifest(1).shards) == 52
