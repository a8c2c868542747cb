"""Reading a text corpus as a stream of documents, in bounded memory, from local disk or S3.

``data.text.files`` entries become a sorted list of :class:`FileRef` (:func:`resolve_files`): a file, a
directory (searched recursively for ``suffixes``; hidden names skipped), a glob pattern, ``s3://BUCKET/KEY``,
``s3://BUCKET/PREFIX/`` (listed, filtered by ``suffixes``), or ``python:stdlib`` (the interpreter's own
standard library sources, a corpus every machine has). A file's *name* is machine-independent (the entry
as written, ``python:stdlib/...``, or the S3 URL): sharding, file order and the resume check hash names,
never where a machine happens to keep the files.

How a file is read, by suffix: ``.parquet`` one row group at a time, only the text column; ``.jsonl`` line
by line (a line longer than ``max_document_bytes`` is skipped unread, a line that is not a JSON object with
a string in the column is skipped; both are counted); anything else is one document, its first
``max_document_bytes`` bytes. Every document is cut at ``max_document_bytes`` bytes of UTF-8.

A position in the stream is a :class:`Cursor`; :meth:`CorpusReader.stream` starts at any cursor and yields
each document with the cursors before and after it, which is what makes exact resumption possible.
A file that cannot be parsed (not Parquet, no such column) is skipped with a warning and counted in
``bad_files``; I/O errors (a missing file, S3 down after its retries) propagate to the caller.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from intellect.config import StorageConfig, TextDataConfig
from intellect.progress import Progress
from intellect.storage import env_first

log = logging.getLogger(__name__)

STDLIB = "python:stdlib"
# Standard-library folders that are not hand-written Python: installed packages, bytecode, the codec
# tables of encodings/ (generated hex maps) and test-data folders (``data``, ``tokenizedata``,
# ``decimaltestdata``, ``pydoc_data``: deliberately broken files, fixtures, one generated string).
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "encodings"}
_PARQUET_BATCH = 1024  # rows turned into Python strings at a time, within one row group
_JSONL_BUFFER = 1 << 20  # bytes per read (one ranged GET on S3)
STORAGE_OPTION_KEYS = ("endpoint_url", "key", "secret", "region", "timeout", "retries")
STAT_KEYS = ("documents", "empty", "oversize_lines", "bad_json", "bad_rows", "bad_files", "row_groups")


class CorpusError(ValueError):
    """A text corpus that cannot be read as configured; the message is one line naming the field or file."""


class CorpusNotFound(CorpusError, FileNotFoundError):
    """A ``data.text.files`` entry that names nothing readable."""


class FileRef(NamedTuple):
    """One corpus file: ``name`` (machine-independent key) and ``location`` (path or s3:// URL)."""

    name: str
    location: str


@dataclass(frozen=True, order=True, slots=True)
class Cursor:
    """A position: row ``row`` (at byte ``offset`` for JSONL) of file ``file_pos`` of epoch ``epoch``'s order.

    >>> Cursor.from_json(Cursor(1, 2, 3, 40).to_json()) == Cursor(1, 2, 3, 40)
    True
    """

    epoch: int = 0
    file_pos: int = 0
    row: int = 0
    offset: int = 0

    def to_json(self) -> list[int]:
        return [self.epoch, self.file_pos, self.row, self.offset]

    @classmethod
    def from_json(cls, value: Any) -> Cursor:
        if not (isinstance(value, list) and len(value) == 4 and all(isinstance(v, int) and v >= 0 for v in value)):
            raise ValueError(f"a cursor is a list of four non-negative ints (got {value!r})")
        return cls(*value)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.file_pos, self.row)


def cut_utf8(data: bytes, limit: int) -> str:
    """The first ``limit`` bytes as text: a character cut in half is dropped, bad bytes become U+FFFD.

    >>> cut_utf8("héllo".encode(), 2), cut_utf8(b"ab\\xffc", 10)
    ('h', 'ab\ufffdc')
    """
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data[:limit], final=False)


def cut_text(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` bytes of UTF-8 (see :func:`cut_utf8`); lone surrogates (JSON allows them,
    UTF-8 does not) become U+FFFD.

    >>> cut_text("héllo", 3), cut_text("a\\ud800b", 100)
    ('hé', 'a?b')
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = text.encode("utf-8", errors="replace")
        text = data.decode("utf-8")
    return text if len(data) <= limit else cut_utf8(data, limit)


def storage_options(cfg: StorageConfig) -> dict[str, Any]:
    """The S3 options of a run's storage config, in the form :func:`resolve_files` takes."""
    return {"endpoint_url": cfg.endpoint_url, "key": cfg.key,
            "secret": cfg.secret.get_secret_value() if cfg.secret else None, "region": cfg.region}


def s3_client(options: dict[str, Any] | None = None):
    """A boto3 S3 client: ``options`` first, then the environment (as :mod:`intellect.storage`), with a
    connect/read timeout and bounded retries so a dead endpoint fails in bounded time."""
    import boto3  # noqa: PLC0415 - only S3 corpora pay for boto3
    from botocore.config import Config  # noqa: PLC0415 - same

    opts = dict(options or {})
    unknown = set(opts) - set(STORAGE_OPTION_KEYS)
    if unknown:
        raise ValueError(f"unknown storage_options {sorted(unknown)}; known: {', '.join(STORAGE_OPTION_KEYS)}")
    timeout, retries = float(opts.get("timeout") or 30.0), int(opts.get("retries") or 3)
    return boto3.client(
        "s3",
        endpoint_url=opts.get("endpoint_url") or env_first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        aws_access_key_id=opts.get("key") or env_first("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=opts.get("secret") or env_first("AWS_SECRET_ACCESS_KEY"),
        region_name=opts.get("region") or env_first("AWS_REGION", "AWS_DEFAULT_REGION"),
        config=Config(connect_timeout=timeout, read_timeout=timeout,
                      retries={"total_max_attempts": retries, "mode": "standard"}),
    )


def _split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise CorpusError(f"data.text.files entry {url!r} has no bucket")
    return bucket, key


class _S3Object(io.RawIOBase):
    """A seekable read-only view of one S3 object: each read is one ranged GET of exactly what is asked."""

    def __init__(self, client, url: str, size: int | None = None) -> None:
        super().__init__()
        self._client, (self._bucket, self._key) = client, _split_s3(url)
        self._size = client.head_object(Bucket=self._bucket, Key=self._key)["ContentLength"] if size is None else size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _get(self, n: int) -> bytes:
        n = min(n, self._size - self._pos)
        if n <= 0:
            return b""
        rng = f"bytes={self._pos}-{self._pos + n - 1}"
        data = self._client.get_object(Bucket=self._bucket, Key=self._key, Range=rng)["Body"].read()
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self._get(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._get(self._size - self._pos)


# --------------------------------------------------------------------- listing


def _suffix_ok(name: str, suffixes: list[str]) -> bool:
    return any(name.endswith(s) for s in suffixes)


def _walk(root: str, suffixes: list[str], skip: Callable[[str], bool]) -> list[str]:
    """Files under ``root`` with one of ``suffixes``, relative to it, sorted (hidden names skipped)."""
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not skip(d)]
        rel = os.path.relpath(here, root)
        out.extend(f if rel == "." else os.path.join(rel, f)
                   for f in files if not f.startswith(".") and _suffix_ok(f, suffixes))
    return sorted(out)


def _stdlib_skip(dirname: str) -> bool:
    return dirname in _STDLIB_SKIP or dirname.endswith("data")


def stdlib_files() -> list[FileRef]:
    """Every ``.py`` file of this interpreter's standard library (see ``_STDLIB_SKIP``), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    return [FileRef(f"{STDLIB}/{rel.replace(os.sep, '/')}", os.path.join(root, rel))
            for rel in _walk(root, [".py"], _stdlib_skip)]


def _s3_entry(entry: str, suffixes: list[str], client) -> list[tuple[FileRef, int]]:
    bucket, key = _split_s3(entry)
    if key and not key.endswith("/"):
        return [(FileRef(entry, entry), client.head_object(Bucket=bucket, Key=key)["ContentLength"])]
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        for obj in page.get("Contents", []):
            k = obj["Key"]
            if not k.endswith("/") and _suffix_ok(k, suffixes) and not os.path.basename(k).startswith("."):
                url = f"s3://{bucket}/{k}"
                out.append((FileRef(url, url), int(obj["Size"])))
    return out


def _local_entry(entry: str, suffixes: list[str]) -> list[FileRef]:
    if os.path.isdir(entry):
        return [FileRef(os.path.join(entry, rel), os.path.join(entry, rel))
                for rel in _walk(entry, suffixes, lambda _: False)]
    if os.path.isfile(entry):
        return [FileRef(entry, entry)]
    if glob.has_magic(entry):
        out = []
        for match in sorted(glob.glob(entry, recursive=True)):
            out.extend(_local_entry(match, suffixes) if os.path.isdir(match) else [FileRef(match, match)])
        return out
    raise CorpusNotFound(f"data.text.files entry {entry!r}: no such file or directory")


class Corpus:
    """The resolved files of ``data.text`` (listed once) and how to open them."""

    def __init__(self, text: TextDataConfig, storage_opts: dict[str, Any] | None = None) -> None:
        self.text, self._opts, self._client = text, storage_opts, None
        self._sizes: dict[str, int] = {}
        seen: dict[str, FileRef] = {}
        for entry in text.files:
            if entry == STDLIB:
                refs = stdlib_files()
            elif entry.startswith("s3://"):
                listed = _s3_entry(entry, text.suffixes, self.client)
                self._sizes.update({ref.location: size for ref, size in listed})
                refs = [ref for ref, _ in listed]
            else:
                refs = _local_entry(entry, text.suffixes)
            if not refs:
                raise CorpusNotFound(f"data.text.files entry {entry!r} holds no file with suffix "
                                     f"{', '.join(text.suffixes)} (data.text.suffixes)")
            for ref in refs:
                seen.setdefault(ref.name, ref)
        self.files = list(seen.values())
        self.digest = hashlib.sha256("\n".join(r.name for r in self.files).encode()).hexdigest()

    @property
    def client(self):
        if self._client is None:
            self._client = s3_client(self._opts)
        return self._client

    def open(self, ref: FileRef, offset: int = 0, buffered: bool = True):
        """``ref`` opened for binary reading at byte ``offset``."""
        if ref.location.startswith("s3://"):
            raw = _S3Object(self.client, ref.location, self._sizes.get(ref.location))
            raw.seek(offset)
            return io.BufferedReader(raw, buffer_size=_JSONL_BUFFER) if buffered else raw
        f = open(ref.location, "rb")  # the caller closes it
        f.seek(offset)
        return f

    def order(self, key: str) -> list[int]:
        """File indices sorted by a hash of ``key`` and each name: a permutation that depends on nothing else."""
        return sorted(range(len(self.files)),
                      key=lambda i: hashlib.sha256(f"{key}\0{self.files[i].name}".encode()).digest())


# --------------------------------------------------------------------- reading

Want = Callable[[FileRef, Cursor], bool]
Doc = tuple[Cursor, Cursor, str]


def new_stats() -> dict[str, int]:
    return dict.fromkeys(STAT_KEYS, 0)


class CorpusReader:
    """Documents of a :class:`Corpus` in the file order ``order_key(epoch)``, from any :class:`Cursor`.

    ``want(ref, cursor)`` picks documents by position before they are read (a shard, a resume set);
    ``keep(text)`` by content after (a split). Both count toward ``stats`` only when they pass.
    ``skip(cursor)``, asked first, passes a document over unjudged (a reader catching up to a position).
    A scan that reads for long before it yields enough (a held-out split) sets ``progress``: it is
    moved to each file's position in the epoch's order once the file is read.
    """

    def __init__(self, corpus: Corpus, order_key: Callable[[int], str]) -> None:
        self.corpus, self._order_key = corpus, order_key
        self._orders: dict[int, list[int]] = {}
        self.limit = corpus.text.max_document_bytes
        self.progress: Progress | None = None

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: self.corpus.order(self._order_key(epoch))}  # one epoch cached at a time
        return self._orders[epoch]

    def stream(self, start: Cursor, want: Want, keep: Callable[[str], bool] | None = None,
               epochs: int | None = None, stats: dict[str, int] | None = None,
               stop: Cursor | None = None, skip: Callable[[Cursor], bool] | None = None) -> Iterator[Doc]:
        """``(cursor at the document, cursor after it, text)`` for every document from ``start`` on; endless
        unless ``epochs`` is given, or ``stop`` (no file after ``stop``'s is opened). A whole epoch with no
        document raises ``CorpusError`` (nothing to read); one with a document that ``skip`` passed over is
        not a whole pass: the documents not judged might have been wanted."""
        stats = new_stats() if stats is None else stats
        for key in STAT_KEYS:
            stats.setdefault(key, 0)
        skipped = False

        def judge(ref: FileRef, at: Cursor) -> bool:
            nonlocal skipped
            if skip is not None and skip(at):
                skipped = True
                return False
            return want(ref, at)

        epoch, file_pos, row, offset = start.epoch, start.file_pos, start.row, start.offset
        while epochs is None or epoch < epochs:
            order, whole, found, skipped = self.order(epoch), file_pos == row == offset == 0, 0, False
            while file_pos < len(order):
                if stop is not None and (epoch, file_pos) > (stop.epoch, stop.file_pos):
                    return
                ref = self.corpus.files[order[file_pos]]
                at = Cursor(epoch, file_pos, row, offset)
                for doc in self._file(ref, at, judge, stats):
                    if not doc[2].strip():
                        stats["empty"] += 1
                    elif keep is None or keep(doc[2]):
                        stats["documents"] += 1
                        found += 1
                        yield doc
                if self.progress is not None:
                    self.progress.update(file_pos + 1, documents=stats["documents"])
                file_pos, row, offset = file_pos + 1, 0, 0
            if whole and not found and not skipped:
                raise CorpusError(self._nothing_found(len(order), stats))
            epoch, file_pos = epoch + 1, 0

    def _nothing_found(self, files: int, stats: dict[str, int]) -> str:
        column = self.corpus.text.column
        why = [f"{stats[k]} {what}" for k, what in (
            ("bad_rows", f"rows without a string {column!r} field (data.text.column)"),
            ("bad_json", "lines that are not JSON"), ("bad_files", "unreadable files"),
            ("oversize_lines", "lines over data.text.max_document_bytes"), ("empty", "empty documents")) if stats[k]]
        first = self.corpus.files[0].name if self.corpus.files else "-"
        return (f"data.text.files: a whole pass over its {files} files (first {first}) found no document for this "
                f"shard and split ({', '.join(why) or 'no rows'})")

    def _file(self, ref: FileRef, at: Cursor, want: Want, stats: dict[str, int]) -> Iterator[Doc]:
        if ref.name.endswith(".parquet"):
            yield from self._parquet(ref, at, want, stats)
        elif ref.name.endswith(".jsonl"):
            yield from self._jsonl(ref, at, want, stats)
        elif at.row == 0 and want(ref, at):
            with self.corpus.open(ref, buffered=False) as f:
                text = cut_utf8(f.read(self.limit), self.limit)
            yield at, Cursor(at.epoch, at.file_pos, 1, 0), text

    def _jsonl(self, ref: FileRef, at: Cursor, want: Want, stats: dict[str, int]) -> Iterator[Doc]:
        column, row, pos = self.corpus.text.column, at.row, at.offset
        with self.corpus.open(ref, pos) as f:
            while line := f.readline(self.limit + 1):
                here = Cursor(at.epoch, at.file_pos, row, pos)
                pos, row = pos + len(line), row + 1
                oversize = len(line) > self.limit and not line.endswith(b"\n")
                while oversize and (rest := f.readline(_JSONL_BUFFER)):  # skip the rest unparsed
                    pos += len(rest)
                    if rest.endswith(b"\n"):
                        break
                if not line.strip() or not want(ref, here):
                    continue
                if oversize:
                    stats["oversize_lines"] += 1
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:  # JSONDecodeError and UnicodeDecodeError
                    stats["bad_json"] += 1
                    continue
                text = obj.get(column) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    stats["bad_rows"] += 1
                    continue
                yield here, Cursor(at.epoch, at.file_pos, row, pos), cut_text(text, self.limit)

    def _parquet(self, ref: FileRef, at: Cursor, want: Want, stats: dict[str, int]) -> Iterator[Doc]:
        column = self.corpus.text.column
        s3 = ref.location.startswith("s3://")
        with self.corpus.open(ref, buffered=False) if s3 else contextlib.nullcontext(ref.location) as f:
            source: Any = f  # a path (pyarrow's own reader) or our seekable S3 object
            try:
                pf = pq.ParquetFile(source)
                field = pf.schema_arrow.field(column)
            except (pa.ArrowException, KeyError) as e:
                stats["bad_files"] += 1
                log.warning("skipping %s: not a Parquet file with a %r column (%s)", ref.name, column, e)
                return
            if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
                stats["bad_files"] += 1
                log.warning("skipping %s: column %r is %s, not a string", ref.name, column, field.type)
                return
            first = 0
            for group in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(group).num_rows
                rows = range(max(first, at.row), first + n)
                first += n
                wanted = [r for r in rows if want(ref, Cursor(at.epoch, at.file_pos, r, 0))]
                if not wanted:
                    continue  # a row group none of whose rows are ours is never read
                stats["row_groups"] += 1
                wanted_set, r = set(wanted), first - n
                for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=[column]):
                    for text in batch.column(0).to_pylist():
                        if r in wanted_set:
                            if isinstance(text, str):
                                yield (Cursor(at.epoch, at.file_pos, r, 0), Cursor(at.epoch, at.file_pos, r + 1, 0),
                                       cut_text(text, self.limit))
                            else:
                                stats["bad_rows"] += 1
                        r += 1


def corpus_stats(text: TextDataConfig, storage_opts: dict[str, Any] | None = None) -> dict[str, int]:
    """Files and bytes of a corpus on this machine (local files only; S3 objects count as listed)."""
    corpus = Corpus(text, storage_opts)
    local = [r.location for r in corpus.files if not r.location.startswith("s3://")]
    return {"files": len(corpus.files), "bytes": sum(os.path.getsize(p) for p in local) + sum(corpus._sizes.values())}


__all__ = ["STDLIB", "STAT_KEYS", "STORAGE_OPTION_KEYS", "Corpus", "CorpusError", "CorpusNotFound", "CorpusReader",
           "Cursor", "FileRef", "corpus_stats", "cut_text", "cut_utf8", "new_stats", "s3_client", "stdlib_files",
           "storage_options"]
