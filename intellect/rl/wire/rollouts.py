"""Rollout files: one Parquet file per worker submission, the contract between inference and training.

A submission is written atomically to ``rollouts/step_{n}/{worker}-{k}.parquet`` in run storage
(:func:`submission_path`), where ``worker`` is the canonical worker id
(:func:`~intellect.ids.canonical_worker`) and ``k`` counts that worker's submissions for
step ``n``. The rows' columns and bounds are :mod:`intellect.rl.wire.rollout_schema`'s.

Files come from untrusted workers, so :func:`read_submission` never trusts one: it rejects
anything off-contract with :class:`RolloutRejected`, whose ``reason`` is one of :data:`REASONS`,
and never lets a parser error escape. Reading is bounded end to end (:class:`RolloutLimits`):
at most ``max_file_bytes + 1`` bytes are read; the footer and every page header are checked
(:func:`check_layout`) before a page is decompressed, so a file whose rows, values or
decompressed sizes exceed the limits, or whose footer disagrees with its pages, costs no
decoding; string columns decode as dictionaries whose expanded size is checked before they
expand; and decoding stops at the first batch past ``max_decoded_bytes``.

What a read file holds is its decoded columns: decoding runs in batches of about
:data:`BATCH_BYTES`, and a read row's token ids are a :class:`~intellect.rl.wire.rollout_schema.Tokens`
view of the decoded ``int32`` column, never a Python object per token. Reading one file therefore
grows memory by at most the layout's estimate (at most ``max_decoded_bytes``; the
:class:`RolloutLimits` docstring states what that is of the validator's memory).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from typing import TYPE_CHECKING, NoReturn, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from intellect.ids import canonical_worker
from intellect.rl.wire.lag import PolicyLag, is_fresh
from intellect.rl.wire.parquet_bounds import (
    ColumnBound, LayoutError, check_bounds, chunk_layouts, footer_length, read_capped, read_local,
)
from intellect.rl.wire.rollout_schema import (
    FINISH_REASONS, MAX_ID_CHARS, REASONS, SCHEMA, SCHEMA_VERSION, VERSION_KEY, Reason, Rollout, RolloutLimits,
    RolloutRejected, Tokens, content_hash, rows_to_table, table_to_rows,
)
from intellect.storage import parse_step, step_name

if TYPE_CHECKING:
    from intellect.storage import RunStorage

# the row model is imported from here by most callers; its home is intellect.rl.wire.rollout_schema
__all__ = [
    "BATCH_BYTES", "BATCH_ROWS", "FINISH_REASONS", "KIND", "MAX_FOOTER_BYTES", "MAX_ID_CHARS", "REASONS", "SCHEMA",
    "SCHEMA_VERSION", "VERSION_KEY", "Reason", "Rollout", "RolloutLimits", "RolloutRejected", "Tokens",
    "check_layout", "content_hash", "encode_submission", "list_submissions", "load_submission",
    "parse_submission_path", "read_submission", "read_submission_table", "rows_to_table", "submission_path",
    "table_to_rows", "validate_table", "write_submission",
]

KIND = "rollouts"

#: Largest footer read (an honest one holds a few KiB per row group).
MAX_FOOTER_BYTES = 1 << 20
#: Most rows, and about the most bytes (by the layout's estimate), decoded in one batch.
BATCH_ROWS, BATCH_BYTES = 1024, 16 << 20
# read dictionary-encoded, so that their expanded size is known before they expand
_STRING_COLUMNS = [f.name for f in SCHEMA if pa.types.is_string(f.type) or pa.types.is_binary(f.type)]

_NAME_RE = re.compile(r"(?P<worker>[a-z0-9][a-z0-9._-]{0,127})-(?P<k>0|[1-9][0-9]{0,17})\.parquet")
_RUN_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


# --------------------------------------------------------------------- paths


def submission_path(step: int, worker: str, k: int) -> str:
    """``rollouts/step_{step}/{worker}-{k}.parquet`` with the canonical worker id."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 10**18:
        raise ValueError(f"submission index must be an int in [0, 1e18), got {k!r}")
    return f"{KIND}/{step_name(step)}/{canonical_worker(worker)}-{k}.parquet"


def parse_submission_path(rel: str) -> tuple[int, str, int]:
    """``(step, worker, k)`` of a path made by :func:`submission_path`; ``ValueError`` otherwise."""
    parts = rel.split("/")
    step = parse_step(parts[1]) if len(parts) == 3 and parts[0] == KIND else None
    name = _NAME_RE.fullmatch(parts[2]) if step is not None else None
    if step is None or name is None:
        raise ValueError(f"{rel!r} is not a rollout file path ({KIND}/step_N/WORKER-K.parquet)")
    return step, name["worker"], int(name["k"])


def list_submissions(storage: RunStorage, step: int) -> list[str]:
    """Relative paths of the well-named submission files of ``step``, sorted (others are ignored)."""
    folder = storage.step_path(step, KIND)
    return [f"{folder}/{n}" for n in storage.listdir(folder) if _NAME_RE.fullmatch(n)]


# --------------------------------------------------------------------- validation


def _reject(reason: Reason, detail: str) -> NoReturn:
    raise RolloutRejected(reason, detail)


def _check_schema(schema: pa.Schema) -> None:
    version = (schema.metadata or {}).get(VERSION_KEY)
    if version is None:
        _reject("version", f"no {VERSION_KEY.decode()} in the schema metadata")
    if version != str(SCHEMA_VERSION).encode():
        _reject("version", f"schema version {version[:32]!r}, this reader knows {SCHEMA_VERSION}")
    names = schema.names
    if len(set(names)) != len(names):
        _reject("schema", "duplicate column names")
    missing, extra = set(SCHEMA.names) - set(names), set(names) - set(SCHEMA.names)
    if missing or extra:
        _reject("schema", f"missing columns {sorted(missing)}, unexpected columns {sorted(extra)[:8]}")
    for want in SCHEMA:
        got = schema.field(want.name).type
        # list child names differ between writers ("item", "element"); only the value type matters
        same = (
            pa.types.is_list(got) and got.value_type == want.type.value_type
            if pa.types.is_list(want.type)
            else got == want.type
        )
        if not same:
            _reject("schema", f"column {want.name} is {got}, expected {want.type}")


def _min_max(arr: pa.ChunkedArray | pa.Array) -> tuple:
    mm = pc.min_max(arr)
    return mm["min"].as_py(), mm["max"].as_py()


def _check_range(table: pa.Table, name: str, lo: float, hi: float, values=None) -> None:
    _check_values(name, lo, hi, table[name] if values is None else values)


def _check_values(name: str, lo: float, hi: float, values) -> None:
    vmin, vmax = _min_max(values)
    if vmin is not None and (vmin < lo or vmax > hi):
        _reject("range", f"{name} spans [{vmin}, {vmax}], allowed [{lo}, {hi}]")


def _single(table: pa.Table, name: str):
    if pc.count_distinct(table[name]).as_py() != 1:
        _reject("identity", f"rows disagree on {name}")
    return table[name][0].as_py()


def validate_table(
    table: pa.Table,
    limits: RolloutLimits,
    *,
    step: int | None = None,
    worker: str | None = None,
    submission: int | None = None,
    run: str | None = None,
    async_level: int | None = None,
    policy_lag: PolicyLag = "newest",
) -> pa.Table:
    """Check a decoded submission and return it as exactly :data:`SCHEMA`; :class:`RolloutRejected` if bad.

    ``step``, ``worker``, ``submission`` and ``run``, when given, are what the file must claim (e.g.
    from its path); ``async_level``, when given, rejects samples the lag rule (``policy_lag``) calls stale.
    """
    _check_schema(table.schema)
    if table.num_rows == 0:
        _reject("empty", "no rows")
    if table.num_rows > limits.max_rows:
        _reject("too_large", f"{table.num_rows} rows, at most {limits.max_rows} allowed")
    for f in SCHEMA:
        if not f.nullable and table[f.name].null_count:
            _reject("schema", f"nulls in column {f.name}")
    table = table.select(SCHEMA.names).cast(SCHEMA)
    flat = {name: pc.list_flatten(table[name]) for name in ("prompt_tokens", "output_tokens")}
    if any(v.null_count for v in flat.values()):
        _reject("schema", "null token ids")

    for name in ("reward", "task_reward", "length_penalty", "advantage"):
        if not pc.all(pc.is_finite(table[name])).as_py():
            _reject("nan", f"non-finite values in {name}")
    # bounds rounded to float32 like the values, so a reward of exactly reward_max=0.1 still passes
    lo, hi, adv, pen = np.array([limits.reward_min, limits.reward_max, limits.max_abs_advantage,
                                 limits.max_abs_length_penalty], dtype=np.float32).tolist()
    _check_range(table, "reward", lo, hi)
    _check_range(table, "task_reward", lo, hi)
    _check_range(table, "advantage", -adv, adv)
    _check_range(table, "length_penalty", -pen, pen)
    for name, most in (("prompt_tokens", limits.max_prompt_tokens), ("output_tokens", limits.max_output_tokens)):
        _check_range(table, f"{name} length", 1, most, pc.list_value_length(table[name]))
        _check_range(table, name, 0, limits.vocab_size - 1, flat[name])
    _check_range(table, "proof bytes", 0, limits.max_proof_bytes, pc.binary_length(table["proof"]))
    _check_range(table, "prompt_id length", 1, MAX_ID_CHARS, pc.utf8_length(table["prompt_id"]))
    _check_range(table, "group_id", 0, limits.max_rows - 1)
    _check_range(table, "target_length", 1, 2**31 - 1)
    for name in ("step", "policy_step", "submission"):
        _check_range(table, name, 0, 2**63 - 1)
    if not pc.all(pc.is_in(table["finish_reason"], pa.array(FINISH_REASONS))).as_py():
        _reject("range", f"finish_reason outside {FINISH_REASONS}")

    got = {name: _single(table, name) for name in ("run", "step", "policy_step", "worker", "submission")}
    if not _RUN_RE.fullmatch(got["run"]):
        _reject("identity", f"invalid run name {got['run'][:80]!r}")
    try:
        if canonical_worker(got["worker"]) != got["worker"]:
            raise ValueError("not lowercase")
    except ValueError:
        _reject("identity", f"worker {got['worker'][:140]!r} is not a canonical worker id")
    if step is not None and got["step"] != step:
        _reject("wrong_step", f"rows are for step {got['step']}, file is for step {step}")
    if worker is not None and got["worker"] != canonical_worker(worker):
        _reject("identity", f"rows are from worker {got['worker']!r}, file is from {worker!r}")
    if submission is not None and got["submission"] != submission:
        _reject("identity", f"rows are submission {got['submission']}, file is submission {submission}")
    if run is not None and got["run"] != run:
        _reject("identity", f"rows are for run {got['run']!r}, not {run!r}")
    if async_level is not None and not is_fresh(got["step"], got["policy_step"], async_level, policy_lag):
        _reject("stale", f"policy {got['policy_step']} is outside the lag bound {async_level} of step {got['step']}")
    return table


# --------------------------------------------------------------------- files


def encode_submission(rows: Sequence[Rollout], limits: RolloutLimits | None = None) -> bytes:
    """The Parquet bytes of one submission; with ``limits`` they are validated as a reader would."""
    table = rows_to_table(rows)
    if limits is not None:
        validate_table(table, limits)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def write_submission(
    storage: RunStorage,
    step: int,
    worker: str,
    k: int,
    rows: Sequence[Rollout],
    *,
    limits: RolloutLimits | None = None,
    overwrite: bool = False,
) -> str:
    """Atomically write submission ``k`` of ``worker`` for ``step``; returns its relative path.

    The rows must claim this step, worker and ``k``. An existing submission is not replaced unless
    ``overwrite`` (the ledger keys verdicts by file and row, so a validated file must not change);
    a step already marked ``STABLE`` is never written to (``FileExistsError``).
    """
    rel = submission_path(step, worker, k)
    if not rows:
        raise ValueError("a submission needs at least one row")
    want = (step, canonical_worker(worker), k)
    bad = [i for i, r in enumerate(rows) if (r.step, r.worker, r.submission) != want]
    if bad:
        raise ValueError(f"rows {bad[:8]} do not claim (step, worker, submission) = {want}")
    if storage.is_stable(step, KIND):
        raise FileExistsError(f"{storage.uri(storage.step_path(step, KIND))} is already stable")
    if not overwrite and storage.exists(rel):
        raise FileExistsError(f"{storage.uri(rel)} exists: use the next submission index")
    storage.write_bytes(rel, encode_submission(rows, limits))
    return rel


def check_layout(data: bytes, meta: pq.FileMetaData, limits: RolloutLimits) -> int:
    """Check a file's footer and page headers against ``limits`` before any page is decoded.

    Returns a bound on the bytes decoding takes; :class:`RolloutRejected` (``too_large`` or
    ``unreadable``) for a file whose rows, values or decompressed sizes exceed what ``limits``
    allow, or whose footer disagrees with its pages (see :mod:`intellect.rl.wire.parquet_bounds`).
    """
    if meta.num_rows > limits.max_rows or meta.num_row_groups > limits.max_rows:
        _reject("too_large", f"{meta.num_rows} rows in {meta.num_row_groups} row groups, "
                             f"at most {limits.max_rows} rows allowed")
    bounds = {}
    for f in SCHEMA:
        if pa.types.is_list(f.type):
            most = limits.max_prompt_tokens if f.name == "prompt_tokens" else limits.max_output_tokens
            bounds[f.name] = ColumnBound(most, 4, True)
        elif f.name == "proof":
            bounds[f.name] = ColumnBound(1, limits.max_proof_bytes, False)
        elif pa.types.is_string(f.type):
            bounds[f.name] = ColumnBound(1, 4 * MAX_ID_CHARS, False)  # UTF-8: at most 4 bytes a character
        else:
            bounds[f.name] = ColumnBound(1, f.type.bit_width // 8, False)
    try:
        layouts = chunk_layouts(data, max_pages=16 * len(SCHEMA) + 4 * limits.max_rows)
        rows = sum({c.row_group: c.rows for c in layouts}.values())  # the row groups' own counts, not the file's
        if rows > limits.max_rows or meta.num_row_groups > max(1, rows):
            _reject("too_large", f"{rows} rows in {meta.num_row_groups} row groups, at most {limits.max_rows} rows "
                                 "allowed, in no more row groups than rows")
        return check_bounds(layouts, bounds, max_bytes=limits.max_decoded_bytes)
    except LayoutError as e:
        _reject(e.reason, e.detail)


def _dense_nbytes(name: str, col: pa.Array, limits: RolloutLimits) -> int:
    """Bytes ``col`` takes once dictionary-decoded, computed (and each value's size checked) before it is."""
    if not isinstance(col, pa.DictionaryArray):
        return col.nbytes
    # pyarrow-stubs types binary_length's argument as an expression only
    sizes = pc.binary_length(col.dictionary)  # pyright: ignore[reportCallIssue, reportArgumentType]
    lengths = pc.take(sizes, col.indices)
    most = limits.max_proof_bytes if name == "proof" else 4 * MAX_ID_CHARS
    _check_values(f"{name} bytes", 0, most, lengths)
    return 4 * (len(col) + 1) + (pc.sum(lengths).as_py() or 0)


def _decode_dictionary(col: pa.DictionaryArray) -> pa.Array:
    dense = col.dictionary_decode()
    dense.validate(full=True)  # UTF-8 of strings: a dictionary's values are not checked when read
    return dense


def read_submission_table(
    source: bytes | bytearray | memoryview | str | os.PathLike,
    limits: RolloutLimits,
    **expect,
) -> pa.Table:
    """Decode and validate one submission from bytes or a local path (``expect`` as in :func:`validate_table`).

    Nothing is decompressed until the footer and every page header have been checked against
    ``limits`` (:func:`check_layout`); decoding then runs batch by batch and stops at the first
    batch that takes the file past ``max_decoded_bytes``.
    """
    try:
        data = read_local(source, limits.max_file_bytes) if isinstance(source, (str, os.PathLike)) else bytes(source)
    except LayoutError as e:
        _reject(e.reason, e.detail)
    if len(data) > limits.max_file_bytes:
        _reject("too_large", f"{len(data)} bytes, at most {limits.max_file_bytes} allowed")
    try:
        if footer_length(data) > MAX_FOOTER_BYTES:
            raise LayoutError("too_large", f"footer of {footer_length(data)} bytes, at most {MAX_FOOTER_BYTES} allowed")
        footer = pq.ParquetFile(
            pa.BufferReader(data), pre_buffer=False, thrift_string_size_limit=MAX_FOOTER_BYTES,
            thrift_container_size_limit=MAX_FOOTER_BYTES // 4,
            schema_depth_limit=16,  # pyright: ignore[reportCallIssue] - pyarrow-stubs predates the argument
        )
        meta, schema = footer.metadata, footer.schema_arrow
    except LayoutError as e:
        _reject(e.reason, e.detail)
    except Exception as e:  # noqa: BLE001 - any parser failure on untrusted bytes is a rejection
        _reject("unreadable", f"not a Parquet file ({type(e).__name__}: {str(e)[:200]})")
    _check_schema(schema)  # before decoding: a wrong file costs no decompression
    estimate = check_layout(data, meta, limits)
    # batches of about BATCH_BYTES: what one batch's decoding holds besides the columns decoded so far
    batch_rows = max(1, min(BATCH_ROWS, meta.num_rows * BATCH_BYTES // max(estimate, 1)))
    batches, decoded = [], 0
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), metadata=meta, read_dictionary=_STRING_COLUMNS, pre_buffer=False)
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=False):
            # strings arrive dictionary-encoded, so what they would expand to is known before they do
            decoded += sum(_dense_nbytes(name, col, limits) for name, col in zip(batch.schema.names, batch.columns))
            if decoded > limits.max_decoded_bytes:
                break
            cols = [_decode_dictionary(col) if isinstance(col, pa.DictionaryArray) else col for col in batch.columns]
            batches.append(pa.RecordBatch.from_arrays(cols, schema=schema))
        table = pa.Table.from_batches(batches, schema=schema)
    except RolloutRejected:
        raise
    except Exception as e:  # noqa: BLE001
        _reject("unreadable", f"corrupt Parquet data ({type(e).__name__}: {str(e)[:200]})")
    if decoded > limits.max_decoded_bytes:
        _reject("too_large", f"decodes to over {limits.max_decoded_bytes} bytes")
    return validate_table(table, limits, **expect)


def read_submission(
    source: bytes | bytearray | memoryview | str | os.PathLike, limits: RolloutLimits, **expect
) -> list[Rollout]:
    """:func:`read_submission_table` as :class:`Rollout` rows."""
    return table_to_rows(read_submission_table(source, limits, **expect))


def load_submission(
    storage: RunStorage,
    rel: str,
    limits: RolloutLimits,
    *,
    run: str | None = None,
    async_level: int | None = None,
    policy_lag: PolicyLag = "newest",
    sha256: str | None = None,
    size: int | None = None,
) -> list[Rollout]:
    """Read a submission from run storage; its path fixes the step, worker and ``k`` it must claim.

    At most ``limits.max_file_bytes + 1`` bytes are read, and an object that storage reports as
    larger is not read at all. ``sha256`` and ``size``, when given, are what the uploader declared:
    other bytes are rejected (``sha256_mismatch``, ``size_mismatch``) before they are parsed.
    """
    try:
        step, worker, k = parse_submission_path(rel)
    except ValueError as e:
        _reject("identity", str(e))
    try:
        data = read_capped(storage, rel, limits.max_file_bytes, size=size)
    except LayoutError as e:
        _reject(e.reason, e.detail)
    got = hashlib.sha256(data).hexdigest() if sha256 is not None else None
    if got is not None and got != str(sha256).lower():  # the declared digest is public: no constant time needed
        _reject("sha256_mismatch", f"content sha256 {got} is not the declared {str(sha256)[:64]!r}")
    return read_submission(data, limits, step=step, worker=worker, submission=k, run=run, async_level=async_level,
                           policy_lag=policy_lag)
