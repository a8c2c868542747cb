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
  ``simplify(a - b) == 0`` decides, in a separate worker process with a time
  and memory limit: a pathological input such as ``9^9^9`` ends as ``timeout``.

Reasons: ``ok``, ``mismatch``, ``no_answer``, ``invalid``, ``timeout``,
``error`` (the checker failed, e.g. out of memory), ``bad_reference``.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
from fractions import Fraction
from typing import Any

from pydantic import Field

from intellect.config import StrictModel
from intellect.rl.rewards.base import RewardResult, after_thinking

__all__ = ["MathRewardConfig", "equivalent", "extract_answer", "math_reward", "normalize_answer"]

log = logging.getLogger("intellect.rl.rewards")


class MathRewardConfig(StrictModel):
    """Limits of the math answer checker."""

    timeout_s: float = Field(2.0, gt=0, le=60, description="Wall-clock limit of one symbolic comparison.")
    max_answer_chars: int = Field(
        200, ge=1, le=10000, description="Longer extracted answers (after normalization) are invalid, unparsed."
    )
    memory_mb: int = Field(
        1024, ge=64, le=65536,
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
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


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
    answer = extract_answer(completion)
    if answer is None:
        return RewardResult(0.0, "no_answer")
    verdict, detail = equivalent(answer, reference, cfg)
    if verdict == "bad_reference":
        log.warning("math reference %r is not a checkable answer: %s", reference, detail)
    return RewardResult(1.0 if verdict == "ok" else 0.0, verdict, detail)


def equivalent(answer: str, reference: str, cfg: MathRewardConfig | None = None) -> tuple[str, str]:
    """Compare an extracted answer with the reference: ``(reason, detail)``, reason ``ok`` if equal.

    >>> equivalent("2^10", "1024")[0], equivalent("sqrt(8)", "2*sqrt(2)")[0]
    ('mismatch', 'ok')
    """
    cfg = cfg or MathRewardConfig()
    ref = normalize_answer(reference)
    if not _checkable(ref, cfg):
        return "bad_reference", f"reference {reference!r} is not a number or simple expression"
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
    return _CHECKER.check(got, ref, cfg)


def _checkable(s: str, cfg: MathRewardConfig) -> bool:
    return 0 < len(s) <= cfg.max_answer_chars and _ALLOWED.fullmatch(s) is not None


def _rational(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------- symbolic worker


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor, implicit_multiplication, parse_expr, rationalize, standard_transformations,
    )

    transformations = standard_transformations + (convert_xor, implicit_multiplication, rationalize)
    names: dict[str, Any] = {"__builtins__": {}, "sqrt": sympy.sqrt, "pi": sympy.pi}
    for name in ("Integer", "Float", "Rational", "Symbol", "Mul", "Add", "Pow"):
        names[name] = getattr(sympy, name)
    x, y = (parse_expr(s, global_dict=dict(names), transformations=transformations) for s in (a, b))
    return bool(sympy.simplify(x - y) == 0)


def _serve(conn: Any, memory_mb: int) -> None:
    import resource

    import sympy  # noqa: F401  (imported before "ready" so the first check is not charged for it)

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
        except BaseException as exc:  # MemoryError, RecursionError...: the worker survives them
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:200]))


class _Checker:
    """One persistent worker process, killed and replaced after a timeout.

    A separate process because sympy can run forever (or exhaust memory) on short
    inputs, and a thread cannot be stopped; "spawn" so that the worker neither
    inherits the validator's address space (an RLIMIT_AS would be meaningless) nor
    its threads' locks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._memory_mb = 0

    def check(self, a: str, b: str, cfg: MathRewardConfig) -> tuple[str, str]:
        with self._lock:
            if self._proc is None or not self._proc.is_alive() or self._memory_mb != cfg.memory_mb:
                self._restart(cfg.memory_mb)
            try:
                self._conn.send((a, b))
                if not self._conn.poll(cfg.timeout_s):
                    self._stop()
                    return "timeout", f"no verdict within {cfg.timeout_s:g}s"
                return self._conn.recv()
            except (EOFError, OSError) as exc:
                self._stop()
                return "error", f"checker process died: {exc!r}"

    def _restart(self, memory_mb: int) -> None:
        self._stop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, memory_mb), daemon=True, name="math-reward-checker")
        proc.start()
        child.close()
        if not parent.poll(120) or parent.recv() != "ready":
            proc.kill()
            raise RuntimeError("the math checker process did not start within 120s")
        self._proc, self._conn, self._memory_mb = proc, parent, memory_mb

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None


_CHECKER = _Checker()
