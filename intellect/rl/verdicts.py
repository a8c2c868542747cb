"""The validator's verdict files: one Parquet file per validated group of submissions.

The validator writes its verdicts on a worker's files of step ``n`` to
``verdicts/step_{n}/{name}.parquet`` (columns :data:`~intellect.ledger.VERDICT_SCHEMA`), and the
recorder reads them back into the ledger in one transaction. Between processes, or between
Prefect tasks, a path travels instead of hundreds of verdict objects: handing 512 verdicts to a
task as a parameter costs ~40 ms of Python per call, measured, while writing and reading the file
costs a few. The files are written atomically by the trusted validator, never by a worker, and
stay as an audit trail of what it decided.

    >>> from intellect.ledger import Verdict
    >>> from intellect.storage import RunStorage
    >>> import tempfile
    >>> storage = RunStorage(f"file://{tempfile.mkdtemp()}")
    >>> v = Verdict("rollouts/step_3/w-0.parquet", -1, 3, "w", 0, "rejected", "schema")
    >>> rel = write_verdicts(storage, 3, "w", [v])
    >>> rel, read_verdicts(storage, [rel])["reason"].to_pylist()
    ('verdicts/step_3/w.parquet', ['schema'])
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from intellect.ledger import VERDICT_SCHEMA, verdict_table
from intellect.rl.assignment import canonical_worker

if TYPE_CHECKING:
    from intellect.ledger import Verdict
    from intellect.storage import RunStorage

KIND = "verdicts"


def verdict_path(step: int, name: str) -> str:
    """``verdicts/step_{step}/{name}.parquet`` (``name`` canonical, as worker ids are)."""
    return f"{KIND}/step_{step}/{canonical_worker(name)}.parquet"


def write_verdicts(storage: RunStorage, step: int, name: str, verdicts: Iterable[Verdict]) -> str:
    """Write ``verdicts`` atomically as ``verdict_path(step, name)``; returns that path."""
    buf = io.BytesIO()
    pq.write_table(verdict_table(verdicts), buf)
    rel = verdict_path(step, name)
    storage.write_bytes(rel, buf.getvalue())
    return rel


def read_verdicts(storage: RunStorage, rels: Sequence[str]) -> pa.Table:
    """The verdicts of ``rels``, concatenated in order; ``ValueError`` names a file that is not one."""
    tables = []
    for rel in rels:
        try:
            table = pq.read_table(io.BytesIO(storage.read_bytes(rel)))
        except pa.ArrowException as e:
            raise ValueError(f"{rel} is not a verdict file: {e}") from e
        if table.schema.remove_metadata() != VERDICT_SCHEMA:
            raise ValueError(f"{rel} is not a verdict file: schema {table.schema}")
        tables.append(table)
    return pa.concat_tables(tables) if tables else VERDICT_SCHEMA.empty_table()
