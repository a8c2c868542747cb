"""The validator's verdict files: one Parquet file per validated group of submissions, each with a MAC.

The validator writes its verdicts on a worker's files of step ``n`` to
``verdicts/step_{n}/{name}.parquet`` (columns :data:`~intellect.verdict.VERDICT_SCHEMA`), and the
recorder reads them back into the ledger in one transaction. Between processes, or between
Prefect tasks, a path travels instead of hundreds of verdict objects, which a task parameter would
serialize on every call. The files stay as an audit trail of what the validator decided.

A verdict file is trusted only with its tag: an HMAC (:mod:`intellect.trust.mac`, key derived from
the run's secret, which only the trainer holds, for ``"verdicts"`` and the step) over the path and
the sha256 of the bytes. The tag travels with the path, in the validator's report, so a file
rewritten after validation, or one written by anybody but the validator, fails
:func:`read_verdicts` before a row of it is read.

    >>> from intellect.verdict import Verdict
    >>> from intellect.storage import RunStorage
    >>> import tempfile
    >>> storage, secret = RunStorage(f"file://{tempfile.mkdtemp()}"), bytes(32)
    >>> v = Verdict("rollouts/step_3/w-0.parquet", -1, 3, "w", 0, "rejected", "schema")
    >>> rel, mac = write_verdicts(storage, 3, "w", [v], secret)
    >>> rel, read_verdicts(storage, [(rel, mac)], secret)["reason"].to_pylist()
    ('verdicts/step_3/w.parquet', ['schema'])
    >>> storage.write_bytes(rel, storage.read_bytes(rel))  # same bytes: still verifies
    >>> read_verdicts(storage, [(rel, "00" * 32)], secret)
    Traceback (most recent call last):
    ...
    intellect.rl.service.verdicts.VerdictTampered: verdicts/step_3/w.parquet: its MAC does not verify
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from intellect.ids import canonical_worker
from intellect.storage import parse_step, step_name
from intellect.trust import mac
from intellect.verdict import VERDICT_SCHEMA, verdict_table

if TYPE_CHECKING:
    from intellect.storage import RunStorage
    from intellect.verdict import Verdict

KIND = "verdicts"
_DOMAIN = "intellect/verdict-file/v1"


class VerdictTampered(ValueError):
    """A verdict file whose MAC does not verify: the record task refuses it."""


def _step_of(rel: str) -> int:
    parts = rel.split("/")
    step = parse_step(parts[1]) if len(parts) == 3 else None
    return -1 if step is None else step


def _tag(secret: bytes, rel: str, data: bytes) -> bytes:
    return mac.tag(mac.derive_key(secret, KIND, _step_of(rel)), _DOMAIN, rel, hashlib.sha256(data).hexdigest())


def verdict_path(step: int, name: str) -> str:
    """``verdicts/step_{step}/{name}.parquet`` (``name`` canonical, as worker ids are)."""
    return f"{KIND}/{step_name(step)}/{canonical_worker(name)}.parquet"


def write_verdicts(storage: RunStorage, step: int, name: str, verdicts: Iterable[Verdict], secret: bytes
                   ) -> tuple[str, str]:
    """Write ``verdicts`` atomically as ``verdict_path(step, name)``; returns that path and its MAC (hex)."""
    buf = io.BytesIO()
    pq.write_table(verdict_table(verdicts), buf)
    rel = verdict_path(step, name)
    storage.write_bytes(rel, buf.getvalue())
    return rel, _tag(secret, rel, buf.getvalue()).hex()


def read_verdicts(storage: RunStorage, files: Sequence[tuple[str, str]], secret: bytes) -> pa.Table:
    """The verdicts of ``files`` (``(path, MAC)`` pairs from :func:`write_verdicts`), concatenated in
    order; :class:`VerdictTampered` for a file whose MAC fails, ``ValueError`` for one that is not a
    verdict file."""
    tables = []
    for rel, tag_hex in files:
        data = storage.read_bytes(rel)
        try:
            got = bytes.fromhex(tag_hex)
        except (TypeError, ValueError):
            got = b""
        if not mac.check(mac.derive_key(secret, KIND, _step_of(rel)), got, _DOMAIN, rel,
                         hashlib.sha256(data).hexdigest()):
            # written by someone else, or changed after validation
            raise VerdictTampered(f"{rel}: its MAC does not verify")
        try:
            table = pq.read_table(io.BytesIO(data))
        except pa.ArrowException as e:
            raise ValueError(f"{rel} is not a verdict file: {e}") from e
        if table.schema.remove_metadata() != VERDICT_SCHEMA:
            raise ValueError(f"{rel} is not a verdict file: schema {table.schema}")
        tables.append(table)
    return pa.concat_tables(tables) if tables else VERDICT_SCHEMA.empty_table()
