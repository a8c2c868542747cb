"""The TOPLOC validator's distribution statistic on hand-made probabilities, its bound against
simulated honest sampling, and the right-padded prefill against the engine's left-padded one."""

import doctest
import random

import pytest
import torch

from intellect.config import ModelConfig
from intellect.inference.protocol import Request
from intellect.inference.sampling import SamplingParams, sample, uniforms
from intellect.inference.torch_engine import TorchEngine
from intellect.model.checkpoint import build_model
from intellect.toploc import check
from intellect.toploc.check import Draws, low_prob_draws, low_prob_surprise, right_padded_prefill, sampling_probs
from intellect.toploc.proofs import ToplocConfig, build_proofs_many, check_many


def test_doctests():
    assert doctest.testmod(check).failed == 0


def test_worked_example_of_the_statistic():
    """Four tokens of a three-token vocabulary, min_token_prob 0.05, floor 0.001:

    position  probabilities        chosen  its p  low   chance of an honest low draw
    0         0.90  0.08  0.02     0       0.90   no    0.02  (the mass below 0.05)
    1         0.50  0.49  0.01     2       0.01   yes   0.01
    2         1.00  0.00  0.00     1       0.00   yes   0.001 (nothing below 0.05 has mass: the floor)
    3         0.04  0.03  0.93     0       0.04   yes   0.07

    3 low tokens where 0.101 were expected: surprise (0.101 - 3 + 3 ln(3 / 0.101)) / ln 10 = 3.16;
    two such rollouts pooled: 6 low where 0.202 were expected, 6.32.
    """
    probs = torch.tensor([[0.90, 0.08, 0.02], [0.50, 0.49, 0.01], [1.0, 0.0, 0.0], [0.04, 0.03, 0.93]],
                         dtype=torch.float64)
    low, chance = low_prob_draws(probs, torch.tensor([0, 2, 1, 0]), min_token_prob=0.05, floor=0.001)
    assert low.tolist() == [False, True, True, True]
    assert chance.tolist() == pytest.approx([0.02, 0.01, 0.001, 0.07])
    draws = Draws(tokens=4, low=int(low.sum()), expected=float(chance.sum()))
    assert draws.surprise == pytest.approx(3.16, abs=0.005)
    assert Draws(4, 0, 0.1).surprise == 0 and Draws(4, 1, 0.0).surprise == float("inf")
    # pooled, two such rollouts cross the default limit that neither crosses alone
    assert draws.surprise < ToplocConfig().max_low_prob_surprise < (draws + draws).surprise


def test_sampling_probs_follow_the_sampler():
    """The sampler never draws where the validator's distribution is 0, and draws each token about
    as often as its probability says."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 12, generator=g)).repeat_interleave(2000, 0)
    t = torch.tensor([1.0, 0.7, 1.0, 0.0]).repeat_interleave(2000)
    top_p = torch.tensor([1.0, 0.8, 0.5, 1.0]).repeat_interleave(2000)
    u = uniforms(torch.arange(len(logits)), 0, 12)
    tokens = sample(logits, t, top_p, u)
    probs = sampling_probs(logits, t, top_p)
    assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(len(probs), dtype=torch.float64))
    for row in range(4):
        block = slice(row * 2000, (row + 1) * 2000)
        freq = torch.bincount(tokens[block], minlength=12).double() / 2000
        assert (freq - probs[row * 2000]).abs().max() < 0.04, row
    assert probs[3 * 2000].max() == 1.0  # greedy: one-hot


def test_the_bound_holds_for_simulated_honest_sampling():
    """Honest draws: each position is low with its own chance. The share of rollouts whose surprise
    exceeds s stays below 10**-s, as a Chernoff bound promises (it is loose, not tight)."""
    g = torch.Generator().manual_seed(1)
    chance = torch.rand(20000, 30, generator=g, dtype=torch.float64) * 0.2
    low = (torch.rand(20000, 30, generator=g, dtype=torch.float64) < chance).sum(-1)
    surprise = low_prob_surprise(low.double(), chance.sum(-1))
    for s in (0.5, 1.0, 2.0, 3.0):
        assert float((surprise > s).double().mean()) <= 10**-s, s
    assert float(surprise.max()) < 6  # the default limit: none of 20,000 honest rollouts
    foreign = low_prob_surprise(torch.full((1,), 20.0), chance[:1].sum(-1))  # two thirds of the tokens low
    assert float(foreign) > 6


def test_distribution_fields_are_bounded():
    with pytest.raises(ValueError):
        ToplocConfig(min_token_prob=0)
    with pytest.raises(ValueError):
        ToplocConfig(max_low_prob_surprise=-1)
    with pytest.raises(ValueError):
        ToplocConfig(low_prob_floor=1.5)
    with pytest.raises(ValueError):
        ToplocConfig(distribution_checks=False)  # a typo is an error, not a silent default


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_tokens=24),
                                      SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24)])
def test_right_padded_prefill_matches_the_left_padded_one(sampling):
    model, tok = build_model(ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2,
                                         intermediate_size=96, init_seed=4))
    rng = random.Random(0)
    requests = [Request([tok.bos_token_id] + [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 9))], seed=i)
                for i in range(20)]
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=True, max_batch_size=7)
    outputs = [c.tokens for c in engine.generate(requests, sampling)]
    outputs[3] = []  # a row with nothing to score
    left = engine.prefill(requests, outputs, sampling, keep_logits=True)
    right = right_padded_prefill(engine, requests, outputs, sampling, keep_logits=True)
    assert [len(s.resampled) for s in right] == [len(o) for o in outputs]
    for a, b in zip(left, right):
        assert torch.equal(a.resampled, b.resampled)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5) and torch.allclose(a.logits, b.logits, atol=1e-5)
    proofs = build_proofs_many([s.hidden_states for s in left], chunk=8, k=32)
    verdicts = check_many([s.hidden_states for s in right], proofs, chunk=8, k=32)
    assert all(c.ok for chunks in verdicts for c in chunks)
    # the right-padded scores are each row's own, not the padding's: a row scored alone agrees
    alone = right_padded_prefill(engine, requests[5:6], outputs[5:6], sampling)[0]
    assert torch.equal(alone.resampled, right[5].resampled)
