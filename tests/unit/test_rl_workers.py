"""The RL run's worker supervision without Prefect: a worker that sends nothing is reported missing and
the step goes on; workers launched elsewhere get the run's parameters without this machine's paths or the
storage credentials, and their announced keys must match. The tests that start worker processes are in
tests/integration/test_rl_worker_processes.py."""

from __future__ import annotations

import doctest
import json
import os
import threading
import time

import pytest

from intellect.rl.trainer import run as run_module
from intellect.rl.trainer import workers as workers_module
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.run import RLRun
from intellect.rl.trainer.workers import (MACHINE_LOCAL, WorkerResult, await_done, deployment_parameters,
                                  ensure_key, host_cache, host_key_file, key_id_of, key_record, parse_worker_argv,
                                  worker_argv, worker_key_file)
from intellect.rl.trainer.step import done_marker
from intellect.trust.keys import SigningKey


@pytest.mark.parametrize("module", [run_module, workers_module])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_a_worker_that_sends_nothing_is_reported_missing_and_the_wait_ends():
    seen: list[list[str]] = []
    alice = WorkerResult(worker="alice", files=["a"], policy_step=0, seconds=0.0)
    t0 = time.monotonic()
    out = await_done(["alice", "bob"], lambda: {"alice": alice}, timeout=0.2, poll=0.01, on_missing=seen.append)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert [(r.worker, r.files, r.missing) for r in out] == [("alice", ["a"], False), ("bob", [], True)]
    assert out[1].policy_step is None and seen == [["bob"]]


def test_a_stopping_run_gives_up_waiting():
    stopping = threading.Event()
    threading.Timer(0.05, stopping.set).start()
    with pytest.raises(RuntimeError, match="stopping"):
        await_done(["bob"], dict, timeout=30, poll=0.01, stopping=stopping)


def test_the_run_collects_done_markers_and_reports_the_missing_worker(tmp_path):
    cfg = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{tmp_path}"}, "tasks": {"size": 8, "data": {"max_digits": 1}},
        "workers": {"names": ["alice", "bob"], "poll_interval": 0.01, "submission_timeout": 0.2},
    })
    with RLRun(cfg) as run:
        run.storage.write_text(done_marker(3, "alice"), json.dumps({"files": ["f0"], "policy_step": 2}))
        missing: list[list[str]] = []
        out = run.collect(3, local=False, on_missing=missing.append)
        assert [(r.worker, r.files, r.policy_step, r.missing) for r in out] == [
            ("alice", ["f0"], 2, False), ("bob", [], None, True)]
        assert missing == [["bob"]] and run.done_policies(3) == [2]
    assert run.ledger._con is None  # closed with the run


def test_deployment_parameters_carry_the_run_but_no_local_paths_or_storage_secrets(tmp_path):
    cfg = RLRunConfig.model_validate({
        "run_name": "rl-dep", "storage": {"url": f"file://{tmp_path}", "key": "AKIA1", "secret": "hunter2"},
        "workers": {"names": ["w0"], "threads": 3, "launch": "deployments"}})
    argv = worker_argv(cfg, "w0", "http://10.0.0.5:8750", "ab" * 32, worker_key_file(cfg, "w0"))
    assert parse_worker_argv(argv)["--threads"] == "3"
    params = deployment_parameters(cfg, "w0", argv)
    assert {k: v for k, v in params.items() if k != "config"} == {
        "worker": "w0", "url": "http://10.0.0.5:8750", "trainer_key": "ab" * 32, "run_name": "rl-dep"}
    sent = RLRunConfig.model_validate(json.loads(json.dumps(params["config"])))  # through the API as JSON
    assert sent.storage.key is None and sent.storage.secret is None and "hunter2" not in json.dumps(params)
    assert sent.model_copy(update={"storage": cfg.storage}) == cfg  # everything else as the trainer has it
    text = json.dumps(params)
    assert str(tmp_path) not in text.replace(cfg.storage.url, "") and str(os.getpid()) not in text
    assert all(flag in argv for flag in MACHINE_LOCAL)
    with pytest.raises(ValueError, match="not worker_argv"):
        parse_worker_argv(["--run-url"])


def test_a_host_key_is_made_once_private_and_kept(tmp_path):
    path = host_key_file("rl-x", "w0", home=tmp_path)
    assert path == tmp_path / "keys" / "rl-x" / "w0.key"
    assert host_cache("rl-x", "w0", home=tmp_path) == tmp_path / "cache" / "rl-x" / "w0"
    key = ensure_key(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert ensure_key(path).public == key.public  # a restarted worker keeps its id
    for bad in ("..", "a/b", "", "x" * 65):
        with pytest.raises(ValueError, match="not a worker name"):
            host_key_file("rl-x", bad, home=tmp_path)


def test_an_announcement_must_match_its_public_key():
    a, b = SigningKey.from_seed(bytes(32)).public, SigningKey.from_seed(b"\x01" * 32).public
    assert key_id_of([key_record("w1", b), key_record("w0", a)], "w0") == a.id
    assert key_id_of([], "w0") is None
    with pytest.raises(ValueError, match="not that of its public key"):
        key_id_of([key_record("w0", a) | {"key_id": b.id}], "w0")
    with pytest.raises(ValueError, match="no valid public key"):
        key_id_of([key_record("w0", a) | {"public_key": "zz"}], "w0")


def test_doctests_of_the_deployment_side():
    import flows.launch  # noqa: PLC0415 - Prefect only for this test
    import flows.rl_worker  # noqa: PLC0415 - as above

    for mod in (flows.launch, flows.rl_worker):
        assert doctest.testmod(mod).failed == 0, mod.__name__
