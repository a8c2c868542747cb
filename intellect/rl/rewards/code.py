"""Code reward: the completion's last Python code block must pass every test of the task.

**Format.** The code is the last fenced block tagged ``python``, ``py``,
``python3`` or untagged (after the last ``</think>``); a completion without one
scores ``no_code``. Each test of a :class:`~intellect.data.loaders.CodeTask` is
Python source (typically ``assert`` lines), run in order in a separate judging
sandbox: the names a test uses are looked up in the candidate's process and only
plain data crosses by value, so the candidate can neither see the tests nor
forge their verdict (:mod:`intellect.rl.rewards.sandbox`).

**Verdict.** 1.0 only if the code and every test run to completion inside the
sandbox of :mod:`intellect.rl.rewards.sandbox` within its limits; otherwise 0.0
with the sandbox's reason (``failed``, ``timeout``, ``memory``, ``killed:SIGXCPU``,
``early_exit``...). ``no_code`` and ``too_long`` are decided before anything runs.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from pydantic import Field

from intellect.config import StrictModel
from intellect.rl.rewards.base import RewardResult, after_thinking
from intellect.rl.rewards.sandbox import SandboxConfig, run_python

__all__ = ["CodeRewardConfig", "code_reward", "code_rewards", "extract_code"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}


class CodeRewardConfig(StrictModel):
    """The code verifier: what it accepts and the sandbox it runs in."""

    max_code_chars: int = Field(
        default=65536, ge=1, le=10_000_000, description="Longer code blocks score 0 (too_long) without running."
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits and isolation of each run.")
    workers: int = Field(
        default=4, ge=1, le=256,
        description="Sandboxes one file's rows run in at once (code_rewards): the validator's pool of sandbox workers.",
    )
    file_budget_s: float = Field(
        default=300.0, gt=0, le=86_400,
        description="Wall-clock budget of one file's rows (code_rewards); a row not started within it scores 0 "
        "as `budget`. The row budget is sandbox.timeout_s.",
    )


def extract_code(completion: str) -> str | None:
    """The last Python (or untagged) fenced block, or None.

    >>> extract_code("try\\n```python\\nx = 1\\n```\\nbetter\\n```\\nx = 2\\n```\\n```text\\nno\\n```")
    'x = 2\\n'
    >>> extract_code("x = 1") is None
    True
    """
    blocks = [m[2] for m in _FENCE.finditer(after_thinking(completion)) if m[1].lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def code_reward(completion: str, tests: Sequence[str], cfg: CodeRewardConfig | None = None) -> RewardResult:
    """Run the completion's code against ``tests`` in the sandbox; 1.0 iff all pass.

    Raises :class:`~intellect.rl.rewards.sandbox.SandboxUnavailable` where no
    sandbox can run (and the fallback is not allowed) and
    :class:`~intellect.rl.rewards.sandbox.SandboxError` when the sandbox broke
    before the code ran: neither is a verdict on the code.
    """
    cfg = cfg or CodeRewardConfig()
    code = extract_code(completion)
    if code is None:
        return RewardResult(0.0, "no_code")
    if len(code) > cfg.max_code_chars:
        return RewardResult(0.0, "too_long", f"{len(code)} chars > {cfg.max_code_chars}")
    run = run_python(code, list(tests), cfg.sandbox)
    detail = run.detail if run.sandboxed else f"UNSANDBOXED run. {run.detail}"
    return RewardResult(1.0 if run.passed else 0.0, run.reason, detail[-800:])


def code_rewards(completions: Sequence[str], tests: Sequence[Sequence[str]],
                 cfg: CodeRewardConfig | None = None) -> list[RewardResult]:
    """:func:`code_reward` of each ``(completion, tests)`` pair, meant for one file's rows: at most
    ``cfg.workers`` sandboxes at once (each bounded by ``cfg.sandbox.timeout_s``), and rows not started
    within ``cfg.file_budget_s`` of the call score 0 as ``budget``, so one file costs at most about
    ``file_budget_s + sandbox.timeout_s`` however many rows it has. Results are in row order.

    >>> [r.reason for r in code_rewards(["no code here"], [["assert True"]])]
    ['no_code']
    """
    cfg = cfg or CodeRewardConfig()
    if len(completions) != len(tests):
        raise ValueError(f"{len(completions)} completions but {len(tests)} test lists")
    deadline = time.monotonic() + cfg.file_budget_s

    def one(i: int) -> RewardResult:
        if time.monotonic() > deadline:
            return RewardResult(0.0, "budget", f"the file's {cfg.file_budget_s:g} s were spent before this row")
        return code_reward(completions[i], tests[i], cfg)

    with ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, range(len(completions))))
