"""No false rejections under real nondeterminism: 1,024 honest rollouts generated in one batch
layout and thread count are checked by a validator with other batch sizes, compositions (shuffled
order, so other left padding) and thread count; hidden states differ in their last bits, and not
one rollout is rejected by the computation, sampling or termination check."""

import random

import pytest
import torch

from intellect.config import ModelConfig
from intellect.inference.protocol import Request
from intellect.inference.sampling import SamplingParams
from intellect.inference.torch_engine import TorchEngine
from intellect.model.checkpoint import build_model
from intellect.rl.rollouts import Rollout
from intellect.toploc.check import completion_proofs, toploc_check
from intellect.toploc.proofs import ToplocConfig

pytestmark = pytest.mark.slow


def test_a_thousand_honest_rollouts_pass_a_differently_batched_validator():
    model, tok = build_model(ModelConfig(init_seed=3))
    sampling = SamplingParams(temperature=1.0, max_tokens=48)
    rng = random.Random(0)
    requests = [Request([tok.bos_token_id] + [rng.randrange(3, len(tok)) for _ in range(rng.randrange(2, 12))],
                        seed=i) for i in range(1024)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        worker = TorchEngine.for_tokenizer(model, tok, capture_hidden=True, max_batch_size=64)
        done = worker.generate(requests, sampling)
        proofs = completion_proofs(done, ToplocConfig())
        rows = [Rollout(run="t", step=0, policy_step=0, worker="w", submission=0, seed=r.seed, prompt_id=str(i),
                        group_id=i, prompt_tokens=tuple(r.prompt_ids), output_tokens=tuple(c.tokens),
                        finish_reason=c.finish_reason, reward=0.0, task_reward=0.0, length_penalty=0.0,
                        advantage=0.0, proof=p)
                for i, (r, c, p) in enumerate(zip(requests, done, proofs))]
        order = list(range(len(rows)))
        rng.shuffle(order)
        torch.set_num_threads(1)
        validator = TorchEngine.for_tokenizer(model, tok, capture_hidden=True, max_batch_size=24)
        check = toploc_check(lambda policy: validator, sampling, ToplocConfig(), [tok.eos_token_id])
        reasons = check([rows[i] for i in order])
        rescored = validator.prefill([requests[i] for i in order], [done[i].tokens for i in order], sampling)
    finally:
        torch.set_num_threads(threads)
    differ = sum(not torch.equal(done[i].hidden_states, s.hidden_states) for i, s in zip(order, rescored))
    assert len(rows) == 1024 and sum(len(c.tokens) for c in done) > 1024 * 8
    assert [r for r in reasons if r is not None] == []
    print(f"{differ} of 1024 rollouts' hidden states differ bitwise between worker and validator; 0 rejected")
