"""Held-out evaluation of an RL checkpoint: greedy completions of the run's held-out tasks, scored
with the run's reward.

Which tasks are held out is :attr:`~intellect.rl.config.TaskPoolConfig.heldout_source`'s: a
split of the task file by prompt hash, a held-out file, or the generator's held-out arithmetic.
Prompts are rendered as the workers render them (:func:`~intellect.rl.submission.prompt_tokens`),
completions end where the run's completions end (``submission.max_tokens``, EOS), and a task counts
as solved when the reward is full (1: the boxed or final answer matches for math, every test
passes for code). The generator's arithmetic under a raw prompt keeps the pretraining evaluation's
exact match of the stripped completion (:func:`intellect.train.evaluate`), so that smoke and RL
figures stay comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from intellect.inference.protocol import Request
from intellect.inference.sampling import SamplingParams
from intellect.prompts import uses_chat
from intellect.rl.setup import heldout_task_file, heldout_tasks
from intellect.rl.submission import (
    RewardFn, completion_text, math_task_reward, prompt_tokens, task_rewards, torch_engine,
)
from intellect.train import evaluate

if TYPE_CHECKING:
    from intellect.config import ComputeConfig
    from intellect.data.loaders import Task
    from intellect.inference.protocol import InferenceEngine
    from intellect.rl.config import TaskPoolConfig
    from intellect.rl.submission import SubmissionConfig
    from intellect.storage import RunStorage

SOLVED = 1.0 - 1e-9  # a full reward, up to float rounding of a reward's sum


@dataclass(frozen=True)
class TaskScore:
    """Greedy results on held-out tasks: share solved, mean reward, how many tasks."""

    accuracy: float
    mean_reward: float
    n: int


def score_tasks(engine: InferenceEngine, tokenizer, tasks: Sequence[Task], sub: SubmissionConfig,
                reward_fn: RewardFn = math_task_reward) -> TaskScore:
    """Greedy completions of ``tasks`` (one batched ``generate``), scored with ``reward_fn``."""
    if not tasks:
        raise ValueError("no held-out task to score")
    # greedy: the seed draws nothing
    requests = [Request(prompt_tokens(tokenizer, t, sub.prompt), seed=0) for t in tasks]
    outs = engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=sub.max_tokens))
    rewards = task_rewards(reward_fn, [completion_text(tokenizer, o.tokens) for o in outs], tasks)
    return TaskScore(accuracy=sum(r >= SOLVED for r in rewards) / len(tasks), mean_reward=sum(rewards) / len(tasks),
                     n=len(tasks))


class HeldOut:
    """The held-out tasks of a pool (loaded on first use) and a checkpoint's accuracy on them."""

    def __init__(self, pool: TaskPoolConfig, size: int, storage: RunStorage | None = None):
        self.pool, self.size, self.storage = pool, size, storage
        self._tasks: list | None = None

    def tasks(self, tokenizer, sub: SubmissionConfig) -> list:
        """The first ``size`` held-out tasks: arithmetic :class:`~intellect.data.arithmetic.Problem`\\ s
        or a file's :class:`~intellect.data.loaders.MathTask`\\ s."""
        if self._tasks is None:
            if self.pool.heldout_source == "arithmetic":
                self._tasks = list(heldout_tasks(self.pool, self.size))
            else:
                self._tasks = heldout_task_file(self.pool, self.storage, tokenizer=tokenizer,
                                                prompt=sub.prompt)[: self.size]
        return self._tasks

    def accuracy(self, model, tokenizer, sub: SubmissionConfig, *, reward_fn: RewardFn | None = None,
                 compute: ComputeConfig | None = None) -> float:
        """Greedy held-out accuracy of ``model`` (module docstring); ``reward_fn`` replaces the pool's."""
        tasks = self.tasks(tokenizer, sub)
        if self.pool.heldout_source == "arithmetic" and not uses_chat(tokenizer, sub.prompt):
            return evaluate(model, tokenizer, tasks).accuracy
        if self.pool.heldout_source == "arithmetic":
            tasks = [p.to_task() for p in tasks]
        engine = torch_engine(model, tokenizer, compute=compute)
        return score_tasks(engine, tokenizer, tasks, sub, reward_fn or self.pool.reward_fn()).accuracy
