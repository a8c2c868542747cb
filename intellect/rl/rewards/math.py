"""Math reward: extract the final answer, compare it with the reference, 1 or 0.

**Answer format** (the first that applies; only text after the last
``</think>`` counts):

1. the content of the last ``\\boxed{...}`` (braces balanced);
2. the rest of the line after the last ``Answer:`` (any case: the tiny model's
   alphabet is lowercase);
3. the whole completion, stripped: the bare format of the synthetic arithmetic
   task (``"12+34="`` completed by ``"46"``).

**Comparison.** Both sides are normalized (``$``, ``\\left``/``\\right``,
``\\frac{a}{b}``, ``\\sqrt{x}``, ``\\pi``, ``\\cdot``, thousands commas, a
trailing period) and must then consist only of digits, ``+ - * / ^ ( ) .``,
spaces and the names ``sqrt`` and ``pi``; anything else is ``invalid``
*before* any parser sees it (sympy's ``parse_expr`` calls ``eval``). Then:

* a reference that is an integer needs an integer literal of the same value
  (``"46"``, ``"+046"``; not ``"46.0"`` nor ``"40+6"``), as in prime-rl's grader;
* two plain rationals (``"1/2"``, ``"0.5"``, ``"-3/4"``) compare exactly in-process;
* anything else is parsed by sympy (decimals read as exact rationals) and
  ``simplify(a - b) == 0`` decides, in a checker process with a time and
  memory limit: a pathological input such as ``9^9^9`` ends as ``timeout``.

**Budgets.** Everything before the symbolic check is linear in the completion's
length (``\\boxed{`` is matched from one vectorized pass over the brace depths). The symbolic
checks run in a bounded pool of ``checkers`` processes shared by every caller
in the process, so a hung sympy call can be killed without touching the others.
Each row's check gets ``timeout_s`` (its row budget; over it the row scores 0 as
``timeout`` and its checker is replaced), and each :func:`math_rewards` call (the
validator's rows of one file) gets ``file_budget_s`` in all, start-up of a
replaced checker and waiting for a free one included: once it is spent, the
file's remaining rows that need the checker score 0 as ``budget``, unchecked.
A call scores its rows one after another, so one file never holds more than one
checker, and files scored in parallel threads do not wait for each other while
no more of them are in flight than there are checkers.

Reasons: ``ok``, ``mismatch``, ``no_answer``, ``invalid``, ``timeout``,
``budget``, ``error`` (the checker failed, e.g. out of memory), ``bad_reference``.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import re
import threading
import time
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
from pydantic import Field

from intellect.config import StrictModel
from intellect.rl.rewards.base import RewardResult, after_thinking

__all__ = [
    "MathRewardConfig", "equivalent", "extract_answer", "math_reward", "math_rewards", "normalize_answer",
    "warm_checkers",
]

log = logging.getLogger("intellect.rl.rewards")


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


_INT = re.compile(r"[+-]?\d+")
_ALLOWED = re.compile(r"(?:[0-9+\-*/^(). ]|sqrt|pi)+")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_LATEX = [
    (re.compile(r"\\(?:left|right|displaystyle|!|,|;|:| )"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi\b"), "pi"),
    (re.compile(r"(?<=\d),(?=\d{3}(?!\d))"), ""),  # thousands separators: 1,000 -> 1000
]
_BOXED = re.compile(r"\\boxed\{")
_OPEN, _CLOSE = ord("{"), ord("}")
#: An answer this many times longer than ``max_answer_chars`` is invalid before it is even normalized
#: (normalizing never lengthens an answer, and no answer's markup makes it that much longer).
_RAW_ANSWER_FACTOR = 16
_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\{([^{}]*)\}")


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion (see the module docstring), or None when it is empty.

    >>> extract_answer("so \\\\boxed{\\\\frac{1}{2}} and \\\\boxed{3}")
    '3'
    >>> extract_answer("we add. Answer: 46\\nthanks"), extract_answer("46"), extract_answer("  ")
    ('46', '46', None)
    """
    text = after_thinking(completion)
    boxed = _last_boxed(text)
    if boxed is not None:
        answer = boxed
    else:
        hits = list(_ANSWER.finditer(text))
        answer = text[hits[-1].end():].split("\n", 1)[0] if hits else text
    answer = answer.strip()
    return answer or None


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{`` whose brace is closed, in linear time (vectorized).

    A ``{`` closes at the first later point where the brace depth falls below its own; it closes at
    all when the lowest depth after it is below its own. The last box that closes wins.

    >>> _last_boxed("\\\\boxed{1} \\\\boxed{{2}} \\\\boxed{3"), _last_boxed("\\\\boxed{{") is None
    ('{2}', True)
    """
    last = text.rfind("\\boxed{")
    if last == -1:
        return None
    found = _last_closed_box(text[last:])  # the usual case: the last box closes; only its tail is read
    if found is not None:
        return found
    # The last box is open, so the depth after it never falls below the depth just before it: an
    # earlier box that closes at all closes before the last one starts.
    first = text.find("\\boxed{", 0, last)
    return None if first == -1 else _last_closed_box(text[first:last])


def _last_closed_box(seg: str) -> str | None:
    codes = np.frombuffer(seg.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    depth = np.cumsum((codes == _OPEN).astype(np.int32) - (codes == _CLOSE))  # after each character
    floor = np.append(np.minimum.accumulate(depth[::-1])[::-1], np.iinfo(np.int32).max)  # lowest from here on
    opens = np.fromiter((m.end() - 1 for m in _BOXED.finditer(seg)), dtype=np.int64)
    closed = opens[floor[opens + 1] < depth[opens]]
    if not closed.size:
        return None
    q = int(closed[-1])
    k = q + 1 + int(np.argmax(depth[q + 1:] < depth[q]))
    return seg[q + 1:k]


def normalize_answer(answer: str) -> str:
    """LaTeX and punctuation reduced to plain arithmetic (no validation).

    >>> normalize_answer("$\\\\dfrac{\\\\sqrt{2}}{2}$."), normalize_answer("1,234,567")
    ('(sqrt(2))/(2)', '1234567')
    >>> normalize_answer("3\\\\cdot\\\\pi")
    '3*pi'
    """
    s = answer.strip().rstrip(".").strip().strip("$").replace("\u2212", "-")
    for pattern, repl in _LATEX:
        s = pattern.sub(repl, s)
    for _ in range(20):  # innermost first; bounded so that nesting cannot loop forever
        t = _SQRT.sub(r"sqrt(\1)", _FRAC.sub(r"(\1)/(\2)", s))
        if t == s:
            break
        s = t
    return " ".join(s.replace("{", "(").replace("}", ")").split())


def math_reward(completion: str, reference: str, cfg: MathRewardConfig | None = None) -> RewardResult:
    """1.0 when the completion's final answer equals ``reference``, else 0.0, with the reason.

    >>> math_reward("46", "46"), math_reward("Answer: 1/2", "0.5").reason, math_reward("45", "46").reason
    (RewardResult(reward=1.0, reason='ok', detail=''), 'ok', 'mismatch')
    >>> math_reward("__import__('os').system('x')", "1").reason
    'invalid'
    """
    cfg = cfg or MathRewardConfig()
    return _score(completion, reference, cfg, time.monotonic() + cfg.file_budget_s)


def math_rewards(
    completions: Sequence[str],
    references: Sequence[str],
    cfg: MathRewardConfig | None = None,
    *,
    row_budget_s: float | None = None,
    total_budget_s: float | None = None,
) -> list[RewardResult]:
    """:func:`math_reward` of each ``(completion, reference)`` pair, within budgets: ``row_budget_s``
    (default ``cfg.timeout_s``) per row's symbolic check and ``total_budget_s`` (default
    ``cfg.file_budget_s``) for the whole call (see the module docstring). Meant for one file's rows.

    >>> [r.reason for r in math_rewards(["\\\\boxed{46}", "45", ""], ["46", "46", "46"], total_budget_s=1)]
    ['ok', 'mismatch', 'no_answer']
    """
    cfg = cfg or MathRewardConfig()
    if len(completions) != len(references):
        raise ValueError(f"{len(completions)} completions but {len(references)} references")
    if row_budget_s is not None or total_budget_s is not None:
        cfg = MathRewardConfig(**{
            **cfg.model_dump(),
            **({} if row_budget_s is None else {"timeout_s": row_budget_s}),
            **({} if total_budget_s is None else {"file_budget_s": total_budget_s}),
        })
    deadline = time.monotonic() + cfg.file_budget_s
    return [_score(c, r, cfg, deadline) for c, r in zip(completions, references)]


def _score(completion: str, reference: str, cfg: MathRewardConfig, deadline: float) -> RewardResult:
    answer = extract_answer(completion)
    if answer is None:
        return RewardResult(0.0, "no_answer")
    verdict, detail = equivalent(answer, reference, cfg, deadline=deadline)
    if verdict == "bad_reference":
        log.warning("math reference %r is not a checkable answer: %s", reference, detail)
    return RewardResult(1.0 if verdict == "ok" else 0.0, verdict, detail)


def equivalent(
    answer: str, reference: str, cfg: MathRewardConfig | None = None, *, deadline: float | None = None
) -> tuple[str, str]:
    """Compare an extracted answer with the reference: ``(reason, detail)``, reason ``ok`` if equal.
    A symbolic check ends by ``deadline`` (``time.monotonic()``; default ``cfg.file_budget_s`` from now).

    >>> equivalent("2^10", "1024")[0], equivalent("sqrt(8)", "2*sqrt(2)")[0]
    ('mismatch', 'ok')
    """
    cfg = cfg or MathRewardConfig()
    if len(reference) > _RAW_ANSWER_FACTOR * cfg.max_answer_chars:
        return "bad_reference", f"reference of {len(reference)} characters is too long"
    ref = normalize_answer(reference)
    if not _checkable(ref, cfg):
        return "bad_reference", f"reference {reference[:80]!r} is not a number or simple expression"
    if len(answer) > _RAW_ANSWER_FACTOR * cfg.max_answer_chars:
        return "invalid", f"answer of {len(answer)} characters is too long"
    got = normalize_answer(answer)
    if not _checkable(got, cfg):
        return "invalid", f"{answer[:80]!r} is not a number or simple expression"
    if _INT.fullmatch(ref):
        if _INT.fullmatch(got) is None:
            return "mismatch", "an integer is expected"
        return ("ok", "") if int(got) == int(ref) else ("mismatch", "")
    a, b = _rational(got), _rational(ref)
    if a is not None and b is not None:
        return ("ok", "") if a == b else ("mismatch", "")
    return _CHECKER.check(got, ref, cfg, time.monotonic() + cfg.file_budget_s if deadline is None else deadline)


def _checkable(s: str, cfg: MathRewardConfig) -> bool:
    return 0 < len(s) <= cfg.max_answer_chars and _ALLOWED.fullmatch(s) is not None


def _rational(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------- symbolic worker


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


class _Waiter:
    """A caller queued for a checker: :meth:`_CheckerPool._release` hands one over and sets the event."""

    __slots__ = ("event", "checker")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.checker: _Checker | None = None


class _CheckerPool:
    """At most ``cfg.checkers`` :class:`_Checker` processes, each lent to one caller at a time. A freed
    checker goes to the longest-waiting caller first, so callers take turns: a file whose rows keep
    coming back for a checker cannot keep it from another file's rows."""

    _START_LIMIT_S = 120.0  # a checker that is not up by then failed to start

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Checker] = []
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._count = 0

    def _acquire(self, size: int, deadline: float) -> _Checker | None:
        with self._lock:
            if self._idle and not self._waiters:
                return self._idle.pop()  # the most recently used: warm
            if self._count < size:
                self._count += 1
                return _Checker()
            waiter = _Waiter()
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
                waiter = self._waiters.popleft()
                waiter.checker = checker
                waiter.event.set()
            elif surplus:
                self._count -= 1
            else:
                self._idle.append(checker)
        if surplus:
            checker.stop()

    def check(self, a: str, b: str, cfg: MathRewardConfig, deadline: float) -> tuple[str, str]:
        """``simplify(a - b) == 0`` on a checker: ``(reason, detail)``, within ``cfg.timeout_s`` of the
        check's start and ``deadline`` (waiting for a free checker and its start-up included)."""
        checker = self._acquire(cfg.checkers, deadline)
        if checker is None:
            return "budget", "no checker was free before the file's budget ran out"
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
            got = checker.check(a, b, limit)
            if got is not None:
                return got
            if limit < cfg.timeout_s:
                return "budget", f"the file's budget ran out after {limit:.2g}s of this check"
            return "timeout", f"no verdict within {cfg.timeout_s:g}s"
        finally:
            self._release(checker, cfg.checkers)

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


_CHECKER = _CheckerPool()


def warm_checkers(cfg: MathRewardConfig | None = None, timeout_s: float = 120.0) -> int:
    """Start ``cfg.checkers`` symbolic checker processes now (e.g. when the validator starts), so that
    the first files are not charged their start-up; returns how many are up within ``timeout_s``."""
    return _CHECKER.warm(cfg or MathRewardConfig(), timeout_s)
