"""Run untrusted Python (a candidate solution) in a bubblewrap sandbox, judged from another one.

Containment, outermost first:

* **bubblewrap** (``bwrap``): new user, pid, network, ipc, uts and cgroup
  namespaces (no network at all, not even the host's loopback); the root is an
  empty read-only tmpfs into which only the system directories (``/usr``,
  ``/bin``, ``/lib*``) are bound read-only, plus a private ``/proc`` and a
  minimal ``/dev``. ``/work`` (the working directory), ``/tmp`` and
  ``/dev/shm`` are private tmpfs mounts of ``work_mb`` each; nothing of the host
  (``/etc``, ``/home``, the repository, the venv) is visible. ``--disable-userns``
  stops the code from creating a nested user namespace (where it could mount an
  unbounded tmpfs); ``--die-with-parent`` and the pid namespace take every
  process down with the sandbox.
* **An unprivileged uid**: ``RLIMIT_NPROC`` is never enforced for uid 0, so a
  validator running as root starts the sandbox as ``SandboxConfig.uid``
  (``nobody``). Since Linux 5.14 the count is kept per user namespace, so the
  limit bounds the processes of this one sandbox, not of every ``nobody``.
* **Memory in total**: where the host lets the validator make cgroups
  (:mod:`intellect.rl.rewards.sandbox_cgroup`), the candidate's processes run in
  a cgroup of their own whose memory limit is ``memory_mb`` (swap included):
  past it the kernel kills one of them. Elsewhere the candidate is one process
  with one thread (``RLIMIT_NPROC`` at 1: a fork or a new thread fails), so
  that its address-space limit of ``memory_mb`` bounds all it holds. Either
  way a run that ends for lack of memory scores 0 as ``memory``.
* **rlimits**, set by a small trusted runner before the candidate's first line:
  CPU seconds, address space, processes (threads included), file size, open
  files, no core dumps.
* **A wall-clock deadline**, after which every process of the run is killed.

Verdict: the candidate's code runs in one sandbox; the tests run in a second
one, the *judge* (:mod:`intellect.rl.rewards.sandbox_runner`), where every name
a test does not define resolves to the candidate's over a socket. Only plain
data crosses by value; any other object stays in the candidate's process and is
used through a reference that compares and hashes as itself. The judge writes
one line per test on a pipe that only it holds, in a process the candidate
cannot see (separate pid namespace), signal or read, so no frame, memory, file
descriptor or output of the candidate's can forge a pass, and returning an
object with a rigged ``__eq__`` fails the comparison. Each test counts on its
own (:attr:`RunResult.tests_passed`); the run passes when all of them do.
Exiting early, closing descriptors or printing anything is a failure. stdout and
stderr are read up to ``max_output_kb``; the rest is discarded.

What a test may do: call the candidate's functions and classes, read their
attributes and items, take ``len``, iterate, ``str``/``repr``/``bool``, catch
builtin exceptions they raise. Arguments must be plain data or the candidate's
own objects (a test's lambda cannot be passed in), and a test sees copies of
the candidate's plain values (mutating an argument in place is not observed).

Without ``bwrap`` nothing runs (:class:`SandboxUnavailable`) unless
``allow_unsandboxed`` is set: then the same two processes and rlimits run in
temporary directories with no namespace isolation (host files and the network
are reachable, the candidate can signal or trace the judge, ``RLIMIT_NPROC``
counts every process of the uid, and a child that calls ``setsid`` escapes the
final kill), and a warning says so.

Not covered: no seccomp filter (the whole kernel interface is reachable from
inside, as with any plain bwrap). Without a cgroup, memory the kernel holds for
the candidate (pipe buffers, its tmpfs mounts: ``3 * work_mb``) is outside the
address-space limit; the judge's process has a limit of its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from pydantic import Field

from intellect.config import StrictModel
from intellect.rl.rewards.sandbox_cgroup import GATE, MemoryCgroup, cgroup_parent
from intellect.rl.rewards.sandbox_processes import finish, kill_group, pipes, pump, wait_exit
from intellect.rl.rewards.sandbox_runner import FAILED_EXIT, MEMORY_EXIT

__all__ = [
    "RunResult", "SandboxConfig", "SandboxError", "SandboxUnavailable", "memory_status", "run_python", "sandbox_status",
]

log = logging.getLogger("intellect.rl.rewards")

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Most bytes of the judge's verdict lines kept (one short line per test).
MAX_VERDICT_BYTES = 1 << 20
# Trusted code run in both sandboxes, by the system interpreter: stdlib only, never imported there.
_RUNNER = (Path(__file__).parent / "sandbox_runner.py").read_text(encoding="utf-8")


class SandboxUnavailable(RuntimeError):
    """No usable sandbox, and the config does not allow running without one."""


class SandboxError(RuntimeError):
    """The sandbox itself failed before the candidate ran: the code was not judged."""


class SandboxConfig(StrictModel):
    """Limits of one sandboxed run of candidate code plus tests."""

    timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="Wall-clock limit of one run, sandbox start included.",
    )
    cpu_s: int = Field(
        default=5, ge=1, le=600, description="RLIMIT_CPU per process: SIGXCPU after this many CPU seconds.",
    )
    memory_mb: int = Field(
        default=512, ge=64, le=65536,
        description="Memory of the candidate's processes together, MiB: its cgroup's limit where the host allows "
        "one, else the address space (RLIMIT_AS) of its only process. Each process's RLIMIT_AS too.",
    )
    max_processes: int = Field(
        default=32, ge=1, le=4096,
        description="RLIMIT_NPROC: processes plus threads the code may have at once, in a cgroup; 1 without one.",
    )
    cgroup: str | None = Field(
        default=None,
        description="A cgroup v2 directory delegated to the validator, with memory in its cgroup.subtree_control, "
        "for the runs' cgroups. Unset: the validator's own memory cgroup where it may have such children.",
    )
    max_file_mb: int = Field(
        default=8, ge=0, le=4096, description="RLIMIT_FSIZE: largest file the code may write, in MiB.",
    )
    max_open_files: int = Field(
        default=64, ge=16, le=4096, description="RLIMIT_NOFILE: open file descriptors per process.",
    )
    work_mb: int = Field(
        default=16, ge=1, le=4096, description="Size of each private tmpfs (/work, /tmp, /dev/shm), in MiB; it is RAM."
    )
    max_output_kb: int = Field(
        default=64, ge=1, le=65536, description="Bytes of stdout and of stderr kept (KiB each); the rest is discarded."
    )
    python: str = Field(
        default="/usr/bin/python3",
        description="Interpreter run inside the sandbox. It must live under /usr, /bin or /lib*: those are "
        "the only host folders the sandbox sees (a venv's python would not start, by design).",
    )
    uid: int = Field(
        default=65534, ge=1, le=2**31 - 2,
        description="When the validator runs as root, the sandbox runs as this uid/gid (RLIMIT_NPROC is not "
        "enforced for root). Ignored otherwise.",
    )
    allow_unsandboxed: bool = Field(
        default=False,
        description="Where bwrap is missing or unusable, run with rlimits only (no filesystem or network "
        "isolation) instead of refusing. Never for untrusted workers.",
    )


@dataclass(frozen=True, slots=True)
class RunResult:
    """One sandboxed run. ``reason``: ``ok``, ``failed`` (the code or a test raised), ``timeout``,
    ``killed:<SIG>`` (e.g. ``killed:SIGXCPU``), ``memory`` (the code ran out of its memory:
    ``MemoryError`` at its address-space limit, or an OOM kill in its cgroup), ``early_exit`` (the
    candidate's process ended with status 0 before the tests finished) or ``exit:<n>``.
    ``tests_passed`` of ``tests_total`` passed, as the judge counted them."""

    passed: bool
    reason: str
    detail: str
    seconds: float
    sandboxed: bool
    tests_passed: int = 0
    tests_total: int = 0

    @property
    def score(self) -> float:
        """The fraction of tests passed (1.0 for a passing run without tests).

        >>> RunResult(False, "failed", "", 0.1, True, tests_passed=3, tests_total=4).score
        0.75
        """
        return 1.0 if self.passed else self.tests_passed / self.tests_total if self.tests_total else 0.0


def run_python(code: str, tests: Sequence[str], cfg: SandboxConfig | None = None) -> RunResult:
    """Run ``code`` in the sandbox and judge it with each of ``tests`` (Python source), in order.

    Raises :class:`SandboxUnavailable` when no sandbox can run and
    ``cfg.allow_unsandboxed`` is false, and :class:`SandboxError` when the
    sandbox broke before the candidate started (that is no verdict on the code).
    """
    cfg = cfg or SandboxConfig()
    bwrap = _usable_bwrap(cfg)
    if bwrap is None and not cfg.allow_unsandboxed:
        raise SandboxUnavailable(
            f"refusing to run untrusted code: {sandbox_status(cfg)}. Install bubblewrap, or set "
            "allow_unsandboxed=true to accept rlimit-only execution (no filesystem or network isolation)."
        )
    if bwrap is None:
        _warn_unsandboxed(sandbox_status(cfg))
    return _run(code, list(tests), cfg, bwrap)


def sandbox_status(cfg: SandboxConfig | None = None) -> str:
    """One line: whether bwrap sandboxing works here, and if not, why.

    >>> sandbox_status(SandboxConfig(python="/nonexistent/python3"))
    "interpreter '/nonexistent/python3' does not exist"
    """
    cfg = cfg or SandboxConfig()
    ok, line = _probe(shutil.which("bwrap"), cfg.python, cfg.uid)
    return f"{line}; {memory_status(cfg)}" if ok else line


def memory_status(cfg: SandboxConfig) -> str:
    """How the candidate's memory is bounded on this host (see the module docstring)."""
    parent = cgroup_parent(cfg.cgroup)
    if parent is None:
        return f"memory: {cfg.memory_mb} MiB address space of one process (no cgroup here: no forks or threads)"
    return f"memory: {cfg.memory_mb} MiB in all, cgroup v{parent.version} under {parent.path}"


def _usable_bwrap(cfg: SandboxConfig) -> str | None:
    bwrap = shutil.which("bwrap")
    return bwrap if _probe(bwrap, cfg.python, cfg.uid)[0] else None


_works: dict[tuple[str, str, int], str] = {}


def _probe(bwrap: str | None, python: str, uid: int) -> tuple[bool, str]:
    # Only successes are remembered: a failure may be transient (a loaded machine) or fixed meanwhile.
    key = (bwrap or "", python, uid)
    if key not in _works:
        ok, why = _try_sandbox(bwrap, python, uid)
        if not ok:
            return False, why
        _works[key] = why
    return True, _works[key]


def _try_sandbox(bwrap: str | None, python: str, uid: int) -> tuple[bool, str]:
    # A trivial run under default limits: the caller's own limits are no verdict on the sandbox.
    cfg = SandboxConfig(python=python, uid=uid, timeout_s=30)
    if not os.path.isfile(python):
        return False, f"interpreter {python!r} does not exist"
    real = os.path.realpath(python)
    if not any(real == d or real.startswith(d + "/") for d in _SYSTEM_DIRS):
        return False, f"interpreter {python!r} ({real}) is not under {', '.join(_SYSTEM_DIRS)}"
    if bwrap is None:
        return False, "bwrap (bubblewrap) is not on PATH"
    try:
        result = _run("assert 1 + 1 == 2", ["pass"], cfg, bwrap)
    except (SandboxError, OSError) as exc:
        return False, f"bwrap cannot start a sandbox here: {exc}"
    if not result.passed:
        return False, f"bwrap sandbox smoke run failed: {result.reason} {result.detail}"
    missing = [f for f in ("--size", "--disable-userns") if f not in _bwrap_features(bwrap)]
    extra = f" (bwrap lacks {' '.join(missing)}: tmpfs size or nested user namespaces unbounded)" if missing else ""
    return True, f"bwrap sandbox works ({bwrap}, uid {_drop_uid(cfg) or os.geteuid()}){extra}"


@lru_cache(maxsize=4)
def _bwrap_features(bwrap: str) -> frozenset[str]:
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    return frozenset(w for w in (out.stdout + out.stderr).split() if w.startswith("--"))


_warned = threading.Event()


def _warn_unsandboxed(why: str) -> None:
    if not _warned.is_set():
        _warned.set()
        log.warning(
            "running untrusted code WITHOUT a sandbox (allow_unsandboxed=true): %s. Only rlimits apply: "
            "the code can read host files and reach the network.", why
        )


def _drop_uid(cfg: SandboxConfig) -> int | None:
    return cfg.uid if os.geteuid() == 0 else None


def _limits(cfg: SandboxConfig, processes: int) -> str:
    mib = 1 << 20
    return json.dumps({
        # soft < hard: SIGXCPU at the soft limit names the cause; SIGKILL one second later if ignored.
        "RLIMIT_CPU": [cfg.cpu_s, cfg.cpu_s + 1],
        "RLIMIT_AS": [cfg.memory_mb * mib] * 2,
        "RLIMIT_NPROC": [processes] * 2,
        "RLIMIT_FSIZE": [cfg.max_file_mb * mib] * 2,
        "RLIMIT_NOFILE": [cfg.max_open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    })


def _bwrap_argv(bwrap: str, cfg: SandboxConfig) -> list[str]:
    features = _bwrap_features(bwrap)
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
    if "--disable-userns" in features:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_DIRS[1:]:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for d in ("/work", "/tmp", "/dev/shm"):
        if "--size" in features:
            argv += ["--size", str(cfg.work_mb << 20)]
        argv += ["--tmpfs", d]
    # Last, so that the mounts above exist: the root and /dev are themselves writable tmpfs otherwise.
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/work", "--clearenv"]
    for key, value in (("PATH", _SANDBOX_PATH), ("HOME", "/work"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    return argv + ["--"]


def _memory_cgroup(cfg: SandboxConfig) -> MemoryCgroup | None:
    parent = cgroup_parent(cfg.cgroup)
    if parent is None:
        return None
    try:
        return parent.create(cfg.memory_mb << 20)
    except OSError as exc:  # this run falls back to one process under its address-space limit
        log.warning("no memory cgroup for a sandboxed run under %s: %s", parent.path, exc)
        return None


def _run(code: str, tests: list[str], cfg: SandboxConfig, bwrap: str | None) -> RunResult:
    group = _memory_cgroup(cfg)
    try:
        return _run_in(code, tests, cfg, bwrap, group)
    finally:
        if group is not None:
            group.remove()


def _run_in(code: str, tests: list[str], cfg: SandboxConfig, bwrap: str | None, group: MemoryCgroup | None
            ) -> RunResult:
    # without a cgroup the candidate is one process, so that its address-space limit bounds all of it
    cand_limits = _limits(cfg, cfg.max_processes if group is not None else 1)
    judge_limits = _limits(cfg, cfg.max_processes)
    cand_sock, judge_sock = socket.socketpair()
    status_r, status_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    workdirs: list[str] = []
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    deadline = start + cfg.timeout_s
    try:
        # each process inherits only its own ends: the candidate never holds the verdict's descriptor
        procs.append(_spawn(cfg, bwrap, ["candidate", str(cand_sock.fileno()), str(status_w), cand_limits],
                            (cand_sock.fileno(), status_w), workdirs, group))
        procs.append(_spawn(cfg, bwrap, ["judge", str(judge_sock.fileno()), str(verdict_w), judge_limits],
                            (judge_sock.fileno(), verdict_w), workdirs))
    except BaseException:
        for fd in (status_r, verdict_r):
            os.close(fd)
        finish(procs, workdirs)
        raise
    finally:
        for end in (cand_sock, judge_sock):
            end.close()
        for fd in (status_w, verdict_w):
            os.close(fd)
    (cand_in, cand_out, cand_stderr), (judge_in, _, judge_stderr) = (pipes(p) for p in procs)
    cand, judge = procs
    cap = cfg.max_output_kb << 10
    cand_err, judge_err = cand_stderr.fileno(), judge_stderr.fileno()
    streams = {cand_out.fileno(): cap, cand_err: cap, status_r: 16, verdict_r: MAX_VERDICT_BYTES, judge_err: cap}
    gate = b"\n" if group is not None else b""  # the candidate's process is in its cgroup: it may start
    feeds = {cand_in.fileno(): (gate + code.encode("utf-8", "surrogatepass"), cand_in.close),
             judge_in.fileno(): (json.dumps(tests).encode(), judge_in.close)}
    ended_rc = None
    try:
        got, timed_out = pump(feeds, streams, verdict_r, deadline)
        verdict = _parse_verdict(got[verdict_r])
        if verdict["ended"]:  # the candidate quit on its own: its status says how
            ended_rc = wait_exit(cand, min(deadline, time.monotonic() + 2.0))
        for proc in procs:
            kill_group(proc)
        rest, _ = pump({}, streams, None, time.monotonic() + 0.5)  # what was left in the pipes
        for fd, data in rest.items():
            got[fd] = (got[fd] + data)[: streams[fd]]
    finally:
        os.close(status_r)
        os.close(verdict_r)
        finish(procs, workdirs)
    oom = group.oom_kills() if group is not None else 0
    seconds = time.monotonic() - start
    err = got[cand_err].decode("utf-8", "replace").strip()
    failures = "\n".join(verdict["why"][:2])[:600]
    detail = (err[-800:] + "\n" + failures).strip()[-800:]
    sandboxed = bwrap is not None

    def result(reason: str, passed: bool = False) -> RunResult:
        return RunResult(passed, reason, detail, seconds, sandboxed, verdict["passed"], len(tests))

    if not verdict["started"]:
        why = got[judge_err].decode("utf-8", "replace").strip()[-300:]
        raise SandboxError(f"the judge's sandbox exited before it ran (status {judge.returncode}): "
                           f"{why or 'no output'}")
    if timed_out and not verdict["done"]:
        return result("memory" if oom else "timeout")
    if not got[status_r].startswith(b"S"):
        raise SandboxError(f"the sandbox exited with status {cand.returncode} before the code ran: "
                           f"{err[-300:] or 'no output'}")
    if verdict["done"] and verdict["passed"] == len(tests):
        return result("ok", passed=True)
    if oom or ended_rc == MEMORY_EXIT:
        return result("memory")
    if ended_rc is None or ended_rc == FAILED_EXIT:
        return result("failed")
    sig = -ended_rc if ended_rc < 0 else (ended_rc - 128 if sandboxed and 128 < ended_rc < 128 + 65 else 0)
    if sig:
        try:
            return result(f"killed:{signal.Signals(sig).name}")
        except ValueError:
            return result(f"killed:{sig}")
    return result("early_exit" if ended_rc == 0 else f"exit:{ended_rc}")


def _spawn(cfg: SandboxConfig, bwrap: str | None, args: list[str], fds: tuple[int, ...],
           workdirs: list[str], group: MemoryCgroup | None = None) -> subprocess.Popen:
    """The process of one sandbox; with ``group``, held at :data:`GATE` until it is in that cgroup
    (the caller's first line on its stdin lets it go on)."""
    argv = [cfg.python, "-I", "-S", "-c", _RUNNER, *args]
    uid = _drop_uid(cfg)
    kwargs: dict = {}
    if bwrap is not None:
        argv = _bwrap_argv(bwrap, cfg) + argv
        kwargs["env"] = {"PATH": os.environ.get("PATH", _SANDBOX_PATH)}
    else:
        workdir = tempfile.mkdtemp(prefix="intellect-unsandboxed-")
        workdirs.append(workdir)
        if uid is not None:
            os.chown(workdir, uid, uid)
        kwargs.update(cwd=workdir, env={"PATH": _SANDBOX_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
    if uid is not None:
        kwargs.update(user=uid, group=uid, extra_groups=[])
    if group is not None:
        argv = GATE + argv
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=fds, start_new_session=True, **kwargs)
    if group is not None:
        try:
            group.add(proc.pid)
        except OSError as exc:
            finish([proc], [])
            raise SandboxError(f"could not move the sandbox into its cgroup {group.path}: {exc}") from exc
    return proc


def _parse_verdict(raw: bytes) -> dict:
    """The judge's lines: whether it started and finished, tests passed, failure lines, whether the candidate quit.

    >>> v = _parse_verdict(b'{"started": true}\\n{"test": 1, "ok": true}\\n{"test": 2, "ok": false, "why": "x"}\\n')
    >>> (v["started"], v["passed"], v["why"], v["done"])
    (True, 1, ['x'], False)
    """
    out = {"started": False, "done": False, "ended": False, "passed": 0, "why": []}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            break  # cut off at the byte bound
        if msg.get("started"):
            out["started"] = True
        elif msg.get("done"):
            out["done"], out["ended"] = True, bool(msg.get("ended"))
        elif msg.get("ok") is True:
            out["passed"] += 1
        elif "why" in msg:
            out["why"].append(str(msg["why"]))
    return out
