"""The untrusted worker side of an RL step: answer the assigned prompts and package the rollouts.

A worker's submission ``k`` for step ``n`` answers the prompts :func:`assign_prompts` picks for it
(group ``j`` answers the ``j``-th), ``group_size`` samples each. Sample ``i`` of group ``j`` is
drawn with the seed

    first 8 bytes, big-endian, of sha256(b"intellect/sample-seed/v1\\0" + a + j + i), top bit cleared

where ``a`` is :func:`~intellect.rl.wire.assignment.assignment_seed` of ``(worker, n, k, salt)`` and ``a``,
``j``, ``i`` are 8-byte big-endian unsigned ints (the top bit is cleared because engine seeds live
in int64). The seed decides the sample: the validator computes it from the row's position and the
worker's salt in the service's registry, rejects a row that carries another one (``seed``), and
TOPLOC's seeded re-check samples with the computed seed, never the row's. So a worker cannot draw
many samples and keep the ones it likes, nor write tokens and search a seed that "picks" them; and
a copy of another worker's rows carries seeds that are not the copier's. Two honest workers never
share a seed, so their samples never share a content hash.

Rewards here are only the worker's *claim*: the validator recomputes every one of them
(:mod:`intellect.rl.service.validator`) with the same :data:`RewardFn`. A worker of the submission service
is never told the reference answers, so it claims none (:func:`unclaimed_reward`: 0). What has signal
is the trainer's count, of the validator's rewards (:mod:`intellect.rl.trainer.online_filter`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from pydantic import Field

from intellect.config import StrictModel
from intellect.ids import canonical_worker
from intellect.inference.protocol import Request
from intellect.inference.sampling import MAX_SEED, SamplingParams
from intellect.rl.advantages import group_advantages
from intellect.rl.wire.assignment import NO_SALT, assign_prompts, assignment_seed
from intellect.prompts import PromptConfig, render_prompt
from intellect.rl.rewards.code import CodeRewardConfig, code_reward, code_rewards
from intellect.rl.rewards.math import math_reward, math_rewards
from intellect.rl.wire.rollout_schema import Rollout
from intellect.toploc.proofs import ToplocConfig, completion_proofs

if TYPE_CHECKING:
    from intellect.data.loaders import CodeTask, MathTask, Task, TaskKind
    from intellect.inference.protocol import InferenceEngine

_SEED_DOMAIN = b"intellect/sample-seed/v1\0"

#: ``reward_fn(completion_text, task) -> reward``: what workers claim and validators recompute; the
#: task is a :class:`~intellect.data.loaders.MathTask` or a :class:`~intellect.data.loaders.CodeTask`.
RewardFn = Callable[[str, Any], float]


def math_task_reward(completion: str, task: MathTask) -> float:
    """The default task reward: :func:`~intellect.rl.rewards.math.math_reward` against ``task.answer``."""
    return math_reward(completion, task.answer).reward


@dataclass(frozen=True)
class CodeTaskReward:
    """The code task reward: :func:`~intellect.rl.rewards.code.code_reward` of the completion against
    ``task.tests``, in the sandbox ``cfg`` sets."""

    cfg: CodeRewardConfig = field(default_factory=CodeRewardConfig)

    def __call__(self, completion: str, task: CodeTask) -> float:
        return code_reward(completion, task.tests, self.cfg).reward


def unclaimed_reward(_completion: str, _task: Any) -> float:
    """What a worker without the reference answers claims: 0 (the validator's reward replaces it)."""
    return 0.0


def task_reward_fn(kind: TaskKind, code: CodeRewardConfig | None = None) -> RewardFn:
    """The reward of a run's tasks: :func:`math_task_reward`, or :class:`CodeTaskReward` with ``code``."""
    return CodeTaskReward(code or CodeRewardConfig()) if kind == "code" else math_task_reward


def task_rewards(reward_fn: RewardFn, completions: Sequence[str], tasks: Sequence[Any], *,
                 worker: str | None = None) -> list[float]:
    """``reward_fn`` of each completion against its task, as one file's rows: the math reward is
    scored in one :func:`~intellect.rl.rewards.math.math_rewards` call and the code reward in one
    :func:`~intellect.rl.rewards.code.code_rewards` call (a pool of sandboxes), so that the file's
    total time budget holds however many hard rows it carries; ``worker``'s math rows also share
    its checker budget across its files."""
    if reward_fn is math_task_reward:
        return [r.reward for r in math_rewards(completions, [t.answer for t in tasks], worker=worker)]
    if isinstance(reward_fn, CodeTaskReward):
        return [r.reward for r in code_rewards(completions, [t.tests for t in tasks], reward_fn.cfg)]
    return [float(reward_fn(c, t)) for c, t in zip(completions, tasks)]


class SubmissionConfig(StrictModel):
    """What one submission holds and how it is sampled (workers and validators must agree)."""

    prompts_per_submission: int = Field(
        default=4, ge=1, le=4096, description="Assigned prompts (GRPO groups) per file.",
    )
    group_size: int = Field(default=8, ge=2, le=1024, description="Samples per prompt (INTELLECT-2: 16).")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus mass kept before sampling.")
    max_tokens: int = Field(default=16, ge=1, le=1 << 20, description="Most completion tokens, EOS included.")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="How task prompts are rendered.")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)


def sample_seed(worker: str, step: int, k: int, group: int, i: int, salt: bytes = NO_SALT) -> int:
    """Seed of sample ``i`` of group ``group`` of submission ``k`` (see the module docstring)."""
    a = assignment_seed(worker, step, k, salt)
    msg = _SEED_DOMAIN + a.to_bytes(8, "big") + group.to_bytes(8, "big") + i.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") & MAX_SEED


def prompt_tokens(tokenizer, task: Task, cfg: PromptConfig) -> list[int]:
    """The token ids a task's prompt is asked with (:func:`~intellect.prompts.render_prompt`)."""
    return render_prompt(tokenizer, task.prompt, cfg)


def completion_text(tokenizer, output_tokens: Sequence[int]) -> str:
    """The text a reward sees: the completion without its final EOS and without special tokens."""
    tokens = list(output_tokens)
    eos = tokenizer.eos_token_id
    if tokens and tokens[-1] == eos:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def advantages_of(rewards: Sequence[float], group_ids: Sequence[int]) -> list[float]:
    """GRPO advantages of flat rewards, computed in float32 like the stored column."""
    if not rewards:
        return []
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_ids))
    return adv.tolist()




def generate_submission(
    engine: InferenceEngine,
    tokenizer,
    tasks: Sequence[Task],
    worker: str,
    step: int,
    k: int,
    policy_step: int,
    cfg: SubmissionConfig,
    *,
    run: str,
    reward_fn: RewardFn = math_task_reward,
    proofs: ToplocConfig | None = None,
) -> list[Rollout]:
    """Submission ``k`` of ``worker`` (an operator-run worker: :data:`~intellect.rl.wire.assignment.NO_SALT`)
    for ``step``, sampled by checkpoint ``policy_step``, every column filled; with ``proofs``, each
    row carries the TOPLOC proofs of its hidden states (the engine must capture them)."""
    assigned = assign_prompts(len(tasks), canonical_worker(worker), step, k, cfg.prompts_per_submission)
    return generate_assigned(engine, tokenizer, [tasks[t] for t in assigned], worker, step, k, policy_step, cfg,
                             run=run, reward_fn=reward_fn, proofs=proofs)


def generate_assigned(
    engine: InferenceEngine,
    tokenizer,
    assigned: Sequence[Task],
    worker: str,
    step: int,
    k: int,
    policy_step: int,
    cfg: SubmissionConfig,
    *,
    run: str,
    reward_fn: RewardFn = math_task_reward,
    proofs: ToplocConfig | None = None,
    salt: bytes = NO_SALT,
) -> list[Rollout]:
    """:func:`generate_submission` with its assigned tasks given, group ``j`` answering ``assigned[j]``
    (a worker of the submission service gets them and its ``salt`` from the service)."""
    worker = canonical_worker(worker)
    plan = []  # (group, i, task, prompt ids, seed), in row order
    for j, task in enumerate(assigned):
        ids = prompt_tokens(tokenizer, task, cfg.prompt)
        plan += [(j, i, task, ids, sample_seed(worker, step, k, j, i, salt)) for i in range(cfg.group_size)]
    completions = engine.generate([Request(ids, seed) for _, _, _, ids, seed in plan], cfg.sampling())
    rewards = task_rewards(reward_fn, [completion_text(tokenizer, c.tokens) for c in completions],
                           [task for _, _, task, _, _ in plan])
    advantages = advantages_of(rewards, [j for j, *_ in plan])
    blobs = completion_proofs(completions, proofs) if proofs is not None else [b""] * len(completions)
    return [
        Rollout(
            run=run, step=step, policy_step=policy_step, worker=worker, submission=k, seed=seed,
            prompt_id=task.id, group_id=j, prompt_tokens=tuple(ids), output_tokens=tuple(c.tokens),
            finish_reason=c.finish_reason, reward=r, task_reward=r, length_penalty=0.0, advantage=a,
            target_length=None, proof=proof,
        )
        for (j, _, task, ids, seed), c, r, a, proof in zip(plan, completions, rewards, advantages, blobs)
    ]
