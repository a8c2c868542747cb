"""The trainer's signatures on SHARDCAST versions: what a relay cannot forge, replay, splice or reorder,
and what verifying costs (each header and shard once)."""

import hashlib
import time

import pytest

from intellect.shardcast import signing
from intellect.shardcast.header import Lineage, SignedHeader
from intellect.shardcast.manifest import FileEntry, ListedVersion, Manifest, ManifestDelta, ManifestView, ShardEntry
from intellect.shardcast.signing import Untrusted, Verifier, VersionSigner
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import VersionWriter
from intellect.trust.keys import SigningKey

KEY = SigningKey.from_seed(b"\2" * 32)  # the trainer's
OTHER = SigningKey.from_seed(b"\3" * 32)  # anyone else's
FILES = [FileEntry(name="w", offset=0)]


def written(tmp_path, version: int, blob: bytes, shard_size: int = 64, key: SigningKey = KEY) -> VersionStore:
    store = VersionStore(tmp_path / f"origin-{version}-{key.public.id}")
    with VersionWriter(store, version, shard_size, key) as w:
        w.begin_file("w")
        w.write(blob)
    return store


def answer(store: VersionStore, version: int, since: int = 0, listing: str = "") -> ManifestDelta:
    delta = store.delta(version, since, listing)
    assert delta is not None, f"the store has no version {version}"
    return delta


def view(version: int, key: SigningKey = KEY) -> ManifestView:
    return ManifestView(version, Verifier(key.public.hex))


def test_the_origin_signs_every_header_and_shard_and_an_honest_listing_verifies(tmp_path):
    store = written(tmp_path, 3, bytes(range(256)) * 2)
    d = answer(store, 3)
    assert d.complete and d.publication and len(d.signature) == 128 and all(len(s.signature) == 128 for s in d.shards)
    v = view(3)
    assert [s.index for s in v.apply("origin", d)] == list(range(8)) and v.manifest().complete
    # nothing signed by the trainer is accepted by a reader pinning another key
    with pytest.raises(Untrusted, match="bad_signature"):
        view(3, OTHER).apply("origin", d)


def _as_sent(d: ManifestDelta, **update) -> ManifestDelta:
    """``d`` altered the way a relay can: re-validated, as a reader parses it off the network."""
    return ManifestDelta.model_validate({**d.model_dump(), **update})


@pytest.mark.parametrize("attack", ["shard_hash", "chain", "file_size", "file_name", "total", "sha256", "shard_size",
                                    "publication"])
def test_no_field_can_be_altered(tmp_path, attack):
    store = written(tmp_path, 1, bytes(1000), shard_size=128)
    d = answer(store, 1)
    first = d.shards[0].model_dump()
    forged = {
        "shard_hash": {"shards": [{**first, "sha256": "f" * 64}] + [s.model_dump() for s in d.shards[1:]]},
        "chain": {"shards": [{**first, "chain": "e" * 64}] + [s.model_dump() for s in d.shards[1:]]},
        "file_size": {"files": [{"name": "w", "offset": 0, "size": 999}], "total_size": 999},
        "file_name": {"files": [{"name": "x", "offset": 0, "size": 1000}]},
        "total": {"total_size": 1001, "files": [{"name": "w", "offset": 0, "size": 1001}]},
        "sha256": {"sha256": hashlib.sha256(b"evil").hexdigest()},
        "shard_size": {"shard_size": 256, "shards": []},
        "publication": {"publication": "0" * 32},
    }[attack]
    if attack in ("file_size", "total", "shard_size"):
        forged["complete"] = False  # so that only the signature can tell
    with pytest.raises(Untrusted, match="bad_signature"):
        view(1).apply("relay", _as_sent(d, **forged))


def test_unsigned_truncated_and_foreign_signatures_are_refused_with_their_reason(tmp_path):
    d = answer(written(tmp_path, 1, bytes(300)), 1)
    cases = {
        "unsigned": _as_sent(d, signature=None),
        "truncated_signature": _as_sent(d, signature=d.signature[:64]),
        "bad_signature": _as_sent(d, signature=OTHER.sign(b"x").hex()),
    }
    for reason, bad in cases.items():
        with pytest.raises(Untrusted) as e:
            view(1).apply("relay", bad)
        assert e.value.reason == reason
    s0 = d.shards[0].model_dump()
    for reason, sig in [("unsigned", None), ("truncated_signature", s0["signature"][:100])]:
        with pytest.raises(Untrusted) as e:
            view(1).apply("relay", _as_sent(d, shards=[{**s0, "signature": sig}]))
        assert e.value.reason == reason
    # a version signed whole by another key (its own shards, hashes that match its own bytes)
    with pytest.raises(Untrusted, match="bad_signature"):
        view(1).apply("relay", answer(written(tmp_path, 1, b"evil" * 100, key=OTHER), 1))


def test_an_old_version_cannot_be_replayed_under_a_newer_number(tmp_path):
    old = answer(written(tmp_path, 4, bytes(300)), 4)
    with pytest.raises(Untrusted) as e:  # as it is: another version's answer
        view(5).apply("relay", old)
    assert e.value.reason == "rollback"
    with pytest.raises(Untrusted, match="bad_signature"):  # renumbered: the signature names version 4
        view(5).apply("relay", _as_sent(old, version=5))
    header_only = _as_sent(old, version=5, shards=[])
    with pytest.raises(Untrusted, match="bad_signature"):
        view(5).apply("relay", header_only)
    # a new header of version 5 with version 4's shards under it: each shard names its version
    new = answer(written(tmp_path, 5, bytes(300)), 5)
    with pytest.raises(Untrusted, match="shard 0 of version 5 is not signed"):
        view(5).apply("relay", _as_sent(new, shards=[s.model_dump() for s in old.shards]))


def test_two_writings_of_one_version_cannot_be_spliced_and_shards_cannot_be_moved(tmp_path):
    """The origin withdrew a half-written version and wrote it anew: each shard is bound to its writing
    (publication) and its index, so a relay can neither mix the two nor move a shard to another place."""
    withdrawn = VersionStore(tmp_path / "a")
    w = VersionWriter(withdrawn, 2, 64, KEY)
    w.begin_file("w")
    w.write(bytes(640))  # ten shards listed; the trainer's run dies before it seals the version
    a = answer(withdrawn, 2)
    b = answer(written(tmp_path / "b", 2, b"\1" * 640), 2)
    assert not a.complete and a.sha256 is None and len(a.shards) == 10
    assert a.publication != b.publication
    with pytest.raises(Untrusted, match="for this publication"):
        view(2).apply("relay", _as_sent(b, shards=[a.shards[0].model_dump()] + [s.model_dump() for s in b.shards[1:]]))
    moved = a.shards[1].model_dump() | {"index": 0, "offset": 0}
    with pytest.raises(Untrusted, match="shard 0"):
        view(2).apply("relay", _as_sent(a, shards=[moved] + [s.model_dump() for s in a.shards[1:]]))
    # a reader that holds one writing refuses the other from another server, as a contradiction (not bad)
    v = view(2)
    v.apply("relay1", _as_sent(a, shards=[s.model_dump() for s in a.shards[:3]]))
    with pytest.raises(ValueError, match="another writing"):
        v.apply("relay2", _as_sent(b, complete=False, shards=[s.model_dump() for s in b.shards[:3]]))
    # and a complete listing of the other writing replaces a view of one still being listed
    assert [s.index for s in v.apply("relay2", b)] == list(range(10)) and v.manifest().sha256 == b.sha256
    assert v.servers() == ["relay2"]


def test_each_shard_is_verified_once_however_often_it_is_listed(tmp_path, monkeypatch):
    """Deltas of a version being written cost their own shards: 300 shards, listed 10 at a time, then
    listed whole twice more (complete answers from two servers), take 300 shard verifications."""
    store = VersionStore(tmp_path / "origin")
    w = VersionWriter(store, 1, 64, KEY)
    w.begin_file("w")
    calls = {"shard": 0, "verify": 0}
    verifier = Verifier(KEY.public)
    real_verify, real_shard = verifier.key.verify, verifier.shard
    def counted(name, real):
        def call(*a):
            calls[name] += 1
            return real(*a)
        return call

    monkeypatch.setattr(verifier.key.__class__, "verify", lambda self, sig, msg: counted("verify", real_verify)(sig, msg))
    monkeypatch.setattr(verifier, "shard", counted("shard", real_shard))
    v = ManifestView(1, verifier)
    for _ in range(30):
        w.write(bytes(640))
        asked = dict(p.split("=") for p in v.query("origin").split("&"))
        v.apply("origin", store.delta(1, int(asked["since"]), asked["listing"]))
    w.finish()
    v.apply("origin", store.delta(1, 0, ""))
    v.apply("relay", store.delta(1, 0, ""))
    assert len(v.entries) == 300 and v.manifest().complete
    assert calls["shard"] == 300
    # headers: one per distinct header (the one being written, the sealed one), not one per answer
    assert calls["verify"] == 300 + 2


def test_signing_and_verifying_cost_little():
    """Per shard: one Ed25519 signature at the origin, one verification per reader. The figures are in
    benchmarks/shardcast_signing.py; the bound here is loose (a shared machine), the number of
    verifications is pinned by the test above."""
    signer = VersionSigner(KEY, 1)
    entries = [ShardEntry(index=i, offset=64 * i, size=64, sha256=hashlib.sha256(str(i).encode()).hexdigest(),
                          chain=hashlib.sha256(b"c" + str(i).encode()).hexdigest()) for i in range(500)]
    t0 = time.perf_counter()
    signed = [signer.shard(e) for e in entries]
    sign_s = time.perf_counter() - t0
    verifier = Verifier(KEY.public)
    t0 = time.perf_counter()
    for e in signed:
        verifier.shard(1, signer.publication, e)
    verify_s = time.perf_counter() - t0
    assert sign_s / 500 < 2e-3 and verify_s / 500 < 4e-3, (sign_s, verify_s)


def test_a_manifest_carries_its_signatures_through_a_relays_store(tmp_path):
    """A relay writes the trainer's header and entries as they are: its readers verify them in turn."""
    d = answer(written(tmp_path, 6, bytes(1000), shard_size=128), 6)
    relay = VersionStore(tmp_path / "relay")
    relay.write_manifest(Manifest(version=6, files=d.files, shard_size=d.shard_size, total_size=d.total_size,
                                  sha256=d.sha256, publication=d.publication, signature=d.signature))
    relay.append_listing(6, list(reversed(d.shards[3:])))  # its own order, not all of them
    again = relay.delta(6, 0, "")
    assert not again.complete and [s.index for s in again.shards] == [7, 6, 5, 4, 3]
    v = view(6)
    assert sorted(s.index for s in v.apply("relay", again)) == [3, 4, 5, 6, 7] and not v.manifest().complete


def test_the_signed_messages_are_canonical():
    """Field boundaries are part of the message: no two headers or shards encode alike."""
    pub = "ab" * 16
    m1 = signing.header_message(1, pub, 64, [FileEntry(name="a", offset=0, size=11)], None, None)
    m2 = signing.header_message(1, pub, 64, [FileEntry(name="a1", offset=0, size=1)], None, None)
    m3 = signing.header_message(1, pub, 64, [FileEntry(name="a", offset=0)], None, None)
    assert len({m1, m2, m3}) == 3
    e = ShardEntry(index=1, offset=64, size=64, sha256="1" * 64)
    assert signing.shard_message(1, pub, e) != signing.shard_message(1, pub, e.model_copy(update={"chain": "0" * 64}))
    assert signing.header_message(1, pub, 64, FILES, None, None).startswith(b"intellect/shardcast/header/v1\0")


def test_the_trainer_republishes_a_version_its_key_did_not_sign(tmp_path):
    """A version left in the origin's folder unsigned, or signed by another key, would get the origin marked
    bad by every relay: publishing the step again writes it anew, signed; one it signed is kept."""
    from intellect.checkpoints import CHECKPOINTS  # noqa: PLC0415 - the RL side only in the test of it
    from intellect.rl.config import RLRunConfig  # noqa: PLC0415 - the RL side only in the test of it
    from intellect.rl.trainer.publish import publish_to_origin  # noqa: PLC0415 - the RL side only in the test of it
    from intellect.storage import RunStorage  # noqa: PLC0415 - the RL side only in the test of it

    cfg = RLRunConfig(shardcast={"shard_size": 1024})
    storage = RunStorage(f"file://{tmp_path}/run")
    ckpt = storage.local_path(storage.step_path(1, CHECKPOINTS))
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 20)
    (ckpt / "optimizer.pt").write_bytes(b"trainer only")
    origin = tmp_path / "origin"
    assert publish_to_origin(cfg, storage, 1, origin, signing_key=OTHER)["published"]
    assert not publish_to_origin(cfg, storage, 1, origin, signing_key=OTHER)["published"]
    assert publish_to_origin(cfg, storage, 1, origin, signing_key=KEY)["published"]  # another key: anew
    m = VersionStore(origin).manifest(1)
    v = view(1)
    v.apply("origin", VersionStore(origin).delta(1, 0, ""))
    assert v.manifest().complete and [f.name for f in m.files] == ["model.safetensors"]


def test_every_header_field_is_signed_and_every_message_carries_the_same_header(tmp_path):
    """The header is declared once (:class:`SignedHeader`): each of its fields changes the signed bytes,
    and a manifest, a listing delta and a ``/versions`` entry of one version carry the same header,
    whose signature verifies in each form."""
    base = SignedHeader(version=1, publication="ab" * 16, shard_size=64, files=[FileEntry(name="w", offset=0, size=9)],
                        total_size=9, sha256="0" * 64)
    changed = {"version": 2, "publication": "cd" * 16, "shard_size": 128, "files": [FileEntry(name="v", offset=0)],
               "total_size": 10, "sha256": "1" * 64,
               "lineage": Lineage(encoding="bitpatch-v1", base=0, checkpoint_digest="2" * 64)}
    assert set(changed) | {"signature"} == set(SignedHeader.model_fields)
    for name, value in changed.items():
        assert base.model_copy(update={name: value}).message() != base.message(), f"{name} is not signed"
    store = written(tmp_path, 4, bytes(300))
    m = store.manifest(4)
    forms = [m, answer(store, 4), ListedVersion.of(m, len(m.shards))]
    assert all(isinstance(f, SignedHeader) for f in forms)
    assert {f.message() for f in forms} == {m.message()}
    for f in forms:
        assert f.header_fields() == m.header_fields()
        Verifier(KEY.public).verify(f)
        Verifier(KEY.public).header(f.version, f.publication, f.shard_size, f.files, f.total_size, f.sha256,
                                    f.signature)
