"""The per-step metrics series on S3 (a moto server): rewritten whole at every flush, resumed in place."""

from pathlib import Path

import duckdb
import pytest

from intellect.metrics import MetricsLog


def query(path: Path | str, sql: str) -> list[tuple]:
    return duckdb.sql(sql.replace("LOG", f"read_json_auto('{path}')")).fetchall()


@pytest.mark.slow
def test_on_s3_the_series_is_rewritten_whole_every_flush(s3_storage, tmp_path):
    name = "metrics/diloco/w1.jsonl"

    def stored() -> list[tuple]:
        local = tmp_path / "copy.jsonl"
        local.write_bytes(s3_storage.read_bytes(name))
        return query(local, "select step, loss from LOG order by step")

    with MetricsLog(s3_storage, name, flush_every=3) as log:
        for step in range(4):
            log.log(step, {"loss": float(step)})
        assert stored() == [(0, 0.0), (1, 1.0), (2, 2.0)]  # one flush so far; step 3 waits for the next
    assert stored() == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    with MetricsLog(s3_storage, name, flush_every=3) as log:  # resumed at step 2
        log.log(2, {"loss": 20.0})
    assert stored() == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert s3_storage.listdir("metrics/diloco") == ["w1.jsonl"]
