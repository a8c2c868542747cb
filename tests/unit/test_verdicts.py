"""The validator's verdict files: written atomically, read back in order, bad files named."""

import pytest

from intellect.ledger import Verdict
from intellect.rl.verdicts import read_verdicts, verdict_path, write_verdicts
from intellect.storage import RunStorage


@pytest.fixture
def storage(tmp_path):
    return RunStorage(f"file://{tmp_path}")


def rejected(step, worker, k):
    return Verdict(f"rollouts/step_{step}/{worker}-{k}.parquet", -1, step, worker, k, "rejected", "schema")


def test_round_trip_keeps_order_across_files(storage):
    a = write_verdicts(storage, 2, "Worker-A", [rejected(2, "worker-a", 0), rejected(2, "worker-a", 1)])
    b = write_verdicts(storage, 2, "worker-b", [rejected(2, "worker-b", 0)])
    assert a == verdict_path(2, "worker-a") == "verdicts/step_2/worker-a.parquet"
    table = read_verdicts(storage, [b, a])
    assert table["file"].to_pylist() == ["rollouts/step_2/worker-b-0.parquet", "rollouts/step_2/worker-a-0.parquet",
                                         "rollouts/step_2/worker-a-1.parquet"]
    assert read_verdicts(storage, []).num_rows == 0


def test_a_file_that_is_not_a_verdict_file_is_named(storage):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"file": ["a"]}), buf)
    storage.write_bytes("verdicts/step_0/z.parquet", buf.getvalue())
    with pytest.raises(ValueError, match="z.parquet is not a verdict file"):
        read_verdicts(storage, ["verdicts/step_0/z.parquet"])
    write_verdicts(storage, 0, "w", [rejected(0, "w", 0)])
    storage.write_bytes("verdicts/step_0/x.parquet", storage.read_bytes("verdicts/step_0/w.parquet")[:-20])
    with pytest.raises(ValueError, match="x.parquet is not a verdict file"):
        read_verdicts(storage, ["verdicts/step_0/x.parquet"])
    storage.write_bytes("verdicts/step_0/y.parquet", b"PAR1")
    with pytest.raises(ValueError, match="y.parquet is not a verdict file"):
        read_verdicts(storage, ["verdicts/step_0/y.parquet"])
