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
length (``\\boxed{`` is matched from one vectorized pass over the brace depths), and a call
decides every row that needs no checker before it asks for one. The symbolic checks run in a
bounded pool of ``checkers`` processes shared by every caller in the process, so a hung sympy
call can be killed without touching the others. Three budgets bound them:

* the row's, ``timeout_s``: over it the row scores 0 as ``timeout`` and its checker is replaced;
* the call's (the validator's rows of one file), ``file_budget_s`` in all, start-up of a replaced
  checker and waiting for a free one included: once it is spent, the rows still needing the
  checker score 0 as ``budget``, unchecked;
* the worker's (every call made for one ``worker``, however many at once): checker time drawn
  from a bucket of ``worker_budget_s`` seconds that refills at that many per
  ``worker_refill_s``; a check starts only while the bucket holds a whole row budget (which it
  reserves, so a worker's checks at once never overdraw it), else the row scores 0 as ``budget``.

**Honest work first.** A freed checker goes to the waiting caller whose worker has drawn the
least from its bucket (the longest waiting first among equals), and a caller keeps its checker
for its next row unless someone who has drawn no more than it is waiting. Rows that end in a
timeout therefore push their worker's later rows behind other workers', and an honest file,
whose checks take milliseconds, waits at most for one check in flight (and a replaced checker's
start-up) before it is scored through.

Reasons: ``ok``, ``mismatch``, ``no_answer``, ``invalid``, ``timeout``,
``budget``, ``error`` (the checker failed, e.g. out of memory), ``bad_reference``.
"""

from __future__ import annotations

import logging
import re
import time
from fractions import Fraction
from typing import Sequence

import numpy as np

from intellect.rl.rewards.base import RewardResult, after_thinking
from intellect.rl.rewards.math_checker import CHECKERS, MathRewardConfig, warm_checkers

__all__ = [
    "MathRewardConfig", "equivalent", "extract_answer", "math_reward", "math_rewards", "normalize_answer",
    "warm_checkers",
]

log = logging.getLogger("intellect.rl.rewards")


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
    return math_rewards([completion], [reference], cfg)[0]


def math_rewards(
    completions: Sequence[str],
    references: Sequence[str],
    cfg: MathRewardConfig | None = None,
    *,
    row_budget_s: float | None = None,
    total_budget_s: float | None = None,
    worker: str | None = None,
) -> list[RewardResult]:
    """:func:`math_reward` of each ``(completion, reference)`` pair, within budgets: ``row_budget_s``
    (default ``cfg.timeout_s``) per row's symbolic check, ``total_budget_s`` (default
    ``cfg.file_budget_s``) for the whole call, and ``worker``'s bucket shared with its other calls
    (see the module docstring; without a worker, the call has a bucket of its own). Meant for one
    file's rows.

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
    out: list[RewardResult | None] = []
    symbolic: list[tuple[int, str, str]] = []  # (row, answer, reference), both normalized
    for c, r in zip(completions, references):
        result = _in_process(c, r, cfg)
        if isinstance(result, tuple):
            symbolic.append((len(out), *result))
            out.append(None)
        else:
            out.append(result)
    if symbolic:
        for i, verdict in zip([row for row, *_ in symbolic],
                              CHECKERS.check_all([(a, b) for _, a, b in symbolic], cfg, deadline, worker)):
            out[i] = RewardResult(1.0 if verdict[0] == "ok" else 0.0, *verdict)
    return [r for r in out if r is not None]


def _in_process(completion: str, reference: str, cfg: MathRewardConfig) -> RewardResult | tuple[str, str]:
    """The row's result when no checker is needed, else ``(answer, reference)`` normalized for one."""
    answer = extract_answer(completion)
    if answer is None:
        return RewardResult(0.0, "no_answer")
    verdict = _compare(answer, reference, cfg)
    if isinstance(verdict, str):
        return verdict, normalize_answer(reference)
    if verdict[0] == "bad_reference":
        log.warning("math reference %r is not a checkable answer: %s", reference, verdict[1])
    return RewardResult(1.0 if verdict[0] == "ok" else 0.0, *verdict)


def equivalent(
    answer: str, reference: str, cfg: MathRewardConfig | None = None, *, deadline: float | None = None
) -> tuple[str, str]:
    """Compare an extracted answer with the reference: ``(reason, detail)``, reason ``ok`` if equal.
    A symbolic check ends by ``deadline`` (``time.monotonic()``; default ``cfg.file_budget_s`` from now).

    >>> equivalent("2^10", "1024")[0], equivalent("sqrt(8)", "2*sqrt(2)")[0]
    ('mismatch', 'ok')
    """
    cfg = cfg or MathRewardConfig()
    verdict = _compare(answer, reference, cfg)
    if not isinstance(verdict, str):
        return verdict
    end = time.monotonic() + cfg.file_budget_s if deadline is None else deadline
    return CHECKERS.check_all([(verdict, normalize_answer(reference))], cfg, end, None)[0]


def _compare(answer: str, reference: str, cfg: MathRewardConfig) -> tuple[str, str] | str:
    """``(reason, detail)`` when decided in-process, else the normalized answer the checker must compare."""
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
    return got


def _checkable(s: str, cfg: MathRewardConfig) -> bool:
    return 0 < len(s) <= cfg.max_answer_chars and _ALLOWED.fullmatch(s) is not None


def _rational(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None
