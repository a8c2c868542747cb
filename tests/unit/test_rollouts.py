"""Rollout files: schema, atomic writes through RunStorage, and a reader that rejects with a reason."""

from __future__ import annotations

import doctest
import io
import pickle
import random
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_files import LIMITS, make_rows

from intellect.rl.wire import rollout_schema
from intellect.rl.wire.rollouts import (
    REASONS,
    SCHEMA,
    SCHEMA_VERSION,
    VERSION_KEY,
    RolloutLimits,
    RolloutRejected,
    Tokens,
    content_hash,
    encode_submission,
    list_submissions,
    load_submission,
    parse_submission_path,
    read_submission,
    rows_to_table,
    submission_path,
    write_submission,
)
from intellect.storage import RunStorage


def to_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def with_column(name, values, type_=None, table=None):
    table = rows_to_table(make_rows()) if table is None else table
    i = table.schema.get_field_index(name)
    field = pa.field(name, type_ or table.schema.field(name).type)
    return table.set_column(i, field, pa.array(values, type=field.type))


def reason_of(data, limits=LIMITS, **expect):
    with pytest.raises(RolloutRejected) as e:
        read_submission(data, limits, **expect)
    assert e.value.reason in REASONS
    return e.value.reason


@pytest.fixture
def store(tmp_path):
    return RunStorage(f"file://{tmp_path}/run")


def test_schema_is_versioned_and_documented():
    assert SCHEMA.metadata == {VERSION_KEY: str(SCHEMA_VERSION).encode()}
    for name in SCHEMA.names:
        assert f"\n{name} " in rollout_schema.__doc__
    assert [f.name for f in SCHEMA if f.nullable] == ["target_length"]


def test_docstring_examples_hold():
    result = doctest.testmod(rollout_schema)
    assert result.attempted > 0 and result.failed == 0


def test_round_trip_through_run_storage(store):
    rows = make_rows()
    rel = write_submission(store, 3, "W1", 0, rows, limits=LIMITS)
    assert rel == "rollouts/step_3/w1-0.parquet" == submission_path(3, "w1", 0)
    assert parse_submission_path(rel) == (3, "w1", 0)
    assert list_submissions(store, 3) == [rel]
    assert load_submission(store, rel, LIMITS, run="run-a", async_level=2) == rows
    assert read_submission(store.read_bytes(rel), LIMITS) == rows
    assert not [n for n in store.listdir("rollouts/step_3") if n != "w1-0.parquet"]  # no temp files left


def test_read_from_a_local_path(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(encode_submission(make_rows()))
    assert read_submission(path, LIMITS) == make_rows()
    assert read_submission(str(path), LIMITS, step=3, worker="w1", submission=0) == make_rows()
    assert reason_of(tmp_path / "missing.parquet") == "unreadable"


def test_writer_refuses_overwrites_stable_steps_and_mislabelled_rows(store):
    rel = write_submission(store, 3, "w1", 0, make_rows())
    with pytest.raises(FileExistsError):
        write_submission(store, 3, "w1", 0, make_rows())
    write_submission(store, 3, "w1", 0, make_rows(2), overwrite=True)
    assert len(load_submission(store, rel, LIMITS)) == 2
    with pytest.raises(ValueError):
        write_submission(store, 3, "w1", 1, make_rows())  # rows claim k=0
    with pytest.raises(ValueError):
        write_submission(store, 3, "w1", 1, [])
    with pytest.raises(RolloutRejected):
        write_submission(store, 3, "w1", 1, [replace(make_rows()[0], submission=1, reward=99.0)], limits=LIMITS)
    store.mark_stable(3, "rollouts")
    with pytest.raises(FileExistsError):
        write_submission(store, 3, "w1", 5, make_rows(k=5))


def test_paths():
    assert submission_path(0, "Node-7", 12) == "rollouts/step_0/node-7-12.parquet"
    assert parse_submission_path("rollouts/step_0/node-7-12.parquet") == (0, "node-7", 12)
    for bad in ["rollouts/step_01/w-0.parquet", "rollouts/step_1/w.parquet", "rollouts/step_1/W-0.parquet",
                "rollouts/step_1/w-01.parquet", "other/step_1/w-0.parquet", "rollouts/step_1/x/w-0.parquet"]:
        with pytest.raises(ValueError):
            parse_submission_path(bad)
    for args in [(-1, "w", 0), (1, "a/b", 0), (1, "w", -1), (1, "w", True)]:
        with pytest.raises(ValueError):
            submission_path(*args)


def test_list_ignores_foreign_names(store):
    write_submission(store, 1, "b", 0, make_rows(step=1, worker="b"))
    write_submission(store, 1, "a", 2, make_rows(step=1, worker="a", k=2))
    store.write_bytes("rollouts/step_1/notes.txt", b"x")
    assert list_submissions(store, 1) == ["rollouts/step_1/a-2.parquet", "rollouts/step_1/b-0.parquet"]
    assert list_submissions(store, 9) == []


def test_foreign_list_child_names_are_accepted():
    t = rows_to_table(make_rows())
    elem = pa.list_(pa.field("element", pa.int32()))
    t = t.set_column(8, pa.field("prompt_tokens", elem), t["prompt_tokens"].cast(elem))
    assert read_submission(to_bytes(t), LIMITS) == make_rows()


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"PAR1" + b"\0" * 100 + b"PAR1", bytes(range(256)) * 10],
    ids=["empty", "text", "fake-magic", "binary"],
)
def test_garbage_is_unreadable(data):
    assert reason_of(data) == "unreadable"


def test_truncated_file_is_unreadable():
    data = encode_submission(make_rows())
    for cut in (4, len(data) // 2, len(data) - 1):
        assert reason_of(data[:cut]) == "unreadable"


def test_random_corruption_never_crashes():
    data = encode_submission(make_rows())
    rng = random.Random(0)
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            read_submission(bytes(b), LIMITS)
        except RolloutRejected as e:
            assert e.reason in REASONS


def test_size_bounds():
    data = encode_submission(make_rows())
    small = LIMITS.model_copy(update={"max_file_bytes": len(data) - 1})
    assert reason_of(data, small) == "too_large"
    assert reason_of(encode_submission(make_rows(n=17))) == "too_large"


def test_decoded_size_is_bounded():
    rows = [replace(r, proof=b"\x00" * (1 << 16)) for r in make_rows(16)]  # 1 MiB that compresses to little
    data = encode_submission(rows)
    assert len(data) < 1 << 15
    assert reason_of(data, LIMITS.model_copy(update={"max_decoded_bytes": 1 << 18})) == "too_large"


def test_version_is_checked():
    t = rows_to_table(make_rows())
    assert reason_of(to_bytes(t.replace_schema_metadata(None))) == "version"
    assert reason_of(to_bytes(t.replace_schema_metadata({VERSION_KEY: b"2"}))) == "version"


def test_schema_is_checked():
    t = rows_to_table(make_rows())
    assert reason_of(to_bytes(t.drop_columns(["proof"]))) == "schema"
    assert reason_of(to_bytes(t.append_column("extra", pa.array([1] * 4)))) == "schema"
    assert reason_of(to_bytes(with_column("reward", [1.0] * 4, pa.float64()))) == "schema"
    assert reason_of(to_bytes(with_column("prompt_tokens", [[1]] * 4, pa.list_(pa.int64())))) == "schema"
    assert reason_of(to_bytes(with_column("seed", [1] * 4, pa.int64()))) == "schema"
    nullable = pa.schema([f.with_nullable(True) for f in SCHEMA], metadata=SCHEMA.metadata)
    t = t.cast(nullable)
    assert reason_of(to_bytes(with_column("prompt_id", ["a", None, "b", "c"], table=t))) == "schema"
    assert reason_of(to_bytes(with_column("output_tokens", [[1, None]] * 4, table=t))) == "schema"


def test_empty_file():
    assert reason_of(to_bytes(rows_to_table(make_rows()).slice(0, 0))) == "empty"


@pytest.mark.parametrize("name", ["reward", "task_reward", "length_penalty", "advantage"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(name, bad):
    assert reason_of(to_bytes(with_column(name, [0.0, bad, 0.0, 0.0]))) == "nan"


@pytest.mark.parametrize(
    "name, values",
    [
        ("reward", [0.0, 10.5, 0.0, 0.0]),
        ("task_reward", [-11.0, 0.0, 0.0, 0.0]),
        ("advantage", [0.0, 0.0, 101.0, 0.0]),
        ("length_penalty", [0.0, -101.0, 0.0, 0.0]),
        ("prompt_tokens", [[1], [50], [1], [1]]),  # id == vocab_size
        ("prompt_tokens", [[1], [-1], [1], [1]]),
        ("prompt_tokens", [[1], [], [1], [1]]),
        ("prompt_tokens", [[1] * 9, [1], [1], [1]]),
        ("output_tokens", [[1], [], [1], [1]]),
        ("output_tokens", [[1] * 13, [1], [1], [1]]),
        ("finish_reason", ["stop", "abort", "stop", "stop"]),
        ("proof", [b"", b"x" * 517, b"", b""]),
        ("prompt_id", ["", "a", "b", "c"]),
        ("prompt_id", ["a" * 257, "a", "b", "c"]),
        ("group_id", [0, -1, 0, 0]),
        ("group_id", [0, 16, 0, 0]),
        ("target_length", [None, 0, 5, 5]),
        ("policy_step", [-1] * 4),
        ("step", [-1] * 4),
        ("submission", [-2] * 4),
    ],
)
def test_out_of_range(name, values):
    assert reason_of(to_bytes(with_column(name, values))) == "range"


@pytest.mark.parametrize(
    "name, values",
    [
        ("worker", ["w1", "w2", "w1", "w1"]),
        ("worker", ["W1"] * 4),  # not canonical
        ("worker", ["../x"] * 4),
        ("run", ["a", "a", "b", "a"]),
        ("run", ["bad run"] * 4),
        ("policy_step", [2, 3, 2, 2]),
        ("submission", [0, 1, 0, 0]),
        ("step", [3, 4, 3, 3]),
    ],
)
def test_identity_must_be_uniform_and_valid(name, values):
    assert reason_of(to_bytes(with_column(name, values))) == "identity"


def test_identity_must_match_the_file():
    data = encode_submission(make_rows())
    assert reason_of(data, step=4) == "wrong_step"
    assert reason_of(data, worker="w2") == "identity"
    assert reason_of(data, submission=1) == "identity"
    assert reason_of(data, run="run-b") == "identity"
    assert read_submission(data, LIMITS, step=3, worker="W1", submission=0, run="run-a") == make_rows()


def test_file_in_the_wrong_step_folder_is_rejected(store):
    store.write_bytes("rollouts/step_4/w1-0.parquet", encode_submission(make_rows(step=3)))
    store.write_bytes("rollouts/step_4/w2-0.parquet", encode_submission(make_rows(step=4)))
    with pytest.raises(RolloutRejected, match="wrong_step"):
        load_submission(store, "rollouts/step_4/w1-0.parquet", LIMITS)
    with pytest.raises(RolloutRejected, match="identity"):
        load_submission(store, "rollouts/step_4/w2-0.parquet", LIMITS)  # rows are w1's
    with pytest.raises(RolloutRejected, match="identity"):
        load_submission(store, "rollouts/step_4/bad name.parquet", LIMITS)
    with pytest.raises(RolloutRejected, match="unreadable"):
        load_submission(store, "rollouts/step_4/w3-0.parquet", LIMITS)


@pytest.mark.parametrize("async_level, policy_step, ok", [(0, 3, True), (0, 2, False), (2, 1, True), (2, 0, False)])
def test_stale_samples(async_level, policy_step, ok):
    data = encode_submission(make_rows(policy_step=policy_step))
    if ok:
        assert read_submission(data, LIMITS, async_level=async_level)
    else:
        assert reason_of(data, async_level=async_level) == "stale"
    assert reason_of(encode_submission(make_rows(policy_step=4)), async_level=2) == "stale"  # from the future



def test_under_a_fixed_lag_a_worker_claiming_a_fresher_checkpoint_is_rejected():
    # step 3 at async_level 2: "newest" takes checkpoints 1..3, "fixed" checkpoint 1 alone, so a lying
    # worker cannot make the run train on fresher samples than the honest ones
    for policy_step in (1, 2, 3):
        assert read_submission(encode_submission(make_rows(policy_step=policy_step)), LIMITS, async_level=2)
    assert read_submission(encode_submission(make_rows(policy_step=1)), LIMITS, async_level=2, policy_lag="fixed")
    for policy_step in (0, 2, 3):
        data = encode_submission(make_rows(policy_step=policy_step))
        assert reason_of(data, async_level=2, policy_lag="fixed") == "stale"

def test_bounds_hold_for_float32_values():
    limits = LIMITS.model_copy(update={"reward_min": -0.1, "reward_max": 0.1})
    rows = [replace(r, reward=0.1 if i % 2 else -0.1, task_reward=0.1) for i, r in enumerate(make_rows())]
    assert len(read_submission(encode_submission(rows), limits)) == 4


def test_rejection_carries_a_reason_code():
    e = RolloutRejected("nan", "reward")
    assert (e.reason, e.detail, str(e)) == ("nan", "reward", "nan: reward") and isinstance(e, ValueError)
    with pytest.raises(ValueError):
        RolloutRejected("bogus", "x")


def test_limits_are_strict():
    with pytest.raises(ValueError):
        RolloutLimits(vocab_size=10, reward_min=1, reward_max=1)
    with pytest.raises(ValueError):
        RolloutLimits(vocab_size=10, max_rowz=3)
    with pytest.raises(ValueError):
        RolloutLimits()


def test_content_hash_is_what_the_sample_is():
    r = make_rows()[1]
    h = r.content_hash
    assert h == content_hash(list(r.prompt_tokens), list(r.output_tokens), r.seed)
    assert replace(r, worker="w9", step=8, submission=3, reward=0.0, proof=b"").content_hash == h
    assert replace(r, seed=r.seed + 1).content_hash != h
    assert replace(r, output_tokens=r.output_tokens + (1,)).content_hash != h
    # token boundaries are encoded: moving a token from prompt to output changes the hash
    assert content_hash((1, 2), (3,), 0) != content_hash((1,), (2, 3), 0)
    assert content_hash((1, 2), (3,), 0) == "%s" % content_hash((1, 2), (3,), 0)


def test_read_tokens_are_views_of_the_decoded_column_and_behave_as_tuples():
    rows = read_submission(encode_submission(make_rows()), LIMITS)
    tokens = [r.output_tokens for r in rows]
    assert all(isinstance(t, Tokens) for t in tokens)
    assert [tuple(t) for t in tokens] == [r.output_tokens for r in make_rows()]
    # one int32 buffer behind every row, back to back (no Python int per token), read-only
    arrays = [np.asarray(t) for t in tokens]
    assert all(b.ctypes.data == a.ctypes.data + a.nbytes for a, b in zip(arrays, arrays[1:]))
    assert arrays[0].dtype == np.int32 and not arrays[0].flags.writeable
    t = rows[1].output_tokens
    assert t == (4, 5) and (4, 5) == t and t != (4, 5, 6) and t != (4.5, 5) and t != "45" and hash(t) == hash((4, 5))
    assert t[-1] == 5 and t[:1] == (4,) and 5 in t and 6 not in t and list(reversed(t)) == [5, 4]
    assert pickle.loads(pickle.dumps(rows)) == rows == make_rows() and len({*rows, *make_rows()}) == len(rows)
    assert rows_to_table(rows).equals(rows_to_table(make_rows()))  # read rows write back unchanged
    assert rows[1].content_hash == make_rows()[1].content_hash
