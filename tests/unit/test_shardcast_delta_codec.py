"""Weight patches (intellect.shardcast.patch), their lineage in the signed header, and the origin's choice
of full versus patch: bit-exact rebuilds, and every hostile patch refused with a reason, leaving nothing."""

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn
from pydantic import ValidationError

from intellect.shardcast.header import FULL, PATCH_ENCODING, Lineage, SignedHeader
from intellect.shardcast.manifest import VersionList
from intellect.shardcast.origin import Origin
from intellect.shardcast.patch import INDEX, PatchRefused, apply_patch, checkpoint_digest, make_patch
from intellect.shardcast.signing import Untrusted, Verifier, VersionSigner
from intellect.shardcast.store import VersionStore
from intellect.trust.keys import SigningKey

KEY = SigningKey.from_seed(b"\x21" * 32)
PATCH = PATCH_ENCODING
RAW = "bitpatch-v1"  # the encoding these hostile patches are written in: values raw, so each is easy to forge


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((64, 32)).astype(np.float16),
            "layer.w": rng.standard_normal((32, 48)).astype(np.float32),
            "layer.b": np.zeros(48, np.float32),
            "steps": np.arange(5, dtype=np.int64)}


def save(folder: Path, tensors: dict[str, np.ndarray], config: str = "{}") -> Path:
    folder.mkdir(parents=True)
    stn.save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(config)
    return folder


def step(tensors: dict[str, np.ndarray], seed: int, share: float = 0.02) -> dict[str, np.ndarray]:
    """A few elements of every float tensor changed, as an optimizer step at a small learning rate would."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        t = t.copy()
        if t.dtype.kind == "f":
            flat = t.reshape(-1)
            hit = rng.random(flat.size) < share
            flat[hit] += np.asarray(0.01, t.dtype)
        out[name] = t
    return out


@pytest.fixture
def pair(tmp_path):
    a = weights()
    b = step(a, 1)
    b["layer.b"][7] = -0.0  # the bits change, the value compares equal: bits are what a patch compares
    b["layer.w"][3, 5] = np.float32("nan")
    base, new = save(tmp_path / "a", a), save(tmp_path / "b", b, config='{"x": 1}')
    return base, new


def test_a_patch_rebuilds_the_new_checkpoint_bit_exact_and_carries_only_what_changed(pair, tmp_path):
    base, new = pair
    stats = make_patch(base, new, tmp_path / "p", checkpoint_digest(base))
    index = json.loads((tmp_path / "p" / INDEX).read_text())
    assert {f["name"]: f["op"] for f in index["files"]} == {"config.json": "whole", "model.safetensors": "tensors"}
    assert 0 < stats.changed < 0.05 * stats.elements and stats.bytes < 0.2 * stats.full_bytes
    apply_patch(base, tmp_path / "p", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(new))
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "c" / name).read_bytes() == (new / name).read_bytes()


def test_files_added_removed_or_relaid_out_are_carried_whole(tmp_path):
    a = weights()
    base = save(tmp_path / "a", a)
    (base / "gone.txt").write_text("old")
    b = {**step(a, 2), "extra": np.ones(3, np.float32)}  # another header: the file is carried whole
    new = save(tmp_path / "b", b)
    (new / "tokenizer.json").write_text("{}")
    make_patch(base, new, tmp_path / "p", checkpoint_digest(base))
    ops = {f["name"]: f["op"] for f in json.loads((tmp_path / "p" / INDEX).read_text())["files"]}
    assert ops == {"config.json": "keep", "model.safetensors": "whole", "tokenizer.json": "whole"}
    apply_patch(base, tmp_path / "p", tmp_path / "c", None, checkpoint_digest(new))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_an_unchanged_checkpoint_is_a_patch_of_only_its_index(tmp_path):
    base = save(tmp_path / "a", weights())
    new = save(tmp_path / "b", weights())
    stats = make_patch(base, new, tmp_path / "p", checkpoint_digest(base))
    assert stats.changed == 0 and [p.name for p in (tmp_path / "p").iterdir()] == [INDEX]


# ------------------------------------------------------------------ hostile patches


def tamper_index(patch: Path, edit) -> None:
    index = json.loads((patch / INDEX).read_text())
    edit(index)
    (patch / INDEX).write_text(json.dumps(index))


def tensor_entry(index: dict, name: str) -> dict:
    f = next(f for f in index["files"] if f["op"] == "tensors")
    return next(t for t in f["tensors"] if t["name"] == name)


def rewrite_indices(patch: Path, tensor: str, indices: list[int]) -> None:
    """Replace ``tensor``'s indices by ``indices`` (delta-coded as the codec does), values kept in length."""
    index = json.loads((patch / INDEX).read_text())
    f = next(f for f in index["files"] if f["op"] == "tensors")
    diff = (patch / f["source"]).read_bytes()
    out, pos = b"", 0
    for t in f["tensors"]:
        packed, pos = diff[pos:pos + t["index_bytes"]], pos + t["index_bytes"]
        size = t["count"] * (2 if t["name"] == "embed" else 4 if t["name"] != "steps" else 8)
        values, pos = diff[pos:pos + size], pos + size
        if t["name"] == tensor:
            gaps = np.diff(np.asarray(indices, np.int64), prepend=0).astype(np.uint32)
            packed = zlib.compress(gaps.tobytes())
            t.update(count=len(indices), width=4, index_bytes=len(packed))
            values = values[: len(indices) * 4].ljust(len(indices) * 4, b"\0")
        out += packed + values
    (patch / f["source"]).write_bytes(out)
    (patch / INDEX).write_text(json.dumps(index))


HOSTILE = {
    "index_past_the_tensor": ("out_of_range", lambda p: rewrite_indices(p, "layer.w", [0, 32 * 48])),
    "index_twice": ("out_of_range", lambda p: rewrite_indices(p, "layer.w", [3, 3])),
    "more_elements_than_the_tensor": ("out_of_range", lambda p: tamper_index(
        p, lambda i: tensor_entry(i, "layer.w").update(count=10**9))),
    "bytes_beyond_its_tensors": ("oversized", lambda p: (p / "diff.1").write_bytes(
        (p / "diff.1").read_bytes() + bytes(4096))),
    "an_index_file_too_big_to_parse": ("oversized", lambda p: (p / INDEX).write_bytes(b" " * (65 << 20))),
    "not_json": ("malformed", lambda p: (p / INDEX).write_bytes(b"{not json")),
    "a_tensor_the_base_lacks": ("layout_mismatch", lambda p: tamper_index(
        p, lambda i: tensor_entry(i, "layer.w").update(name="layer.q"))),
    "indices_that_inflate_past_their_count": ("malformed", lambda p: rewrite_bomb(p)),
    "a_source_outside_the_patch": ("malformed", lambda p: tamper_index(
        p, lambda i: i["files"][1].update(source="../a"))),
}


def rewrite_bomb(patch: Path) -> None:
    index = json.loads((patch / INDEX).read_text())
    f = next(f for f in index["files"] if f["op"] == "tensors")
    bomb = zlib.compress(bytes(50 << 20))  # 50 MiB of zeros in ~50 KiB, for a tensor of a few changes
    first = f["tensors"][0]
    diff = (patch / f["source"]).read_bytes()
    (patch / f["source"]).write_bytes(bomb + diff[first["index_bytes"]:])
    first["index_bytes"] = len(bomb)
    (patch / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_patch_is_refused_with_its_reason_and_leaves_nothing(pair, tmp_path, attack):
    base, new = pair
    reason, spoil = HOSTILE[attack]
    make_patch(base, new, tmp_path / "p", checkpoint_digest(base), RAW)
    spoil(tmp_path / "p")
    with pytest.raises(PatchRefused) as e:
        apply_patch(base, tmp_path / "p", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(new))
    assert e.value.reason == reason, e.value
    assert not (tmp_path / "c").exists()


def test_a_patch_made_against_another_base_or_rebuilding_another_digest_is_refused(pair, tmp_path):
    base, new = pair
    make_patch(base, new, tmp_path / "p", "0" * 64)  # it lies about its base
    with pytest.raises(PatchRefused, match="base_mismatch"):
        apply_patch(base, tmp_path / "p", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(new))
    make_patch(base, new, tmp_path / "q", checkpoint_digest(base), RAW)
    with pytest.raises(PatchRefused, match="digest_mismatch"):  # the signed result is another checkpoint
        apply_patch(base, tmp_path / "q", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(base))
    values = tmp_path / "q" / "diff.1"
    raw = bytearray(values.read_bytes())
    raw[-1] ^= 1  # one bit of one new value
    values.write_bytes(bytes(raw))
    with pytest.raises(PatchRefused, match="digest_mismatch"):
        apply_patch(base, tmp_path / "q", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(new))
    assert not (tmp_path / "c").exists()


def test_a_base_that_is_no_safetensors_file_is_a_layout_mismatch(pair, tmp_path):
    base, new = pair
    make_patch(base, new, tmp_path / "p", checkpoint_digest(base))
    (base / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(PatchRefused, match="layout_mismatch"):
        apply_patch(base, tmp_path / "p", tmp_path / "c", None, checkpoint_digest(new))


# ------------------------------------------------------------------ the lineage in the signed header


def test_the_lineage_is_signed_and_a_base_must_be_an_older_version():
    signer = VersionSigner(KEY, 5, lineage=Lineage(encoding=PATCH, base=4, checkpoint_digest="a" * 64))
    h = SignedHeader(version=5, shard_size=4, publication=signer.publication, lineage=signer.lineage,
                     signature=signer.header([], 4))
    Verifier(KEY.public).verify(h)
    for other in (FULL, Lineage(encoding=PATCH, base=3, checkpoint_digest="a" * 64),
                  Lineage(encoding=PATCH, base=4, checkpoint_digest="b" * 64)):
        with pytest.raises(Untrusted, match="bad_signature"):
            Verifier(KEY.public).verify(h.model_copy(update={"lineage": other}))
    for base in (5, 6):  # itself (a cycle) or a newer version: no such header parses, nor is signed
        with pytest.raises(ValidationError, match="not an older version"):
            SignedHeader(version=5, shard_size=4, lineage=Lineage(encoding=PATCH, base=base))
        with pytest.raises(ValueError, match="cannot be a patch"):
            VersionSigner(KEY, 5, lineage=Lineage(encoding=PATCH, base=base))
    listing = {"versions": [{**h.model_dump(), "lineage": {"encoding": PATCH, "base": 7}, "complete": True,
                             "shards": 0}]}
    with pytest.raises(ValidationError):  # what a relay's /versions answer with such a header parses as
        VersionList.model_validate_json(json.dumps(listing))
    with pytest.raises(ValidationError, match="a patch names its base"):
        Lineage(encoding=PATCH)
    with pytest.raises(ValidationError, match="a patch names its base"):
        Lineage(base=3)


# ------------------------------------------------------------------ the origin's choice


def test_the_origin_anchors_every_n_versions_and_retention_keeps_the_bases_of_served_patches(tmp_path):
    origin = Origin(tmp_path / "origin", shard_size=1 << 14, keep=2, anchor_every=4)
    w = weights()
    kinds = []
    for v in range(1, 11):
        w = step(w, v)
        p = origin.publish(save(tmp_path / f"s{v}", w), v, KEY)
        kinds.append((p.encoding, p.base))
        assert p.bytes is not None and p.full_bytes is not None
        assert (p.bytes < p.full_bytes) == (p.encoding == PATCH)
    assert kinds == [("full", None), (PATCH, 1), (PATCH, 2), (PATCH, 3), ("full", None), (PATCH, 5), (PATCH, 6),
                     (PATCH, 7), ("full", None), (PATCH, 9)]
    assert VersionStore(tmp_path / "origin").versions() == [9, 10]
    origin.publish(save(tmp_path / "s11", step(w, 11)), 11, KEY)
    # 10 and 11 served; 11 is a patch on 10, on 9, the anchor
    assert VersionStore(tmp_path / "origin").versions() == [9, 10, 11]
    again = origin.publish(tmp_path / "s11", 11, KEY)
    assert not again.published and again.encoding == PATCH
    with pytest.raises(ValueError, match="reference is 11"):
        origin.publish(save(tmp_path / "s12", step(w, 12)), 12, KEY, base=10)
    m = VersionStore(tmp_path / "origin").manifest(11)
    assert m is not None and m.lineage.checkpoint_digest == checkpoint_digest(tmp_path / "s11")


def test_with_anchor_every_1_or_without_a_reference_every_version_is_full(tmp_path):
    every = Origin(tmp_path / "o1", shard_size=1 << 14, keep=3, anchor_every=1)
    w = weights()
    assert [every.publish(save(tmp_path / f"a{v}", step(w, v)), v, KEY).encoding for v in (1, 2)] == ["full"] * 2
    lost = Origin(tmp_path / "o2", shard_size=1 << 14, keep=3, anchor_every=5)
    lost.publish(tmp_path / "a1", 1, KEY)
    VersionStore(tmp_path / "o2").drop(1)  # the base is gone from the store: no client could rebuild on it
    assert lost.publish(tmp_path / "a2", 2, KEY).encoding == "full"


def test_a_reference_checkpoint_rewritten_in_place_is_no_base_for_a_patch(tmp_path):
    """The origin's reference links the trainer's files: one changed in place since would make every client
    refuse the patch, so the next version is published whole."""
    origin = Origin(tmp_path / "o", shard_size=1 << 14, keep=3, anchor_every=5)
    first = save(tmp_path / "a1", weights())
    origin.publish(first, 1, KEY)
    with open(first / "config.json", "a") as f:  # the same inode, other bytes
        f.write(" ")
    assert origin.reference() is None
    assert origin.publish(save(tmp_path / "a2", step(weights(), 2)), 2, KEY).encoding == "full"
    assert origin.publish(save(tmp_path / "a3", step(weights(), 3)), 3, KEY).encoding == PATCH
