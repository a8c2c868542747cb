"""The validator's verdict files: written atomically, read back in order, bad files named, and
refused when their MAC does not verify (a file rewritten after validation, or forged)."""

import doctest
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from intellect.rl.service import verdicts as V
from intellect.rl.service.verdicts import VerdictTampered, read_verdicts, verdict_path, write_verdicts
from intellect.storage import RunStorage
from intellect.verdict import Verdict

SECRET = b"s" * 32


@pytest.fixture
def storage(tmp_path):
    return RunStorage(f"file://{tmp_path}")


def rejected(step, worker, k):
    return Verdict(f"rollouts/step_{step}/{worker}-{k}.parquet", -1, step, worker, k, "rejected", "schema")


def accepted_like(step, worker, k):
    return Verdict(f"rollouts/step_{step}/{worker}-{k}.parquet", 0, step, worker, k, "accepted",
                   content_hash="h" * 64, policy_step=step, prompt_id="p", group_id=0, reward=1e6, advantage=1e6,
                   prompt_tokens=1, output_tokens=1)


def test_doctest():
    assert doctest.testmod(V).failed == 0


def test_round_trip_keeps_order_across_files(storage):
    a = write_verdicts(storage, 2, "Worker-A", [rejected(2, "worker-a", 0), rejected(2, "worker-a", 1)], SECRET)
    b = write_verdicts(storage, 2, "worker-b", [rejected(2, "worker-b", 0)], SECRET)
    assert a[0] == verdict_path(2, "worker-a") == "verdicts/step_2/worker-a.parquet"
    table = read_verdicts(storage, [b, a], SECRET)
    assert table["file"].to_pylist() == ["rollouts/step_2/worker-b-0.parquet", "rollouts/step_2/worker-a-0.parquet",
                                         "rollouts/step_2/worker-a-1.parquet"]
    assert read_verdicts(storage, [], SECRET).num_rows == 0


def test_a_file_that_is_not_a_verdict_file_is_named(storage):
    def planted(rel, data):  # a file the validator wrote: its MAC is right, its content is not a verdict file
        storage.write_bytes(rel, data)
        return rel, V._tag(SECRET, rel, data).hex()

    buf = io.BytesIO()
    pq.write_table(pa.table({"file": ["a"]}), buf)
    with pytest.raises(ValueError, match="z.parquet is not a verdict file"):
        read_verdicts(storage, [planted("verdicts/step_0/z.parquet", buf.getvalue())], SECRET)
    rel, _ = write_verdicts(storage, 0, "w", [rejected(0, "w", 0)], SECRET)
    with pytest.raises(ValueError, match="x.parquet is not a verdict file"):
        read_verdicts(storage, [planted("verdicts/step_0/x.parquet", storage.read_bytes(rel)[:-20])], SECRET)
    with pytest.raises(ValueError, match="y.parquet is not a verdict file"):
        read_verdicts(storage, [planted("verdicts/step_0/y.parquet", b"PAR1")], SECRET)


def test_a_verdict_file_overwritten_after_validation_is_refused(storage):
    """Issue 17's first attack: a worker rewrites its verdict file between validate and record."""
    honest = write_verdicts(storage, 1, "mallory", [rejected(1, "mallory", 0)], SECRET)
    forged = write_verdicts(storage, 1, "other", [accepted_like(1, "mallory", 0)], b"x" * 32)  # not the run's secret
    storage.write_bytes(honest[0], storage.read_bytes(forged[0]))
    with pytest.raises(VerdictTampered, match="MAC does not verify"):
        read_verdicts(storage, [honest], SECRET)
    # a valid tag of another step or path does not carry over
    moved = write_verdicts(storage, 2, "mallory", [rejected(2, "mallory", 0)], SECRET)
    with pytest.raises(VerdictTampered):
        read_verdicts(storage, [(honest[0], moved[1])], SECRET)
    with pytest.raises(VerdictTampered):
        read_verdicts(storage, [(honest[0], "not hex")], SECRET)
