"""``intellect worker``: key files (``keygen``), what it refuses to start with, and the worker ids the
validator accepts from the submission service."""

from __future__ import annotations

import json
import stat

import pytest

from intellect.rl.worker.worker import WorkerRunInfo, main
from intellect.trust.keys import SigningKey, is_key_id


def test_keygen_writes_a_private_key_file_and_prints_its_identity(tmp_path, capsys):
    out = tmp_path / "keys" / "w.key"
    assert main(["keygen", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    key = SigningKey.load(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert f"worker id: {key.public.id}" in printed and f"public key: {key.public.hex}" in printed
    assert is_key_id(key.public.id)
    before = out.read_bytes()
    assert main(["keygen", "--out", str(out)]) == 2  # never overwritten
    assert out.read_bytes() == before and "never overwritten" in capsys.readouterr().err


def test_a_readable_key_or_a_bad_trainer_key_is_refused(tmp_path, capsys):
    path = tmp_path / "w.key"
    SigningKey.generate().save(path)
    good = SigningKey.generate().public.hex
    assert main(["--run-url", "http://127.0.0.1:9", "--key", str(path), "--trainer-key", "zz"]) == 2
    assert "public key" in capsys.readouterr().err
    path.chmod(0o644)
    assert main(["--run-url", "http://127.0.0.1:9", "--key", str(path), "--trainer-key", good]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_run_info_is_strict():
    doc = {"run": "r", "steps": 2, "committed": -1, "async_level": 0, "submission": {}, "toploc": None,
           "limits": None, "min_signal_samples": 0, "max_submissions": 1, "relays": ["http://127.0.0.1:1"],
           "poll_interval": 0.1, "checkpoint_timeout": 5}
    assert WorkerRunInfo.model_validate(doc).relays == ["http://127.0.0.1:1"]
    with pytest.raises(ValueError):
        WorkerRunInfo.model_validate({**doc, "storage": {"url": "s3://secret"}})
    with pytest.raises(ValueError):
        WorkerRunInfo.model_validate({**doc, "relays": []})
    json.dumps(WorkerRunInfo.model_validate(doc).model_dump(mode="json"))
