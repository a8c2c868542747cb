"""The RL run's worker supervision without Prefect: a worker that sends nothing is reported missing and
the step goes on; stopping workers escalates from waiting to SIGTERM to SIGKILL."""

from __future__ import annotations

import doctest
import json
import signal
import threading
import time

import pytest

from intellect.launch import LocalLauncher
from intellect.rl import run as run_module
from intellect.rl import workers as workers_module
from intellect.rl.config import RLRunConfig
from intellect.rl.run import RLRun
from intellect.rl.workers import WorkerResult, await_done, stop_workers
from intellect.rl.step import done_marker


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


def _launch(tmp_path, name: str, body: str):
    (tmp_path / f"{name}.py").write_text(body)
    ready = tmp_path / f"{name}.ready"
    h = LocalLauncher(tmp_path / "logs", name).launch(name, [str(ready)], {"PYTHONPATH": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not ready.exists():  # its signal handler is installed
        assert h.poll() is None and time.monotonic() < deadline, (tmp_path / "logs" / f"{name}.log").read_text()
        time.sleep(0.02)
    return h


READY = "import pathlib, signal, sys, time\n{handler}\npathlib.Path(sys.argv[1]).touch()\n{then}\n"


def test_stopping_workers_waits_then_terminates_then_kills(tmp_path):
    stubborn = _launch(tmp_path, "stubborn", READY.format(handler="signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                                                          then="time.sleep(600)"))
    polite = _launch(tmp_path, "polite", READY.format(handler="", then="time.sleep(600)"))
    finishing = _launch(tmp_path, "finishing", READY.format(
        handler="signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))", then="time.sleep(0.3)"))
    t0 = time.monotonic()
    codes = stop_workers({"s": stubborn, "p": polite, "f": finishing}, grace=2.0, term_grace=0.5, poll=0.02)
    # finishing exits 0 within the grace period (never signalled); polite dies of SIGTERM; stubborn
    # ignores it and is killed
    assert codes == {"s": -signal.SIGKILL, "p": -signal.SIGTERM, "f": 0}
    assert time.monotonic() - t0 < 2.0 + 0.5 + 0.5 + 5
    t0 = time.monotonic()
    assert stop_workers({}, grace=10.0) == {} and time.monotonic() - t0 < 1  # nothing to wait for


def test_a_failed_launch_stops_the_workers_already_started(tmp_path):
    started = []

    class Flaky:
        def launch(self, name, args, env):
            if started:
                raise OSError("no more processes")
            h = LocalLauncher(tmp_path / "logs", "time_sleeper").launch(name, [], {"PYTHONPATH": str(tmp_path)})
            started.append(h)
            return h

    (tmp_path / "time_sleeper.py").write_text("import time\ntime.sleep(600)\n")
    cfg = RLRunConfig.model_validate({"run_name": "rl", "storage": {"url": f"file://{tmp_path}"},
                                      "workers": {"names": ["alice", "bob"]}})
    with pytest.raises(OSError, match="no more processes"):
        workers_module.start_workers(cfg, "http://127.0.0.1:9", "00" * 32, Flaky())
    assert len(started) == 1 and started[0].poll() is not None
