"""An untrusted Parquet file read with a byte cap, and its layout checked without decoding a page.

A Parquet footer is the writer's claim; the page headers are what a reader acts on (it allocates
each page's ``uncompressed_page_size`` and decodes its ``num_values``). :func:`chunk_layouts` walks
every page header of every column chunk and checks that the pages tile the chunk's byte range
exactly, that their value counts add up to the footer's ``num_values`` and their sizes (headers
included) to its ``total_uncompressed_size``. A footer that lies about sizes therefore fails here,
and the verified figures bound what decoding can allocate before anything is decompressed.
Only the value encodings pyarrow writes by default are accepted (:data:`ACCEPTED_ENCODINGS`).

Pages are parsed with a minimal reader of Thrift's compact protocol (the encoding of Parquet
metadata): bounded in bytes read, nesting depth and number of pages, and any malformed input is a
:class:`LayoutError`, never another exception.

>>> import io, pyarrow as pa, pyarrow.parquet as pq
>>> buf = io.BytesIO(); pq.write_table(pa.table({"x": [1, 2, 3]}), buf)
>>> data = buf.getvalue()
>>> [(c.path, c.rows, c.num_values, c.pages) for c in chunk_layouts(data)]
[('x', 3, 3, 2)]
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, NamedTuple, Sequence, TypeVar

if TYPE_CHECKING:
    from intellect.storage import RunStorage

__all__ = [
    "ChunkLayout", "ColumnBound", "LayoutError", "check_bounds", "chunk_layouts", "footer_length", "read_capped",
    "read_local", "read_struct",
]

_T = TypeVar("_T")
MAGIC = b"PAR1"
#: Largest page header read; a writer's headers hold sizes, counts and at most small statistics.
MAX_PAGE_HEADER_BYTES = 64 << 10
MAX_DEPTH = 8  # a page header's nesting
FOOTER_DEPTH = 24  # a footer's: row groups, column chunks, their metadata, statistics and their lists

# page types (parquet.thrift PageType)
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
#: Value encodings accepted (PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY: what pyarrow writes by
#: default). The delta encodings are refused: DELTA_BYTE_ARRAY rebuilds each value from a prefix of
#: the one before, so a page of empty suffixes decodes to values x length bytes.
ACCEPTED_ENCODINGS = frozenset({0, 2, 3, 8})


LayoutReason = Literal["unreadable", "too_large", "size_mismatch"]


class LayoutError(ValueError):
    """The file is off; ``reason`` is ``unreadable``, ``too_large`` or ``size_mismatch``."""

    def __init__(self, reason: LayoutReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: LayoutReason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """One column chunk as its page headers describe it (sizes in bytes, page headers excluded)."""

    path: str  # the column's path in the schema, e.g. ``prompt_tokens.list.element``
    row_group: int
    rows: int  # the row group's row count (footer)
    num_values: int  # values and level slots of its data pages
    uncompressed: int  # sum of the pages' uncompressed sizes
    largest_page: int
    dictionary_bytes: int  # uncompressed size of its dictionary page, 0 without one
    pages: int
    header_bytes: int


# ------------------------------------------------------------------ thrift compact protocol


class _Reader:
    __slots__ = ("buf", "pos", "end", "max_depth")

    def __init__(self, buf: memoryview, pos: int, end: int, max_depth: int) -> None:
        self.buf, self.pos, self.end, self.max_depth = buf, pos, end, max_depth

    def byte(self) -> int:
        if self.pos >= self.end:
            raise LayoutError("unreadable", "thrift struct runs past its bound")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = out = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise LayoutError("unreadable", "thrift varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise LayoutError("unreadable", "thrift field runs past its bound")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def value(self, ctype: int, depth: int):
        if ctype in (1, 2):  # booleans: the type is the value inside structs
            return ctype == 1
        if ctype == 3:
            return struct.unpack("b", self.skip(1))[0]
        if ctype in (4, 5, 6):
            return self.zigzag()
        if ctype == 7:
            return struct.unpack("<d", self.skip(8))[0]
        if ctype == 8:
            return bytes(self.skip(self.varint()))
        if depth >= self.max_depth:
            raise LayoutError("unreadable", f"thrift nesting deeper than {self.max_depth}")
        if ctype in (9, 10):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > self.end - self.pos:  # every element takes at least one byte
                raise LayoutError("unreadable", "thrift list longer than its bytes")
            if etype in (1, 2):
                return [self.byte() == 1 for _ in range(size)]
            return [self.value(etype, depth + 1) for _ in range(size)]
        if ctype == 11:
            size = self.varint()
            if not size:
                return {}
            if 2 * size > self.end - self.pos:
                raise LayoutError("unreadable", "thrift map longer than its bytes")
            kv = self.byte()
            return {_key(self.value(kv >> 4, depth + 1)): self.value(kv & 0x0F, depth + 1) for _ in range(size)}
        if ctype == 12:
            return self.struct(depth + 1)
        raise LayoutError("unreadable", f"unknown thrift type {ctype}")

    def struct(self, depth: int = 0) -> dict[int, object]:
        out: dict[int, object] = {}
        fid = 0
        while True:
            head = self.byte()
            if head == 0:
                return out
            delta, ctype = head >> 4, head & 0x0F
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(ctype, depth)


def _key(k):
    return tuple(k) if isinstance(k, list) else k


def read_struct(
    data: bytes | memoryview, pos: int = 0, end: int | None = None, *, max_depth: int = MAX_DEPTH
) -> tuple[dict[int, object], int]:
    """One compact-protocol struct at ``pos`` as ``{field id: value}``, and the position after it.

    >>> read_struct(bytes([0x15, 0x04, 0x18, 0x02, 0x68, 0x69, 0x00]))  # i32 field 1 = 2, binary field 2 = b"hi"
    ({1: 2, 2: b'hi'}, 7)
    """
    buf = memoryview(data)
    r = _Reader(buf, pos, len(buf) if end is None else min(end, len(buf)), max_depth)
    return r.struct(), r.pos


# ------------------------------------------------------------------ files


def footer_length(data: bytes | memoryview) -> int:
    """The declared length of the file's footer (``LayoutError`` without Parquet magic at both ends)."""
    if len(data) < 12 or bytes(data[:4]) != MAGIC or bytes(data[-4:]) != MAGIC:
        raise LayoutError("unreadable", "no Parquet magic at the start and end")
    n = int.from_bytes(data[-8:-4], "little")
    if n > len(data) - 12:
        raise LayoutError("unreadable", f"footer of {n} bytes does not fit in a {len(data)}-byte file")
    return n


def _int(header: dict, fid: int, what: str) -> int:
    v = header.get(fid)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise LayoutError("unreadable", f"page header without a valid {what}")
    return v


def chunk_layouts(data: bytes | memoryview, *, max_pages: int = 1 << 16) -> list[ChunkLayout]:
    """Every column chunk of every row group of the file, verified against its page headers.

    The footer is parsed here too, not through pyarrow's accessors (some of those abort the
    process on malformed metadata). ``LayoutError`` when the page headers disagree with the
    footer, a chunk lies outside the file or in another one, a column has two dictionary pages,
    or there are more than ``max_pages`` pages in all.
    """
    buf = memoryview(data)
    n = footer_length(buf)
    footer, _ = read_struct(buf, len(buf) - 8 - n, len(buf) - 8, max_depth=FOOTER_DEPTH)
    size = len(buf) - 8 - n  # pages live between the leading magic and the footer
    out: list[ChunkLayout] = []
    pages_left = max_pages
    for g, group in enumerate(_list(footer, 4, dict, "row groups")):
        rows = _field(group, 3, int, "row count")
        for chunk in _list(group, 1, dict, "columns"):
            cc = chunk.get(3)
            if not isinstance(cc, dict) or 1 in chunk:
                raise LayoutError("unreadable", "a column chunk without inline metadata (encrypted or in another file)")
            path = ".".join(p.decode("utf-8", "replace") for p in _list(cc, 3, bytes, "column path"))[:200]
            values, raw_size = _field(cc, 5, int, "value count"), _field(cc, 6, int, "uncompressed size")
            packed_size, start = _field(cc, 7, int, "compressed size"), _field(cc, 9, int, "data page offset")
            if values == 0:  # a reader reads no page of a chunk without values
                out.append(ChunkLayout(path, g, rows, 0, 0, 0, 0, 0, 0))
                continue
            dictionary_at = cc.get(11)
            if isinstance(dictionary_at, int) and 0 < dictionary_at < start:
                start = dictionary_at  # as the reader computes a chunk's range
            end = start + packed_size
            if start < 4 or packed_size <= 0 or end > size:
                raise LayoutError("unreadable", f"column chunk {path} of row group {g} is outside the file")
            layout = _walk(buf, start, end, path, g, rows, pages_left)
            pages_left -= layout.pages
            if layout.num_values != values:
                raise LayoutError("unreadable", f"{path}: pages hold {layout.num_values} values, "
                                                f"the footer says {values}")
            real = layout.uncompressed + layout.header_bytes
            if real != raw_size:
                raise LayoutError("too_large" if real > raw_size else "unreadable",
                                  f"{path}: pages decompress to {real} bytes, the footer says {raw_size}")
            out.append(layout)
    return out


def _field(struct_: dict, fid: int, kind: type[_T], what: str) -> _T:
    v = struct_.get(fid)
    if type(v) is not kind or (isinstance(v, int) and v < 0):
        raise LayoutError("unreadable", f"footer without a valid {what}")
    return v


def _list(struct_: dict, fid: int, kind: type, what: str) -> list:
    v = struct_.get(fid, [])
    if type(v) is not list or not all(type(i) is kind for i in v):
        raise LayoutError("unreadable", f"footer without a valid list of {what}")
    return v


def _walk(buf: memoryview, pos: int, end: int, path: str, group: int, rows: int, pages_left: int) -> ChunkLayout:
    values = uncompressed = largest = dictionary = pages = header_bytes = 0
    while pos < end:
        if pages >= pages_left:
            raise LayoutError("too_large", "too many pages")
        header, body = read_struct(buf, pos, min(end, pos + MAX_PAGE_HEADER_BYTES))
        kind = _int(header, 1, "type")
        raw, packed = _int(header, 2, "uncompressed size"), _int(header, 3, "compressed size")
        header_bytes += body - pos
        pos = body + packed
        if pos > end:
            raise LayoutError("unreadable", f"{path}: a page runs past its column chunk")
        if kind in (DATA_PAGE, DATA_PAGE_V2, DICTIONARY_PAGE):
            sub = header.get({DATA_PAGE: 5, DATA_PAGE_V2: 8, DICTIONARY_PAGE: 7}[kind])
            if not isinstance(sub, dict):
                raise LayoutError("unreadable", f"{path}: page without its type's header")
            encoding = sub.get(4 if kind == DATA_PAGE_V2 else 2)
            if encoding not in ACCEPTED_ENCODINGS:
                raise LayoutError("unreadable", f"{path}: page encoding {encoding!r} is not accepted")
        if kind in (DATA_PAGE, DATA_PAGE_V2):
            values += _int(sub, 1, "value count")
        elif kind == DICTIONARY_PAGE:
            if pages:
                raise LayoutError("unreadable", f"{path}: a dictionary page that is not the first page")
            dictionary = raw
        elif kind != INDEX_PAGE:
            raise LayoutError("unreadable", f"{path}: unknown page type {kind}")
        uncompressed += raw
        largest = max(largest, raw)
        pages += 1
    return ChunkLayout(path, group, rows, values, uncompressed, largest, dictionary, pages, header_bytes)


class ColumnBound(NamedTuple):
    """What one top-level column may hold per row: at most ``values`` values of ``value_bytes`` each."""

    values: int  # 1 for a flat column
    value_bytes: int
    repeated: bool  # a list column (one value slot per element, at least one per row)


def check_bounds(layouts: Sequence[ChunkLayout], bounds: Mapping[str, ColumnBound], *, max_bytes: int) -> int:
    """Check verified chunk layouts against per-row bounds; returns a bound on the bytes decoding takes.

    Flat columns must hold exactly one value per row. A chunk may decompress to at most its values'
    bound (a dictionary holds distinct values, fallback pages the others: together no more than the
    values themselves), plus five bytes a value for dictionary indices and levels, plus page overhead.

    >>> c = ChunkLayout("t.list.element", 0, rows=2, num_values=9, uncompressed=40, largest_page=40,
    ...                 dictionary_bytes=0, pages=1, header_bytes=20)
    >>> try:
    ...     check_bounds([c], {"t": ColumnBound(4, 4, True)}, max_bytes=1 << 20)
    ... except LayoutError as e:
    ...     print(e)
    too_large: t.list.element: 9 values in 2 rows, at most 8 allowed
    """
    total = 0
    for c in layouts:
        name = c.path.split(".", 1)[0]
        if name not in bounds:
            raise LayoutError("unreadable", f"unexpected column {c.path[:80]!r}")
        b = bounds[name]
        most = c.rows * b.values
        if c.num_values < c.rows or (not b.repeated and c.num_values != c.rows):
            raise LayoutError("unreadable", f"{c.path}: {c.num_values} values in {c.rows} rows")
        if c.num_values > most:
            raise LayoutError("too_large", f"{c.path}: {c.num_values} values in {c.rows} rows, at most {most} allowed")
        cap = most * (b.value_bytes + 4) + 5 * c.num_values + 64 * c.pages + 4096
        if c.uncompressed > cap:
            raise LayoutError("too_large", f"{c.path}: pages decompress to {c.uncompressed} bytes for {c.rows} "
                                           f"rows, at most {cap} allowed")
        # decompressed pages, plus the decoded arrays: values (or dictionary indices) and levels
        total += c.uncompressed + c.num_values * (min(b.value_bytes, 8) + 4)
    if total > max_bytes:
        raise LayoutError("too_large", f"decoding would take about {total} bytes, at most {max_bytes} allowed")
    return total


# ------------------------------------------------------------------ reading with a byte cap


def read_capped(storage: RunStorage, rel: str, cap: int, *, size: int | None = None) -> bytes:
    """The bytes of ``rel`` in run storage, reading at most ``cap + 1`` of them.

    ``LayoutError``: ``too_large`` past ``cap`` (before reading when storage reports the size),
    ``size_mismatch`` when ``size`` is given and the object has another, ``unreadable`` if absent.
    """
    local = storage.local_path(rel)
    if local is not None:
        return read_local(local, cap, size=size)
    uri = storage.uri(rel)
    try:
        _check_stored_size(storage.fs.size(uri), cap, size)
        data = storage.fs.cat_file(uri, start=0, end=(cap if size is None else min(cap, size)) + 1)
    except OSError as e:
        raise LayoutError("unreadable", f"{type(e).__name__}: {e}") from None
    if not isinstance(data, bytes):
        raise LayoutError("unreadable", f"storage returned {type(data).__name__}, not bytes")
    return _check_read(data, cap, size)


def read_local(path: str | os.PathLike, cap: int, *, size: int | None = None) -> bytes:
    """:func:`read_capped` for a local file (its size is taken from the open descriptor)."""
    try:
        with open(path, "rb") as f:
            _check_stored_size(os.fstat(f.fileno()).st_size, cap, size)
            data = f.read((cap if size is None else min(cap, size)) + 1)
    except OSError as e:
        raise LayoutError("unreadable", f"{type(e).__name__}: {e}") from None
    return _check_read(data, cap, size)


def _check_stored_size(stored: int | None, cap: int, size: int | None) -> None:
    if stored is None:
        return
    if stored > cap:
        raise LayoutError("too_large", f"{stored} bytes stored, at most {cap} allowed")
    if size is not None and stored != size:
        raise LayoutError("size_mismatch", f"{stored} bytes stored, {size} declared")


def _check_read(data: bytes, cap: int, size: int | None) -> bytes:
    if len(data) > cap:
        raise LayoutError("too_large", f"over {cap} bytes")
    if size is not None and len(data) != size:
        raise LayoutError("size_mismatch", f"{len(data)} bytes read, {size} declared")
    return data
