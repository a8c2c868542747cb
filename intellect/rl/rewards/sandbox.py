"""Run untrusted Python (a candidate solution plus its tests) in a bubblewrap sandbox.

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
* **rlimits**, set by a small trusted runner before the candidate's first line:
  CPU seconds, address space, processes (threads included), file size, open
  files, no core dumps.
* **A wall-clock deadline**, after which the sandbox's process group is killed.

Protocol: the candidate source, then each test, is ``exec``'d in one namespace
by ``python3 -I -S`` (the *system* interpreter, never the venv's); the run passes
only if every unit completes and the runner then reports a per-run secret on a
private pipe. Exiting early with status 0 (``sys.exit(0)``, ``os._exit(0)``) is
therefore a failure, not a pass. The program arrives on stdin; stdout/stderr
are read up to ``max_output_kb`` and the rest is discarded.

Without ``bwrap`` nothing runs (:class:`SandboxUnavailable`) unless
``allow_unsandboxed`` is set: then the same runner and rlimits run in a
temporary directory with no namespace isolation (host files and the network are
reachable, ``RLIMIT_NPROC`` counts every process of the uid, and a child that
calls ``setsid`` escapes the final kill), and a warning says so.

Not covered: tests run in the candidate's own process, so code written against
this runner can dig the secret out of memory, or return an object whose
``__eq__`` is always true (the tests should check types); early exits and a
failing test are caught, a targeted forgery is not. No seccomp filter (the whole kernel interface is reachable from
inside, as with any plain bwrap), and memory is bounded per process, not in
total: at most ``max_processes * memory_mb + 3 * work_mb`` (a cgroup would be
needed for less).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from pydantic import Field

from intellect.config import StrictModel

__all__ = ["RunResult", "SandboxConfig", "SandboxError", "SandboxUnavailable", "run_python", "sandbox_status"]

log = logging.getLogger("intellect.rl.rewards")

#: Exit status of the runner when a unit raised (any other status is the candidate's own doing).
FAILED_EXIT = 101
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"

# Trusted code run inside the sandbox before the candidate. The secret stays a
# local of main(): plain early exits cannot produce it.
_RUNNER = r"""
import json, os, resource, sys, traceback
def main():
    status = int(sys.argv[1])
    data = sys.stdin.buffer.read()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    secret, _, job = data.partition(b"\n")
    job = json.loads(job)
    del data
    for name, (soft, hard) in json.loads(sys.argv[2]).items():
        kind = resource.getrlimit(getattr(resource, name))[1]
        if kind != resource.RLIM_INFINITY:
            soft, hard = min(soft, kind), min(hard, kind)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.write(status, b"S")
    units = [("<solution>", job["code"])] + [("<test %d>" % i, t) for i, t in enumerate(job["tests"], 1)]
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    del job
    for name, src in units:
        try:
            exec(compile(src, name, "exec"), scope)
        except BaseException as exc:
            try:
                line = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                sys.stderr.write("FAILED %s: %s\n" % (name, line[:500]))
                sys.stderr.flush()
            finally:
                os._exit(101)
    sys.stdout.flush()
    os.write(status, secret)
    os._exit(0)
main()
"""


class SandboxUnavailable(RuntimeError):
    """No usable sandbox, and the config does not allow running without one."""


class SandboxError(RuntimeError):
    """The sandbox itself failed before the candidate ran: the code was not judged."""


class SandboxConfig(StrictModel):
    """Limits of one sandboxed run of candidate code plus tests."""

    timeout_s: float = Field(10.0, gt=0, le=600, description="Wall-clock limit of one run, sandbox start included.")
    cpu_s: int = Field(5, ge=1, le=600, description="RLIMIT_CPU per process: SIGXCPU after this many CPU seconds.")
    memory_mb: int = Field(512, ge=64, le=65536, description="RLIMIT_AS: address space per process, in MiB.")
    max_processes: int = Field(
        32, ge=1, le=4096, description="RLIMIT_NPROC: processes plus threads the code may have at once."
    )
    max_file_mb: int = Field(8, ge=0, le=4096, description="RLIMIT_FSIZE: largest file the code may write, in MiB.")
    max_open_files: int = Field(64, ge=16, le=4096, description="RLIMIT_NOFILE: open file descriptors per process.")
    work_mb: int = Field(
        16, ge=1, le=4096, description="Size of each private tmpfs (/work, /tmp, /dev/shm), in MiB; it is RAM."
    )
    max_output_kb: int = Field(
        64, ge=1, le=65536, description="Bytes of stdout and of stderr kept (KiB each); the rest is discarded."
    )
    python: str = Field(
        "/usr/bin/python3",
        description="Interpreter run inside the sandbox. It must live under /usr, /bin or /lib*: those are "
        "the only host folders the sandbox sees (a venv's python would not start, by design).",
    )
    uid: int = Field(
        65534, ge=1, le=2**31 - 2,
        description="When the validator runs as root, the sandbox runs as this uid/gid (RLIMIT_NPROC is not "
        "enforced for root). Ignored otherwise.",
    )
    allow_unsandboxed: bool = Field(
        False,
        description="Where bwrap is missing or unusable, run with rlimits only (no filesystem or network "
        "isolation) instead of refusing. Never for untrusted workers.",
    )


@dataclass(frozen=True, slots=True)
class RunResult:
    """One sandboxed run. ``reason``: ``ok``, ``failed`` (a unit raised), ``timeout``,
    ``killed:<SIG>`` (e.g. ``killed:SIGXCPU``), ``early_exit`` (status 0 before the
    tests finished) or ``exit:<n>``."""

    passed: bool
    reason: str
    detail: str
    seconds: float
    sandboxed: bool


def run_python(code: str, tests: Sequence[str], cfg: SandboxConfig | None = None) -> RunResult:
    """Run ``code`` then each of ``tests`` (Python source) in the sandbox.

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
    return _probe(shutil.which("bwrap"), cfg.python, cfg.uid)[1]


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


def _limits(cfg: SandboxConfig) -> str:
    mib = 1 << 20
    return json.dumps({
        # soft < hard: SIGXCPU at the soft limit names the cause; SIGKILL one second later if ignored.
        "RLIMIT_CPU": [cfg.cpu_s, cfg.cpu_s + 1],
        "RLIMIT_AS": [cfg.memory_mb * mib] * 2,
        "RLIMIT_NPROC": [cfg.max_processes] * 2,
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


def _run(code: str, tests: list[str], cfg: SandboxConfig, bwrap: str | None) -> RunResult:
    secret = secrets.token_hex(16).encode()
    payload = secret + b"\n" + json.dumps({"code": code, "tests": tests}).encode()
    status_r, status_w = os.pipe()
    workdir = None
    uid = _drop_uid(cfg)
    argv = [cfg.python, "-I", "-S", "-c", _RUNNER, str(status_w), _limits(cfg)]
    kwargs: dict = {}
    if bwrap is not None:
        argv = _bwrap_argv(bwrap, cfg) + argv
        kwargs["env"] = {"PATH": os.environ.get("PATH", _SANDBOX_PATH)}
    else:
        workdir = tempfile.mkdtemp(prefix="intellect-unsandboxed-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        kwargs.update(cwd=workdir, env={"PATH": _SANDBOX_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
    if uid is not None:
        kwargs.update(user=uid, group=uid, extra_groups=[])
    start = time.monotonic()
    deadline = start + cfg.timeout_s
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(status_w,), start_new_session=True, **kwargs,
        )
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    os.close(status_w)
    try:
        cap = cfg.max_output_kb << 10
        _, err, status, timed_out = _pump(proc, payload, status_r, cap, deadline)
        timed_out = _reap(proc, deadline) or timed_out
    finally:
        os.close(status_r)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        if proc.returncode is None:
            _kill_group(proc)
            proc.wait()
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - start
    rc = proc.returncode
    tail = err.decode("utf-8", "replace").strip()[-800:]
    sandboxed = bwrap is not None

    def result(reason: str, passed: bool = False) -> RunResult:
        return RunResult(passed, reason, tail, seconds, sandboxed)

    if timed_out:
        return result("timeout")
    if not status.startswith(b"S"):
        raise SandboxError(f"the sandbox exited with status {rc} before the code ran: {tail[-300:] or 'no output'}")
    if rc == 0 and status == b"S" + secret:
        return result("ok", passed=True)
    if rc == FAILED_EXIT:
        return result("failed")
    sig = -rc if rc < 0 else (rc - 128 if sandboxed and 128 < rc < 128 + 65 else 0)
    if sig:
        try:
            return result(f"killed:{signal.Signals(sig).name}")
        except ValueError:
            return result(f"killed:{sig}")
    return result("early_exit" if rc == 0 else f"exit:{rc}")


def _pump(
    proc: subprocess.Popen, payload: bytes, status_fd: int, cap: int, deadline: float
) -> tuple[bytes, bytes, bytes, bool]:
    """Feed stdin and drain stdout/stderr/status until all close or the deadline passes."""
    assert proc.stdin and proc.stdout and proc.stderr
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    todo = memoryview(payload)
    stdin = proc.stdin.fileno()
    with selectors.DefaultSelector() as sel:
        os.set_blocking(stdin, False)
        sel.register(stdin, selectors.EVENT_WRITE)
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        timed_out = False
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin:
                    try:
                        todo = todo[os.write(fd, todo[:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        todo = todo[:0]
                    if not todo:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                if len(buf) < cap:
                    buf += chunk[: cap - len(buf)]
    out, err, status = (bytes(b) for b in bufs.values())
    return out, err, status, timed_out


def _reap(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait for the leader until the deadline, kill its whole group, then reap it. True if it timed out.

    The group is killed while the leader is still unreaped, so its id cannot have
    been reused by an unrelated process group.
    """
    timed_out = True
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            timed_out = False
            break
        time.sleep(0.005)
    _kill_group(proc)
    proc.wait()
    return timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
