"""Weight patches: a checkpoint as the elements whose bits changed since a base checkpoint, rebuilt bit-exact.

At RL learning rates most bf16 weights keep their bits from one step to the next (an Adam step is
about the learning rate, and bf16 absorbs any change below ``|w| / 256``), so a version that carries,
for each safetensors tensor, the indices and new bits of the elements that changed is a few per cent
of the checkpoint. A patch is a folder (published as an ordinary SHARDCAST version whose signed
:class:`~intellect.shardcast.header.Lineage` names its base and the digest of what it rebuilds):

* ``patch.json`` (:class:`PatchIndex`): the base checkpoint's digest, then each file of the new
  checkpoint: ``keep`` (the base's file, unchanged), ``whole`` (carried whole, as ``whole.<i>``) or
  ``tensors`` (the base's safetensors file, same header, with the changed elements of ``diff.<i>``);
* ``diff.<i>``: per tensor listed, its changed element indices (ascending, delta-coded as the
  narrowest unsigned integers that hold the largest gap, zlib-compressed), then their new bits: raw
  in encoding ``bitpatch-v1``; in ``bitpatch-v2`` each as its difference
  from the base's bits (:func:`code_values`), a few bits where an optimizer step moved the weight by
  an ulp or two, zlib-compressed.

:func:`make_patch` writes one (pure: two folders in, one out); :func:`apply_patch` rebuilds the new
checkpoint from the base and the patch, parsing nothing unbounded (sizes, counts, index ranges, the
tensor's dtype and shape from the base), and refuses with :class:`PatchRefused` (a recorded reason)
anything that does not rebuild the signed digest, leaving no folder behind.

>>> import tempfile, safetensors.numpy as stn
>>> d = Path(tempfile.mkdtemp())
>>> for name, w in (("a", [1.0, 2.0, 3.0, 4.0]), ("b", [1.0, 2.0, 3.5, 4.0])):
...     (d / name).mkdir(); stn.save_file({"w": np.array(w, np.float32)}, str(d / name / "model.safetensors"))
...     _ = (d / name / "config.json").write_text("{}")
>>> stats = make_patch(d / "a", d / "b", d / "p", checkpoint_digest(d / "a"))
>>> stats.changed, stats.elements, json.loads((d / "p" / INDEX).read_text())["files"][0]["op"]
(1, 4, 'keep')
>>> json.loads((d / "p" / INDEX).read_text())["format"]
'intellect/weight-patch/v2'
>>> apply_patch(d / "a", d / "p", d / "c", checkpoint_digest(d / "a"), checkpoint_digest(d / "b"))
>>> stn.load_file(str(d / "c" / "model.safetensors"))["w"].tolist()
[1.0, 2.0, 3.5, 4.0]
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError

from intellect.shardcast.header import FILE_NAME, MAX_FILES, PATCH_ENCODING, SHA256_HEX, Encoding, PatchEncoding, Strict

__all__ = ["INDEX", "PatchIndex", "PatchRefused", "PatchStats", "apply_patch", "checkpoint_digest", "checkpoint_files",
           "code_values", "diff_elements", "make_patch", "place", "MAX_CHAIN"]

INDEX = "patch.json"
Format = Literal["intellect/weight-patch/v1", "intellect/weight-patch/v2"]
#: ``patch.json``'s ``format`` of each encoding a version's signed header names
FORMATS: dict[PatchEncoding, Format] = {"bitpatch-v1": "intellect/weight-patch/v1",
                                     "bitpatch-v2": "intellect/weight-patch/v2"}
MAX_INDEX_BYTES = 64 << 20  # a patch.json longer than this is refused before it is parsed
MAX_HEADER_BYTES = 100_000_000  # a safetensors header's bound, as the safetensors format sets it
MAX_TENSORS = 1_000_000  # tensors of one file
MAX_CHAIN = 256  # versions a client downloads to rebuild one: an anchor and the patches after it
# bytes per element of each safetensors dtype: the unit whose bits a patch compares and carries
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_LE = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}  # safetensors' byte order
# zlib's fastest level: the indices are a third of a patch's bytes, and higher levels shrink them by a
# few per cent at several times the time, on the trainer's critical path (figures: benchmarks/results)
_ZLIB_LEVEL = 1
# bitpatch-v2's deflate strategies (any inflater reads them): the index gaps are near-independent small
# numbers, which Huffman codes alone pack best; the coded values are byte planes of long zero runs and
# small numbers, for which run-length matching beats the default's string search, both faster and smaller
# (figures: benchmarks/results, "XOR-coded patch values")
_V2_INDICES, _V2_VALUES = zlib.Z_HUFFMAN_ONLY, zlib.Z_RLE

Reason = Literal["malformed", "oversized", "base_mismatch", "out_of_range", "layout_mismatch", "digest_mismatch",
                 "base_missing", "chain_too_long", "encoding_mismatch"]


class PatchRefused(ValueError):
    """A patch that does not rebuild the signed checkpoint; ``reason`` is one of :data:`Reason`."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class TensorPatch(Strict):
    name: str = Field(max_length=4096)
    count: int = Field(ge=1, description="Changed elements.")
    width: Literal[1, 2, 4, 8] = Field(description="Bytes per delta-coded index.")
    index_bytes: int = Field(ge=1, description="Bytes of the zlib-compressed indices.")
    value_bytes: int | None = Field(default=None, ge=1, description="Bytes of the zlib-compressed coded values "
                                    "(bitpatch-v2; None in bitpatch-v1, whose values are raw, count x itemsize).")


class FilePatch(Strict):
    name: str = Field(pattern=FILE_NAME.pattern)
    op: Literal["keep", "whole", "tensors"]
    source: str | None = Field(default=None, pattern=FILE_NAME.pattern, description="The patch's file it takes.")
    tensors: list[TensorPatch] = Field(default_factory=list, max_length=MAX_TENSORS)


class PatchIndex(Strict):
    format: Format = Field(
        description="How the values are carried: v1 raw, v2 coded against the base (:data:`FORMATS`).")
    base_digest: str = Field(pattern=SHA256_HEX, description="checkpoint_digest of the base it applies to.")
    files: list[FilePatch] = Field(max_length=MAX_FILES)

    @property
    def encoding(self) -> PatchEncoding:
        return next(e for e, f in FORMATS.items() if f == self.format)


@dataclass
class PatchStats:
    bytes: int  # of the patch folder
    full_bytes: int  # of the new checkpoint
    changed: int  # elements whose bits changed (carried as such, or in a file carried whole)
    elements: int  # elements of the tensors compared


def checkpoint_digest(folder: Path) -> str:
    """The digest a version's lineage signs: :func:`intellect.checkpoints.local_digest` of the inference files."""
    from intellect.checkpoints import local_digest  # noqa: PLC0415 - it loads torch, which relays never need

    return local_digest(folder, inference=True)


def checkpoint_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder a version carries: top-level, plain names (no ``STABLE`` marker
    or hidden file), sorted."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and FILE_NAME.match(p.name) and p.name != "STABLE")


# ------------------------------------------------------------------ safetensors layout


@dataclass
class _Tensor:
    dtype: str
    numel: int
    start: int  # in the file
    end: int


def _layout(path: Path) -> tuple[bytes, dict[str, _Tensor]]:
    """A safetensors file's header bytes and its tensors; ValueError for anything malformed or oversized."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"a header of {n} bytes")
        raw = f.read(n)
    meta = json.loads(raw)
    if not isinstance(meta, dict) or len(meta) > MAX_TENSORS + 1:
        raise ValueError("the header is not a table of tensors")
    tensors = {}
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = t["dtype"], t["shape"], t["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r} is malformed") from None
        if dtype not in ITEMSIZE or not all(isinstance(x, int) and x >= 0 for x in [*shape, lo, hi]):
            raise ValueError(f"tensor {name!r}: dtype {dtype} or shape {shape} unknown")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if hi - lo != numel * ITEMSIZE[dtype] or 8 + n + hi > size:
            raise ValueError(f"tensor {name!r}: offsets {lo}..{hi} do not hold {shape} {dtype}")
        tensors[name] = _Tensor(dtype, numel, 8 + n + lo, 8 + n + hi)
    return head + raw, tensors


def _elements(mm: np.ndarray, t: _Tensor) -> np.ndarray:
    return mm[t.start:t.end].view(_UINT[ITEMSIZE[t.dtype]])


# ------------------------------------------------------------------ make


def code_values(old: np.ndarray, new: np.ndarray) -> bytes:
    """bitpatch-v2's values before compression: each element's bits minus the base's, as an integer of
    the element's width (wrapping), zigzag-mapped (0, -1, 1, -2, ... to 0, 1, 2, 3, ...) and laid out
    as byte planes, most significant byte of every element first. Floats of one sign order as their
    bits do, so a weight an optimizer step moved by k ulps differs by k: planes of zeros and a low
    plane of small numbers, which zlib packs to a few bits each (raw new bits, or their XOR with the
    base's, keep the mantissa's random low bits; figures: benchmarks/results). :func:`decode_values`
    inverts it.

    >>> list(code_values(np.array([5, 9], np.uint16), np.array([6, 8], np.uint16)))  # +1, -1: 2, 1
    [0, 0, 2, 1]
    """
    width = old.dtype.itemsize
    d = new.astype(_LE[width]) - old.astype(_LE[width])  # wraps: unsigned
    z = (d << 1) ^ (np.zeros_like(d) - (d >> (8 * width - 1)))
    return np.ascontiguousarray(z.view(np.uint8).reshape(-1, width)[:, ::-1].T).tobytes()


def decode_values(old: np.ndarray, coded: bytes) -> np.ndarray:
    """The new bits of elements whose base bits are ``old``, from :func:`code_values`'s bytes
    (``len(coded) == old.nbytes``, checked by the caller)."""
    width = old.dtype.itemsize
    z = np.ascontiguousarray(np.frombuffer(coded, np.uint8).reshape(width, -1)[::-1].T).view(_LE[width]).reshape(-1)
    d = (z >> 1) ^ (np.zeros_like(z) - (z & 1))
    return (old.astype(_LE[width]) + d).astype(old.dtype)


def diff_elements(old: np.ndarray, new: np.ndarray, encoding: PatchEncoding = PATCH_ENCODING
                  ) -> tuple[int, Literal[1, 2, 4, 8], bytes, bytes] | None:
    """What a patch of ``encoding`` carries of one tensor, given its elements' bits before and after
    (unsigned integer arrays of one shape): ``(changed elements, index width, packed indices, values)``,
    None when no bit changed.

    >>> n, w, packed, values = diff_elements(np.array([1, 2, 3, 4], np.uint16), np.array([1, 9, 3, 7], np.uint16),
    ...                                      "bitpatch-v1")
    >>> n, w, np.frombuffer(zlib.decompress(packed), np.uint8).tolist(), np.frombuffer(values, np.uint16).tolist()
    (2, 1, [1, 2], [9, 7])
    """
    old, new = old.reshape(-1), new.reshape(-1)
    idx = np.flatnonzero(old != new)
    if not idx.size:
        return None
    gaps = np.diff(idx, prepend=0)
    top = int(gaps.max())
    width: Literal[1, 2, 4, 8] = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
    gaps = gaps.astype(_UINT[width]).tobytes()
    if encoding == "bitpatch-v1":
        return idx.size, width, zlib.compress(gaps, _ZLIB_LEVEL), new[idx].tobytes()
    return idx.size, width, _deflate(gaps, _V2_INDICES), _deflate(code_values(old[idx], new[idx]), _V2_VALUES)


def _deflate(data: bytes, strategy: int) -> bytes:
    z = zlib.compressobj(_ZLIB_LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 8, strategy)
    return z.compress(data) + z.flush()


def _covers(tensors: dict[str, _Tensor], start: int, end: int) -> bool:
    """Whether the tensors fill ``start..end`` of the file with no byte between or after them: then a
    file whose tensors' elements are the base's is the base's, byte for byte."""
    pos = start
    for t in sorted(tensors.values(), key=lambda t: t.start):
        if t.start != pos:
            return False
        pos = t.end
    return pos == end


def _diff_tensors(base: Path, new: Path, out: Path, encoding: PatchEncoding
                  ) -> tuple[list[TensorPatch], int, int] | None:
    """The changed elements of ``new`` against ``base`` into ``out``; None where the two files do not
    share one safetensors header (the file is then carried whole)."""
    try:
        hb, tb = _layout(base)
        hn, tn = _layout(new)
    except (ValueError, OSError):
        return None
    size = new.stat().st_size
    if hb != hn or base.stat().st_size != size or not tn or not _covers(tn, len(hn), size):
        return None
    a = np.memmap(base, np.uint8, "r")
    b = np.memmap(new, np.uint8, "r")
    patches, changed, elements = [], 0, 0
    with open(out, "wb") as f:
        for name, t in sorted(tn.items(), key=lambda kv: kv[1].start):
            elements += t.numel
            got = diff_elements(_elements(a, t), _elements(b, t), encoding)
            if got is None:
                continue
            count, width, packed, values = got
            f.write(packed)
            f.write(values)
            patches.append(TensorPatch(name=name, count=count, width=width, index_bytes=len(packed),
                                       value_bytes=None if encoding == "bitpatch-v1" else len(values)))
            changed += count
    return patches, changed, elements


def make_patch(base: Path, new: Path, out: Path, base_digest: str,
               encoding: PatchEncoding = PATCH_ENCODING) -> PatchStats:
    """Write into the new folder ``out`` the patch of ``encoding`` that rebuilds checkpoint folder ``new``
    from ``base`` (whose :func:`checkpoint_digest` is ``base_digest``). A safetensors file whose patch
    would be no smaller than the file is carried whole."""
    out.mkdir(parents=True)
    base_names = set(checkpoint_files(base))
    entries, changed, elements, full = [], 0, 0, 0
    for i, name in enumerate(checkpoint_files(new)):
        src = new / name
        full += src.stat().st_size
        got = _diff_tensors(base / name, src, out / f"diff.{i}", encoding) if name in base_names else None
        if got is not None:
            changed, elements = changed + got[1], elements + got[2]
        if (got is not None and not got[0]) or (got is None and name in base_names and
                                                 filecmp.cmp(base / name, src, shallow=False)):
            (out / f"diff.{i}").unlink(missing_ok=True)
            entries.append(FilePatch(name=name, op="keep"))
            continue
        if got is not None and (out / f"diff.{i}").stat().st_size < src.stat().st_size:
            entries.append(FilePatch(name=name, op="tensors", source=f"diff.{i}", tensors=got[0]))
            continue
        (out / f"diff.{i}").unlink(missing_ok=True)
        shutil.copyfile(src, out / f"whole.{i}")
        entries.append(FilePatch(name=name, op="whole", source=f"whole.{i}"))
    index = PatchIndex(format=FORMATS[encoding], base_digest=base_digest, files=entries)
    (out / INDEX).write_text(index.model_dump_json())
    return PatchStats(sum(p.stat().st_size for p in out.iterdir()), full, changed, elements)


# ------------------------------------------------------------------ apply


def _read_index(patch: Path) -> PatchIndex:
    path = patch / INDEX
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PatchRefused("malformed", f"the patch has no {INDEX}") from None
    if size > MAX_INDEX_BYTES:
        raise PatchRefused("oversized", f"{INDEX} has {size} bytes (at most {MAX_INDEX_BYTES})")
    try:
        index = PatchIndex.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise PatchRefused("malformed", f"{INDEX}: {str(e).splitlines()[0]}") from None
    if len({f.name for f in index.files}) != len(index.files):
        raise PatchRefused("malformed", "a file is listed twice")
    coded = index.encoding != "bitpatch-v1"
    if any((t.value_bytes is not None) != coded for f in index.files for t in f.tensors):
        raise PatchRefused("malformed", f"{index.format}: a tensor's values are {'not ' if coded else ''}"
                                        "carried coded")
    return index


def _source(patch: Path, f: FilePatch) -> Path:
    if f.source is None or not (patch / f.source).is_file():
        raise PatchRefused("malformed", f"{f.name}: the patch has no file {f.source!r}")
    return patch / f.source


def _inflate(raw: bytes, size: int, what: str) -> bytes:
    """``raw`` decompressed, exactly ``size`` bytes of it; never more than ``size`` held, whatever
    ``raw`` claims to inflate to."""
    inflate = zlib.decompressobj()
    try:
        out = inflate.decompress(raw, size)
    except zlib.error as e:
        raise PatchRefused("malformed", f"{what}: {e}") from None
    if len(out) != size or not inflate.eof or inflate.unused_data:
        raise PatchRefused("malformed", f"{what} are not {size} bytes")
    return out


def _patch_file(target: Path, diff: Path, f: FilePatch) -> None:
    """Write the changed elements of ``diff`` into ``target`` (a copy of the base's file)."""
    try:
        _, tensors = _layout(target)
    except (ValueError, OSError) as e:
        raise PatchRefused("layout_mismatch", f"{f.name}: the base's file is no safetensors file ({e})") from None
    size = diff.stat().st_size
    need = 0
    for t in f.tensors:  # the patch's own sizes checked against the base's shapes before reading a byte
        if t.name not in tensors:
            raise PatchRefused("layout_mismatch", f"{f.name}: the base has no tensor {t.name!r}")
        if t.count > tensors[t.name].numel:
            raise PatchRefused("out_of_range", f"{f.name}: {t.count} elements of tensor {t.name!r} "
                                               f"({tensors[t.name].numel})")
        need += t.index_bytes + (t.count * ITEMSIZE[tensors[t.name].dtype] if t.value_bytes is None else t.value_bytes)
    if need != size:
        raise PatchRefused("oversized" if size > need else "malformed",
                           f"{f.name}: {f.source} has {size} bytes, its tensors account for {need}")
    if len({t.name for t in f.tensors}) != len(f.tensors):
        raise PatchRefused("malformed", f"{f.name}: a tensor is listed twice")
    mm = np.memmap(target, np.uint8, "r+")
    with open(diff, "rb") as src:
        for t in f.tensors:
            spec = tensors[t.name]
            packed = _inflate(src.read(t.index_bytes), t.count * t.width, f"{f.name}: indices of {t.name!r}")
            gaps = np.frombuffer(packed, _UINT[t.width]).astype(np.uint64)
            # each gap below the element count, so a sum wraps at most once and shows as a step back
            if int(gaps.max()) >= spec.numel or (t.count > 1 and not gaps[1:].all()):
                raise PatchRefused("out_of_range", f"{f.name}: indices of {t.name!r} are not ascending within "
                                                   f"its {spec.numel} elements")
            idx = np.cumsum(gaps, dtype=np.uint64)
            if int(idx[-1]) >= spec.numel or (t.count > 1 and not (idx[1:] > idx[:-1]).all()):
                raise PatchRefused("out_of_range", f"{f.name}: an index of {t.name!r} is past its {spec.numel} "
                                                   "elements")
            width = ITEMSIZE[spec.dtype]
            elements = _elements(mm, spec)
            if t.value_bytes is None:
                elements[idx] = np.frombuffer(src.read(t.count * width), _UINT[width])
            else:
                coded = _inflate(src.read(t.value_bytes), t.count * width, f"{f.name}: values of {t.name!r}")
                elements[idx] = decode_values(elements[idx], coded)
    mm.flush()
    del mm


def place(src: Path, dest: Path) -> None:
    """``dest`` holds ``src``'s bytes: a hard link where possible (nothing writes to either in place)."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def apply_patch(base: Path, patch: Path, out: Path, base_digest: str | None, expect: str | None,
                encoding: Encoding | None = None) -> None:
    """Rebuild into the new folder ``out`` the checkpoint ``patch`` makes of ``base`` (whose signed
    digest is ``base_digest``, where known), and check it against ``expect``, the signed digest of the
    result, and the patch's format against ``encoding``, the one its signed header names (where
    given); :class:`PatchRefused` (and no ``out``) when anything does not hold."""
    index = _read_index(patch)
    if encoding is not None and index.encoding != encoding:
        raise PatchRefused("encoding_mismatch", f"the version is signed as {encoding}, its patch is {index.format}")
    if base_digest is not None and index.base_digest != base_digest:
        raise PatchRefused("base_mismatch", f"the patch applies to a base of digest {index.base_digest[:16]}, "
                                            f"the base's is {base_digest[:16]}")
    if expect is None:
        raise PatchRefused("malformed", "the version signs no digest of the checkpoint it rebuilds")
    out.mkdir(parents=True)
    try:
        for f in index.files:
            if f.op == "whole":
                shutil.copyfile(_source(patch, f), out / f.name)
                continue
            if not (base / f.name).is_file():
                raise PatchRefused("base_mismatch", f"the base has no file {f.name!r}")
            if f.op == "keep":
                place(base / f.name, out / f.name)
                continue
            diff = _source(patch, f)
            shutil.copyfile(base / f.name, out / f.name)
            _patch_file(out / f.name, diff, f)
        got = checkpoint_digest(out) if index.files else None
        if got != expect:
            raise PatchRefused("digest_mismatch", f"the rebuilt checkpoint's digest {str(got)[:16]} is not the "
                                                  f"signed {expect[:16]}")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
