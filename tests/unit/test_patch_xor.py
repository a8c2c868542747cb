"""Weight patches of encoding bitpatch-v2 (intellect.shardcast.patch): the changed values coded against the
base's bits and compressed. Bit-exact for every bit pattern, smaller than bitpatch-v1, the old encoding
still read, and a hostile relay's v2 patch (a decompression bomb in the values, values whose length is
not the index count's, values for indices past the tensor) refused with its reason before more than the
declared size is held."""

import json
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn

from intellect.shardcast.origin import Origin
from intellect.shardcast.patch import (INDEX, PatchRefused, apply_patch, checkpoint_digest, code_values,
                                       decode_values, make_patch)

V2, V1 = "bitpatch-v2", "bitpatch-v1"


def save(folder: Path, tensors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True)
    stn.save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed": (rng.standard_normal((256, 64)) * 0.02).astype(np.float16),
            "w": (rng.standard_normal((64, 96)) * 0.02).astype(np.float32),
            "steps": np.arange(7, dtype=np.int64)}


def adam_like(tensors: dict[str, np.ndarray], seed: int, share: float = 0.1) -> dict[str, np.ndarray]:
    """A share of the float elements moved by about an ulp or two (what an RL step does to most changed
    weights), plus the awkward ones: a sign flip through zero, a NaN, an infinity, a negative zero."""
    rng = np.random.default_rng(seed)
    out = {k: v.copy() for k, v in tensors.items()}
    for name in ("embed", "w"):
        flat = out[name].reshape(-1)
        hit = rng.random(flat.size) < share
        flat[hit] = flat[hit] * (1 + rng.choice([-2, -1, 1, 2], hit.sum()) * np.finfo(flat.dtype).eps)
    out["w"][0, :4] = [-out["w"][0, 0], np.nan, np.inf, -0.0]
    out["steps"][3] = -(2**62)
    return out


@pytest.fixture
def pair(tmp_path):
    a = weights()
    return save(tmp_path / "a", a), save(tmp_path / "b", adam_like(a, 1))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_coded_values_decode_to_the_new_bits_for_every_bit_pattern(dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    old = rng.integers(0, info.max, 4096, dtype=dtype, endpoint=True)
    new = rng.integers(0, info.max, 4096, dtype=dtype, endpoint=True)
    new[:4], old[:4] = [0, info.max, 0, info.max], [info.max, 0, 0, info.max]  # the wraps and the extremes
    coded = code_values(old, new)
    assert len(coded) == old.nbytes
    assert np.array_equal(decode_values(old, coded), new)


def test_a_v2_patch_rebuilds_bit_exact_and_is_smaller_than_v1(pair, tmp_path):
    base, new = pair
    s2 = make_patch(base, new, tmp_path / "p2", checkpoint_digest(base), V2)
    s1 = make_patch(base, new, tmp_path / "p1", checkpoint_digest(base), V1)
    assert json.loads((tmp_path / "p2" / INDEX).read_text())["format"] == "intellect/weight-patch/v2"
    assert s2.changed == s1.changed > 0
    assert s2.bytes < 0.75 * s1.bytes, (s2.bytes, s1.bytes)
    for patch, encoding in (("p2", V2), ("p1", V1)):  # the old encoding stays readable
        apply_patch(base, tmp_path / patch, tmp_path / f"c{patch}", checkpoint_digest(base), checkpoint_digest(new),
                    encoding)
        assert (tmp_path / f"c{patch}" / "model.safetensors").read_bytes() == (new / "model.safetensors").read_bytes()


# ------------------------------------------------------------------ hostile v2 patches


def edit(patch: Path, tensor: str, change) -> None:
    """Rewrite ``tensor``'s entry and its bytes in the patch: ``change(entry, indices, values)`` returns the
    new (indices, values) bytes and may edit the entry."""
    index = json.loads((patch / INDEX).read_text())
    f = next(f for f in index["files"] if f["op"] == "tensors")
    diff = (patch / f["source"]).read_bytes()
    out, pos = b"", 0
    for t in f["tensors"]:
        packed, values = diff[pos:pos + t["index_bytes"]], diff[pos + t["index_bytes"]:pos + t["index_bytes"] + t["value_bytes"]]
        pos += t["index_bytes"] + t["value_bytes"]
        if t["name"] == tensor:
            packed, values = change(t, packed, values)
            t.update(index_bytes=len(packed), value_bytes=len(values))
        out += packed + values
    (patch / f["source"]).write_bytes(out)
    (patch / INDEX).write_text(json.dumps(index))


def bomb(_t, packed, _values):
    return packed, zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KiB, for a few hundred values


def short_values(_t, packed, values):  # one value fewer than the indices say
    return packed, zlib.compress(zlib.decompress(values)[:-2])


def long_values(_t, packed, values):  # one value more than the indices say
    return packed, zlib.compress(zlib.decompress(values) + b"\0\0")


def past_the_tensor(t, _packed, _values):  # the right number of values, for indices past the tensor's end
    gaps = np.diff(np.asarray([0, 256 * 64 + 5], np.int64), prepend=0).astype(np.uint32)
    t.update(count=2, width=4)
    return zlib.compress(gaps.tobytes()), zlib.compress(bytes(4))


def trailing_garbage(_t, packed, values):  # a complete stream, then bytes the count never reads
    return packed, values + b"\x00" * 8


def raw_values(patch: Path) -> None:  # a v2 index whose tensor carries its values uncoded
    index = json.loads((patch / INDEX).read_text())
    next(f for f in index["files"] if f["op"] == "tensors")["tensors"][0]["value_bytes"] = None
    (patch / INDEX).write_text(json.dumps(index))


def another_value(_t, packed, values):  # a well-formed stream, one coded value off by one
    raw = bytearray(zlib.decompress(values))
    raw[-1] ^= 1
    return packed, zlib.compress(bytes(raw))


HOSTILE = {
    "a_decompression_bomb_in_the_values": ("malformed", lambda p: edit(p, "embed", bomb)),
    "fewer_values_than_indices": ("malformed", lambda p: edit(p, "embed", short_values)),
    "more_values_than_indices": ("malformed", lambda p: edit(p, "embed", long_values)),
    "values_for_indices_past_the_tensor": ("out_of_range", lambda p: edit(p, "embed", past_the_tensor)),
    "bytes_after_the_value_stream": ("malformed", lambda p: edit(p, "embed", trailing_garbage)),
    "values_not_coded_in_a_v2_patch": ("malformed", raw_values),
    "a_value_that_rebuilds_another_checkpoint": ("digest_mismatch", lambda p: edit(p, "w", another_value)),
    "an_unknown_format": ("malformed", lambda p: (p / INDEX).write_text(
        (p / INDEX).read_text().replace("weight-patch/v2", "weight-patch/v9"))),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_v2_patch_is_refused_with_its_reason_within_its_declared_size(pair, tmp_path, attack):
    base, new = pair
    reason, spoil = HOSTILE[attack]
    make_patch(base, new, tmp_path / "p", checkpoint_digest(base), V2)
    spoil(tmp_path / "p")
    digests = checkpoint_digest(base), checkpoint_digest(new)
    tracemalloc.start()
    try:
        with pytest.raises(PatchRefused) as e:
            apply_patch(base, tmp_path / "p", tmp_path / "c", *digests)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.reason == reason, e.value
    assert not (tmp_path / "c").exists()
    # the largest thing held is a patch file or a tensor's declared values (a few KiB here), never the 64 MiB bomb
    assert peak < 4 << 20, peak


def test_a_patch_of_another_encoding_than_its_signed_header_names_is_refused(pair, tmp_path):
    base, new = pair
    make_patch(base, new, tmp_path / "p", checkpoint_digest(base), V1)
    with pytest.raises(PatchRefused) as e:
        apply_patch(base, tmp_path / "p", tmp_path / "c", checkpoint_digest(base), checkpoint_digest(new), V2)
    assert e.value.reason == "encoding_mismatch" and not (tmp_path / "c").exists()


def test_an_origin_told_to_publishes_v2_patches_and_signs_them_as_such(pair, tmp_path):
    from intellect.trust.keys import SigningKey  # noqa: PLC0415 - only this test signs

    key = SigningKey.from_seed(b"\x22" * 32)
    base, new = pair
    sizes = {}
    for enc in (V1, V2):
        origin = Origin(tmp_path / enc, shard_size=1 << 14, keep=3, anchor_every=5, patch_encoding=enc)
        assert origin.publish(base, 1, key).encoding == "full"
        p = origin.publish(new, 2, key)
        assert (p.encoding, p.base) == (enc, 1)
        sizes[enc] = p.bytes
    assert sizes[V2] < sizes[V1]
