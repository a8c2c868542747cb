"""Seeded synthetic arithmetic: pretraining text and RL prompts with a verifiable answer.

A problem is two non-negative operands and an operator::

    >>> p = Problem(12, "+", 345)
    >>> p.prompt, p.answer, p.text, p.id
    ('12+345=', '357', '12+345=357', '12+345')

The same problem serves both stages: ``p.text`` is a pretraining document (the
model's tokenizer adds BOS/EOS itself) and ``(p.prompt, p.answer)`` is an RL
prompt whose completion :func:`verify_answer` checks exactly.

The held-out split is fixed by content, not by the seed: a problem is held out
iff ``sha256(problem.id) % 100 < heldout_percent``. :func:`train_stream` never
yields a held-out problem, and :func:`heldout_problems` returns the same list
whatever ``DataConfig.seed`` is.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Literal

from intellect.config import DataConfig
from intellect.data.loaders import MathTask

__all__ = [
    "ALPHABET",
    "HELDOUT_SEED",
    "OPS",
    "Problem",
    "batch_texts",
    "documents",
    "heldout_problems",
    "in_alphabet",
    "is_heldout",
    "operand_range",
    "problem_space_size",
    "sample_problem",
    "train_stream",
    "verify_answer",
]

#: Every character a text, prompt or answer may contain; the character-level
#: tokenizer is built over exactly this string (order included).
ALPHABET = "0123456789+-*/=()., :" + string.ascii_lowercase

#: The operators :class:`Problem` supports.
OPS = ("+", "-", "*")
Op = Literal["+", "-", "*"]  # one of OPS, as DataConfig.ops types it

#: Seed of the stream the held-out list is drawn from (never ``DataConfig.seed``).
HELDOUT_SEED = 20_240_601

_ALPHABET_SET = frozenset(ALPHABET)
_ID_RE = re.compile(r"([0-9]+)([+\-*])([0-9]+)=?")
_INT_RE = re.compile(r"[+-]?[0-9]+")
# Spaces at most this large are enumerated exactly by heldout_problems/train_stream.
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True, slots=True)
class Problem:
    """``a op b`` with non-negative integer operands.

    >>> Problem(12, "-", 345).prompt, Problem(12, "-", 345).answer
    ('12-345=', '-333')
    >>> Problem(7, "*", 8).text
    '7*8=56'
    >>> Problem.from_id("12-345=")
    Problem(a=12, op='-', b=345)
    """

    a: int
    op: str
    b: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS} (got {self.op!r})")
        for name in ("a", "b"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"operand {name} must be a non-negative int (got {v!r})")

    @classmethod
    def from_id(cls, text: str) -> "Problem":
        """Parse ``"12+345"`` (an id) or ``"12+345="`` (a prompt)."""
        m = _ID_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"not an arithmetic problem: {text!r}")
        return cls(int(m[1]), m[2], int(m[3]))

    @property
    def id(self) -> str:
        """Stable identity, also the key of the held-out hash: ``"12+345"``."""
        return f"{self.a}{self.op}{self.b}"

    @property
    def prompt(self) -> str:
        """What the model sees: ``"12+345="``."""
        return f"{self.id}="

    @property
    def value(self) -> int:
        """The result as an int."""
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        return self.a * self.b

    @property
    def answer(self) -> str:
        """The expected completion: ``"357"`` (``"-333"`` for a negative result)."""
        return str(self.value)

    @property
    def text(self) -> str:
        """The pretraining document: prompt followed by answer, no BOS/EOS."""
        return self.prompt + self.answer

    @property
    def slip(self) -> str:
        """The sign error: the result with its sign flipped. The magnitude is right, so a model that
        learned both from a corpus computes the same digits either way and differs in one token.

        >>> Problem(12, "+", 34).slip, Problem(12, "-", 34).slip, Problem(7, "*", 0).slip
        ('-46', '22', '0')
        """
        return str(-self.value)

    def to_task(self) -> MathTask:
        """This problem as a :class:`~intellect.data.loaders.MathTask` (id, prompt, answer)."""
        return MathTask(id=self.id, prompt=self.prompt, answer=self.answer)


def in_alphabet(text: str) -> bool:
    """Whether every character of ``text`` is in :data:`ALPHABET`.

    >>> in_alphabet("12+345=357"), in_alphabet("12 + 3 = 15"), in_alphabet("A")
    (True, True, False)
    """
    return _ALPHABET_SET.issuperset(text)


def verify_answer(expected: "Problem | str | int", completion: str) -> bool:
    """Exact integer check of a completion against a problem or its answer.

    Whitespace around either side is ignored and both sides are read as base-10
    integers (ASCII digits, optional sign); anything else is simply wrong.

    >>> verify_answer(Problem(12, "-", 345), " -333\\n")
    True
    >>> verify_answer("357", "0357"), verify_answer("357", "357.0"), verify_answer("357", "")
    (True, False, False)
    """
    want = _as_int(expected.answer if isinstance(expected, Problem) else expected)
    got = _as_int(completion)
    return want is not None and got is not None and want == got


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    return int(text) if _INT_RE.fullmatch(text) else None


def is_heldout(problem: "Problem | str", heldout_percent: int) -> bool:
    """Whether a problem (or its id) belongs to the fixed held-out split.

    The split depends only on the id, so it is the same for every seed, and a
    split at a larger percent contains the one at a smaller percent.

    >>> [is_heldout("4*5", pct) for pct in (1, 2, 3, 5)]  # sha256("4*5") % 100 == 2
    [False, False, True, True]
    """
    pid = problem.id if isinstance(problem, Problem) else problem
    digest = hashlib.sha256(pid.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % 100 < heldout_percent


def operand_range(digits: int) -> tuple[int, int]:
    """Smallest and largest operand with ``digits`` digits (1 digit includes 0).

    >>> operand_range(1), operand_range(3)
    ((0, 9), (100, 999))
    """
    if digits < 1:
        raise ValueError(f"digits must be >= 1 (got {digits})")
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def problem_space_size(cfg: DataConfig) -> int:
    """Number of distinct problems ``cfg`` can draw.

    >>> problem_space_size(DataConfig(ops=["+"], min_digits=1, max_digits=1))
    100
    >>> problem_space_size(DataConfig(max_digits=3))  # 0..999 squared, three operators
    3000000
    """
    lo, _ = operand_range(cfg.min_digits)
    _, hi = operand_range(cfg.max_digits)
    return len(set(cfg.ops)) * (hi - lo + 1) ** 2


def sample_problem(rng: random.Random, cfg: DataConfig) -> Problem:
    """One problem: operator uniform over ``cfg.ops``; per operand, a digit count
    uniform in ``[min_digits, max_digits]`` then a uniform number of that many digits.

    >>> sample_problem(random.Random(0), DataConfig(ops=["*"], min_digits=2, max_digits=2)).op
    '*'
    """
    op = rng.choice(cfg.ops)
    a = rng.randint(*operand_range(rng.randint(cfg.min_digits, cfg.max_digits)))
    b = rng.randint(*operand_range(rng.randint(cfg.min_digits, cfg.max_digits)))
    return Problem(a, op, b)


def _all_problems(cfg: DataConfig) -> Iterator[Problem]:
    lo, _ = operand_range(cfg.min_digits)
    _, hi = operand_range(cfg.max_digits)
    for op in dict.fromkeys(cfg.ops):
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                yield Problem(a, op, b)


def train_stream(cfg: DataConfig, seed: int | None = None) -> Iterator[Problem]:
    """Endless, deterministic stream of training problems (never a held-out one).

    ``seed`` overrides ``cfg.seed`` (e.g. one stream per worker).

    >>> cfg = DataConfig(seed=1)
    >>> batch_texts(train_stream(cfg), 4) == batch_texts(train_stream(cfg), 4)
    True
    >>> stream = train_stream(cfg)
    >>> all(not is_heldout(next(stream), cfg.heldout_percent) for _ in range(100))
    True
    """
    if not _has_train_problem(tuple(cfg.ops), cfg.min_digits, cfg.max_digits, cfg.heldout_percent):
        raise ValueError(f"every problem of {cfg!r} is held out; lower heldout_percent or widen the digits")
    return _train_stream(cfg.model_copy(deep=True), cfg.seed if seed is None else seed)


@lru_cache(maxsize=32)
def _has_train_problem(ops: tuple[Op, ...], min_digits: int, max_digits: int, pct: int) -> bool:
    cfg = DataConfig(ops=list(ops), min_digits=min_digits, max_digits=max_digits, heldout_percent=pct)
    if problem_space_size(cfg) > _ENUMERATE_LIMIT:
        return True  # a large space is never all held out (pct <= 50)
    return not all(is_heldout(p, pct) for p in _all_problems(cfg))


def _train_stream(cfg: DataConfig, seed: int) -> Iterator[Problem]:
    rng = random.Random(seed)
    pct = cfg.heldout_percent
    while True:
        p = sample_problem(rng, cfg)
        if not is_heldout(p, pct):
            yield p


def documents(cfg: DataConfig, seed: int | None = None) -> Iterator[str]:
    """Endless pretraining documents: :func:`train_stream` as text, a ``cfg.slip_rate`` share of
    them answered with :attr:`Problem.slip` (the choice is seeded too).

    >>> docs = documents(DataConfig(ops=["-"], seed=3, slip_rate=0.5))
    >>> sorted({next(docs).startswith("-") for _ in range(50)})  # never a leading minus
    [False]
    >>> next(documents(DataConfig(seed=1))) == next(train_stream(DataConfig(seed=1))).text
    True
    """
    return (prompt + answer for prompt, answer in document_pairs(cfg, seed))


def document_pairs(cfg: DataConfig, seed: int | None = None) -> Iterator[tuple[str, str]]:
    """:func:`documents` as ``(prompt, answer as written)`` pairs, for a template to lay out.

    >>> next(document_pairs(DataConfig(seed=1))) == (next(train_stream(DataConfig(seed=1))).prompt,
    ...                                              next(train_stream(DataConfig(seed=1))).answer)
    True
    """
    seed = cfg.seed if seed is None else seed
    stream, rate = train_stream(cfg, seed), cfg.slip_rate
    rng = random.Random(f"slips-{seed}")
    for p in stream:
        yield p.prompt, p.slip if rate and rng.random() < rate else p.answer


def batch_texts(stream: Iterator[Problem], n: int) -> list[str]:
    """The next ``n`` pretraining documents of a stream.

    >>> batch_texts(iter([Problem(1, "+", 2), Problem(3, "*", 4)]), 2)
    ['1+2=3', '3*4=12']
    """
    return [next(stream).text for _ in range(n)]


def heldout_problems(cfg: DataConfig, n: int) -> list[Problem]:
    """The first ``n`` distinct held-out problems of a fixed-seed stream.

    Deterministic and independent of ``cfg.seed`` (only ``ops``, the digit range
    and ``heldout_percent`` matter); a longer list extends a shorter one. When the
    whole problem space holds fewer than ``n`` held-out problems, all of them are
    returned. Raises ``ValueError`` when ``n`` is too large to draw in reasonable
    time from a space too large to enumerate.

    >>> a = heldout_problems(DataConfig(seed=0), 5)
    >>> a == heldout_problems(DataConfig(seed=7), 5) and a == heldout_problems(DataConfig(), 9)[:5]
    True
    >>> len(heldout_problems(DataConfig(ops=["+"], min_digits=1, max_digits=1), 1000)) < 100
    True
    """
    if n < 0:
        raise ValueError(f"n must be >= 0 (got {n})")
    return list(_heldout(tuple(cfg.ops), cfg.min_digits, cfg.max_digits, cfg.heldout_percent, n))


@lru_cache(maxsize=32)
def _heldout(ops: tuple[Op, ...], min_digits: int, max_digits: int, pct: int, n: int) -> tuple[Problem, ...]:
    cfg = DataConfig(ops=list(ops), min_digits=min_digits, max_digits=max_digits, heldout_percent=pct)
    size = problem_space_size(cfg)
    rng = random.Random(HELDOUT_SEED)
    seen: dict[Problem, None] = {}
    if size <= _ENUMERATE_LIMIT:
        # Small space: draw at most 4x its size, then append the held-out problems
        # the stream has not reached yet in enumeration order (the rare tail of a
        # coupon collector); the result stays deterministic and prefix-stable.
        pool = [p for p in _all_problems(cfg) if is_heldout(p, pct)]
        target = min(n, len(pool))
        for _ in range(4 * size):
            if len(seen) >= target:
                break
            p = sample_problem(rng, cfg)
            if p not in seen and is_heldout(p, pct):
                seen[p] = None
        for p in pool:
            if len(seen) >= target:
                break
            seen.setdefault(p, None)
        return tuple(seen)
    expected = size * pct // 100
    if n > expected // 2:
        raise ValueError(
            f"asked for {n} held-out problems but the space holds about {expected}; "
            "ask for at most half of that, or raise heldout_percent or max_digits"
        )
    while len(seen) < n:
        p = sample_problem(rng, cfg)
        if p not in seen and is_heldout(p, pct):
            seen[p] = None
    return tuple(seen)

