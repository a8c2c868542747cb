import copy
import math

import pydantic
import pytest
import torch

from intellect.config import ModelConfig
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.checkpoints import fetch
from intellect.rl.trainer.logprobs import split_causal_lm
from intellect.rl.trainer.loss import GRPOLossConfig
from intellect.rl.wire.rollouts import Rollout, RolloutLimits, write_submission
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample, StepStats, load_accepted
from intellect.storage import RunStorage
from intellect.verdict import Verdict

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY)


def trainer(tiny, dtype=torch.float32, ref_model=None, **kw):
    model, tok = tiny
    kw.setdefault("warmup_steps", 0)
    return GRPOTrainer(copy.deepcopy(model).to(dtype), tok, RLTrainerConfig(**kw), ref_model=ref_model)


def make_samples(n, seed=0, vocab=20, behaviour=False):
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    out = []
    for _ in range(n):
        p = torch.randint(4, vocab, (ints(1, 6),), generator=g).tolist()
        o = torch.randint(4, vocab, (ints(0, 8) if out else 7,), generator=g).tolist()  # one empty output likely
        lp = (-torch.rand(len(o), generator=g) * 3).tolist() if behaviour else None
        out.append(Sample(p, o, float(torch.randn(1, generator=g)), lp))
    return out


def accumulate_gradients(t: GRPOTrainer, samples) -> dict:
    """The gradient one optimizer step would take on ``samples`` as one mini-batch, left in ``.grad``
    without stepping (old log-probs as in ``train_step``)."""
    t.model.train()
    mini = t._micro_batches(samples)
    t._prepare([mini])
    t.optimizer.zero_grad(set_to_none=True)
    return t._accumulate(mini)


def manual_logprobs(model, s: Sample, temperature: float) -> torch.Tensor:
    """Token by token: the log-prob of output j given the prompt and outputs before it."""
    seq = torch.tensor([list(s.prompt_tokens) + list(s.output_tokens)])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0]
    lps = []
    for j, tok in enumerate(s.output_tokens):
        lps.append(torch.log_softmax(logits[len(s.prompt_tokens) - 1 + j] / temperature, -1)[tok])
    return torch.stack(lps) if lps else torch.zeros(0)


def test_alignment_matches_a_manual_computation(tiny):
    t = trainer(tiny, temperature=0.7, micro_batch_tokens=24)
    samples = make_samples(5)
    got = t.logprobs(samples)
    for s, lp in zip(samples, got):
        assert lp.shape == (len(s.output_tokens),)
        torch.testing.assert_close(lp, manual_logprobs(t.model, s, 0.7), rtol=0, atol=1e-5)
    # and the packed path the loss uses agrees with it, on a row of several samples
    mb = max(t._micro_batches(samples), key=lambda mb: mb.samples)
    assert mb.samples > 1
    packed = t._logprobs(t.model, mb)[0]
    expected = torch.cat([manual_logprobs(t.model, samples[i], 0.7) for i in mb.row.members])
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalization", ["constant", "token", "sequence"])
@pytest.mark.parametrize("old", ["recomputed", "behaviour"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny, normalization, old):
    # behaviour log-probs put ratios all over, so the clips and delta bind on some tokens
    loss = GRPOLossConfig(normalization=normalization, old_logprobs=old, entropy_coef=0.01)
    samples = make_samples(7, seed=1, behaviour=True)
    grads, stats = [], []
    for budget in (12, 4096):  # rows of a few samples; the whole mini-batch in one row
        t = trainer(tiny, torch.float64, micro_batch_tokens=budget, loss=loss)
        stats.append(accumulate_gradients(t, samples))
        grads.append(torch.cat([p.grad.flatten() for p in t.model.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], abs=1e-9)
    for key in ("clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "tokens", "samples"):
        assert stats[0][key] == pytest.approx(stats[1][key], abs=1e-9)
    if old == "behaviour":
        assert stats[0]["clip_fraction"] > 0


def test_first_mini_step_has_ratio_one_and_later_ones_drift(tiny):
    t = trainer(tiny, lr=1e-2, steps_per_rollout=4, micro_batch_tokens=20)
    stats = t.train_step(make_samples(16, seed=2))
    assert isinstance(stats, StepStats) and len(stats.mini_steps) == 4 and t.step == 4
    first = stats.mini_steps[0]
    assert first.ratio_min == first.ratio_max == first.ratio_mean == 1.0 and first.clip_fraction == 0.0
    assert all(m.ratio_max > 1 or m.ratio_min < 1 for m in stats.mini_steps[1:])
    assert stats.samples == 16 and stats.tokens == sum(m.tokens for m in stats.mini_steps)
    assert stats.ratio_min < 1 < stats.ratio_max and stats.seconds > 0


def test_old_logprobs_cost_one_forward_per_later_micro_batch(tiny):
    """The first mini-batch's old log-probs are its own (detached); only later ones get a no-grad pass."""
    t = trainer(tiny, steps_per_rollout=4, micro_batch_tokens=1)  # every sample a row of its own
    calls = []
    split_causal_lm(t.model)[0].register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    t.train_step(make_samples(16, seed=3))  # 4 mini-batches of 4 samples, 4 micro-batches each
    assert calls.count(True) == 16 and calls.count(False) == 12


def test_behaviour_logprobs_are_the_ratio_denominator(tiny):
    t = trainer(tiny, steps_per_rollout=1, loss=GRPOLossConfig(old_logprobs="behaviour"))
    plain = make_samples(6, seed=3)
    shifted = [Sample(s.prompt_tokens, s.output_tokens, s.advantage, (lp - 0.1).tolist())
               for s, lp in zip(plain, t.logprobs(plain))]
    stats = accumulate_gradients(t, shifted)
    assert stats["ratio_min"] == pytest.approx(math.exp(0.1), abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.1), abs=1e-5)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        t.train_step(plain)


def test_positive_advantages_become_more_likely_and_negative_less(tiny):
    t = trainer(tiny, lr=3e-3, steps_per_rollout=1)
    prompt = [5, 6, 7]
    samples = [Sample(prompt, [8, 9, 10], 1.0), Sample(prompt, [11, 12], -1.0),
               Sample(prompt, [13, 14, 15, 16], 1.0), Sample(prompt, [17], -1.0)]
    before = [lp.sum().item() for lp in t.logprobs(samples)]
    for _ in range(3):
        t.train_step(samples)
    after = [lp.sum().item() for lp in t.logprobs(samples)]
    for s, b, a in zip(samples, before, after):
        assert (a > b) == (s.advantage > 0), (s, b, a)


def test_zero_advantages_give_no_policy_gradient(tiny):
    t = trainer(tiny, torch.float64, micro_batch_tokens=16)
    samples = [Sample(s.prompt_tokens, s.output_tokens, 0.0) for s in make_samples(5, seed=4)]
    accumulate_gradients(t, samples)
    assert max(p.grad.abs().max().item() for p in t.model.parameters() if p.grad is not None) < 1e-12
    assert t.train_step(samples).grad_norm < 1e-12


def test_schedule_and_clipping(tiny):
    t = trainer(tiny, lr=1e-3, warmup_steps=4, total_steps=8, min_lr_ratio=0.1, steps_per_rollout=4, grad_clip=1e-3)
    before = [p.detach().clone() for p in t.model.parameters()]
    stats = t.train_step(make_samples(8, seed=5))
    assert [m.lr for m in stats.mini_steps] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(m.grad_norm > 1e-3 for m in stats.mini_steps)  # so clipping was active
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    assert t.train_step(make_samples(8, seed=6)).lr == pytest.approx(1e-4)


def test_state_dict_resumes_identically(tiny):
    a = trainer(tiny, lr=1e-2, steps_per_rollout=2)
    a.train_step(make_samples(6, seed=7))
    b = GRPOTrainer(copy.deepcopy(a.model), a.tokenizer, a.cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.step == 2
    nxt = make_samples(6, seed=8)
    a.train_step(nxt)
    b.train_step(nxt)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_kl_needs_and_uses_a_reference_model(tiny):
    cfg = GRPOLossConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_model"):
        trainer(tiny, loss=cfg)
    ref = copy.deepcopy(tiny[0])
    t = trainer(tiny, loss=cfg, ref_model=ref, lr=1e-2, steps_per_rollout=2)
    stats = t.train_step(make_samples(6, seed=9))
    assert stats.mini_steps[0].kl == pytest.approx(0, abs=1e-7) and stats.mini_steps[1].kl > 0


def test_publish_writes_a_loadable_checkpoint(tiny, tmp_path):
    storage = RunStorage(f"file://{tmp_path}")
    t = trainer(tiny, lr=1e-2, steps_per_rollout=1)
    t.train_step(make_samples(4, seed=10))
    uri = t.publish(storage, 1)
    assert storage.is_stable(1, "checkpoints") and uri.endswith("checkpoints/step_1")
    model, _ = fetch(storage, 1)
    for (n, p), q in zip(t.model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(input_ids=ids).logits, t.model(input_ids=ids).logits)


def rollout(i, prompt, output, adv):
    return Rollout(run="r", step=1, policy_step=0, worker="w", submission=0, seed=i, prompt_id=f"p{i}",
                   group_id=0, prompt_tokens=tuple(prompt), output_tokens=tuple(output), finish_reason="stop",
                   reward=adv, task_reward=adv, length_penalty=0.0, advantage=adv)


def test_load_accepted(tmp_path):
    rows = [rollout(i, [5, 6], [7 + i], float(i) - 0.5) for i in range(2)]
    storage = RunStorage(f"file://{tmp_path}/run")
    limits = RolloutLimits(vocab_size=64)
    rel = write_submission(storage, 1, "w", 0, rows, limits=limits)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        ledger.record_verdicts(1, [Verdict.of(rows[0], rel, 0, "toploc"), Verdict.of(rows[1], rel, 1)])
        accepted = ledger.accepted(1)
    assert load_accepted(storage, accepted, limits) == [rows[1]]
    write_submission(storage, 1, "w", 0, [rows[1], rows[0]], limits=limits, overwrite=True)  # after validation
    with pytest.raises(ValueError, match="not what the ledger accepted"):
        load_accepted(storage, accepted, limits)


def test_config_is_strict():
    with pytest.raises(pydantic.ValidationError):
        RLTrainerConfig(micro_batch_tokens=0)
    with pytest.raises(pydantic.ValidationError):
        RLTrainerConfig(micro_batch_size=32)  # renamed: a stale config fails loudly
    with pytest.raises(pydantic.ValidationError):
        RLTrainerConfig(lr_typo=1e-3)
    with pytest.raises(ValueError, match="prompt token"):
        Sample([], [1], 0.0)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        Sample([1], [2, 3], 0.0, [0.0])
