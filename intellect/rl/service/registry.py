"""The submission service's registry: admitted workers, stored submissions and done records.

:class:`Registry` persists them as an append-only, fsync'd JSON-lines file (``submissions.jsonl``)
in a folder only the trainer writes, and reloads it on restart; a key that stored nothing within
``expire_after`` seconds of its admission gives its place up to a new one once the registry is full,
so a registration flood cannot close a run for good. It refuses as the rest of the service does,
with a :class:`~intellect.rl.service.admission.Refusal`.

Each admitted key gets a salt (:data:`~intellect.rl.wire.assignment.SALT_BYTES` bytes) at its admission,
recorded with it: random, or the service's keyed hash of the key (a run's trainer derives that key
from its secret, so a rerun of the run draws the same prompts for the same keys, and no worker can
compute it); its assignments and sample seeds derive from it
(:mod:`intellect.rl.wire.assignment`), so they are unknown until the key is committed. A key keeps its
first salt for the run, also when it expires and registers again, so re-registering draws nothing.
The validator reads the salts from here (:meth:`Registry.salts`, or :func:`read_salts` of the
folder), never from a worker.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from intellect.rl.service.admission import Refusal
from intellect.rl.wire.assignment import SALT_BYTES, check_salt
from intellect.trust.keys import BadKey, VerifyKey

REGISTRY_FILE = "submissions.jsonl"


@dataclass(frozen=True)
class SubmissionRecord:
    """A submission the service stored (local storage) or handed an upload for (S3): ``path`` is
    :func:`~intellect.rl.wire.rollouts.submission_path` of ``(step, worker, k)``, ``sha256`` (hex) and
    ``size`` are of the body the worker signed (local) or declared (S3), ``time`` is Unix seconds."""

    worker: str
    step: int
    k: int
    path: str
    sha256: str
    size: int
    time: float


#: Seconds allowed between the trainer's clock and the object store's when a presigned POST expires.
UPLOAD_CLOCK_MARGIN = 5.0


def uploads_settled_at(records: Iterable[SubmissionRecord], presign_expiry: float,
                       margin: float = UPLOAD_CLOCK_MARGIN) -> float:
    """When no presigned POST handed out for ``records`` can write any more (Unix seconds; 0 for none).

    A presigned POST can be used again until it expires, and every POST for a name expires at the
    end of the window its first declaration opened, so an S3 object is final from then on: the
    validator reads it after that, and what it validated is what the trainer later reads.

    >>> uploads_settled_at([SubmissionRecord("w", 1, 0, "p", "0" * 64, 10, 100.0)], 60, margin=5)
    165.0
    """
    return max((r.time + presign_expiry + margin for r in records), default=0.0)


@dataclass(frozen=True)
class DoneRecord:
    """A worker's statement that ``files`` (its submissions of ``step``) are all it has for that step."""

    worker: str
    step: int
    files: list[str]
    policy_step: int
    time: float


@dataclass(frozen=True)
class WorkerRecord:
    worker: str
    public: str  # hex Ed25519 public key
    time: float
    salt: str  # hex, drawn at the key's first admission


@dataclass(frozen=True)
class ExpiredRecord:
    """An admitted key removed because it stored nothing in time (it may register again)."""

    worker: str
    time: float


_TYPES = {"worker": WorkerRecord, "submission": SubmissionRecord, "done": DoneRecord, "expired": ExpiredRecord}


def _record_from(doc: dict):
    kind = doc.pop("type", None)
    cls = _TYPES.get(kind)
    if cls is None or set(doc) != {f for f in cls.__dataclass_fields__}:
        raise ValueError(f"not a registry record: {kind!r} with {sorted(doc)}")
    return cls(**doc)


@dataclass
class _State:
    keys: dict[str, VerifyKey] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    admitted: dict[str, float] = field(default_factory=dict)
    salts: dict[str, bytes] = field(default_factory=dict)  # kept when a key expires
    active: set[str] = field(default_factory=set)  # workers with a submission or done record
    subs: dict[int, list[SubmissionRecord]] = field(default_factory=dict)
    by_name: dict[tuple[int, str, int], SubmissionRecord] = field(default_factory=dict)
    done: dict[int, dict[str, DoneRecord]] = field(default_factory=dict)


class Registry:
    """What the service admitted and stored, in ``state_dir/submissions.jsonl`` (see the module doc).

    Each record is one JSON line, appended and fsync'd before the request that made it is
    answered, so an answered request survives a crash. A torn last line (a crash mid-append) is cut
    off on load; any other unreadable line means the trainer-only folder was tampered with, and
    loading fails loudly rather than forgetting what was stored.
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / REGISTRY_FILE
        self._lock = threading.Lock()
        self._s = _State()
        self._pending: set[tuple[int, str, int]] = set()
        self._load()
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        for n, line in enumerate(data[:end].splitlines(), 1):
            try:
                self._apply(_record_from(json.loads(line)))
            except (ValueError, TypeError, BadKey) as e:
                raise RuntimeError(f"{self.path}:{n}: unreadable registry record ({e})") from None
        if end != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())

    def _apply(self, rec) -> None:
        s = self._s
        if isinstance(rec, WorkerRecord):
            key = VerifyKey.from_hex(rec.public)
            if key.id != rec.worker:
                raise ValueError(f"worker {rec.worker} is not the id of its key")
            salt = check_salt(bytes.fromhex(rec.salt))
            if len(salt) != SALT_BYTES or s.salts.setdefault(rec.worker, salt) != salt:
                raise ValueError(f"worker {rec.worker}: a salt of {len(salt)} bytes, or not its first one")
            if rec.worker not in s.keys:
                s.keys[rec.worker] = key
                s.order.append(rec.worker)
                s.admitted[rec.worker] = rec.time
        elif isinstance(rec, ExpiredRecord):
            if rec.worker in s.keys and rec.worker not in s.active:
                del s.keys[rec.worker], s.admitted[rec.worker]
                s.order.remove(rec.worker)
        elif isinstance(rec, SubmissionRecord):
            s.subs.setdefault(rec.step, []).append(rec)
            s.by_name[(rec.step, rec.worker, rec.k)] = rec
            s.active.add(rec.worker)
        else:
            s.active.add(rec.worker)
            s.done.setdefault(rec.step, {})[rec.worker] = DoneRecord(rec.worker, rec.step, list(rec.files),
                                                                    rec.policy_step, rec.time)

    def _append(self, rec) -> None:
        line = json.dumps({"type": next(k for k, c in _TYPES.items() if isinstance(rec, c)), **asdict(rec)})
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._apply(rec)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    # ---------------------------------------------------------------- workers

    def key(self, worker: str) -> VerifyKey | None:
        with self._lock:
            return self._s.keys.get(worker)

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._s.order)

    def salt(self, worker: str) -> bytes | None:
        """The salt of an admitted ``worker`` (None: not admitted)."""
        with self._lock:
            return self._s.salts.get(worker) if worker in self._s.keys else None

    def salts(self) -> dict[str, bytes]:
        """The salt of every key ever admitted (an expired key's files stay checkable)."""
        with self._lock:
            return dict(self._s.salts)

    def admit(self, key: VerifyKey, max_workers: int | None = None, expire_after: float | None = None,
              now: float | None = None, salt: bytes | None = None) -> bool:
        """Admit ``key`` (True), or say it was admitted before (False); :class:`Refusal` ``full`` when
        ``max_workers`` are admitted already, after expiring the keys admitted more than
        ``expire_after`` seconds ago that never stored anything (oldest first, as many as it takes).
        A key admitted for the first time gets ``salt`` (None: random bytes), one admitted before its
        first salt again."""
        now = time.time() if now is None else now
        with self._lock:
            s = self._s
            if key.id in s.keys:
                return False
            if max_workers is not None and len(s.order) >= max_workers and expire_after is not None:
                idle = [w for w in s.order if w not in s.active and s.admitted[w] < now - expire_after]
                for w in idle[:len(s.order) - max_workers + 1]:
                    self._append(ExpiredRecord(w, now))
            if max_workers is not None and len(s.order) >= max_workers:
                raise Refusal(503, "full", f"{max_workers} workers are admitted already")
            salt = s.salts.get(key.id) or salt or secrets.token_bytes(SALT_BYTES)
            if len(salt) != SALT_BYTES:
                raise ValueError(f"a salt of {len(salt)} bytes")
            self._append(WorkerRecord(key.id, key.hex, now, salt.hex()))
            return True

    # ---------------------------------------------------------------- submissions

    def submission(self, step: int, worker: str, k: int) -> SubmissionRecord | None:
        with self._lock:
            return self._s.by_name.get((step, worker, k))

    def stored_bytes(self, step: int, worker: str) -> int:
        """The bytes of ``worker``'s submissions at ``step`` (stored, or declared for S3)."""
        with self._lock:
            return sum(r.size for r in self._s.subs.get(step, []) if r.worker == worker)

    def submissions(self, step: int, worker: str | None = None) -> list[SubmissionRecord]:
        """The records of ``step`` in arrival order (only ``worker``'s, if given)."""
        with self._lock:
            return [r for r in self._s.subs.get(step, []) if worker is None or r.worker == worker]

    def claim(self, step: int, worker: str, k: int, refill: bool = False) -> SubmissionRecord | None:
        """Reserve the name ``(step, worker, k)`` for a write, or return its record if it has one.
        :class:`Refusal` ``finished`` after the worker's done record for ``step`` (unless ``refill``: the
        online filter asks for more of the step), ``busy`` while another request is writing the name.
        :meth:`release` after."""
        with self._lock:
            name = (step, worker, k)
            if name in self._s.by_name:
                return self._s.by_name[name]
            if not refill and worker in self._s.done.get(step, {}):
                raise Refusal(409, "finished", f"step {step} is finished: no new submissions")
            if name in self._pending:
                raise Refusal(409, "busy", "another request is storing this submission")
            self._pending.add(name)
            return None

    def release(self, step: int, worker: str, k: int, record: SubmissionRecord | None = None) -> None:
        """End a :meth:`claim`: record ``record`` (persisted) or give the name back."""
        with self._lock:
            try:
                if record is not None:
                    self._append(record)
            finally:
                self._pending.discard((step, worker, k))

    # ---------------------------------------------------------------- done

    def done(self, step: int) -> dict[str, DoneRecord]:
        with self._lock:
            return dict(self._s.done.get(step, {}))

    def finish(self, record: DoneRecord) -> bool:
        """Record ``record`` (True); False when the same record exists; :class:`Refusal` ``conflict``
        when a different one does, ``unknown_file`` when it names a file the service does not hold
        for that worker and step, ``busy`` while one of them is being stored."""
        with self._lock:
            old = self._s.done.get(record.step, {}).get(record.worker)
            if old is not None:
                if (old.files, old.policy_step) == (record.files, record.policy_step):
                    return False
                raise Refusal(409, "conflict", f"step {record.step} was finished with other files or policy")
            held = {r.path for r in self._s.subs.get(record.step, []) if r.worker == record.worker}
            unknown = [f for f in record.files if f not in held]
            if unknown:
                raise Refusal(409, "unknown_file", f"not a submission of this worker at step {record.step}: "
                              f"{unknown[0][:200]!r}")
            if any(s == record.step and w == record.worker for s, w, _ in self._pending):
                raise Refusal(409, "busy", "a submission of this step is being stored")
            self._append(record)
            return True


def read_salts(state_dir: str | os.PathLike) -> dict[str, bytes]:
    """The salts a service's registry in ``state_dir`` holds, read without opening it for writing
    (a validator in a process beside the service's); empty when there is no registry."""
    path = Path(state_dir) / REGISTRY_FILE
    if not path.exists():
        return {}
    out: dict[str, bytes] = {}
    for line in path.read_bytes().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:  # a torn last line: the service cuts it off when it loads
            continue
        if isinstance(doc, dict) and doc.get("type") == "worker":
            rec = _record_from(doc)
            out.setdefault(rec.worker, check_salt(bytes.fromhex(rec.salt)))
    return out
