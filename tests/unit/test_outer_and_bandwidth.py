import doctest
import itertools

import pytest

import torch

import intellect.diloco.bandwidth as bandwidth
import intellect.diloco.outer as outer
from intellect.config import ModelConfig
from intellect.diloco.bandwidth import round_robin, solve_ring
from intellect.diloco.outer import OuterState
from intellect.diloco.ring_order import bottleneck
from intellect.model.checkpoint import build_model


def test_docstring_examples():
    for mod in (outer, bandwidth):
        assert doctest.testmod(mod).failed == 0


def test_outer_step_is_sgd_nesterov_on_the_synced_copy():
    model, _ = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2))
    state = OuterState(model, lr=0.7, momentum=0.9)
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        g = state.pseudo_gradient(model)
        for r, gi in zip(ref, g):
            r.grad = gi.clone()
        opt.step()
        state.step(g)
        state.load_into(model)
        for r, s, p in zip(ref, state.params, model.parameters()):
            assert torch.equal(r.detach(), s) and torch.equal(s, p.detach())


def test_outer_lr_one_without_momentum_is_plain_model_averaging():
    # the DiLoCo-vs-DDP benchmark's setting; the config's nesterov=True default must not make torch reject it
    models = [torch.nn.Linear(3, 2) for _ in range(3)]
    state = OuterState(models[0], lr=1.0, momentum=0.0, nesterov=True)
    start = [p.clone() for p in state.params]
    for m in models:
        state.load_into(m)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p))
    grads = [state.pseudo_gradient(m) for m in models]
    state.step([sum(g[i] for g in grads) / len(grads) for i in range(len(start))])
    for i, s in enumerate(state.params):
        assert torch.allclose(s, sum(list(m.parameters())[i].detach() for m in models) / len(models), atol=1e-6)
    assert not state.has_momentum()


def test_replicas_with_equal_inputs_have_equal_digests_and_state_transfers():
    a_model, _ = build_model(ModelConfig(num_layers=1))
    b_model, _ = build_model(ModelConfig(num_layers=1, init_seed=9))
    a, b = OuterState(a_model), OuterState(b_model)
    assert a.digest() != b.digest()
    g = [torch.randn_like(p) for p in a.params]
    a.step(g)
    b.set_state(a.params, a.momentum_buffers())
    assert a.digest() == b.digest()
    g2 = [torch.randn_like(p) for p in a.params]
    a.step(g2)
    b.step(g2)
    assert a.digest() == b.digest()


def test_round_robin_covers_every_pair_once_with_disjoint_rounds():
    for n in range(2, 10):
        rounds = round_robin(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == list(itertools.combinations(range(n), 2))
        for r in rounds:
            busy = [x for p in r for x in p]
            assert len(busy) == len(set(busy))


def test_solved_ring_avoids_the_slow_link():
    n = 5
    cols = [[0.0 if i == j else 100.0 for i in range(n)] for j in range(n)]
    cols[3][1] = cols[1][3] = 1.0  # 1 <-> 3 slow
    cols[4][0] = 2.0  # 0 -> 4 slow one way
    order = solve_ring(cols)
    bw = [[cols[j][i] for j in range(n)] for i in range(n)]
    assert bottleneck(order, bw) == 100.0


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.7, True), (0.9, False)])
def test_the_eager_preview_is_the_outer_step_on_a_copy(momentum, nesterov):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    outer = OuterState(model, lr=0.7, momentum=momentum, nesterov=nesterov)
    outer.step([torch.randn_like(p) for p in outer.params])  # a momentum to copy
    before = [p.clone() for p in outer.params]
    buffers = [b.clone() for b in outer.momentum_buffers()]
    g = [torch.randn_like(p) for p in outer.params]
    preview = outer.preview(g, 1.0)
    # theta_sync and its momentum untouched; the next phase's start and the pseudo-gradient's base are the preview
    assert all(torch.equal(a, b) for a, b in zip(before, outer.params))
    assert all(torch.equal(a, b) for a, b in zip(buffers, outer.momentum_buffers()))
    assert outer.base is preview
    outer.step(g)  # weight 1 (one worker): the preview is the outer step bit for bit
    assert all(torch.equal(a, b) for a, b in zip(preview, outer.params))
    if momentum == 0:  # plain SGD: DeepMind's eager update, theta - lr * g / n
        half = outer.preview(g, 0.5)
        assert all(torch.allclose(h, p - 0.7 * 0.5 * x) for h, p, x in zip(half, outer.params, g))
    # the pseudo-gradient of the phase that starts there is measured from it
    assert outer.base is not None
    outer.load_into(model, outer.base)
    assert all(float(d.abs().max()) == 0 for d in outer.pseudo_gradient(model))
