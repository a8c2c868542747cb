"""Rollout rows and forged rollout files shared by the rollout tests (tests/unit/test_rollouts.py,
tests/unit/test_rollout_bombs.py, tests/integration/test_rollout_bomb_memory.py): honest rows, a typed
thrift compact codec that forges parquet footers, and ``BOMBS``, files built to exhaust a reader's memory.
"""

from __future__ import annotations

import io
import struct
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from intellect.rl.wire.rollouts import Rollout, RolloutLimits, encode_submission, rows_to_table

LIMITS = RolloutLimits(vocab_size=50, max_rows=16, max_prompt_tokens=8, max_output_tokens=12, max_proof_bytes=516)


def make_rows(n=4, step=3, worker="w1", k=0, policy_step=2):
    return [
        Rollout(run="run-a", step=step, policy_step=policy_step, worker=worker, submission=k, seed=100 + i,
                prompt_id=f"p{i // 2}", group_id=i // 2, prompt_tokens=(1, 2, 3), output_tokens=tuple(range(4, 5 + i)),
                finish_reason="stop" if i % 2 else "length", reward=1.0 - i, task_reward=1.0, length_penalty=float(i),
                advantage=0.5 * (-1) ** i, target_length=None if i == 0 else 10, proof=b"\x01" * (258 if i else 0))
        for i in range(n)
    ]

DEFAULT = RolloutLimits(vocab_size=50)  # the reader's defaults: 4096 rows, 32768 tokens, 256 MiB decoded


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
