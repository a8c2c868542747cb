"""Loaders for user task files: math (``prompt``, ``answer``) and code (``prompt``, ``tests``).

A task file is JSONL (one JSON object per line; blank lines are skipped) or
Parquet (one row per task). Rows are numbered from 1: the line number in a
JSONL file, the row index + 1 in a Parquet file. Fields other than the ones
below are ignored.

========  ==================================================================
math      ``prompt``: non-empty string; ``answer``: string or number (kept as
          a string, ``3.0`` becomes ``"3"``); ``id``: optional string or int
code      ``prompt``: non-empty string; ``tests``: non-empty list of
          non-empty strings that parse as Python, or one string; ``id``:
          optional
========  ==================================================================

A missing ``id`` defaults to ``"{file stem}-{row}"``; ids must be unique.

Strict loading (the default) stops at the first bad row with a one-line
:class:`TaskFileError`::

    tasks.jsonl row 3: missing field 'answer'

Lenient loading keeps the good rows and reports the bad ones by number in
:attr:`LoadResult.errors`. A file with no rows, or with no good rows, is an
error either way.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Iterator, Literal, NamedTuple, TypeVar, Union

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "CodeTask",
    "LoadResult",
    "MathTask",
    "RowError",
    "Task",
    "TaskFileError",
    "TaskKind",
    "load_code_tasks",
    "load_math_tasks",
    "load_tasks",
    "split_heldout",
    "task_of_row",
    "task_row",
    "write_tasks_jsonl",
]

SUFFIXES = (".jsonl", ".parquet")


class TaskFileError(ValueError):
    """A task file that cannot be loaded; the message is one line and names the file."""


@dataclass(frozen=True, slots=True)
class MathTask:
    """A prompt whose completion is checked against ``answer``."""

    id: str
    prompt: str
    answer: str


@dataclass(frozen=True, slots=True)
class CodeTask:
    """A prompt whose completion must pass ``tests`` (source snippets)."""

    id: str
    prompt: str
    tests: tuple[str, ...]


class RowError(NamedTuple):
    """A bad row: its 1-based number and what is wrong with it."""

    row: int
    reason: str


T = TypeVar("T", MathTask, CodeTask)
Task = Union[MathTask, CodeTask]
TaskKind = Literal["math", "code"]
AnyTask = TypeVar("AnyTask", bound=Task)


@dataclass(frozen=True)
class LoadResult(Generic[T]):
    """The tasks of a file and, in lenient mode, the rows that were skipped."""

    path: str
    tasks: list[T]
    errors: list[RowError] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the row number of each task

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[T]:
        return iter(self.tasks)


class _BadRow(Exception):
    """Internal: a row failed validation (the message is the reason)."""


# --------------------------------------------------------------------- row readers


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (line number, parsed object or _BadRow) for every non-blank line."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield number, _BadRow(f"not valid UTF-8 (byte {e.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            yield number, _BadRow(f"invalid JSON: {e.msg} (column {e.colno})")
        except RecursionError:
            yield number, _BadRow("invalid JSON: nested too deeply")


def _iter_parquet(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TaskFileError(f"{path}: not a readable Parquet file: {_one_line(e)}") from None
    missing = [name for name in required if name not in table.column_names]
    if missing:
        raise TaskFileError(
            f"{path}: missing column {', '.join(repr(m) for m in missing)} "
            f"(columns: {', '.join(table.column_names) or 'none'})"
        )
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, row


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# --------------------------------------------------------------------- field checks


def _require(row: dict[str, Any], name: str) -> Any:
    if name not in row or row[name] is None:
        raise _BadRow(f"missing field {name!r}")
    return row[name]


def _prompt(row: dict[str, Any]) -> str:
    value = _require(row, "prompt")
    if not isinstance(value, str) or not value.strip():
        raise _BadRow("field 'prompt' must be a non-empty string")
    return value


def _answer(row: dict[str, Any]) -> str:
    """``"357"``, ``357`` and ``357.0`` all become ``"357"``; ``1.5`` becomes ``"1.5"``."""
    value = _require(row, "answer")
    if isinstance(value, bool):
        raise _BadRow("field 'answer' must be a string or a number (got a boolean)")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadRow(f"field 'answer' must be a finite number (got {value})")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise _BadRow("field 'answer' must be a non-empty string or a number")


def _tests(row: dict[str, Any]) -> tuple[str, ...]:
    value = _require(row, "tests")
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(t, str) and t.strip() for t in value)
    ):
        raise _BadRow("field 'tests' must be a non-empty list of strings")
    for i, test in enumerate(value, start=1):
        try:
            ast.parse(test)
        except SyntaxError as e:
            where = f" (line {e.lineno})" if e.lineno else ""
            raise _BadRow(f"test {i} is not Python: {e.msg}{where}") from None
        except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
            raise _BadRow(f"test {i} is not Python: {_one_line(e)}") from None
    return tuple(value)


def _id(row: dict[str, Any], default: str) -> str:
    value = row.get("id")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise _BadRow("field 'id' must be a non-empty string or an integer")
    return str(value).strip()


def _math_task(row: dict[str, Any], default_id: str) -> MathTask:
    return MathTask(id=_id(row, default_id), prompt=_prompt(row), answer=_answer(row))


def _code_task(row: dict[str, Any], default_id: str) -> CodeTask:
    return CodeTask(id=_id(row, default_id), prompt=_prompt(row), tests=_tests(row))


# --------------------------------------------------------------------- loading


def _load(
    path: str | Path,
    lenient: bool,
    required: tuple[str, ...],
    build: Callable[[dict[str, Any], str], T],
) -> LoadResult[T]:
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise TaskFileError(
            f"{path}: unsupported task file extension {p.suffix or '(none)'!r} (use .jsonl or .parquet)"
        )
    if not p.is_file():
        raise TaskFileError(f"{path}: file not found" if not p.exists() else f"{path}: not a file")
    rows = _iter_jsonl(p) if suffix == ".jsonl" else _iter_parquet(p, required)

    tasks: list[T] = []
    numbers: list[int] = []
    errors: list[RowError] = []
    first_row: dict[str, int] = {}
    seen_rows = 0
    for number, row in rows:
        seen_rows += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            if not isinstance(row, dict):
                raise _BadRow(f"expected a JSON object, got {_json_type(row)}")
            task = build(row, f"{p.stem}-{number}")
            if task.id in first_row:
                raise _BadRow(f"duplicate id {task.id!r} (first at row {first_row[task.id]})")
        except _BadRow as e:
            if not lenient:
                raise TaskFileError(f"{path} row {number}: {e}") from None
            errors.append(RowError(number, str(e)))
            continue
        first_row[task.id] = number
        tasks.append(task)
        numbers.append(number)

    if seen_rows == 0:
        raise TaskFileError(f"{path}: no rows (the file is empty)")
    if not tasks:
        row, reason = errors[0]
        raise TaskFileError(f"{path}: no valid rows ({len(errors)} bad; first: row {row}: {reason})")
    return LoadResult(path=str(path), tasks=tasks, errors=errors, rows=numbers)


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, (int, float)) else type(value).__name__


def load_math_tasks(path: str | Path, lenient: bool = False) -> LoadResult[MathTask]:
    """Math tasks (``prompt``, ``answer``, optional ``id``) from a .jsonl or .parquet file.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> f = os.path.join(d, "tasks.jsonl")
    >>> _ = open(f, "w").write('{"prompt": "2+2=", "answer": 4}\\n{"prompt": "3*3="}\\n')
    >>> load_math_tasks(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    intellect.data.loaders.TaskFileError: .../tasks.jsonl row 2: missing field 'answer'
    >>> r = load_math_tasks(f, lenient=True)
    >>> r.tasks, r.errors
    ([MathTask(id='tasks-1', prompt='2+2=', answer='4')], [RowError(row=2, reason="missing field 'answer'")])
    """
    return _load(path, lenient, ("prompt", "answer"), _math_task)


def load_code_tasks(path: str | Path, lenient: bool = False) -> LoadResult[CodeTask]:
    """Code tasks (``prompt``, ``tests``, optional ``id``) from a .jsonl or .parquet file.

    ``tests`` may be one string or a list of strings; it is stored as a tuple.
    """
    return _load(path, lenient, ("prompt", "tests"), _code_task)


def is_heldout_task(task: MathTask | CodeTask, percent: int) -> bool:
    """Whether ``task`` is in the ``percent`` held-out split of its file. The split hashes the prompt
    (not the id or the row), so it survives reordering and renaming, duplicates of a prompt fall on
    the same side, and a split at a larger percent contains the one at a smaller percent.

    >>> [is_heldout_task(MathTask("a", "What is 3+5?", "8"), pct) for pct in (10, 40, 50)]  # hashes to 43
    [False, False, True]
    """
    digest = hashlib.sha256(b"intellect/heldout-task/v1\0" + task.prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def split_heldout(tasks: Iterable[AnyTask], percent: int) -> tuple[list[AnyTask], list[AnyTask]]:
    """``(train, heldout)``: the tasks outside and inside the ``percent`` split, each in file order."""
    train: list[AnyTask] = []
    heldout: list[AnyTask] = []
    for t in tasks:
        (heldout if is_heldout_task(t, percent) else train).append(t)
    return train, heldout


def load_tasks(path: str | Path, kind: TaskKind, lenient: bool = False) -> LoadResult:
    """:func:`load_math_tasks` or :func:`load_code_tasks`, as ``kind`` says."""
    return load_code_tasks(path, lenient) if kind == "code" else load_math_tasks(path, lenient)


def task_row(task: Task) -> dict[str, Any]:
    """``task`` as the JSON object of a task file row; the one form tasks travel in (task files, the
    service's assignments, the filter's scores).

    >>> task_row(CodeTask("c1", "Write f.", ("assert f() == 1",)))
    {'id': 'c1', 'prompt': 'Write f.', 'tests': ['assert f() == 1']}
    """
    if isinstance(task, MathTask):
        return {"id": task.id, "prompt": task.prompt, "answer": task.answer}
    if isinstance(task, CodeTask):
        return {"id": task.id, "prompt": task.prompt, "tests": list(task.tests)}
    raise TypeError(f"expected MathTask or CodeTask, got {type(task).__name__}")


def task_of_row(row: Any, kind: TaskKind) -> Task:
    """The ``kind`` task of a :func:`task_row` object, checked as a file's rows are (an ``id`` is
    required); ``ValueError`` naming what is wrong.

    >>> task_of_row({"id": "a", "prompt": "2+2=", "answer": 4}, "math")
    MathTask(id='a', prompt='2+2=', answer='4')
    >>> task_of_row({"id": "a", "prompt": "2+2="}, "math")
    Traceback (most recent call last):
    ...
    ValueError: missing field 'answer'
    """
    try:
        if not isinstance(row, dict):
            raise _BadRow(f"expected a JSON object, got {_json_type(row)}")
        _require(row, "id")
        return _code_task(row, "") if kind == "code" else _math_task(row, "")
    except _BadRow as e:
        raise ValueError(str(e)) from None


def write_tasks_jsonl(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL that :func:`load_math_tasks` / :func:`load_code_tasks` read back.

    Returns the path written; parent folders are created.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(task_row(t), ensure_ascii=False) + "\n" for t in tasks), encoding="utf-8")
    return p
