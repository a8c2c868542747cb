"""The symbolic checker of the math reward (:mod:`intellect.rl.rewards.math`): processes that run
sympy on two normalized answers, and the pool that lends them out within the row, call and worker
budgets described there.

sympy is imported by the checker processes only, never by the trainer or the validator.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any, Sequence

from pydantic import Field

from intellect.config import StrictModel

__all__ = ["CHECKERS", "MathRewardConfig", "warm_checkers"]


class MathRewardConfig(StrictModel):
    """Limits of the math answer checker."""

    timeout_s: float = Field(
        default=2.0, gt=0, le=60,
        description="Row budget: wall-clock limit of one row's symbolic comparison (over it: 0, `timeout`).",
    )
    file_budget_s: float = Field(
        default=60.0, gt=0, le=3600,
        description="Wall-clock budget of one math_rewards call (a file's rows) for symbolic checks, waiting "
        "for a checker included; rows still needing one after it score 0 as `budget`.",
    )
    worker_budget_s: float = Field(
        default=120.0, gt=0, le=86_400,
        description="Checker seconds one worker's rows may draw in all (its files together, also at once); the "
        "bucket refills at this many per worker_refill_s. Rows of a worker with an empty bucket score 0 as `budget`.",
    )
    worker_refill_s: float = Field(
        default=600.0, gt=0, le=86_400, description="Seconds in which an empty worker bucket fills up again.",
    )
    checkers: int = Field(
        default=2, ge=1, le=64, description="Most symbolic checker processes in this process, shared by every caller."
    )
    max_answer_chars: int = Field(
        default=200, ge=1, le=10000, description="Longer extracted answers (after normalization) are invalid, unparsed."
    )
    memory_mb: int = Field(
        default=1024, ge=64, le=65536,
        description="Address space (RLIMIT_AS) the symbolic checker process may add to its start-up size, MiB.",
    )



def _sympy_equal(a: str, b: str) -> bool:
    # sympy is loaded by the checker process only, never by the trainer or the validator
    import sympy  # noqa: PLC0415
    from sympy.parsing.sympy_parser import (  # noqa: PLC0415
        convert_xor, implicit_multiplication, parse_expr, rationalize, standard_transformations,
    )

    transformations = standard_transformations + (convert_xor, implicit_multiplication, rationalize)
    names: dict[str, Any] = {"__builtins__": {}, "sqrt": sympy.sqrt, "pi": sympy.pi}
    for name in ("Integer", "Float", "Rational", "Symbol", "Mul", "Add", "Pow"):
        names[name] = getattr(sympy, name)
    x, y = (parse_expr(s, global_dict=dict(names), transformations=transformations) for s in (a, b))
    return bool(sympy.simplify(x - y) == 0)


def _serve(conn: Any, memory_mb: int) -> None:
    import resource  # noqa: PLC0415 - the checker process only

    import sympy  # noqa: F401, PLC0415 - imported before "ready", so the first check is not charged for it

    # On top of what the interpreter already maps (which depends on what the package imports).
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    conn.send("ready")
    while True:
        try:
            a, b = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok" if _sympy_equal(a, b) else "mismatch", ""))
        except (SyntaxError, TypeError, ValueError, ZeroDivisionError, AttributeError, NameError) as exc:
            conn.send(("invalid", f"{type(exc).__name__}: {exc}"[:200]))
        except BaseException as exc:  # noqa: BLE001 - MemoryError, RecursionError...: the worker survives them
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:200]))


class _Checker:
    """One checker process, started without waiting; killed and started again after a timeout.

    A separate process because sympy can run forever (or exhaust memory) on short inputs, and a
    thread cannot be stopped; "spawn" so that the worker neither inherits the validator's address
    space (an RLIMIT_AS would be meaningless) nor its threads' locks. Used by one caller at a time
    (the pool hands it out).
    """

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Any = None
        self._memory_mb = 0
        self._ready = False

    def start(self, memory_mb: int) -> None:
        self.stop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, memory_mb), daemon=True, name="math-reward-checker")
        proc.start()
        child.close()
        self._proc, self._conn, self._memory_mb, self._ready = proc, parent, memory_mb, False

    def wait_ready(self, memory_mb: int, timeout: float) -> bool:
        """Whether the process is up (started first if needed) within ``timeout`` seconds."""
        if self._proc is None or not self._proc.is_alive() or self._memory_mb != memory_mb:
            self.start(memory_mb)
        if not self._ready:
            try:
                self._ready = self._conn.poll(max(timeout, 0)) and self._conn.recv() == "ready"
            except (EOFError, OSError):
                self.stop()
        return self._ready

    def check(self, a: str, b: str, limit: float) -> tuple[str, str] | None:
        """The verdict on ``a`` against ``b``, or ``None`` when none came within ``limit`` seconds
        (the process is then replaced)."""
        try:
            self._conn.send((a, b))
            if not self._conn.poll(limit):
                self.start(self._memory_mb)  # kills the busy one; the new one warms up meanwhile
                return None
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            self.stop()
            return "error", f"checker process died: {exc!r}"

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None
        self._ready = False


class _Bucket:
    """A worker's checker time: ``level`` seconds left, refilled with time (module docstring)."""

    __slots__ = ("level", "at", "calls")

    def __init__(self, cfg: MathRewardConfig, now: float) -> None:
        self.level, self.at, self.calls = cfg.worker_budget_s, now, 0

    def drawn(self, cfg: MathRewardConfig, now: float) -> float:
        """Seconds drawn and not yet refilled (checks in flight included): the caller's priority."""
        self.level = min(cfg.worker_budget_s, self.level + (now - self.at) * cfg.worker_budget_s / cfg.worker_refill_s)
        self.at = now
        return cfg.worker_budget_s - self.level


class _Waiter:
    """A caller queued for a checker: :meth:`_CheckerPool._release` hands one over and sets the event."""

    __slots__ = ("event", "checker", "bucket", "seq")

    def __init__(self, bucket: _Bucket, seq: int) -> None:
        self.event = threading.Event()
        self.checker: _Checker | None = None
        self.bucket, self.seq = bucket, seq


class _CheckerPool:
    """At most ``cfg.checkers`` :class:`_Checker` processes, each lent to one caller at a time, and
    the workers' buckets. A freed checker goes to the waiting caller whose worker has drawn the
    least (then the longest waiting), so a worker whose rows time out waits behind the others."""

    _START_LIMIT_S = 120.0  # a checker that is not up by then failed to start

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Checker] = []
        self._waiters: list[_Waiter] = []
        self._buckets: dict[object, _Bucket] = {}
        self._count = 0
        self._seq = 0
        self._cfg = MathRewardConfig()  # the latest caller's: buckets are compared under one rule

    def check_all(self, pairs: Sequence[tuple[str, str]], cfg: MathRewardConfig, deadline: float,
                  worker: str | None) -> list[tuple[str, str]]:
        """``(reason, detail)`` of ``simplify(a - b) == 0`` for each pair, one after another on one
        checker at a time, within the row, call and worker budgets (module docstring)."""
        key: object = object() if worker is None else worker
        with self._lock:
            self._cfg = cfg
            bucket = self._buckets.get(key) or self._buckets.setdefault(key, _Bucket(cfg, time.monotonic()))
            bucket.calls += 1
        checker: _Checker | None = None
        out: list[tuple[str, str]] = []
        try:
            for a, b in pairs:
                if checker is not None and self._should_yield(bucket):
                    self._release(checker, cfg.checkers)
                    checker = None
                if checker is None:
                    checker = self._acquire(cfg.checkers, deadline, bucket)
                if checker is None:
                    out.append(("budget", "no checker was free before the file's budget ran out"))
                    continue
                out.append(self._check(checker, a, b, cfg, deadline, bucket))
        finally:
            if checker is not None:
                self._release(checker, cfg.checkers)
            with self._lock:
                bucket.calls -= 1
                now = time.monotonic()
                for k in [k for k, b in self._buckets.items() if not b.calls and b.drawn(cfg, now) <= 0]:
                    del self._buckets[k]
                if not bucket.calls and not isinstance(key, str):
                    self._buckets.pop(key, None)
        return out

    def _should_yield(self, bucket: _Bucket) -> bool:
        with self._lock:
            now = time.monotonic()
            mine = bucket.drawn(self._cfg, now)
            return any(w.bucket.drawn(self._cfg, now) <= mine for w in self._waiters if w.bucket is not bucket)

    def _acquire(self, size: int, deadline: float, bucket: _Bucket) -> _Checker | None:
        with self._lock:
            if self._idle and not self._waiters:
                return self._idle.pop()  # the most recently used: warm
            if self._count < size:
                self._count += 1
                return _Checker()
            self._seq += 1
            waiter = _Waiter(bucket, self._seq)
            self._waiters.append(waiter)
        waiter.event.wait(max(deadline - time.monotonic(), 0))
        with self._lock:
            if waiter.checker is None:
                self._waiters.remove(waiter)
            return waiter.checker

    def _release(self, checker: _Checker, size: int) -> None:
        with self._lock:
            surplus = not self._waiters and self._count > size
            if self._waiters:
                now = time.monotonic()
                waiter = min(self._waiters, key=lambda w: (w.bucket.drawn(self._cfg, now), w.seq))
                self._waiters.remove(waiter)
                waiter.checker = checker
                waiter.event.set()
            elif surplus:
                self._count -= 1
            else:
                self._idle.append(checker)
        if surplus:
            checker.stop()

    def _check(self, checker: _Checker, a: str, b: str, cfg: MathRewardConfig, deadline: float,
               bucket: _Bucket) -> tuple[str, str]:
        """One comparison on ``checker``, within ``cfg.timeout_s`` and ``deadline``; it starts only
        while ``bucket`` holds a whole row budget, which it reserves (so that the worker's checks at
        once never overdraw it) and then draws what the comparison took."""
        with self._lock:
            if bucket.drawn(cfg, time.monotonic()) > cfg.worker_budget_s - cfg.timeout_s:
                return "budget", f"the worker's checker budget ({cfg.worker_budget_s:g}s) is spent"
            bucket.level -= cfg.timeout_s
        took = 0.0
        try:
            started = time.monotonic()
            if not checker.wait_ready(cfg.memory_mb, min(deadline - started, self._START_LIMIT_S)):
                if checker._proc is None:
                    return "error", "the checker process died while starting"
                if time.monotonic() - started >= self._START_LIMIT_S:
                    checker.stop()  # hung while starting: the next caller starts a fresh one
                    return "error", f"the checker process did not start within {self._START_LIMIT_S:g}s"
                return "budget", "the file's budget ran out while a checker started"
            limit = min(cfg.timeout_s, deadline - time.monotonic())
            if limit <= 0:
                return "budget", "the file's budget ran out"
            t0 = time.monotonic()
            got = checker.check(a, b, limit)
            took = min(time.monotonic() - t0, cfg.timeout_s)
            if got is not None:
                return got
            if limit < cfg.timeout_s:
                return "budget", f"the file's budget ran out after {limit:.2g}s of this check"
            return "timeout", f"no verdict within {cfg.timeout_s:g}s"
        finally:
            with self._lock:
                bucket.level += cfg.timeout_s - took  # the reservation, less what the check drew

    def warm(self, cfg: MathRewardConfig, timeout_s: float) -> int:
        """Start the free checkers up to ``cfg.checkers`` and wait for them; how many are up."""
        deadline = time.monotonic() + timeout_s
        held: list[_Checker] = []
        with self._lock:
            while self._idle or self._count < cfg.checkers:
                if self._idle:
                    held.append(self._idle.pop())
                else:
                    self._count += 1
                    held.append(_Checker())
        try:
            for c in held:
                if c._proc is None:
                    c.start(cfg.memory_mb)  # all start at once, then each is waited for
            return sum(c.wait_ready(cfg.memory_mb, deadline - time.monotonic()) for c in held)
        finally:
            for c in held:
                self._release(c, cfg.checkers)


#: The process's pool, shared by every caller.
CHECKERS = _CheckerPool()


def warm_checkers(cfg: MathRewardConfig | None = None, timeout_s: float = 120.0) -> int:
    """Start ``cfg.checkers`` symbolic checker processes now (e.g. when the validator starts), so that
    the first files are not charged their start-up; returns how many are up within ``timeout_s``."""
    return CHECKERS.warm(cfg or MathRewardConfig(), timeout_s)
