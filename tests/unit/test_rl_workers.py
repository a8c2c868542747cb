"""The RL run's worker supervision without Prefect: a worker that sends nothing is reported missing and
the step goes on; stopping workers escalates from waiting to SIGTERM to SIGKILL; workers launched
elsewhere keep their keys where they run, announce their key ids, and get the run's parameters
without this machine's paths or the storage credentials."""

from __future__ import annotations

import doctest
import json
import os
import signal
import sys
import threading
import time

import pytest

from intellect.launch import LocalLauncher, stop
from intellect.rl import run as run_module
from intellect.rl import workers as workers_module
from intellect.rl.config import RLRunConfig
from intellect.rl.run import RLRun
from intellect.rl.workers import (MACHINE_LOCAL, RemoteKeys, WorkerResult, await_done, deployment_parameters,
                                  ensure_key, host_cache, host_key_file, key_id_of, key_record, parse_worker_argv,
                                  stop_workers, wait_key_id, worker_argv, worker_key_file)
from intellect.rl.step import done_marker
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


# A launcher whose workers make their own keys, as rl-worker flow runs do on their hosts: a child
# process makes its key in its own home (not the run folder) and announces it in a file.
ANNOUNCER = """import json, pathlib, sys, time
from intellect.rl.workers import ensure_key, host_key_file, key_record
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


def test_doctests_of_the_deployment_side():
    import flows.launch  # noqa: PLC0415 - Prefect only for this test
    import flows.rl_worker  # noqa: PLC0415 - as above

    for mod in (flows.launch, flows.rl_worker):
        assert doctest.testmod(mod).failed == 0, mod.__name__


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
