"""Rollout files built to exhaust the reader's memory: each is rejected with a reason, cheaply.

Every bomb is parsed in a fresh Python process, which reports its peak resident set (``VmHWM``)
just before and just after the parse: the growth must stay under 64 MiB, whatever the test
process itself holds. Honest files load through the same path, unchanged.
"""

from __future__ import annotations

import doctest
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_rollouts import LIMITS, make_rows  # tests/unit is on sys.path (rootdir-less prepend import)

import intellect.rl.parquet_bounds as bounds_mod
from intellect.rl.parquet_bounds import LayoutError, read_struct
from intellect.rl.rollouts import (
    REASONS,
    RolloutLimits,
    RolloutRejected,
    encode_submission,
    load_submission,
    read_submission,
    rows_to_table,
    write_submission,
)
from intellect.storage import RunStorage

REPO = Path(__file__).resolve().parents[2]
MAX_GROWTH = 64 << 20
DEFAULT = RolloutLimits(vocab_size=50)  # the reader's defaults: 4096 rows, 32768 tokens, 1 GiB decoded

# Parses one file in a fresh interpreter: warm up on an honest file, then measure the bomb alone.
CHILD = r"""
import json, sys
from intellect.rl.rollouts import RolloutLimits, RolloutRejected, read_submission
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
limits = RolloutLimits.model_validate_json(sys.argv[3])
read_submission(open(sys.argv[1], "rb").read(), limits)
data = open(sys.argv[2], "rb").read()
before = hwm()
try:
    rows = read_submission(data, limits)
    reason = "accepted:%d" % len(rows)
except RolloutRejected as e:
    reason = e.reason
print(json.dumps({"reason": reason, "growth": hwm() - before}))
"""


def parse_in_child(tmp_path: Path, data: bytes, limits: RolloutLimits) -> tuple[str, int]:
    honest, bomb = tmp_path / "honest.parquet", tmp_path / "bomb.parquet"
    honest.write_bytes(encode_submission(make_rows()))
    bomb.write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(honest), str(bomb), limits.model_dump_json()],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["reason"], got["growth"]


def to_bytes(table: pa.Table, **kwargs) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", **kwargs)
    return buf.getvalue()


def with_column(table: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), arr)


# ------------------------------------------------------------------ a typed thrift compact codec, to forge footers


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zz(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def t_decode(buf: bytes, pos: int = 0):
    """A struct as ``[(field id, type, value)]`` (lists as ``(element type, [values])``), and the end."""
    fields, fid = [], 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        fid = fid + (head >> 4)
        value, pos = _t_value(buf, pos, head & 0x0F)
        fields.append((fid, head & 0x0F, value))


def _t_varint(buf, pos):
    shift = out = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return out, pos


def _t_value(buf, pos, ctype):
    if ctype in (1, 2):
        return ctype == 1, pos
    if ctype == 3:
        return buf[pos], pos + 1
    if ctype in (4, 5, 6):
        n, pos = _t_varint(buf, pos)
        return (n >> 1) ^ -(n & 1), pos
    if ctype == 7:
        return buf[pos:pos + 8], pos + 8
    if ctype == 8:
        n, pos = _t_varint(buf, pos)
        return buf[pos:pos + n], pos + n
    if ctype == 9:
        head = buf[pos]
        pos += 1
        size, etype = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _t_varint(buf, pos)
        items = []
        for _ in range(size):
            if etype in (1, 2):
                items.append(buf[pos] == 1)
                pos += 1
            else:
                item, pos = _t_value(buf, pos, etype)
                items.append(item)
        return (etype, items), pos
    if ctype == 12:
        return t_decode(buf, pos)
    raise ValueError(f"type {ctype} not needed by these tests")


def t_encode(fields) -> bytes:
    out, last = bytearray(), 0
    for fid, ctype, value in fields:
        assert 0 < fid - last <= 15
        out.append((fid - last) << 4 | ctype)
        last = fid
        out += _t_encode_value(ctype, value)
    return bytes(out + b"\0")


def _t_encode_value(ctype, value) -> bytes:
    if ctype in (1, 2):
        return b""
    if ctype == 3:
        return bytes([value])
    if ctype in (4, 5, 6):
        return _zz(value)
    if ctype == 7:
        return bytes(value)
    if ctype == 8:
        return _varint(len(value)) + bytes(value)
    if ctype == 9:
        etype, items = value
        head = bytes([len(items) << 4 | etype]) if len(items) < 15 else bytes([0xF0 | etype]) + _varint(len(items))
        body = b"".join(bytes([1 if v else 2]) if etype in (1, 2) else _t_encode_value(etype, v) for v in items)
        return head + body
    if ctype == 12:
        return t_encode(value)
    raise ValueError(ctype)


def _set(fields, fid, value):
    return [(f, t, value if f == fid else v) for f, t, v in fields]


def _get(fields, fid):
    return next(v for f, _, v in fields if f == fid)


def forge_footer(data: bytes, edit) -> bytes:
    """``data`` with its footer decoded, passed through ``edit`` and re-encoded."""
    n = int.from_bytes(data[-8:-4], "little")
    footer, _ = t_decode(data[-8 - n:-8])
    new = t_encode(edit(footer))
    return data[:-8 - n] + new + struct.pack("<I", len(new)) + b"PAR1"


def understate(column: str, values: int, size: int):
    """A footer edit: ``column`` claims ``values`` values and ``size`` uncompressed bytes in every row group."""
    def edit(footer):
        groups = []
        for group in _get(footer, 4)[1]:
            chunks = []
            for chunk in _get(group, 1)[1]:
                meta = _get(chunk, 3)
                if b".".join(_get(meta, 3)[1]).decode().split(".")[0] == column:
                    meta = _set(_set(meta, 5, values), 6, size)
                    chunk = _set(chunk, 3, meta)
                chunks.append(chunk)
            groups.append(_set(_set(group, 1, (12, chunks)), 2, 1024))
        return _set(footer, 4, (12, groups))
    return edit


def bad_histograms(footer):
    """A footer edit: every column's size statistics carry a definition-level histogram one bucket too long."""
    groups = []
    for group in _get(footer, 4)[1]:
        chunks = []
        for chunk in _get(group, 1)[1]:
            meta = [f for f in _get(chunk, 3) if f[0] != 16]
            meta = sorted(meta + [(16, 12, [(3, 9, (6, [4, 0, 0]))])], key=lambda f: f[0])
            chunks.append(_set(chunk, 3, meta))
        groups.append(_set(group, 1, (12, chunks)))
    return _set(footer, 4, (12, groups))


def test_the_forging_codec_round_trips():
    data = encode_submission(make_rows())
    assert forge_footer(data, lambda f: f) == data
    assert read_submission(forge_footer(data, lambda f: f), LIMITS) == make_rows()


# ------------------------------------------------------------------ the bombs


def base16() -> pa.Table:
    """16 valid rows (under both limits below), for bombs to replace one column of."""
    return rows_to_table([replace(r, reward=0.5, output_tokens=(4, 5)) for r in make_rows(16)])


def long_lists(per_row: int = 2 << 20) -> bytes:
    """16 rows of ``per_row`` zero tokens each: a few KiB on disk, 128 MiB as int32."""
    offsets = pa.array(np.arange(17, dtype=np.int32) * per_row)
    tokens = pa.ListArray.from_arrays(offsets, np.zeros(16 * per_row, "i4"))
    return to_bytes(with_column(base16(), "output_tokens", tokens), use_dictionary=False)  # quicker to write


def dictionary_page(column: str = "proof", size: int = 32 << 20) -> bytes:
    """Every row points at one dictionary entry of ``size`` zero bytes: tiny on disk, 16 x ``size`` decoded."""
    table = base16()
    # 16 values over one zeroed buffer: the writer folds them into a single dictionary entry
    offsets, data = np.arange(17, dtype=np.int32) * size, np.zeros(16 * size, np.uint8)
    if column != "proof":
        data += ord("a")
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    values = pa.Array.from_buffers(table.schema.field(column).type, 16, buffers)
    return to_bytes(with_column(table, column, values))


def delta_prefixes(rows: int = 512, size: int = 1 << 20) -> bytes:
    """DELTA_BYTE_ARRAY proofs: one ``size``-byte value, then ``rows - 1`` that repeat it as a prefix."""
    table = rows_to_table(make_rows(rows))
    buffers = [None, pa.py_buffer(np.arange(rows + 1, dtype=np.int32) * size), pa.py_buffer(np.zeros(rows * size, "u1"))]
    table = with_column(table, "proof", pa.Array.from_buffers(pa.binary(), rows, buffers))
    return to_bytes(table, use_dictionary=False, column_encoding={"proof": "DELTA_BYTE_ARRAY"})


def many_row_groups(groups: int = 3000) -> bytes:
    table = rows_to_table(make_rows())
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, table.schema) as w:
        w.write_table(table)
        for _ in range(groups):
            w.write_table(table.slice(0, 0))
    return buf.getvalue()


def deep_nesting(depth: int = 64) -> bytes:
    table = rows_to_table(make_rows())
    arr = pa.array([0, 1, 2, 3], type=pa.int32())
    for _ in range(depth):
        arr = pa.ListArray.from_arrays(pa.array(np.arange(len(arr) + 1, dtype=np.int32)), arr)
    return to_bytes(table.append_column("nest", arr.slice(0, 1).take([0, 0, 0, 0])))


def wide_schema(columns: int = 20000) -> bytes:
    table = rows_to_table(make_rows())
    extra = pa.array([1] * 4, pa.int8())
    return to_bytes(pa.Table.from_arrays(table.columns + [extra] * columns,
                                         names=table.column_names + [f"c{i}" for i in range(columns)]))


def huge_footer() -> bytes:
    table = rows_to_table(make_rows())
    meta = {**table.schema.metadata, b"junk": b"x" * (8 << 20)}
    return to_bytes(table.replace_schema_metadata(meta))


BOMBS = {
    "long-lists": (lambda: long_lists(), DEFAULT),
    "long-lists-tight-limits": (lambda: long_lists(1 << 16), LIMITS),
    "dictionary-page-binary": (lambda: dictionary_page("proof"), DEFAULT),
    "dictionary-page-string": (lambda: dictionary_page("prompt_id", 8 << 20), DEFAULT),
    "footer-lies-about-values": (lambda: forge_footer(long_lists(), understate("output_tokens", 160, 400)), DEFAULT),
    "footer-lies-about-size": (
        lambda: forge_footer(dictionary_page("proof"), understate("proof", 16, 600)), DEFAULT),
    "delta-prefixes": (delta_prefixes, DEFAULT),
    "many-row-groups": (many_row_groups, LIMITS),
    "deep-nesting": (deep_nesting, DEFAULT),
    "wide-schema": (wide_schema, DEFAULT),
    "huge-footer": (huge_footer, DEFAULT),
    # pyarrow's metadata accessors abort the whole process on this one (an uncaught C++ exception)
    "bad-size-statistics": (lambda: forge_footer(encode_submission(make_rows()), bad_histograms), LIMITS),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BOMBS))
def test_bomb_is_rejected_within_a_memory_bound(tmp_path, name):
    build, limits = BOMBS[name]
    data = build()
    assert len(data) < limits.max_file_bytes
    reason, growth = parse_in_child(tmp_path, data, limits)
    assert reason in REASONS, reason
    assert growth < MAX_GROWTH, f"{name}: peak RSS grew by {growth / 2**20:.1f} MiB"
    with pytest.raises(RolloutRejected) as e:  # the same verdict in this process
        read_submission(data, limits)
    assert e.value.reason == reason


def test_a_bomb_names_what_it_exceeds():
    with pytest.raises(RolloutRejected, match="too_large: output_tokens.* values in 16 rows"):
        read_submission(long_lists(1 << 16), DEFAULT)
    with pytest.raises(RolloutRejected, match="too_large: proof: pages decompress to"):
        read_submission(dictionary_page("proof", 32 << 20), DEFAULT)
    # a dictionary within the file's total but with values over the per-row bound: caught before it expands
    with pytest.raises(RolloutRejected, match=r"range: proof bytes spans \[4194304"):
        read_submission(dictionary_page("proof", 4 << 20), DEFAULT)
    with pytest.raises(RolloutRejected, match="unreadable: output_tokens.*pages hold .* the footer says 160"):
        read_submission(forge_footer(long_lists(1 << 16), understate("output_tokens", 160, 400)), DEFAULT)
    with pytest.raises(RolloutRejected, match="too_large: .*row groups"):
        read_submission(many_row_groups(20), LIMITS)
    with pytest.raises(RolloutRejected, match="unreadable: proof: page encoding 7 is not accepted"):
        read_submission(delta_prefixes(4, 1 << 10), DEFAULT)


def test_an_oversized_footer_is_refused_before_it_is_parsed():
    with pytest.raises(RolloutRejected, match="too_large: footer of"):
        read_submission(huge_footer(), DEFAULT)


def test_honest_files_load_unchanged_and_cheaply(tmp_path):
    rows = [replace(r, reward=0.5, output_tokens=tuple(range(1, 13)), proof=bytes(range(256)) * 2)
            for r in make_rows(16)]
    data = encode_submission(rows)
    reason, growth = parse_in_child(tmp_path, data, LIMITS)
    assert reason == "accepted:16" and growth < MAX_GROWTH
    assert read_submission(data, LIMITS) == rows


def test_expansion_past_the_decoded_bound_stops_at_that_batch():
    # honest within per-row limits, but over a small total: caught from the dictionary before it expands
    rows = [replace(r, proof=b"\0" * 500) for r in make_rows(16)]
    with pytest.raises(RolloutRejected, match="too_large"):
        read_submission(encode_submission(rows), LIMITS.model_copy(update={"max_decoded_bytes": 4096}))


# ------------------------------------------------------------------ the bounded read from storage


def test_load_reads_at_most_the_cap_and_checks_the_declared_digest(tmp_path):
    store = RunStorage(f"file://{tmp_path}/run")
    rel = write_submission(store, 3, "w1", 0, make_rows())
    data = store.read_bytes(rel)
    digest = hashlib.sha256(data).hexdigest()
    assert load_submission(store, rel, LIMITS, sha256=digest, size=len(data)) == make_rows()
    assert load_submission(store, rel, LIMITS, sha256=digest.upper()) == make_rows()
    for kwargs, reason in [
        ({"sha256": "0" * 64}, "sha256_mismatch"),
        ({"sha256": "not hex"}, "sha256_mismatch"),
        ({"sha256": "é" * 64}, "sha256_mismatch"),
        ({"size": len(data) - 1}, "size_mismatch"),
        ({"size": len(data) + 1}, "size_mismatch"),
    ]:
        with pytest.raises(RolloutRejected) as e:
            load_submission(store, rel, LIMITS, **kwargs)
        assert e.value.reason == reason, kwargs
    small = LIMITS.model_copy(update={"max_file_bytes": len(data) - 1})
    with pytest.raises(RolloutRejected, match="too_large"):
        load_submission(store, rel, small)


def test_an_object_that_grows_while_read_is_cut_at_the_cap(tmp_path, monkeypatch):
    # storage that cannot tell the size up front: the read itself stops one byte past the cap
    store = RunStorage(f"file://{tmp_path}/run")
    rel = write_submission(store, 3, "w1", 0, make_rows())
    store.write_bytes(rel, store.read_bytes(rel) + b"\0" * (1 << 20))
    monkeypatch.setattr(store, "local_path", lambda rel: None)
    monkeypatch.setattr(store.fs, "size", lambda path: None)
    reads = []
    real = store.fs.cat_file
    monkeypatch.setattr(store.fs, "cat_file", lambda *a, **k: reads.append(k) or real(*a, **k))
    limits = LIMITS.model_copy(update={"max_file_bytes": 64 << 10})
    with pytest.raises(RolloutRejected, match="too_large"):
        load_submission(store, rel, limits)
    assert reads == [{"start": 0, "end": (64 << 10) + 1}]


# ------------------------------------------------------------------ the page walker itself


def test_docstring_examples_hold():
    result = doctest.testmod(bounds_mod)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("blob", [b"", b"\x15", b"\x19\xf5", b"\x1c" * 20, b"\x18\xff\xff\xff\x0f", b"\x15\x80" * 8])
def test_malformed_thrift_is_a_layout_error(blob):
    with pytest.raises(LayoutError) as e:
        read_struct(blob)
    assert e.value.reason == "unreadable"
