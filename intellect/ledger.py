"""The DuckDB ledger of an RL run: every sample's verdict, every step, checkpoint and worker.

Tables (schema version :data:`LEDGER_SCHEMA_VERSION`, kept in ``meta``):

* ``rollouts``: one row per submitted sample, keyed by its location ``(file, row_index)`` in run
  storage, with its content hash (:func:`intellect.rl.wire.rollout_schema.content_hash`), step, policy step,
  worker, submission, prompt, group, reward, advantage, token counts, ``status``
  (``accepted``/``rejected``) and ``reason``. A whole file rejected before its rows could be read is
  one row with ``row_index = -1``.
* ``steps``: one row per committed training step: counts, mean accepted reward, loss, clip
  fraction, trained samples and timings (JSON).
* ``checkpoints``: ``(step, uri, sha256)``, immutable once recorded.
* ``workers``: first and last time a verdict on the worker's samples was recorded (``info`` is
  kept in the schema, unwritten).

Rules that make a crashed step safe to re-run:

* Every write is one transaction; a failure or a kill inside it leaves nothing behind.
* Recording a verdict is idempotent: a location already in the ledger is never recorded again, so
  re-validating a file after a crash never double-counts and never flips a verdict. A re-recorded
  location whose content hash changed (the file was overwritten) keeps its first verdict and is
  reported in :attr:`RecordResult.conflicts`; the trainer must compare the content hash of each
  row it loads with the one :meth:`Ledger.accepted` returns.
* **Duplicates.** A sample whose content hash (seed + prompt tokens + output tokens) is already
  *accepted* at another location, by any worker, submission or step, is a copy: if it would have
  been accepted it is recorded as ``rejected`` / :data:`~intellect.verdict.DUPLICATE`. Within one
  call the first accepted copy in table order wins, and callers give rows in arrival order (the
  submission service's), never sorted by worker id, which a key can be ground to sort first.
  Copies rarely get this far: a sample's seed is assigned to its worker and position, so a copy
  filed by another worker is rejected as ``seed`` before it is recorded. Rejected rows never count: otherwise a worker
  could file a copy of an honest worker's rollouts under an id that sorts first, have it rejected
  (``assignment``), and so turn the honest rows into duplicates. Honest workers never collide,
  since their seeds differ.
* **Bounds.** :meth:`Ledger.record_table` takes status, reward and advantage from a table, so every
  row is checked first (:func:`intellect.verdict.check_verdict_table`); one bad row refuses the
  whole table, unwritten.
* A committed step is frozen: :meth:`Ledger.commit_step` is a no-op the second time, and new
  verdicts for it are refused, so what the trainer read (:meth:`Ledger.accepted`) stays what the
  ledger says it trained.

**Connection policy.** DuckDB lets one process at a time open a database file for writing. The
orchestrating flow's process owns the ledger: a :class:`Ledger` opens its connection on first use
and keeps it until :meth:`Ledger.close` (or the end of a ``with Ledger(path) as ledger:`` block),
because opening a database costs far more than one operation, and every operation is one
transaction on it. Tasks running in that process (threads) may each open their own
:class:`Ledger` on the same path; DuckDB shares one
database per process, and operations are serialized per file. A second process waits up to
``lock_timeout`` seconds for the owner to close, then fails; nothing outside the owner should
write, and a reader (a notebook) opens the file only while the run is not active.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Iterator, Mapping

import duckdb
import pyarrow as pa

from intellect.verdict import DUPLICATE, LedgerError, Verdict, check_verdict_table, verdict_table

LEDGER_SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollouts (
    file TEXT NOT NULL,
    row_index INTEGER NOT NULL,
    content_hash TEXT,
    step BIGINT NOT NULL,
    policy_step BIGINT,
    worker TEXT NOT NULL,
    submission BIGINT NOT NULL,
    prompt_id TEXT,
    group_id INTEGER,
    reward DOUBLE,
    advantage DOUBLE,
    prompt_tokens INTEGER,
    output_tokens INTEGER,
    status TEXT NOT NULL CHECK (status IN ('accepted', 'rejected')),
    reason TEXT,
    recorded_at TIMESTAMP NOT NULL,
    PRIMARY KEY (file, row_index)
);
CREATE TABLE IF NOT EXISTS steps (
    step BIGINT PRIMARY KEY,
    committed_at TIMESTAMP NOT NULL,
    accepted BIGINT NOT NULL,
    rejected BIGINT NOT NULL,
    mean_reward DOUBLE,
    trained_samples BIGINT,
    loss DOUBLE,
    clip_fraction DOUBLE,
    timings TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    step BIGINT PRIMARY KEY,
    uri TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    recorded_at TIMESTAMP NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker TEXT PRIMARY KEY,
    first_seen TIMESTAMP NOT NULL,
    last_seen TIMESTAMP NOT NULL,
    info TEXT
);
CREATE TABLE IF NOT EXISTS solve_rates (
    prompt_id TEXT NOT NULL,
    model TEXT NOT NULL,
    k INTEGER NOT NULL,
    solved INTEGER NOT NULL,
    kept BOOLEAN NOT NULL,
    recorded_at TIMESTAMP NOT NULL,
    PRIMARY KEY (prompt_id, model)
);
"""

_PATH_LOCKS: dict[str, threading.Lock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)  # stored as naive UTC


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> tuple[Any, ...]:
    """The row of a statement that always yields exactly one (an aggregate, a counted insert)."""
    row = con.execute(sql, params).fetchone()
    if row is None:
        raise LedgerError(f"no row from {sql.split()[0]}")
    return row


@dataclass(frozen=True, slots=True)
class RecordResult:
    """What :meth:`Ledger.record_verdicts` did: rows written now, already present, turned duplicate."""

    inserted: int
    existing: int
    duplicates: int
    conflicts: int


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What the trainer reports when it commits a step (counts and mean reward come from the ledger)."""

    loss: float | None = None
    clip_fraction: float | None = None
    trained_samples: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)


class Ledger:
    """The ledger file at ``path`` (created with its schema on first use). See the module docstring.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d, Ledger(os.path.join(d, "ledger.duckdb")) as ledger:
    ...     bad = Verdict.file_rejected("rollouts/step_0/a-0.parquet", 0, "a", 0, "schema")
    ...     ledger.record_verdicts(0, [bad, bad]), ledger.commit_step(0), ledger.commit_step(0)
    ...     ledger.get_step(0)["rejected"], ledger.summary()
    (RecordResult(inserted=1, existing=1, duplicates=0, conflicts=0), True, False)
    (1, [{'step': 0, 'status': 'rejected', 'reason': 'schema', 'n': 1}])
    """

    def __init__(self, path: str | os.PathLike, *, lock_timeout: float = 30.0) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.lock_timeout = lock_timeout
        self._con: duckdb.DuckDBPyConnection | None = None
        with _PATH_LOCKS_GUARD:
            self._lock = _PATH_LOCKS.setdefault(self.path, threading.Lock())
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with self._transaction() as con:
            con.execute(_DDL)
            con.execute(
                "INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING", [str(LEDGER_SCHEMA_VERSION)]
            )
            (version,) = _one(con, "SELECT value FROM meta WHERE key = 'schema_version'")
        if version != str(LEDGER_SCHEMA_VERSION):
            self.close()
            raise LedgerError(f"{self.path} has ledger schema {version}, this code writes {LEDGER_SCHEMA_VERSION}")

    def __repr__(self) -> str:
        return f"Ledger({self.path!r})"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file (the next operation opens it again)."""
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    # ------------------------------------------------------------------ plumbing

    def _connect(self) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                return duckdb.connect(self.path)
            except duckdb.IOException as e:
                # another process holds the file: wait our turn, within bounds
                if "lock" not in str(e).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            if self._con is None:
                self._con = self._connect()
            con = self._con
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # a broken connection: drop it, DuckDB discards the transaction
                    self._con = None
                    con.close()
                raise
            con.execute("COMMIT")

    def _query(self, sql: str, params: list | None = None) -> list[dict[str, Any]]:
        with self._transaction() as con:
            cur = con.execute(sql, params or [])
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    # ------------------------------------------------------------------ rollouts

    def record_verdicts(self, step: int, verdicts: Iterable[Verdict]) -> RecordResult:
        """Record the verdicts of ``step`` in one transaction, idempotently (see the module docstring)."""
        return self.record_table(step, verdict_table(verdicts))

    def record_table(self, step: int, table: pa.Table) -> RecordResult:
        """:meth:`record_verdicts` for verdicts already in a :func:`verdict_table` (e.g. read back from
        the validator's verdict files); rows are taken in table order. Every row is checked first
        (:func:`check_verdict_table`): a bad one raises :class:`BadVerdictTable` and nothing is written."""
        check_verdict_table(step, table)
        if not table.num_rows:
            return RecordResult(0, 0, 0, 0)
        incoming = table.append_column("ord", pa.array(range(table.num_rows), pa.int64()))
        now = _now()
        with self._transaction() as con:
            con.register("incoming", incoming)
            con.execute(
                """
                CREATE OR REPLACE TEMP TABLE batch AS
                SELECT * FROM incoming
                QUALIFY row_number() OVER (PARTITION BY file, "row" ORDER BY ord) = 1
                """
            )
            (conflicts,) = _one(
                con,
                """
                SELECT count(*) FROM batch b JOIN rollouts r ON r.file = b.file AND r.row_index = b."row"
                WHERE r.content_hash IS DISTINCT FROM b.content_hash
                """
            )
            con.execute(
                """
                CREATE OR REPLACE TEMP TABLE fresh AS
                SELECT b.*,
                    b.status = 'accepted' AND (
                        EXISTS (SELECT 1 FROM rollouts r WHERE r.content_hash = b.content_hash
                                AND r.status = 'accepted')
                        OR row_number() OVER (PARTITION BY b.content_hash, b.status ORDER BY b.ord) > 1
                    ) AS dup
                FROM batch b ANTI JOIN rollouts r ON r.file = b.file AND r.row_index = b."row"
                """
            )
            (inserted, duplicates) = _one(con, "SELECT count(*), count(*) FILTER (WHERE dup) FROM fresh")
            if inserted and con.execute("SELECT 1 FROM steps WHERE step = ?", [step]).fetchone():
                raise LedgerError(f"step {step} is committed: {inserted} new verdicts arrived too late")
            con.execute(
                f"""
                INSERT INTO rollouts
                SELECT file, "row", content_hash, step, policy_step, worker, submission, prompt_id, group_id,
                    reward, advantage, prompt_tokens, output_tokens,
                    CASE WHEN dup THEN 'rejected' ELSE status END,
                    CASE WHEN dup THEN '{DUPLICATE}' ELSE reason END,
                    ?
                FROM fresh ORDER BY ord
                """,
                [now],
            )
            self._touch_workers(con, now)
            con.execute("DROP TABLE batch; DROP TABLE fresh")
            con.unregister("incoming")
            return RecordResult(inserted, incoming.num_rows - inserted, duplicates, conflicts)

    @staticmethod
    def _touch_workers(con: duckdb.DuckDBPyConnection, now: datetime) -> None:
        con.execute(
            """
            INSERT INTO workers SELECT DISTINCT worker, ?, ?, NULL FROM fresh
            ON CONFLICT (worker) DO UPDATE SET last_seen = excluded.last_seen
            """,
            [now, now],
        )

    def accepted(self, step: int) -> list[dict[str, Any]]:
        """The trainer's input: the accepted samples of ``step``, in (file, row) order."""
        return self._query(
            """
            SELECT file, row_index, content_hash, policy_step, worker, submission, prompt_id, group_id,
                reward, advantage, prompt_tokens, output_tokens
            FROM rollouts WHERE step = ? AND status = 'accepted' ORDER BY file, row_index
            """,
            [step],
        )

    # ------------------------------------------------------------------ steps

    def commit_step(self, step: int, metrics: StepMetrics = StepMetrics()) -> bool:
        """Commit ``step`` in one transaction; ``False`` (and nothing changes) if it already was."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        timings = json.dumps(dict(metrics.timings), sort_keys=True)
        with self._transaction() as con:
            (n,) = _one(
                con,
                """
                INSERT INTO steps
                SELECT ?, ?, count(*) FILTER (WHERE status = 'accepted'), count(*) FILTER (WHERE status = 'rejected'),
                    avg(reward) FILTER (WHERE status = 'accepted'), ?, ?, ?, ?
                FROM rollouts WHERE step = ?
                ON CONFLICT DO NOTHING
                """,
                [step, _now(), metrics.trained_samples, metrics.loss, metrics.clip_fraction, timings, step],
            )
        return n == 1

    def get_step(self, step: int) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM steps WHERE step = ?", [step])
        if not rows:
            return None
        rows[0]["timings"] = json.loads(rows[0]["timings"])
        return rows[0]

    def record_solve_rates(self, model: str, k: int, rows: Iterable[tuple[str, int, bool]]) -> int:
        """``(prompt_id, solved, kept)`` of the offline filter for ``model`` (a checkpoint's sha256), one
        transaction; rows already recorded for that model are kept as they are. Returns rows inserted."""
        rows = list(rows)
        now = _now()
        table = pa.table({
            "prompt_id": pa.array([r[0] for r in rows], pa.string()), "model": pa.array([model] * len(rows)),
            "k": pa.array([k] * len(rows), pa.int32()), "solved": pa.array([int(r[1]) for r in rows], pa.int32()),
            "kept": pa.array([bool(r[2]) for r in rows]), "recorded_at": pa.array([now] * len(rows), pa.timestamp("us")),
        })
        with self._transaction() as con:
            ((before,),) = con.execute("SELECT count(*) FROM solve_rates WHERE model = ?", [model]).fetchall()
            con.register("_solve_rows", table)
            try:
                con.execute("INSERT INTO solve_rates SELECT * FROM _solve_rows ON CONFLICT DO NOTHING")
            finally:
                con.unregister("_solve_rows")
            ((after,),) = con.execute("SELECT count(*) FROM solve_rates WHERE model = ?", [model]).fetchall()
        return after - before

    def solve_rates(self, model: str) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM solve_rates WHERE model = ? ORDER BY prompt_id", [model])

    def steps(self) -> list[dict[str, Any]]:
        """Every committed step, in order (``timings`` decoded)."""
        rows = self._query("SELECT * FROM steps ORDER BY step")
        for r in rows:
            r["timings"] = json.loads(r["timings"])
        return rows

    def committed_steps(self) -> list[int]:
        return [r["step"] for r in self._query("SELECT step FROM steps ORDER BY step")]

    def summary(self) -> list[dict[str, Any]]:
        """Sample counts by step, status and reason (``reason`` is ``None`` for accepted)."""
        return self._query(
            "SELECT step, status, reason, count(*) AS n FROM rollouts GROUP BY ALL ORDER BY step, status, reason"
        )

    def step_verdicts(self, step: int) -> list[dict[str, Any]]:
        """Sample counts and mean reward of ``step`` by status and reason."""
        return self._query(
            "SELECT status, reason, count(*) AS n, avg(reward) AS mean_reward FROM rollouts WHERE step = ? "
            "GROUP BY ALL ORDER BY status, reason",
            [step],
        )

    # ------------------------------------------------------------------ checkpoints

    def record_checkpoint(self, step: int, uri: str, sha256: str) -> None:
        """Record checkpoint ``step``; again with the same values is a no-op, with others a ``LedgerError``."""
        with self._transaction() as con:
            con.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING", [step, uri, sha256, _now()])
            got = con.execute("SELECT uri, sha256 FROM checkpoints WHERE step = ?", [step]).fetchone()
            if got != (uri, sha256):
                raise LedgerError(f"checkpoint {step} is already recorded as {got}, not {(uri, sha256)}")

    def checkpoint(self, step: int) -> tuple[str, str] | None:
        """``(uri, sha256)`` of checkpoint ``step``, or ``None``."""
        rows = self._query("SELECT uri, sha256 FROM checkpoints WHERE step = ?", [step])
        return (rows[0]["uri"], rows[0]["sha256"]) if rows else None
