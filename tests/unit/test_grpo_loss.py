import doctest

import pydantic
import pytest
import torch

from intellect.rl.trainer import loss as loss_mod
from intellect.rl.trainer.loss import GRPOLossConfig, grpo_loss, token_logprobs

TOKEN = GRPOLossConfig(normalization="token")


def one_token(ratio: float, adv: float, cfg: GRPOLossConfig = TOKEN):
    """Loss and d loss / d logp_new for a single token with the given ratio and advantage."""
    logp = torch.tensor([[float(torch.tensor(ratio).log())]], dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_doctests():
    assert doctest.testmod(loss_mod).failed == 0


@pytest.mark.parametrize(
    "ratio, adv, loss, grad, clipped",
    [
        # A > 0: unclipped below 1 + eps, capped at 1 + eps above (no gradient)
        (1.1, 2.0, -2.2, -2.2, None),
        (0.5, 2.0, -1.0, -1.0, None),
        (1.5, 2.0, -2.4, 0.0, "clip_high"),
        (9.0, 2.0, -2.4, 0.0, "clip_high"),  # delta never binds for A > 0
        # A < 0: floored at 1 - eps below, unclipped up to delta, capped at delta
        (0.9, -2.0, 1.8, 1.8, None),
        (0.5, -2.0, 1.6, 0.0, "clip_low"),
        (3.0, -2.0, 6.0, 6.0, None),
        (5.0, -2.0, 8.0, 0.0, "clip_delta"),
    ],
)
def test_worked_examples(ratio, adv, loss, grad, clipped):
    # d/dlogp of -r*A is -r*A (dr/dlogp = r)
    got_loss, got_grad, stats = one_token(ratio, adv)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)
    for k in ("clip_low", "clip_high", "clip_delta"):
        assert stats[k].item() == (1.0 if k == clipped else 0.0)
    assert stats["clip_fraction"].item() == (0.0 if clipped is None else 1.0)


def test_delta_none_is_plain_ppo_clip():
    cfg = GRPOLossConfig(normalization="token", delta=None)
    assert one_token(5.0, -2.0, cfg)[:2] == pytest.approx((10.0, 10.0))
    assert one_token(5.0, 2.0, cfg)[:2] == pytest.approx((-2.4, 0.0))


def test_config_bounds():
    with pytest.raises(pydantic.ValidationError, match="delta"):
        GRPOLossConfig(delta=1.1)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        GRPOLossConfig(beta=0.1)
    with pytest.raises(pydantic.ValidationError):
        GRPOLossConfig(normalization="dapo")
    cfg = GRPOLossConfig()
    assert (cfg.delta, cfg.epsilon_low, cfg.epsilon_high, cfg.normalization, cfg.kl_coef, cfg.entropy_coef) == (
        4.0, 0.2, 0.2, "constant", 0.0, 0.0,
    )


def batch(b=3, t=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp_new = (logp_old + torch.randn(b, t, generator=g, dtype=dtype) * 0.3).requires_grad_()
    adv = torch.randn(b, generator=g, dtype=dtype)
    lengths = torch.tensor([t, 2, 4][:b])
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    return logp_new, logp_old, adv, mask


def per_token_reference(logp_new, logp_old, adv):
    r = (logp_new - logp_old).exp()
    c1 = r.clamp(0, 4.0)
    c2 = c1.clamp(0.8, 1.2)
    return torch.maximum(-c1 * adv[:, None], -c2 * adv[:, None])


def test_normalization_modes():
    logp_new, logp_old, adv, mask = batch()
    pt = per_token_reference(logp_new, logp_old, adv).detach() * mask
    expect = {
        "constant": pt.sum() / (3 * 5),
        "token": pt.sum() / mask.sum(),
        "sequence": (pt.sum(1) / mask.sum(1)).mean(),
    }
    for mode, want in expect.items():
        got, _ = grpo_loss(logp_new, logp_old, adv, mask, GRPOLossConfig(normalization=mode))
        torch.testing.assert_close(got.detach(), want)
    got, _ = grpo_loss(logp_new, logp_old, adv, mask, GRPOLossConfig(), max_len=8)
    torch.testing.assert_close(got.detach(), pt.sum() / (3 * 8))
    got, _ = grpo_loss(logp_new, logp_old, adv, mask, TOKEN, token_count=40)
    torch.testing.assert_close(got.detach(), pt.sum() / 40)


@pytest.mark.parametrize("mode", ["constant", "token", "sequence"])
def test_gradcheck_all_terms(mode):
    logp_new, logp_old, adv, mask = batch()
    g = torch.Generator().manual_seed(1)
    ref = (logp_old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.5)
    ent = torch.rand(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    cfg = GRPOLossConfig(normalization=mode, kl_coef=0.1, entropy_coef=0.01)
    fn = lambda lp, h: grpo_loss(lp, logp_old, adv, mask, cfg, ref_logp=ref, entropy=h)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp_new, ent))


def test_gradcheck_token_logprobs():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.7, entropy_grad=True), (logits,))


def test_padding_is_ignored_even_when_garbage():
    logp_new, logp_old, adv, mask = batch()
    pad = mask == 0
    for mode in ("constant", "token", "sequence"):
        cfg = GRPOLossConfig(normalization=mode, kl_coef=0.1)
        ref = logp_old.clone()
        clean, _ = grpo_loss(logp_new, logp_old, adv, mask, cfg, ref_logp=ref)
        (g_clean,) = torch.autograd.grad(clean, logp_new)
        dirty_new = torch.where(pad, torch.tensor(float("nan"), dtype=torch.float64), logp_new)
        dirty, stats = grpo_loss(
            dirty_new, logp_old.masked_fill(pad, -1e30), adv, mask, cfg, ref_logp=ref.masked_fill(pad, float("inf"))
        )
        (g_dirty,) = torch.autograd.grad(dirty, logp_new)
        torch.testing.assert_close(dirty, clean)
        torch.testing.assert_close(g_dirty, g_clean)
        assert (g_dirty[pad] == 0).all()
        assert all(torch.isfinite(v) for v in stats.values())


def test_per_token_advantages_equal_broadcast():
    logp_new, logp_old, adv, mask = batch()
    a, _ = grpo_loss(logp_new, logp_old, adv, mask, TOKEN)
    b, _ = grpo_loss(logp_new, logp_old, adv[:, None].expand(3, 5), mask, TOKEN)
    torch.testing.assert_close(a, b)


def test_kl_off_ignores_ref_and_on_has_gradient():
    logp_new, logp_old, _, mask = batch()
    adv = torch.zeros(3, dtype=torch.float64)  # no policy gradient: only the KL moves logp_new
    ref = logp_old - 0.5
    off, off_stats = grpo_loss(logp_new, logp_old, adv, mask, TOKEN, ref_logp=ref)
    assert off.item() == 0.0 and off_stats["kl"].item() > 0  # logged, not trained on
    cfg = GRPOLossConfig(normalization="token", kl_coef=0.5)
    on, stats = grpo_loss(logp_new, logp_old, adv, mask, cfg, ref_logp=ref)
    (grad,) = torch.autograd.grad(on, logp_new)
    d = (ref - logp_new).detach()
    k3 = d.exp() - d - 1
    torch.testing.assert_close(on.detach(), 0.5 * (k3 * mask).sum() / mask.sum())
    torch.testing.assert_close(stats["kl"], (k3 * mask).sum() / mask.sum())
    torch.testing.assert_close(grad, 0.5 * (1 - d.exp()) * mask / mask.sum())  # d k3 / d logp = 1 - e^d
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp_new, logp_old, adv, mask, cfg)


def test_entropy_bonus_on_and_off():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 6, generator=g, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 4), generator=g)
    mask = torch.ones(2, 4)
    adv = torch.tensor([1.0, -1.0])
    logp, h = token_logprobs(logits, tokens, entropy_grad=True)
    base, stats = grpo_loss(logp, logp.detach(), adv, mask, TOKEN, entropy=h)
    assert stats["entropy"].item() == pytest.approx(h.mean().item())
    cfg = GRPOLossConfig(normalization="token", entropy_coef=0.01)
    bonus, _ = grpo_loss(logp, logp.detach(), adv, mask, cfg, entropy=h)
    assert (base - bonus).item() == pytest.approx(0.01 * h.mean().item(), rel=1e-5)
    (grad,) = torch.autograd.grad(bonus - base, logits, retain_graph=True)
    (want,) = torch.autograd.grad(-0.01 * h.mean(), logits)
    torch.testing.assert_close(grad, want)
    _, h_nograd = token_logprobs(logits, tokens)
    assert not h_nograd.requires_grad
    with pytest.raises(ValueError, match="entropy_grad"):
        grpo_loss(logp, logp.detach(), adv, mask, GRPOLossConfig(entropy_coef=0.01), entropy=h_nograd)


def test_temperature_scaling():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    for t in (0.3, 1.0, 1.7):
        logp, h = token_logprobs(logits, tokens, t)
        want = torch.log_softmax(logits / t, -1).gather(-1, tokens[..., None]).squeeze(-1)
        torch.testing.assert_close(logp, want)
        torch.testing.assert_close(h, torch.distributions.Categorical(logits=logits / t).entropy())
    assert not torch.allclose(token_logprobs(logits, tokens, 0.5)[0], token_logprobs(logits, tokens, 1.0)[0])


def test_half_precision_logits_upcast():
    logits = torch.randn(2, 3, 9).bfloat16()
    logp, h = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert logp.dtype == h.dtype == torch.float32


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[[1e4, -1e4, 0.0, float("-inf")], [-3e4, 3e4, 3e4, float("-inf")]]], requires_grad=True)
    tokens = torch.tensor([[1, 0]])  # both tokens at ~zero probability: logp ~ -2e4 and -6e4
    logp, h = token_logprobs(logits, tokens, 0.5, entropy_grad=True)
    assert torch.isfinite(logp).all() and torch.isfinite(h).all()
    torch.testing.assert_close(h, torch.tensor([[0.0, 0.6931472]]))
    old = logp.detach() + torch.tensor([[30.0, -30.0]])  # ratios e^-30 and e^30
    cfg = GRPOLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, stats = grpo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), cfg, ref_logp=old, entropy=h)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert stats["clip_low"].item() == 0.5 and stats["clip_delta"].item() == 0.5


def test_ratio_stats_skip_padding():
    logp_old = torch.zeros(2, 3)
    logp_new = torch.tensor([[1.0, 1.5, 99.0], [0.5, 99.0, 99.0]]).log()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    _, stats = grpo_loss(logp_new, logp_old, torch.tensor([1.0, 1.0]), mask, GRPOLossConfig())
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["clip_high"].item() == pytest.approx(1 / 3)
    assert not any(v.requires_grad for v in stats.values())
