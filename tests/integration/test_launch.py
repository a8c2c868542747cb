"""intellect.launch: the generic process launcher (start, log, withhold secrets, SIGTERM -> SIGKILL)."""

from __future__ import annotations

import json
import signal
import time

from intellect.launch import LocalLauncher, stop


def _module(tmp_path, name: str, body: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(body)
    return {"PYTHONPATH": str(tmp_path)}


def test_a_process_gets_its_args_and_env_and_logs_to_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH_TEST_SECRET", "s3cret")
    monkeypatch.setenv("LAUNCH_TEST_PLAIN", "inherited")
    env = _module(tmp_path, "echo_env", "import json, os, sys\n"
                  "print(json.dumps({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items()"
                  " if k.startswith('LAUNCH_TEST')}}))\n")
    launcher = LocalLauncher(tmp_path / "logs", "echo_env", withhold=["LAUNCH_TEST_SECRET"])
    h = launcher.launch("p0", ["--x", "1"], {**env, "LAUNCH_TEST_EXTRA": "given"})
    assert h.name == "p0" and h.wait(timeout=60) == 0 and h.poll() == 0
    got = json.loads(h.log.read_text().splitlines()[0])
    assert h.log == tmp_path / "logs" / "p0.log"
    assert got == {"argv": ["--x", "1"], "env": {"LAUNCH_TEST_PLAIN": "inherited", "LAUNCH_TEST_EXTRA": "given"}}


def test_stop_terminates_then_kills_what_ignores_sigterm(tmp_path):
    env = _module(tmp_path, "stubborn", "import signal, sys, time\n"
                  "if sys.argv[1] == 'ignore':\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                  "print('up', flush=True)\ntime.sleep(120)\n")
    launcher = LocalLauncher(tmp_path / "logs", "stubborn")
    polite, stubborn = launcher.launch("polite", ["obey"], env), launcher.launch("stubborn", ["ignore"], env)
    deadline = time.monotonic() + 60
    while not all(h.log.read_text().startswith("up") for h in (polite, stubborn)):
        assert time.monotonic() < deadline, "the processes never started"
        time.sleep(0.05)
    t0 = time.monotonic()
    codes = stop([polite, stubborn], grace=1.0, kill_wait=10.0)
    assert codes == {"polite": -signal.SIGTERM, "stubborn": -signal.SIGKILL}
    assert 1.0 <= time.monotonic() - t0 < 10.0  # the stubborn one was given its grace period, then killed


def test_stop_leaves_finished_processes_their_exit_codes(tmp_path):
    env = _module(tmp_path, "quick", "import sys\nsys.exit(7)\n")
    h = LocalLauncher(tmp_path / "logs", "quick").launch("q", [], env)
    h.wait(timeout=60)
    t0 = time.monotonic()
    assert stop([h], grace=30.0) == {"q": 7} and time.monotonic() - t0 < 5.0
