"""The TOPLOC validator's distribution statistic on hand-made probabilities, its bound against
simulated honest sampling, the prefills' per-token statistics against the same maths on full
logits, the right-padded prefill against the engine's left-padded one, and the seeded re-check
pooled per submission."""

import doctest
import random

import pytest
import torch

from intellect.config import ModelConfig
from intellect.inference.protocol import Request
from intellect.inference.sampling import LowProb, SamplingParams, sample, score_tokens, uniforms
from intellect.inference.torch_engine import TorchEngine
from intellect.model.checkpoint import build_model
from intellect.toploc import check
from intellect.toploc.check import (
    Draws,
    engine_prefill,
    low_prob_draws,
    low_prob_surprise,
    right_padded_prefill,
    sampling_probs,
)
from intellect.toploc.proofs import ToplocConfig, build_proofs_many, check_many

LOW = LowProb(ToplocConfig().min_token_prob, ToplocConfig().low_prob_floor)


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
    for rate in (0, 0.5):
        with pytest.raises(ValueError):
            ToplocConfig(honest_flip_rate=rate)
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
    left = engine.prefill(requests, outputs, sampling, low_prob=LOW)
    right = right_padded_prefill(engine, requests, outputs, sampling, LOW)
    assert [len(s.resampled) for s in right] == [len(o) for o in outputs]
    for a, b in zip(left, right):
        assert torch.equal(a.resampled, b.resampled) and torch.equal(a.low, b.low)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5) and torch.allclose(a.chance, b.chance, atol=1e-6)
    proofs = build_proofs_many([s.hidden_states for s in left], chunk=8, k=32)
    verdicts = check_many([s.hidden_states for s in right], proofs, chunk=8, k=32)
    assert all(c.ok for chunks in verdicts for c in chunks)
    # the right-padded scores are each row's own, not the padding's: a row scored alone agrees
    alone = right_padded_prefill(engine, requests[5:6], outputs[5:6], sampling)[0]
    assert torch.equal(alone.resampled, right[5].resampled)


SMALL = ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=96, init_seed=4)


@pytest.fixture(scope="module")
def confident():
    """A confident model (the final norm x8), so that some claimed tokens are low and others not."""
    model, tok = build_model(SMALL)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return model, tok


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_tokens=16),
                                      SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16),
                                      SamplingParams(temperature=0.0, max_tokens=16)])
def test_per_token_statistics_equal_the_full_logits_computation(confident, sampling):
    """Both prefills' ``low`` and ``chance`` are :func:`low_prob_draws` under :func:`sampling_probs` of
    the very logits the LM head produced (caught by a hook here, as the validator used to copy them
    to the CPU), bit for bit; the seeded choices and log-probabilities too."""
    model, tok = confident
    rng = random.Random(1)
    requests = [Request([tok.bos_token_id] + [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 9))], seed=i)
                for i in range(8)]
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=True)
    outputs = [c.tokens for c in engine.generate(requests, sampling)]
    outputs[2] = [(t + 7) % len(tok) for t in outputs[2]]  # tokens the model would rarely pick: low ones
    tokens = torch.tensor([t for o in outputs for t in o])
    full = torch.full((len(tokens),), sampling.temperature), torch.full((len(tokens),), sampling.top_p)
    seeds = torch.tensor([r.seed for r, o in zip(requests, outputs) for _ in o])
    pos = torch.tensor([t for o in outputs for t in range(len(o))])
    one = TorchEngine.for_tokenizer(model, tok, capture_hidden=True, max_batch_size=1)
    for prefill in (engine_prefill, right_padded_prefill):
        seen: list[torch.Tensor] = []
        hook = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: seen.append(out))
        try:
            scored = [prefill(one, [r], [o], sampling, LOW)[0] for r, o in zip(requests, outputs)]
        finally:
            hook.remove()
        # a row alone: both prefills keep the logits of exactly its producing positions, the last len(o)
        logits = torch.cat([out[0, -len(o):] for out, o in zip(seen, outputs)]).float()
        low, chance = low_prob_draws(sampling_probs(logits, *full), tokens, LOW.min_token_prob, LOW.floor)
        assert torch.equal(torch.cat([s.low for s in scored]), low), prefill
        assert torch.equal(torch.cat([s.chance for s in scored]), chance), prefill
        assert 0 < int(low.sum()) < len(low)
        again = score_tokens(logits, tokens, *full, seeds, pos)
        assert torch.equal(torch.cat([s.resampled for s in scored]), again["resampled"])
        assert torch.equal(torch.cat([s.logprobs for s in scored]), again["logprobs"])
        assert "low" not in again and all(s.low is None and s.chance is None
                                          for s in prefill(one, requests[:2], outputs[:2], sampling, None))
    # the slicing that bounds the float64 intermediates does not change a bit
    sliced = score_tokens(logits, tokens, *full, seeds, pos, LOW, max_elements=3 * logits.shape[-1])
    assert torch.equal(sliced["low"], low) and torch.equal(sliced["chance"], chance)
