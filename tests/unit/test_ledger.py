"""The DuckDB ledger: idempotent verdicts, duplicate rule, atomic steps. Crash safety across processes:
tests/integration/test_ledger_processes.py."""

from __future__ import annotations

from dataclasses import replace

import duckdb
import pytest
from ledger_rows import accepted_elsewhere, counts, rollout, verdicts, worker_rows

from intellect.ledger import LEDGER_SCHEMA_VERSION, Ledger, RecordResult, StepMetrics
from intellect.verdict import LedgerError, Verdict, verdict_table


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "run" / "ledger.duckdb") as ledger:
        yield ledger


def test_schema_is_versioned(tmp_path):
    path = tmp_path / "l.duckdb"
    Ledger(path).close()
    Ledger(path).close()  # reopening an existing ledger is fine
    con = duckdb.connect(str(path))
    assert con.execute("SELECT value FROM meta").fetchall() == [(str(LEDGER_SCHEMA_VERSION),)]
    con.execute("UPDATE meta SET value = '999'")
    con.close()
    with pytest.raises(LedgerError, match="schema 999"):
        Ledger(path)


def test_record_and_read_the_trainer_input(ledger):
    res = ledger.record_verdicts(1, verdicts(4, reject={2}))
    assert res == RecordResult(inserted=4, existing=0, duplicates=0, conflicts=0)
    acc = ledger.accepted(1)
    assert [(a["file"], a["row_index"]) for a in acc] == [("rollouts/step_1/w1-0.parquet", i) for i in (0, 1, 3)]
    assert acc[0]["content_hash"] == rollout(0).content_hash and acc[1]["output_tokens"] == 2
    assert counts(ledger) == [(1, "accepted", None, 3), (1, "rejected", "toploc", 1)]
    assert ledger.accepted(2) == []


def test_recording_twice_counts_once(ledger):
    vs = verdicts(6, reject={1})
    ledger.record_verdicts(1, vs)
    before = (counts(ledger), ledger.accepted(1))
    assert ledger.record_verdicts(1, vs) == RecordResult(0, 6, 0, 0)
    assert ledger.record_verdicts(1, vs + vs) == RecordResult(0, 12, 0, 0)
    assert (counts(ledger), ledger.accepted(1)) == before


def test_rerun_after_a_partial_step_loses_and_doubles_nothing(ledger):
    vs = verdicts(4) + verdicts(4, worker="w2", seed0=100)
    ledger.record_verdicts(1, vs[:3])  # the flow crashed after recording part of the step
    assert ledger.record_verdicts(1, vs) == RecordResult(5, 3, 0, 0)
    assert len(ledger.accepted(1)) == 8


def test_a_copy_from_another_worker_is_a_duplicate(ledger):
    ledger.record_verdicts(1, verdicts(2))
    copy = [replace(v, file="rollouts/step_1/w2-0.parquet", worker="w2") for v in verdicts(2)]
    assert ledger.record_verdicts(1, copy).duplicates == 2
    assert counts(ledger) == [(1, "accepted", None, 2), (1, "rejected", "duplicate", 2)]
    assert {a["worker"] for a in ledger.accepted(1)} == {"w1"}  # the first one keeps its place
    assert ledger.record_verdicts(1, copy) == RecordResult(0, 2, 0, 0)  # and re-recording changes nothing


def test_duplicates_within_one_batch_and_across_steps(ledger):
    a, b = verdicts(1)[0], verdicts(1, worker="w2")[0]
    assert ledger.record_verdicts(1, [a, b]).duplicates == 1
    assert [x["worker"] for x in ledger.accepted(1)] == ["w1"]
    replay = replace(a, file="rollouts/step_2/w1-0.parquet", step=2)
    assert ledger.record_verdicts(2, [replay]).duplicates == 1 and ledger.accepted(2) == []


def test_a_rejected_copy_does_not_make_the_sample_a_duplicate(ledger):
    # only accepted rows count (issue 17, attack 4): a rejected copy filed first cannot poison the sample
    ledger.record_verdicts(1, verdicts(1, reject={0}))
    copy = replace(verdicts(1)[0], file="rollouts/step_1/w2-0.parquet", worker="w2")
    assert ledger.record_verdicts(1, [copy]).duplicates == 0
    assert [a["worker"] for a in ledger.accepted(1)] == ["w2"]
    # a rejected copy keeps its own reason; an accepted copy of the accepted one is a duplicate
    copy2 = replace(verdicts(1, reject={0})[0], file="rollouts/step_1/w3-0.parquet", worker="w3")
    copy3 = replace(verdicts(1)[0], file="rollouts/step_1/w4-0.parquet", worker="w4")
    assert ledger.record_verdicts(1, [copy2, copy3]).duplicates == 1
    assert counts(ledger) == [(1, "accepted", None, 1), (1, "rejected", "duplicate", 1), (1, "rejected", "toploc", 2)]


def test_identical_outputs_with_different_seeds_are_not_duplicates(ledger):
    same = [Verdict.of(rollout(0, seed=s, output=(7, 7)), "rollouts/step_1/w1-0.parquet", s) for s in range(4)]
    assert ledger.record_verdicts(1, same).duplicates == 0
    assert len(ledger.accepted(1)) == 4
    assert accepted_elsewhere(ledger, same[0].content_hash)
    assert not accepted_elsewhere(ledger, same[0].content_hash, same[0].file, 0)
    assert not accepted_elsewhere(ledger, "0" * 64)


def test_a_changed_file_keeps_its_first_verdict(ledger):
    ledger.record_verdicts(1, verdicts(2))
    changed = [Verdict.of(rollout(0, seed=99), verdicts(1)[0].file, 0)]
    assert ledger.record_verdicts(1, changed) == RecordResult(0, 1, 0, 1)
    assert ledger.accepted(1)[0]["content_hash"] == rollout(0).content_hash


def test_interrupted_transaction_leaves_nothing(ledger, monkeypatch):
    def boom(_con, _now):
        raise RuntimeError("killed midway")

    monkeypatch.setattr(Ledger, "_touch_workers", staticmethod(boom))
    with pytest.raises(RuntimeError, match="midway"):
        ledger.record_verdicts(1, verdicts(4))
    monkeypatch.undo()
    assert ledger.summary() == [] and worker_rows(ledger) == []
    assert ledger.record_verdicts(1, verdicts(4)).inserted == 4


def test_commit_step_once(ledger):
    ledger.record_verdicts(1, verdicts(4, reject={3}))
    m = StepMetrics(loss=0.25, clip_fraction=0.1, trained_samples=3, timings={"train": 1.5})
    assert ledger.commit_step(1, m)
    row = ledger.get_step(1)
    assert (row["accepted"], row["rejected"], row["loss"], row["clip_fraction"], row["trained_samples"]) == (
        3, 1, 0.25, 0.1, 3)
    assert row["mean_reward"] == pytest.approx(1 / 3) and row["timings"] == {"train": 1.5}
    assert not ledger.commit_step(1, StepMetrics(loss=9.0))  # a re-run changes nothing
    assert ledger.get_step(1)["loss"] == 0.25 and ledger.committed_steps() == [1]
    assert ledger.get_step(2) is None


def test_committed_step_is_frozen(ledger):
    ledger.record_verdicts(1, verdicts(2))
    ledger.commit_step(1)
    assert ledger.record_verdicts(1, verdicts(2)) == RecordResult(0, 2, 0, 0)  # a re-run is fine
    with pytest.raises(LedgerError, match="too late"):
        ledger.record_verdicts(1, verdicts(3))
    assert len(ledger.accepted(1)) == 2


def test_empty_step_commits(ledger):
    assert ledger.commit_step(0)
    assert (ledger.get_step(0)["accepted"], ledger.get_step(0)["mean_reward"]) == (0, None)


def test_verdicts_must_belong_to_the_step(ledger):
    with pytest.raises(ValueError):
        ledger.record_verdicts(2, verdicts(2, step=1))
    assert ledger.record_verdicts(2, []) == RecordResult(0, 0, 0, 0)


def test_verdict_validation():
    v = verdicts(1)[0]
    for bad in [dict(status="maybe"), dict(reason="x"), dict(status="rejected"), dict(row=-1),
                dict(row=-2, status="rejected", reason="x"), dict(content_hash=None), dict(reward=float("nan")),
                dict(worker="a/b")]:
        with pytest.raises(ValueError):
            replace(v, **bad)


def test_whole_file_rejections(ledger):
    ledger.record_verdicts(3, [Verdict.file_rejected("rollouts/step_3/w1-0.parquet", 3, "w1", 0, "unreadable")])
    ledger.record_verdicts(3, [Verdict.file_rejected("rollouts/step_3/w1-0.parquet", 3, "w1", 0, "unreadable")])
    assert counts(ledger) == [(3, "rejected", "unreadable", 1)]


def test_checkpoints(ledger):
    ledger.record_checkpoint(2, "file:///r/checkpoints/step_2", "ab" * 32)
    ledger.record_checkpoint(2, "file:///r/checkpoints/step_2", "ab" * 32)
    assert ledger.checkpoint(2) == ("file:///r/checkpoints/step_2", "ab" * 32)
    with pytest.raises(LedgerError):
        ledger.record_checkpoint(2, "file:///r/checkpoints/step_2", "cd" * 32)
    assert ledger.checkpoint(2) == ("file:///r/checkpoints/step_2", "ab" * 32) and ledger.checkpoint(3) is None


def test_recording_verdicts_registers_their_workers(ledger):
    ledger.record_verdicts(1, verdicts(3, reject={0}))
    first = worker_rows(ledger)[0]
    ledger.record_verdicts(1, verdicts(1, worker="w2", seed0=50))
    ledger.record_verdicts(1, verdicts(4, k=1, seed0=60))
    ws = {w["worker"]: w for w in worker_rows(ledger)}
    assert set(ws) == {"w1", "w2"}
    assert (ws["w1"]["info"], ws["w1"]["accepted"], ws["w1"]["rejected"]) == (None, 6, 1)
    assert ws["w1"]["first_seen"] == first["first_seen"] and ws["w1"]["last_seen"] >= first["last_seen"]
    assert ws["w2"]["info"] is None and ws["w2"]["accepted"] == 1


def test_many_instances_in_one_process_share_the_file(tmp_path):
    a, b = Ledger(tmp_path / "l.duckdb"), Ledger(tmp_path / "l.duckdb")
    a.record_verdicts(1, verdicts(2))
    assert len(b.accepted(1)) == 2
    b.commit_step(1)
    assert a.committed_steps() == [1]
    a.close()
    assert b.get_step(1)["accepted"] == 2


def test_a_verdict_table_records_like_its_verdicts(ledger, tmp_path):
    vs = verdicts(6, reject={1})
    assert ledger.record_table(1, verdict_table(vs)) == RecordResult(6, 0, 0, 0)
    with Ledger(tmp_path / "other.duckdb") as other:
        other.record_verdicts(1, vs)
        assert other.accepted(1) == ledger.accepted(1) and other.summary() == ledger.summary()
    assert [(r["status"], r["reason"], r["n"]) for r in ledger.step_verdicts(1)] == [
        ("accepted", None, 5), ("rejected", "toploc", 1)]


def test_record_table_refuses_other_columns_and_steps(ledger):
    table = verdict_table(verdicts(2))
    with pytest.raises(ValueError, match="not a verdict table"):
        ledger.record_table(1, table.drop_columns(["reward"]))
    with pytest.raises(ValueError, match="other steps than 2"):
        ledger.record_table(2, table)
    assert ledger.summary() == []
