"""The ledger as a trust boundary: duplicates count accepted rows only, and a verdict table is checked
row by row before anything is written (issue 17, attacks 1 and 4)."""

from __future__ import annotations

import doctest
import math
from dataclasses import replace

import pyarrow as pa
import pytest

import intellect.ledger as ledger_mod
import intellect.verdict as verdict_mod
from intellect.ledger import Ledger, RecordResult
from intellect.rl.worker.submission import advantages_of
from intellect.verdict import MAX_ABS_ADVANTAGE, MAX_GROUP_SIZE, BadVerdictTable, LedgerError, Verdict, verdict_table
from ledger_rows import accepted_elsewhere, counts, verdicts, worker_rows


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "run" / "ledger.duckdb") as ledger:
        yield ledger


def copy_of(vs, worker, reason=None):
    """``vs`` filed by ``worker`` under its own file name, with the verdict the validator gave it."""
    return [replace(v, file=f"rollouts/step_{v.step}/{worker}-0.parquet", worker=worker,
                    status="rejected" if reason else "accepted", reason=reason) for v in vs]


def test_docstring_examples_hold():
    result = doctest.testmod(ledger_mod)
    assert result.attempted > 0 and result.failed == 0


def test_a_squatters_rejected_copy_does_not_poison_the_honest_rows_in_one_call(ledger):
    honest = verdicts(16, worker="worker-b")
    squat = copy_of(honest, "a-mallory", reason="assignment")  # sorts first, so it is recorded first
    res = ledger.record_verdicts(1, squat + honest)
    assert res == RecordResult(inserted=32, existing=0, duplicates=0, conflicts=0)
    assert [(a["worker"], a["row_index"]) for a in ledger.accepted(1)] == [("worker-b", i) for i in range(16)]
    assert counts(ledger) == [(1, "accepted", None, 16), (1, "rejected", "assignment", 16)]


def test_a_squatters_rejected_copy_does_not_poison_the_honest_rows_across_calls(ledger):
    honest = verdicts(16, worker="worker-b")
    ledger.record_verdicts(1, copy_of(honest, "a-mallory", reason="assignment"))
    assert not accepted_elsewhere(ledger, honest[0].content_hash)
    assert ledger.record_verdicts(1, honest).duplicates == 0
    assert len(ledger.accepted(1)) == 16 and {a["worker"] for a in ledger.accepted(1)} == {"worker-b"}
    assert accepted_elsewhere(ledger, honest[0].content_hash) and not accepted_elsewhere(ledger, honest[0].content_hash,
                                                                                       honest[0].file, 0)


def test_only_the_first_accepted_copy_stays_accepted(ledger):
    first = verdicts(4, worker="w1")
    # one call: rejected copy, accepted original, two accepted copies; the first accepted one wins
    res = ledger.record_verdicts(1, copy_of(first, "w0", "toploc_sampling") + first + copy_of(first, "w2")
                                 + copy_of(first, "w3"))
    assert res.duplicates == 8
    assert {a["worker"] for a in ledger.accepted(1)} == {"w1"}
    # across calls and steps: a later accepted copy is a duplicate, a later rejected one keeps its reason
    later = [replace(v, step=2, policy_step=2) for v in copy_of(first, "w4")]
    assert ledger.record_verdicts(2, later).duplicates == 4 and ledger.accepted(2) == []
    ledger.record_verdicts(2, [replace(v, step=2, policy_step=2) for v in copy_of(first, "w5", "seed")])
    assert counts(ledger) == [(1, "accepted", None, 4), (1, "rejected", "duplicate", 8),
                              (1, "rejected", "toploc_sampling", 4), (2, "rejected", "duplicate", 4),
                              (2, "rejected", "seed", 4)]


def forge(table: pa.Table, i: int, **values) -> pa.Table:
    """``table`` with the given columns of its row ``i`` replaced (types kept)."""
    for name, value in values.items():
        col = table[name].to_pylist()
        col[i] = value
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(col, table.schema.field(name).type))
    return table


def test_the_forged_verdict_file_is_refused_whole(ledger):
    """Attack 1: a worker rewrites its verdict file between validate and record: 16 rows the validator
    rejected become accepted, each with advantage 1e6."""
    table = verdict_table(verdicts(16, worker="mallory", reject=set(range(16))))
    for i in range(16):
        table = forge(table, i, status="accepted", reason=None, advantage=1e6, reward=1.0)
    with pytest.raises(BadVerdictTable, match=r"verdict row 0 \(rollouts/step_1/mallory-0.parquet:0\): advantage") as e:
        ledger.record_table(1, table)
    assert isinstance(e.value, LedgerError) and isinstance(e.value, ValueError)
    assert ledger.summary() == [] and worker_rows(ledger) == [] and ledger.accepted(1) == []


@pytest.mark.parametrize(
    "row, values, field",
    [
        (0, dict(status="maybe"), "status"),
        (0, dict(status=None), "status"),
        (1, dict(reason="assignment"), "reason"),  # an accepted row with a reason
        (2, dict(status="rejected", reason=None), "reason"),
        (2, dict(status="rejected", reason="x" * 65), "reason"),
        (2, dict(status="rejected", reason="DROP TABLE rollouts; --"), "reason"),
        (1, dict(reward=math.nan), "reward"),
        (1, dict(reward=math.inf), "reward"),
        (1, dict(reward=2e6), "reward"),
        (1, dict(advantage=-math.inf), "advantage"),
        (1, dict(advantage=MAX_ABS_ADVANTAGE * 1.01), "advantage"),
        (1, dict(advantage=None), "missing on a sample row"),
        (3, dict(step=2), "step"),
        (1, dict(worker="W1"), "worker"),
        (1, dict(worker="a/b"), "worker"),
        (1, dict(submission=-1), "submission"),
        (1, dict(content_hash="zz"), "content_hash"),
        (1, dict(policy_step=5), "policy_step"),
        (1, dict(policy_step=-1), "policy_step"),
        (1, dict(group_id=-3), "group_id"),
        (1, dict(prompt_tokens=-1), "prompt_tokens"),
        (1, dict(output_tokens=1 << 30), "output_tokens"),
        (1, dict(file=""), "file"),
        (1, dict(file="x" * 2000), "file"),
        (1, dict(row=-2), "row"),
        (1, dict(row=-1), "row"),  # a whole-file verdict that is accepted
    ],
)
def test_every_field_is_bounded_and_a_bad_row_writes_nothing(ledger, row, values, field):
    table = forge(verdict_table(verdicts(4, reject={3})), row, **values)
    with pytest.raises(BadVerdictTable, match=rf"verdict row {row} .*{field}"):
        ledger.record_table(1, table)
    assert ledger.summary() == [] and worker_rows(ledger) == []  # the good rows before it are not written either
    assert ledger.record_table(1, verdict_table(verdicts(4, reject={3}))).inserted == 4


def test_the_first_bad_row_is_named(ledger):
    table = forge(forge(verdict_table(verdicts(6)), 4, reward=math.nan), 2, advantage=1e6)
    with pytest.raises(BadVerdictTable, match=r"verdict row 2 .*advantage"):
        ledger.record_table(1, table)


def test_rejected_rows_keep_the_workers_claims_within_the_wide_bound(ledger):
    # a rejected row carries what the worker claimed; RolloutLimits allows |advantage| up to its own bound
    vs = [replace(v, advantage=99.0) for v in verdicts(2, reject={0, 1})]
    assert ledger.record_verdicts(1, vs).inserted == 2
    with pytest.raises(BadVerdictTable, match="advantage"):
        ledger.record_verdicts(1, [replace(verdicts(1, reject={0})[0], file="rollouts/step_1/w1-1.parquet",
                                           submission=1, advantage=2e6)])


def test_the_advantage_bound_holds_for_real_grpo_groups():
    # the largest |z| of a group is one outlier among equal values: (n - 1) / sqrt(n)
    for n in (2, 16, 1000, MAX_GROUP_SIZE):
        adv = advantages_of([1.0] + [0.0] * (n - 1), [0] * n)
        assert max(abs(a) for a in adv) <= MAX_ABS_ADVANTAGE
        assert max(abs(a) for a in adv) == pytest.approx((n - 1) / math.sqrt(n), rel=1e-3)


def test_an_honest_validator_table_records(ledger):
    rows = [Verdict.file_rejected("rollouts/step_1/w9-0.parquet", 1, "w9", 0, "too_large")]
    rows += verdicts(8, reject={1, 5})
    assert ledger.record_table(1, verdict_table(rows)).inserted == 9


def test_verdict_docstring_examples_hold():
    result = doctest.testmod(verdict_mod)
    assert result.attempted > 0 and result.failed == 0
