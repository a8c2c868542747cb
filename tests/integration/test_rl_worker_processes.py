"""RL worker processes without Prefect: stopping them escalates from waiting to SIGTERM to SIGKILL; a
failed launch stops those already started; workers launched elsewhere keep their keys where they run and
announce their key ids; local workers get their own LOCAL_RANK."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from intellect.launch import LocalLauncher, stop
from intellect.rl.trainer import workers as workers_module
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.workers import (RemoteKeys, host_key_file, parse_worker_argv, stop_workers, wait_key_id,
                                  worker_key_file)
from intellect.trust.keys import SigningKey


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


# A launcher whose workers make their own keys, as rl-worker flow runs do on their hosts: a child
# process makes its key in its own home (not the run folder) and announces it in a file.
ANNOUNCER = """import json, pathlib, sys, time
from intellect.rl.trainer.workers import ensure_key, host_key_file, key_record
name, home, out = sys.argv[1:4]
if name != "silent":
    key = ensure_key(host_key_file("rl", name, home=home))
    pathlib.Path(out).write_text(json.dumps([key_record(name, key.public)]))
    time.sleep(600)
"""


class AnnouncingLauncher:
    def __init__(self, tmp_path):
        self.tmp, self.seen_args, self.seen_env, self.started = tmp_path, {}, {}, []
        (tmp_path / "announcer.py").write_text(ANNOUNCER)
        self.local = LocalLauncher(tmp_path / "logs", "announcer")

    def launch(self, name, args, env):
        self.seen_args[name] = list(args)
        self.seen_env[name] = dict(env)
        path = os.pathsep.join([str(self.tmp), *sys.path])
        h = self.local.launch(name, [name, str(self.tmp / "home"), str(self.tmp / f"{name}.json")],
                              {**env, "PYTHONPATH": path})
        self.started.append(h)
        return h

    def key_id(self, handle, timeout):
        out = self.tmp / f"{handle.name}.json"
        return wait_key_id(handle.name, handle, lambda: json.loads(out.read_text()) if out.exists() else [],
                           timeout=timeout, poll=0.02)


def test_workers_that_keep_their_keys_elsewhere_are_known_by_the_ids_they_announce(tmp_path):
    cfg = RLRunConfig.model_validate({"run_name": "rl", "storage": {"url": f"file://{tmp_path}/runs"},
                                      "workers": {"names": ["alice", "bob"], "submission_timeout": 60}})
    launcher = AnnouncingLauncher(tmp_path)
    assert isinstance(launcher, RemoteKeys) and not isinstance(LocalLauncher(tmp_path, "x"), RemoteKeys)
    handles, ids = workers_module.start_workers(cfg, "http://127.0.0.1:9", "00" * 32, launcher)
    try:
        want = {n: SigningKey.load(host_key_file("rl", n, home=tmp_path / "home")).public.id for n in ids}
        assert ids == want and len(set(ids.values())) == 2
        assert not worker_key_file(cfg, "alice").exists()  # no key made in the run folder for them
        assert parse_worker_argv(launcher.seen_args["bob"])["--run-url"] == "http://127.0.0.1:9"
        assert not any("LOCAL_RANK" in e for e in launcher.seen_env.values())  # their hosts pick their GPUs
    finally:
        codes = stop_workers(handles, grace=0.0, term_grace=2.0)
    assert codes == {"alice": -signal.SIGTERM, "bob": -signal.SIGTERM}


def test_a_worker_that_ends_without_announcing_stops_the_start(tmp_path):
    cfg = RLRunConfig.model_validate({"run_name": "rl", "storage": {"url": f"file://{tmp_path}/runs"},
                                      "workers": {"names": ["alice", "silent"], "submission_timeout": 60}})
    launcher = AnnouncingLauncher(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="silent ended .exit code 0. before announcing"):
        workers_module.start_workers(cfg, "http://127.0.0.1:9", "00" * 32, launcher)
    assert time.monotonic() - t0 < 30 and [h.poll() for h in launcher.started] == [-signal.SIGTERM, 0]


def test_waiting_for_a_key_id_times_out(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    h = LocalLauncher(tmp_path / "logs", "sleeper").launch("w0", [], {"PYTHONPATH": str(tmp_path)})
    try:
        with pytest.raises(TimeoutError, match="w0 announced no key id within 0 s"):
            wait_key_id("w0", h, list, timeout=0.1, poll=0.02)
    finally:
        stop([h])


def test_local_workers_get_their_own_local_rank_and_remote_ones_none(tmp_path):
    envs: dict[str, dict] = {}
    (tmp_path / "time_sleeper.py").write_text("import time\ntime.sleep(600)\n")

    class Recording:
        def launch(self, name, args, env):
            envs[name] = dict(env)
            return LocalLauncher(tmp_path / "logs", "time_sleeper").launch(name, [], {"PYTHONPATH": str(tmp_path)})

    cfg = RLRunConfig.model_validate({"run_name": "rl", "storage": {"url": f"file://{tmp_path}/runs"},
                                      "workers": {"names": ["alice", "bob", "carol"]}})
    handles, _ = workers_module.start_workers(cfg, "http://127.0.0.1:9", "00" * 32, Recording(), env={"X": "1"})
    stop_workers(handles, grace=0.0, term_grace=2.0)
    # rank 0 is the trainer's and the validator's; the workers spread over the GPUs after it
    assert {n: (e["LOCAL_RANK"], e["X"]) for n, e in envs.items()} == {"alice": ("1", "1"), "bob": ("2", "1"),
                                                                       "carol": ("3", "1")}
