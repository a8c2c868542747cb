"""The packed, chunked log-prob path of the GRPO trainer against the padded full-logits computation."""

import copy
import doctest

import pytest
import torch

from intellect.config import ModelConfig
from intellect.model.checkpoint import build_model
from intellect.rl.trainer import logprobs as logprobs_mod
from intellect.rl.trainer import packing
from intellect.rl.trainer.logprobs import chunked_token_logprobs, hidden_states, packing_isolates, row_logprobs
from intellect.rl.trainer.loss import GRPOLossConfig, grpo_loss, token_logprobs
from intellect.rl.trainer.packing import first_fit_decreasing, output_mask, pack, unpack
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample

TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY)


def test_doctests():
    assert doctest.testmod(packing).failed == 0
    assert doctest.testmod(logprobs_mod).failed == 0


def make_samples(n, seed=0, vocab=20):
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    out = []
    for i in range(n):
        p = torch.randint(4, vocab, (ints(1, 6),), generator=g).tolist()
        o = torch.randint(4, vocab, (0 if i == 3 else ints(1, 10),), generator=g).tolist()  # one empty output
        lp = (-torch.rand(len(o), generator=g) * 3).tolist()
        out.append(Sample(p, o, float(torch.randn(1, generator=g)), lp))
    return out


# ------------------------------------------------------------------ packing


def test_first_fit_decreasing_respects_the_budget():
    lengths = [7, 3, 3, 12, 1, 5, 5, 2, 9]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # only an over-budget item exceeds it, alone
    assert [3] in bins and len(bins) == 5  # the 12 alone; the other 35 tokens in 4 bins


def test_rows_restart_positions_and_target_only_outputs():
    samples = make_samples(6, seed=1)
    rows = pack(samples, 20)
    assert sorted(i for r in rows for i in r.members) == list(range(6))
    for r in rows:
        start = 0
        for k, i in enumerate(r.members):
            s = samples[i]
            n = len(s.prompt_tokens) + len(s.output_tokens)
            assert r.position_ids[start : start + n].tolist() == list(range(n))
            assert r.ids[start : start + n].tolist() == list(s.prompt_tokens) + list(s.output_tokens)
            mine = r.sample == k
            assert r.targets[mine].tolist() == list(s.output_tokens)
            assert r.predict[mine].tolist() == list(range(start + len(s.prompt_tokens) - 1, start + n - 1))
            start += n
        assert start == r.ids.numel() and (start <= 20 or len(r.members) == 1)
        assert r.mask.sum() == r.tokens == sum(r.output_lengths)
        assert output_mask(r).sum(-1).tolist() == list(r.output_lengths)
    assert all(len(r.members) == 1 for r in pack(samples, 20, one_per_row=True))


def test_unpack_is_differentiable():
    row = pack([([1], [2, 3]), ([4], [5])], 10)[0]
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (unpack(x, row) * torch.tensor([[1.0, 10.0], [100.0, 1000.0]])).sum().backward()
    assert x.grad.tolist() == [1.0, 10.0, 100.0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_models_keep_packed_samples_apart(arch):
    model, _ = build_model(TINY.model_copy(update={"arch": arch}))
    assert packing_isolates(model)


def test_a_model_that_lets_packed_samples_see_each_other_is_caught(tiny, monkeypatch):
    def plain_causal(base, ids, position_ids):  # noqa: ARG001 - positions that never restart
        return base(input_ids=ids, use_cache=False).last_hidden_state

    monkeypatch.setattr(logprobs_mod, "hidden_states", plain_causal)
    assert not packing_isolates(tiny[0])
    with pytest.warns(UserWarning, match="one sample per forward pass"):
        t = GRPOTrainer(copy.deepcopy(tiny[0]), tiny[1], RLTrainerConfig(micro_batch_tokens=4096))
    assert [mb.samples for mb in t._micro_batches(make_samples(5))] == [1] * 5


def test_changing_one_sample_leaves_the_other_samples_of_its_row_alone(tiny):
    model = copy.deepcopy(tiny[0]).double()
    a, b, c = ([5, 6, 7], [8, 9, 10, 11]), ([12, 13], [14, 15, 16]), ([17], [4, 5])
    changed = ([9, 9, 4], [4, 19, 18, 6])
    rows = [pack([x, b, c], 100)[0] for x in (a, changed)]
    assert [r.members for r in rows] == [(0, 1, 2)] * 2
    lps = [row_logprobs(model, r, TEMPERATURE)[0] for r in rows]
    others = rows[0].sample > 0
    torch.testing.assert_close(lps[0][others], lps[1][others], rtol=0, atol=1e-12)
    assert (lps[0][~others] - lps[1][~others]).abs().max() > 1e-3
    # and they are the samples' log-probs alone
    alone = torch.cat([row_logprobs(model, pack([s], 100)[0], TEMPERATURE)[0] for s in (b, c)])
    torch.testing.assert_close(lps[0][others], alone, rtol=0, atol=1e-12)
    # the control: positions that run on across samples let them see each other
    r = rows[0]
    base, head = model.base_model, model.get_output_embeddings()
    with torch.no_grad():
        plain = hidden_states(base, r.ids[None], torch.arange(r.ids.numel())[None])[0]
    leaked = token_logprobs(head(plain[r.predict]), r.targets, TEMPERATURE)[0]
    assert (leaked[others] - lps[0][others]).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("linear", [True, False])  # the hand-written backward; a checkpoint per chunk
def test_chunked_logprobs_equal_the_full_logits(entropy_grad, linear, temperature):
    g = torch.Generator().manual_seed(0)
    linear_head = torch.nn.Linear(8, 50, dtype=torch.float64)
    head = linear_head if linear else torch.nn.Sequential(linear_head)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    weights = torch.randn(2, 11, generator=g, dtype=torch.float64)
    grads = []
    for chunked in (False, True):
        head.zero_grad()
        hidden.grad = None
        if chunked:
            lp, h = chunked_token_logprobs(head, hidden, targets, temperature, entropy_grad=entropy_grad, chunk_tokens=4)
        else:
            lp, h = token_logprobs(head(hidden), targets, temperature, entropy_grad=entropy_grad)
        ((lp * weights[0]).sum() + (h * weights[1]).sum() if entropy_grad else (lp * weights[0]).sum()).backward()
        grads.append([lp.detach(), h.detach(), torch.clone(hidden.grad), torch.clone(linear_head.weight.grad),
                      torch.clone(linear_head.bias.grad)])
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ the trainer against the padded path


def padded_reference(model, ref_model, samples, cfg: GRPOLossConfig):
    """The whole mini-batch as one right-padded batch through the model's full logits, token_logprobs
    and grpo_loss (behaviour log-probs as the old ones); backward leaves the gradient in ``.grad``."""
    seqs = [list(s.prompt_tokens) + list(s.output_tokens) for s in samples]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    old = torch.zeros((len(seqs), width - 1), dtype=torch.float64)
    for i, (s, q) in enumerate(zip(samples, seqs)):
        ids[i, : len(q)] = torch.tensor(q)
        out = slice(len(s.prompt_tokens) - 1, len(q) - 1)
        mask[i, out] = True
        old[i, out] = torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
    logp, entropy = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], TEMPERATURE,
                                   entropy_grad=cfg.entropy_coef > 0)
    with torch.no_grad():
        ref = token_logprobs(ref_model(input_ids=ids).logits[:, :-1], ids[:, 1:], TEMPERATURE)[0]
    dt = logp.dtype
    adv = torch.tensor([s.advantage for s in samples], dtype=dt)
    max_len = max(len(s.output_tokens) for s in samples)
    loss, _ = grpo_loss(logp, old.to(dt), adv, mask, cfg, ref_logp=ref, entropy=entropy, max_len=max_len,
                        token_count=int(mask.sum()))
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalization", ["constant", "token", "sequence"])
@pytest.mark.parametrize("budget", [1, 14, 4096])  # one sample per row; a few per row; all in one row
def test_packed_chunked_loss_and_gradients_equal_the_padded_full_logits(tiny, dtype, normalization, budget):
    cfg = GRPOLossConfig(normalization=normalization, old_logprobs="behaviour", kl_coef=0.1, entropy_coef=0.01)
    samples = make_samples(7, seed=2)
    model = copy.deepcopy(tiny[0]).to(dtype)
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():  # a reference away from the policy, so that the KL has a gradient
            p.add_(torch.randn_like(p) * 0.05)

    reference = copy.deepcopy(model)
    reference.train()
    expected_loss = padded_reference(reference, ref_model, samples, cfg)

    t = GRPOTrainer(model, tiny[1], RLTrainerConfig(micro_batch_tokens=budget, logit_chunk_tokens=3,
                                                    temperature=TEMPERATURE, loss=cfg), ref_model=ref_model)
    t.model.train()
    mini = t._micro_batches(samples)
    if budget == 1:
        assert len(mini) == len(samples)
    elif budget == 14:
        assert len(samples) > len(mini) > 1 and any(mb.samples > 1 for mb in mini)
    else:
        assert len(mini) == 1
    t._prepare([mini])
    t.optimizer.zero_grad(set_to_none=True)
    stats = t._accumulate(mini)

    assert stats["kl"] > 0 and stats["clip_fraction"] > 0
    assert stats["loss"] == pytest.approx(expected_loss, abs=1e-6)
    for (name, p), q in zip(t.model.named_parameters(), reference.parameters()):
        assert q.grad is not None and q.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def test_the_linear_head_backward_under_bf16_autocast_matches_autograd():
    """Under autocast the matmuls run in bf16 and the softmax in float32, in the hand-written backward
    as in autograd's (the checkpointed path of any other head)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (9,), generator=g)
    head = torch.nn.Linear(16, 40)
    out = []
    for wrapped in (head, torch.nn.Sequential(head)):
        head.zero_grad()
        hidden.grad = None
        lp, h = chunked_token_logprobs(wrapped, hidden, targets, TEMPERATURE, entropy_grad=True, chunk_tokens=4,
                                       context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        assert lp.dtype == torch.float32
        (lp.sum() + 0.5 * h.sum()).backward()
        out.append([lp.detach(), h.detach(), torch.clone(hidden.grad), torch.clone(head.weight.grad)])
    for x, y in zip(*out):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)
