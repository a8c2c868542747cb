"""A small generated set of Python code tasks (``prompt``, ``tests``, and a reference ``solution``),
the code counterpart of the arithmetic generator: every machine can make it, nothing is downloaded.

Each task asks for one short function; its tests are ``assert`` lines over a few inputs, computed
from the reference solution's own semantics (so they hold for it), and its ``solution`` is that
reference as a fenced block, the form :func:`~intellect.rl.rewards.code.extract_code` reads (a
pretraining corpus can show it; the loaders ignore the field)::

    >>> t = code_tasks(3, seed=0)[0]
    >>> print(t["prompt"])
    Write a Python function `add_7(x)` that returns x plus 7. Answer with one ```python block.
    >>> t["tests"][:2], t["solution"]
    (['assert add_7(0) == 7', 'assert add_7(6) == 13'], '```python\\ndef add_7(x):\\n    return x + 7\\n```')

``python -m intellect.data.code_tasks OUT.jsonl [N] [SEED] [HELDOUT_PERCENT]`` writes a set as a task
file, and beside it ``OUT-corpus.jsonl``: the pretraining corpus of its training split (each task's
prompt, a newline and its solution, as ``text``), so that a model learns the answer format without
seeing the held-out tasks (:func:`~intellect.data.loaders.split_heldout`, as the RL run splits).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from intellect.data.loaders import split_heldout, task_of_row

ANSWER_FORMAT = "Answer with one ```python block."


class _Family(NamedTuple):
    """A kind of task: its name, what it asks, its body, the inputs it is tested on, and the truth."""

    name: str  # function name, with {a} for the parameter
    args: str
    ask: str  # what the function returns, with {a}
    body: str  # the reference's return expression, with {a}
    inputs: Callable[[random.Random], list]  # argument tuples
    truth: Callable[[int, tuple], Any]  # (parameter, args) -> expected value


def _ints(rng: random.Random) -> list:
    return [(0,), (rng.randint(1, 9),), (rng.randint(10, 99),), (-rng.randint(1, 9),)]


def _lists(rng: random.Random) -> list:
    return [([],), ([rng.randint(0, 9) for _ in range(3)],), ([rng.randint(-9, 9) for _ in range(5)],)]


def _words(rng: random.Random) -> list:
    return [("",), ("".join(rng.choice("abcdeiou") for _ in range(rng.randint(1, 6))),), ("hello world",)]


FAMILIES: tuple[_Family, ...] = (
    _Family("add_{a}", "x", "x plus {a}", "x + {a}", _ints, lambda a, v: v[0] + a),
    _Family("times_{a}", "x", "x times {a}", "x * {a}", _ints, lambda a, v: v[0] * a),
    _Family("minus_{a}", "x", "x minus {a}", "x - {a}", _ints, lambda a, v: v[0] - a),
    _Family("is_multiple_of_{a}", "n", "True if n is divisible by {a}, else False", "n % {a} == 0", _ints,
            lambda a, v: v[0] % a == 0),
    _Family("sum_plus_{a}", "xs", "the sum of the list xs plus {a}", "sum(xs) + {a}", _lists,
            lambda a, v: sum(v[0]) + a),
    _Family("count_above_{a}", "xs", "how many elements of the list xs are greater than {a}",
            "sum(1 for x in xs if x > {a})", _lists, lambda a, v: sum(1 for x in v[0] if x > a)),
    _Family("repeat_{a}", "s", "the string s repeated {a} times", "s * {a}", _words, lambda a, v: v[0] * a),
    _Family("first_{a}", "s", "the first {a} characters of the string s", "s[:{a}]", _words, lambda a, v: v[0][:a]),
)


def code_task(family: _Family, a: int, rng: random.Random) -> dict[str, Any]:
    """One task of ``family`` with parameter ``a`` as a task-file row (``id``, ``prompt``, ``tests``,
    ``solution``)."""
    name = family.name.format(a=a)
    tests = [f"assert {name}({', '.join(map(repr, args))}) == {family.truth(a, args)!r}"
             for args in family.inputs(rng)]
    solution = f"```python\ndef {name}({family.args}):\n    return {family.body.format(a=a)}\n```"
    prompt = f"Write a Python function `{name}({family.args})` that returns {family.ask.format(a=a)}. {ANSWER_FORMAT}"
    return {"id": name, "prompt": prompt, "tests": tests, "solution": solution}


def code_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct tasks (at most ``len(FAMILIES) * 9``), families taken in turn, parameters 1..9
    in a seeded order; the same ``(n, seed)`` gives the same rows."""
    rng = random.Random(seed)
    limit = len(FAMILIES) * 9
    if not 1 <= n <= limit:
        raise ValueError(f"n must be in [1, {limit}], got {n}")
    params = [rng.sample(range(1, 10), 9) for _ in FAMILIES]
    return [code_task(FAMILIES[i % len(FAMILIES)], params[i % len(FAMILIES)][i // len(FAMILIES)], rng)
            for i in range(n)]


def write_code_tasks(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write :func:`code_tasks` as JSONL (``load_code_tasks`` reads it); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(row) + "\n" for row in code_tasks(n, seed)), encoding="utf-8")
    return p


def corpus_rows(rows: Sequence[dict[str, Any]], heldout_percent: int) -> list[dict[str, str]]:
    """The pretraining documents (``{"text": prompt + newline + solution}``) of the tasks outside the
    ``heldout_percent`` split."""
    by_id = {r["id"]: r for r in rows}
    train, _ = split_heldout([task_of_row(r, "code") for r in rows], heldout_percent)
    return [{"text": t.prompt + "\n" + by_id[t.id]["solution"]} for t in train]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 4:
        print("usage: python -m intellect.data.code_tasks OUT.jsonl [N] [SEED] [HELDOUT_PERCENT]", file=sys.stderr)
        return 2
    n, seed = int(args[1]) if len(args) > 1 else len(FAMILIES) * 9, int(args[2]) if len(args) > 2 else 0
    out = write_code_tasks(args[0], n, seed)
    corpus = out.with_name(out.stem + "-corpus.jsonl")
    rows = corpus_rows(code_tasks(n, seed), int(args[3]) if len(args) > 3 else 20)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(out, corpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
