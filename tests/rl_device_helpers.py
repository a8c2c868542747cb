"""What the RL device tests share, on the CPU (tests/unit/test_rl_device.py) and on CUDA
(tests/gpu/test_rl_cuda.py): a tiny model shape, a submission shape, prompts and small builders."""

import copy

import torch

from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.inference import Request
from intellect.rl.worker.submission import SubmissionConfig
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample
from intellect.toploc.proofs import ToplocConfig

TINY = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
SUB = SubmissionConfig(prompts_per_submission=2, group_size=4, max_tokens=24, temperature=1.0)
TASKS = [Problem(a, "+", b).to_task() for a in range(4) for b in range(3)]
# bf16 compute flips an honest near-tie now and then (about one token in a thousand, as on bf16
# GPUs) between the worker's cached decode and the validator's prefill; in these short rollouts one flip
# is several percent of a row, so the per-rollout allowance is widened. The pooled seeded test still
# holds each submission to honest_flip_rate, and the proofs' own tolerances are the defaults.
PROOFS = ToplocConfig(max_resampled_fraction=0.25)


def samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, 20, (3 + i % 3,), generator=g).tolist()
        output = torch.randint(4, 20, (2 + i % 4,), generator=g).tolist()
        out.append(Sample(prompt, output, float(torch.randn(1, generator=g))))
    return out


def trainer(tiny, compute, **kw):
    model, tok = tiny
    cfg = RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2, micro_batch_tokens=16, **kw)
    return GRPOTrainer(copy.deepcopy(model), tok, cfg, compute=compute)


def adam_state(t: GRPOTrainer) -> list[torch.Tensor]:
    return [v for s in t.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]


def requests(tok):
    return [Request(tok(p)["input_ids"], seed=i) for i, p in enumerate(("1+2=", "33+4=", "5+66=", "7"))]


def parity_reward(completion, task):  # noqa: ARG001 - the reward signature
    return float(sum(map(ord, completion)) % 2)  # the untrained model hits it half the time: every group has signal
