"""The code reward's sandbox against hostile submissions: each scores 0, is contained, and ends in time.

Every attack below runs for real in bubblewrap (the suite skips, saying why,
only where bwrap cannot start a sandbox at all). "Contained" is checked from the
host: no connection reached the host's listener, no file appeared outside the
sandbox, no sandbox process outlived the run.
"""

from __future__ import annotations

import doctest
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import intellect.rl.rewards.code as code_mod
import intellect.rl.rewards.sandbox as sandbox_mod
from intellect.data.loaders import CodeTask
from intellect.rl.rewards import (
    CodeRewardConfig,
    SandboxConfig,
    SandboxUnavailable,
    code_reward,
    extract_code,
    run_python,
    sandbox_status,
)
from intellect.rl.rewards.sandbox_cgroup import cgroup_parent

TIMEOUT = 4.0
SLACK = 3.0  # process start and kill on a loaded CI machine
CFG = CodeRewardConfig(sandbox=SandboxConfig(timeout_s=TIMEOUT, cpu_s=2, memory_mb=256, max_processes=16))
# For code that only ends when killed: a shorter deadline keeps the suite quick.
SHORT = CFG.model_copy(update={"sandbox": CFG.sandbox.model_copy(update={"timeout_s": 2.0, "cpu_s": 1})})
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
REPO_FILE = Path(__file__).resolve().parents[2] / "pyproject.toml"
# Appended to every attack, so that the attack itself is the only way to score 0.
ADD = "\ndef add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def bwrap():
    status = sandbox_status(CFG.sandbox)
    if not status.startswith("bwrap sandbox works"):
        pytest.skip(f"no bubblewrap sandbox on this machine: {status}")
    return status


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def judge(code: str, tests=TESTS, cfg=CFG, honest_tail: bool = False):
    code = code + ADD if honest_tail else code
    start = time.monotonic()
    result = code_reward(fenced(code), tests, cfg)
    return result, time.monotonic() - start


def sandbox_pids(uid: int = CFG.sandbox.uid) -> set[int]:
    """Live processes of the sandbox uid (only meaningful when the tests run as root, which drops to it).

    Zombies are left out: bwrap's own helpers end reparented to the host's init,
    which reaps them when it gets round to it; they hold nothing but a pid.
    """
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields["State"].strip().startswith("Z"):
            pids.add(int(entry.name))
    return pids


def assert_no_survivors(before: set[int]) -> None:
    if os.geteuid() != 0:
        return
    deadline = time.monotonic() + 5
    while (left := sandbox_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes outlived the run: {sorted(left)}"


def test_docstring_examples_hold():
    for mod in (code_mod, sandbox_mod):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, mod.__name__


# ------------------------------------------------------------------ honest code


@pytest.mark.usefixtures("bwrap")
def test_honest_solution_scores_1():
    result, seconds = judge("def add(a, b):\n    return a + b")
    assert (result.reward, result.reason) == (1.0, "ok"), result
    assert seconds < TIMEOUT


@pytest.mark.usefixtures("bwrap")
def test_wrong_solution_scores_0_and_names_the_test():
    result, _ = judge("def add(a, b):\n    return a + b if a >= 0 else 7")
    assert (result.reward, result.reason) == (0.0, "failed")
    assert "<test 2>" in result.detail and "AssertionError" in result.detail


@pytest.mark.usefixtures("bwrap")
def test_code_task_from_the_loader():
    task = CodeTask(id="sq", prompt="write sq", tests=("assert sq(3) == 9", "assert sq(-2) == 4"))
    assert code_reward(fenced("def sq(x):\n    return x * x"), task.tests, CFG).reward == 1.0
    assert code_reward(fenced("def sq(x):\n    return x + x"), task.tests, CFG).reward == 0.0


def test_no_code_block_runs_nothing(monkeypatch):
    monkeypatch.setattr(code_mod, "run_python", lambda *a: pytest.fail("ran"))
    assert code_reward("def add(a, b): return a + b", TESTS, CFG).reason == "no_code"
    assert code_reward(fenced("x = 1" * 100), TESTS, CodeRewardConfig(max_code_chars=10)).reason == "too_long"
    assert extract_code("```text\nx\n```") is None


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"])
@pytest.mark.usefixtures("bwrap")
def test_exiting_before_the_tests_is_not_a_pass(exit_call):
    result, _ = judge(exit_call, tests=["assert False"], honest_tail=True)
    assert result.reward == 0.0 and result.reason in ("failed", "early_exit"), result


@pytest.mark.usefixtures("bwrap")
def test_environment_is_not_leaked(monkeypatch):
    monkeypatch.setenv("INTELLECT_TEST_SECRET", "hunter2")
    result, _ = judge("import os\nassert 'INTELLECT_TEST_SECRET' not in os.environ", honest_tail=True)
    assert result.reward == 1.0, result


@pytest.mark.usefixtures("bwrap")
def test_output_flood_is_bounded():
    code = "import sys\nsys.stdout.write('x' * (1 << 25))\nsys.stderr.write('y' * (1 << 25))"
    result, seconds = judge(code, honest_tail=True)
    assert result.reward == 1.0 and seconds < TIMEOUT, result
    assert len(result.detail) <= 800


# ------------------------------------------------------------------ attacks


@pytest.mark.usefixtures("bwrap")
def test_socket_to_the_host_fails():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        result, seconds = judge(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", honest_tail=True
        )
        assert (result.reward, result.reason) == (0.0, "failed"), result
        assert "ConnectionRefusedError" in result.detail  # the sandbox's own, empty loopback
        with pytest.raises(BlockingIOError):
            server.accept()
    result, _ = judge("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", honest_tail=True)
    assert result.reward == 0.0 and "unreachable" in result.detail, result
    assert seconds < TIMEOUT + SLACK


@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd", str(REPO_FILE), "/root/.bashrc", "/home"])
@pytest.mark.usefixtures("bwrap")
def test_files_outside_the_sandbox_are_invisible(path):
    result, _ = judge(f"import os\nprint(os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())",
                      honest_tail=True)
    assert (result.reward, result.reason) == (0.0, "failed"), result
    assert "Error" in result.detail


@pytest.mark.usefixtures("bwrap")
def test_host_processes_are_invisible():
    result, _ = judge("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nassert len(pids) <= 3, pids",
                      honest_tail=True)
    assert result.reward == 1.0, result


@pytest.mark.usefixtures("bwrap")
def test_writes_outside_the_work_dir_fail(tmp_path):
    targets = [tmp_path / "escaped", REPO_FILE.parent / "escaped", Path("/usr/escaped"), Path("/escaped"),
               Path("/dev/escaped")]
    for target in targets:
        result, _ = judge(f"open({str(target)!r}, 'w').write('pwned')", honest_tail=True)
        assert (result.reward, result.reason) == (0.0, "failed"), (target, result)
        assert not target.exists()
    # the private work dir and /tmp are writable, and vanish with the sandbox
    result, _ = judge("open('/work/f', 'w').write('ok')\nopen('/tmp/f', 'w').write('ok')", honest_tail=True)
    assert result.reward == 1.0, result


@pytest.mark.usefixtures("bwrap")
def test_filling_the_work_dir_stops_at_its_size():
    code = "i = 0\nwhile True:\n    open(f'/work/f{i}', 'w').write('a' * (1 << 20))\n    i += 1"
    result, seconds = judge(code, honest_tail=True)
    assert result.reward == 0.0 and "No space left" in result.detail, result
    assert seconds < TIMEOUT


# Allocates 1 MiB at a time until it dies; with forked copies of itself where the host lets it fork.
ALLOCATION_LOOP = "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"
FORKED_ALLOCATION_LOOP = ("import os\nfor _ in range(6):\n    try:\n        if os.fork() == 0:\n            break\n"
                          "    except OSError:\n        break\n" + ALLOCATION_LOOP)


def sandbox_anon_bytes(uid: int, each: bool = False) -> int:
    """Anonymous memory of every live process of ``uid`` together (pages shared after a fork count in
    each), or (``each``) of the largest one. A child of this test process between ``Popen``'s setuid and its
    exec runs as ``uid`` while still a copy of this process (its cmdline this one's): it holds none of the
    candidate's memory and is left out."""
    own = Path("/proc/self/cmdline").read_bytes()
    sizes = []
    for pid in sandbox_pids(uid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == own:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        sizes.append(sum(int(line.split()[1]) << 10 for line in status.splitlines() if line.startswith("RssAnon:")))
    return max(sizes, default=0) if each else sum(sizes)


@pytest.fixture(params=["host", "no-cgroup"])
def memory_cfg(request, tmp_path) -> CodeRewardConfig:
    """The host's way of bounding memory (a cgroup where it offers one), and the rlimit-only fallback,
    forced by pointing the sandbox at a folder that is no cgroup."""
    # a uid of this test process's own: another xdist worker's sandboxes (the default uid) would count
    # in the measured memory, and in the fallback's RLIMIT_NPROC
    sandbox = CFG.sandbox.model_copy(update={"cgroup": str(tmp_path) if request.param == "no-cgroup" else None,
                                             "uid": 60000 + os.getpid() % 5000})
    if request.param == "no-cgroup":
        assert "no cgroup here" in sandbox_mod.memory_status(sandbox)
    return CFG.model_copy(update={"sandbox": sandbox})


@pytest.mark.parametrize("code", ["x = bytearray(1 << 40)", ALLOCATION_LOOP, FORKED_ALLOCATION_LOOP],
                         ids=["one-huge-block", "loop", "forked-loops"])
@pytest.mark.usefixtures("bwrap")
def test_an_allocation_loop_dies_at_its_memory_limit(code, memory_cfg):
    """The candidate's processes together never hold more than ``memory_mb`` (the slack: their shared
    start-up pages, counted once per process, and the judge's), and the run ends as ``memory``. Without a
    cgroup the bound is each process's address space (RLIMIT_AS): what is checked then is the largest
    process, since one being torn down after its kill still counts beside the next."""
    peak, stop = [0], threading.Event()
    each = memory_cfg.sandbox.cgroup is not None  # the no-cgroup fallback: a folder that is no cgroup

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], sandbox_anon_bytes(memory_cfg.sandbox.uid, each))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result, seconds = judge(code, cfg=memory_cfg, honest_tail=True)
    finally:
        stop.set()
        watcher.join()
    assert (result.reward, result.reason) == (0.0, "memory"), result
    assert seconds < TIMEOUT + SLACK
    if os.geteuid() == 0:  # only then does the sandbox run as a uid of its own, whose processes are watched here
        limit = memory_cfg.sandbox.memory_mb << 20
        assert peak[0] < limit + (64 << 20), f"the sandbox held {peak[0] >> 20} MiB, its limit is {limit >> 20} MiB"
    assert judge("def add(a, b):\n    return a + b", cfg=memory_cfg)[0].reward == 1.0
    parent = cgroup_parent(memory_cfg.sandbox.cgroup)
    if parent is not None:  # each run's cgroup is gone with it
        assert not list(parent.path.glob(f"intellect-sandbox-{os.getpid()}-*"))


@pytest.mark.usefixtures("bwrap")
def test_process_limit_is_enforced():
    # forks sleeping children until the kernel refuses; the test passes iff it refused below the limit
    code = ("import os, time\nn = 0\nwhile n < 1000:\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1")
    before = sandbox_pids()
    result, seconds = judge(code, [f"assert n < {CFG.sandbox.max_processes}, n"])
    assert result.reward == 1.0, result
    assert seconds < TIMEOUT
    assert_no_survivors(before)


@pytest.mark.parametrize(
    "code",
    [
        pytest.param("import os\nwhile True:\n    os.fork()", id="dies-on-EAGAIN"),
        pytest.param(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            id="keeps-forking", marks=pytest.mark.slow,
        ),
    ],
)
@pytest.mark.usefixtures("bwrap")
def test_fork_bomb_is_contained(code):
    before = sandbox_pids()
    result, seconds = judge(code, cfg=SHORT, honest_tail=True)
    assert result.reward == 0.0, result
    assert seconds < SHORT.sandbox.timeout_s + SLACK
    assert_no_survivors(before)
    # and the machine still starts new sandboxes
    assert judge("def add(a, b):\n    return a + b")[0].reward == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "code", ["while True:\n    pass", "import time\ntime.sleep(3600)", "import os\nos.read(0, 1)\nwhile 1: pass"]
)
@pytest.mark.usefixtures("bwrap")
def test_endless_code_is_stopped_in_time(code):
    before = sandbox_pids()
    result, seconds = judge(code, cfg=SHORT, honest_tail=True)
    assert result.reward == 0.0 and result.reason in ("timeout", "killed:SIGXCPU", "killed:SIGKILL"), result
    assert seconds < SHORT.sandbox.timeout_s + SLACK
    assert_no_survivors(before)


@pytest.mark.usefixtures("bwrap")
def test_detached_children_die_with_the_sandbox():
    # without a cgroup the candidate may not fork at all (test_an_allocation_loop_dies_at_its_memory_limit)
    code = "import os, time\ntry:\n    pid = os.fork()\nexcept OSError:\n    pid = 1\nif pid == 0:\n" \
           "    os.setsid()\n    time.sleep(3600)"
    before = sandbox_pids()
    result, _ = judge(code, honest_tail=True)
    assert result.reward == 1.0, result
    assert_no_survivors(before)


# ------------------------------------------------------------------ no sandbox


def test_python_outside_the_system_dirs_is_refused(tmp_path):
    cfg = SandboxConfig(python=str(tmp_path / "python3"))
    with pytest.raises(SandboxUnavailable, match="does not exist"):
        run_python("pass", [], cfg)
    if not os.path.realpath(sys.executable).startswith(("/usr/", "/bin/")):  # e.g. a pyenv or venv interpreter
        assert "is not under" in sandbox_status(SandboxConfig(python=sys.executable))


def test_missing_bwrap_refuses_untrusted_code(monkeypatch):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bwrap.*allow_unsandboxed"):
        code_reward(fenced("def add(a, b):\n    return a + b"), TESTS, CFG)


def test_unsandboxed_fallback_only_when_allowed_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox_mod, "_warned", sandbox_mod.threading.Event())
    cfg = CFG.model_copy(update={"sandbox": CFG.sandbox.model_copy(update={"allow_unsandboxed": True})})
    with caplog.at_level(logging.WARNING, logger="intellect.rl.rewards"):
        ok, _ = judge("def add(a, b):\n    return a + b", cfg=cfg)
        bad, _ = judge("import sys; sys.exit(0)", cfg=cfg, honest_tail=True)
        hog, _ = judge("x = bytearray(1 << 40)", cfg=cfg, honest_tail=True)
    assert (ok.reward, ok.reason) == (1.0, "ok") and ok.detail.startswith("UNSANDBOXED")
    assert bad.reward == 0.0 and hog.reward == 0.0
    assert "WITHOUT a sandbox" in caplog.text
