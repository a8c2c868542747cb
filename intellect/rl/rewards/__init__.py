"""Rewards, always recomputed by the validator from the prompt, the completion and the task.

* :mod:`~intellect.rl.rewards.math`: final-answer extraction and exact or symbolic comparison.
* :mod:`~intellect.rl.rewards.code`: the completion's code against the task's tests, in a bubblewrap sandbox.
* :mod:`~intellect.rl.rewards.length`: the thinking-budget shaping of either.
"""

from intellect.rl.rewards.base import RewardResult, after_thinking
from intellect.rl.rewards.code import CodeRewardConfig, code_reward, extract_code
from intellect.rl.rewards.length import (
    LengthMode,
    LengthRewardConfig,
    add_budget,
    budget_reward,
    length_reward,
    parse_budget,
    sample_target,
)
from intellect.rl.rewards.math import (
    MathRewardConfig,
    equivalent,
    extract_answer,
    math_reward,
    math_rewards,
    normalize_answer,
    warm_checkers,
)
from intellect.rl.rewards.sandbox import (
    RunResult,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    run_python,
    sandbox_status,
)

__all__ = [
    "CodeRewardConfig",
    "LengthMode",
    "LengthRewardConfig",
    "MathRewardConfig",
    "RewardResult",
    "RunResult",
    "SandboxConfig",
    "SandboxError",
    "SandboxUnavailable",
    "add_budget",
    "after_thinking",
    "budget_reward",
    "code_reward",
    "equivalent",
    "extract_answer",
    "extract_code",
    "length_reward",
    "math_reward",
    "math_rewards",
    "normalize_answer",
    "warm_checkers",
    "parse_budget",
    "run_python",
    "sample_target",
    "sandbox_status",
]
