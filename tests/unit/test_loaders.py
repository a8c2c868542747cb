"""Task-file loaders: JSONL and Parquet, strict errors that name the row, lenient loading."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import intellect.data.loaders as loaders
from intellect.config import DataConfig
from intellect.data import (
    CodeTask,
    LoadResult,
    MathTask,
    RowError,
    TaskFileError,
    heldout_problems,
    load_code_tasks,
    load_math_tasks,
    write_tasks_jsonl,
)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    return write_lines(path, [json.dumps(r) for r in rows])


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_docstring_examples_hold():
    result = doctest.testmod(loaders, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------- math, happy path


def test_math_jsonl_loads(tmp_path):
    f = write_rows(
        tmp_path / "tasks.jsonl",
        [
            {"prompt": "2+2=", "answer": "4"},
            {"prompt": "3*3=", "answer": 9, "id": "sq3", "extra": [1, 2]},
            {"prompt": "1/2=", "answer": 0.5},
            {"prompt": "6/2=", "answer": 3.0, "id": 17},
        ],
    )
    result = load_math_tasks(f)
    assert isinstance(result, LoadResult)
    assert result.errors == []
    assert result.tasks == [
        MathTask("tasks-1", "2+2=", "4"),
        MathTask("sq3", "3*3=", "9"),
        MathTask("tasks-3", "1/2=", "0.5"),
        MathTask("17", "6/2=", "3"),
    ]
    assert len(result) == 4 and list(result) == result.tasks


def test_math_jsonl_skips_blank_lines_but_numbers_rows_by_line(tmp_path):
    f = write_lines(tmp_path / "t.jsonl", ['{"prompt": "a", "answer": "1"}', "", "   ", '{"prompt": "b", "answer": "2"}'])
    assert [t.id for t in load_math_tasks(f).tasks] == ["t-1", "t-4"]


def test_math_jsonl_tolerates_bom_and_crlf(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\r\n{"prompt": "b", "answer": "2"}\r\n')
    assert [t.prompt for t in load_math_tasks(f).tasks] == ["a", "b"]


def test_math_parquet_loads(tmp_path):
    f = write_parquet(tmp_path / "tasks.parquet", {"prompt": ["2+2=", "3*3="], "answer": [4, 9]})
    assert load_math_tasks(f).tasks == [MathTask("tasks-1", "2+2=", "4"), MathTask("tasks-2", "3*3=", "9")]


def test_math_parquet_with_ids(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", {"id": ["x", None], "prompt": ["p", "q"], "answer": ["1", "2"]})
    assert [t.id for t in load_math_tasks(f).tasks] == ["x", "t-2"]


def test_path_may_be_a_string(tmp_path):
    f = write_rows(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}])
    assert load_math_tasks(str(f)).path == str(f)


# --------------------------------------------------------------------- strict errors name the row


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "2+2="}, "missing field 'answer'"),
        ({"answer": "4"}, "missing field 'prompt'"),
        ({"prompt": "2+2=", "answer": None}, "missing field 'answer'"),
        ({"prompt": "", "answer": "4"}, "field 'prompt' must be a non-empty string"),
        ({"prompt": 5, "answer": "4"}, "field 'prompt' must be a non-empty string"),
        ({"prompt": "2+2=", "answer": "  "}, "field 'answer' must be a non-empty string or a number"),
        ({"prompt": "2+2=", "answer": [4]}, "field 'answer' must be a non-empty string or a number"),
        ({"prompt": "2+2=", "answer": True}, "field 'answer' must be a string or a number (got a boolean)"),
        ({"prompt": "2+2=", "answer": "4", "id": ""}, "field 'id' must be a non-empty string or an integer"),
        ({"prompt": "2+2=", "answer": "4", "id": [1]}, "field 'id' must be a non-empty string or an integer"),
    ],
)
def test_math_strict_error_names_file_row_and_problem(tmp_path, row, reason):
    good = {"prompt": "1+1=", "answer": "2"}
    f = write_rows(tmp_path / "tasks.jsonl", [good, good | {"id": "b"}, row])
    with pytest.raises(TaskFileError) as info:
        load_math_tasks(f)
    msg = str(info.value)
    assert msg == f"{f} row 3: {reason}"
    assert "\n" not in msg
    assert isinstance(info.value, ValueError)


def test_nan_answer_is_a_bad_row(tmp_path):
    f = write_lines(tmp_path / "t.jsonl", ['{"prompt": "x", "answer": NaN}'])
    with pytest.raises(TaskFileError, match=r"row 1: field 'answer' must be a finite number"):
        load_math_tasks(f)


def test_bad_json_line_is_reported_by_row(tmp_path):
    f = write_lines(
        tmp_path / "tasks.jsonl",
        ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2=", "answer": "4"', '{"prompt": "3+3=", "answer": "6"}'],
    )
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl row 2: invalid JSON: Expecting ',' delimiter \(column \d+\)$"):
        load_math_tasks(f)


@pytest.mark.parametrize(
    "line, reason",
    [("[1, 2]", "expected a JSON object, got an array"), ('"text"', "expected a JSON object, got a string"),
     ("42", "expected a JSON object, got a number"), ("null", "expected a JSON object, got null")],
)
def test_non_object_rows_are_bad_rows(tmp_path, line, reason):
    f = write_lines(tmp_path / "t.jsonl", [line])
    with pytest.raises(TaskFileError, match=f"row 1: {reason}"):
        load_math_tasks(f)


def test_invalid_utf8_line_is_a_bad_row(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(TaskFileError, match=r"row 2: not valid UTF-8"):
        load_math_tasks(f)
    assert load_math_tasks(f, lenient=True).errors == [RowError(2, "not valid UTF-8 (byte 13)")]


def test_duplicate_ids_are_bad_rows(tmp_path):
    f = write_rows(
        tmp_path / "t.jsonl",
        [{"prompt": "a", "answer": "1", "id": "x"}, {"prompt": "b", "answer": "2", "id": "x"}],
    )
    with pytest.raises(TaskFileError, match=r"row 2: duplicate id 'x' \(first at row 1\)"):
        load_math_tasks(f)


# --------------------------------------------------------------------- lenient loading


def test_lenient_keeps_good_rows_and_reports_bad_ones(tmp_path):
    f = write_lines(
        tmp_path / "tasks.jsonl",
        [
            '{"prompt": "1+1=", "answer": "2"}',
            '{"prompt": "2+2="}',
            "not json",
            '{"prompt": "3+3=", "answer": 6}',
            "",
            '{"prompt": "", "answer": "0"}',
            '{"prompt": "4+4=", "answer": "8"}',
        ],
    )
    result = load_math_tasks(f, lenient=True)
    assert [t.prompt for t in result.tasks] == ["1+1=", "3+3=", "4+4="]
    assert [t.id for t in result.tasks] == ["tasks-1", "tasks-4", "tasks-7"]
    assert [e.row for e in result.errors] == [2, 3, 6]
    assert result.errors[0] == (2, "missing field 'answer'")
    assert result.errors[1].reason.startswith("invalid JSON: ")
    assert result.errors[2] == RowError(6, "field 'prompt' must be a non-empty string")


def test_lenient_with_no_good_rows_is_still_an_error(tmp_path):
    f = write_lines(tmp_path / "t.jsonl", ['{"prompt": "x"}', "oops"])
    with pytest.raises(TaskFileError, match=r"no valid rows \(2 bad; first: row 1: missing field 'answer'\)"):
        load_math_tasks(f, lenient=True)


def test_lenient_parquet_keeps_good_rows(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", {"prompt": ["a", None, "c", ""], "answer": ["1", "2", None, "4"]})
    result = load_math_tasks(f, lenient=True)
    assert result.tasks == [MathTask("t-1", "a", "1")]
    assert result.errors == [
        (2, "missing field 'prompt'"),
        (3, "missing field 'answer'"),
        (4, "field 'prompt' must be a non-empty string"),
    ]
    with pytest.raises(TaskFileError, match=r"t\.parquet row 2: missing field 'prompt'"):
        load_math_tasks(f)


# --------------------------------------------------------------------- file-level errors


@pytest.mark.parametrize("lenient", [False, True])
def test_empty_file_is_an_error(tmp_path, lenient):
    for f in (tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"):
        f.write_text("" if f.stem == "empty" else "\n  \n")
        with pytest.raises(TaskFileError, match=r"no rows \(the file is empty\)"):
            load_math_tasks(f, lenient=lenient)


def test_empty_parquet_is_an_error(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", {"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
    with pytest.raises(TaskFileError, match="no rows"):
        load_math_tasks(f)


@pytest.mark.parametrize("lenient", [False, True])
def test_parquet_missing_column_is_a_file_error(tmp_path, lenient):
    f = write_parquet(tmp_path / "t.parquet", {"question": ["a"], "answer": ["1"]})
    with pytest.raises(TaskFileError, match=r"t\.parquet: missing column 'prompt' \(columns: question, answer\)"):
        load_math_tasks(f, lenient=lenient)


def test_unreadable_parquet_is_a_clear_error(tmp_path):
    f = tmp_path / "t.parquet"
    f.write_text('{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(TaskFileError, match=r"t\.parquet: not a readable Parquet file: "):
        load_math_tasks(f)


@pytest.mark.parametrize("name", ["tasks.csv", "tasks.json", "tasks"])
def test_unknown_extension_is_a_clear_error(tmp_path, name):
    f = tmp_path / name
    f.write_text("prompt,answer\n")
    with pytest.raises(TaskFileError, match=r"unsupported task file extension .* \(use \.jsonl or \.parquet\)"):
        load_math_tasks(f)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TaskFileError, match=r"nope\.jsonl: file not found"):
        load_code_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(TaskFileError, match="not a file"):
        load_math_tasks(tmp_path / "dir.parquet")


def test_extension_is_case_insensitive(tmp_path):
    f = write_rows(tmp_path / "T.JSONL", [{"prompt": "a", "answer": "1"}])
    assert load_math_tasks(f).tasks == [MathTask("T-1", "a", "1")]


# --------------------------------------------------------------------- code tasks


def test_code_jsonl_loads(tmp_path):
    f = write_rows(
        tmp_path / "code.jsonl",
        [
            {"prompt": "def add(a, b):", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
            {"prompt": "def neg(a):", "tests": "assert neg(1) == -1", "id": "neg"},
        ],
    )
    assert load_code_tasks(f).tasks == [
        CodeTask("code-1", "def add(a, b):", ("assert add(1, 2) == 3", "assert add(0, 0) == 0")),
        CodeTask("neg", "def neg(a):", ("assert neg(1) == -1",)),
    ]


def test_code_parquet_loads(tmp_path):
    f = write_parquet(
        tmp_path / "code.parquet",
        {"prompt": ["def f():", "def g():"], "tests": [["assert f() is None"], ["assert g() == 1", "assert g()"]]},
    )
    result = load_code_tasks(f)
    assert [t.tests for t in result.tasks] == [("assert f() is None",), ("assert g() == 1", "assert g()")]


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "def f():"}, "missing field 'tests'"),
        ({"tests": ["assert True"]}, "missing field 'prompt'"),
        ({"prompt": "def f():", "tests": []}, "field 'tests' must be a non-empty list of strings"),
        ({"prompt": "def f():", "tests": [1, 2]}, "field 'tests' must be a non-empty list of strings"),
        ({"prompt": "def f():", "tests": ["ok", ""]}, "field 'tests' must be a non-empty list of strings"),
        ({"prompt": "def f():", "tests": ""}, "field 'tests' must be a non-empty list of strings"),
        ({"prompt": "def f():", "tests": {"a": "b"}}, "field 'tests' must be a non-empty list of strings"),
    ],
)
def test_code_strict_errors(tmp_path, row, reason):
    good = {"prompt": "def f():", "tests": ["assert True"]}
    rows = [good] * 6 + [row]
    f = write_rows(tmp_path / "code.jsonl", rows)
    with pytest.raises(TaskFileError) as info:
        load_code_tasks(f)
    assert str(info.value) == f"{f} row 7: {reason}"


def test_code_lenient(tmp_path):
    f = write_rows(
        tmp_path / "code.jsonl",
        [{"prompt": "a", "tests": ["t"]}, {"prompt": "b", "tests": []}, {"prompt": "c", "tests": "t"}],
    )
    result = load_code_tasks(f, lenient=True)
    assert [t.prompt for t in result.tasks] == ["a", "c"]
    assert result.errors == [RowError(2, "field 'tests' must be a non-empty list of strings")]


def test_code_loader_requires_tests_column_in_parquet(tmp_path):
    f = write_parquet(tmp_path / "c.parquet", {"prompt": ["a"], "answer": ["1"]})
    with pytest.raises(TaskFileError, match="missing column 'tests'"):
        load_code_tasks(f)


# --------------------------------------------------------------------- writing


def test_write_and_read_back_math(tmp_path):
    tasks = [p.to_task() for p in heldout_problems(DataConfig(), 20)] + [MathTask("unicode", "π ≈ ?", "3")]
    f = write_tasks_jsonl(tasks, tmp_path / "sub" / "heldout.jsonl")
    assert f == tmp_path / "sub" / "heldout.jsonl"
    assert load_math_tasks(f).tasks == tasks
    assert "π" in f.read_text(encoding="utf-8")


def test_write_and_read_back_code(tmp_path):
    tasks = [CodeTask("a", "def f():", ("assert f() is None",)), CodeTask("b", "x", ("t1", "t2"))]
    f = write_tasks_jsonl(tasks, tmp_path / "code.jsonl")
    assert load_code_tasks(f).tasks == tasks


def test_write_rejects_other_objects(tmp_path):
    with pytest.raises(TypeError, match="expected MathTask or CodeTask"):
        write_tasks_jsonl([{"prompt": "a"}], tmp_path / "x.jsonl")


def test_tasks_are_frozen_and_hashable():
    t = MathTask("a", "b", "c")
    with pytest.raises(AttributeError):
        t.answer = "d"  # type: ignore[misc]
    assert len({t, MathTask("a", "b", "c"), CodeTask("a", "b", ("c",))}) == 2
