"""DiLoCo across precisions on the CPU: a bf16 inner copy with the fp32 host outer state, fp32 checkpoints."""

from __future__ import annotations

import doctest

import pytest
import torch

import flows.diloco as diloco_flow
import flows.diloco_worker as worker_flow
import intellect.diloco.outer as outer_mod
import intellect.diloco.worker as worker_mod
import intellect.diloco.data as data_mod
from intellect.checkpoints import CHECKPOINTS, fetch
from intellect.config import ComputeConfig, ModelConfig, TrainConfig
from intellect.device import prepare_model
from intellect.diloco.coordinator import LOGS, save_logs, worker_log_dir
from intellect.diloco.outer import OuterState, host_model, publish_outer_checkpoint
from intellect.diloco.data import data_sketch, sequence_hash
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage
from intellect.train import Trainer

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
CPU = torch.device("cpu")


def test_docstring_examples():
    for mod in (outer_mod, worker_mod, data_mod, diloco_flow, worker_flow):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def inner_phase(model, tok, precision: str, steps: int = 3):
    trainer = Trainer(model, tok, TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup_steps=0),
                      compute=ComputeConfig(device="cpu", precision=precision))  # type: ignore[arg-type]
    texts = iter(lambda: ["12+3=15", "7*8=56", "40-2=38", "9+9=18"], None)
    return trainer.train_steps(steps, texts)


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_low_precision_inner_phase_keeps_the_outer_state_fp32_on_the_host(precision):
    model, tok = build_model(TINY)
    outer = OuterState(model, lr=0.7, momentum=0.9, device=CPU)  # from the fp32 weights, before the cast
    exact = [p.clone() for p in outer.params]
    prepare_model(model, ComputeConfig(device="cpu", precision=precision), CPU)  # type: ignore[arg-type]
    weight = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in model.parameters()} == {weight}
    assert all(torch.equal(s, e) and s.dtype == torch.float32 for s, e in zip(outer.params, exact))

    logs = inner_phase(model, tok, precision)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logs)
    pseudo = outer.pseudo_gradient(model)
    assert all(g.dtype == torch.float32 and g.device == CPU for g in pseudo)
    assert sum(float(g.abs().sum()) for g in pseudo) > 0
    # the pseudo-gradient is theta_sync minus the local weights read exactly in fp32
    for s, g, p in zip(outer.params, pseudo, model.parameters()):
        assert torch.equal(g, s - p.detach().float())

    outer.step(pseudo)
    assert all(p.dtype == torch.float32 for p in outer.params)
    assert outer.has_momentum() and all(m.dtype == torch.float32 for m in outer.momentum_buffers())
    outer.load_into(model)
    for s, p in zip(outer.params, model.parameters()):
        assert p.dtype == weight  # cast back to the inner precision ...
        assert torch.equal(p.detach(), s.to(weight))  # ... from the fp32 copy, which keeps its own bits
    assert any(not torch.equal(s, s.to(weight).float()) for s in outer.params) == (weight != torch.float32)


def test_replicas_of_a_bf16_run_apply_the_same_average_bit_identically():
    states, pseudos = [], []
    for seed in (0, 1):
        model, tok = build_model(TINY)
        outer = OuterState(model, device=CPU)
        prepare_model(model, ComputeConfig(device="cpu", precision="bf16"), CPU)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        states.append((model, outer))
        pseudos.append(outer.pseudo_gradient(model))
    average = [(a + b) / 2 for a, b in zip(*pseudos)]
    for model, outer in states:
        outer.step(average)
        outer.load_into(model)
    (m0, o0), (m1, o1) = states
    assert o0.digest() == o1.digest()
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))


def test_checkpoints_of_a_bf16_model_are_the_fp32_synced_copy(tmp_path):
    model, tok = build_model(TINY)
    outer = OuterState(model, device=CPU)
    prepare_model(model, ComputeConfig(device="cpu", precision="bf16"), CPU)
    inner_phase(model, tok, "bf16")
    outer.step(outer.pseudo_gradient(model))
    storage = RunStorage(f"file://{tmp_path}/run")
    with pytest.raises(ValueError, match="fp32 CPU"):
        publish_outer_checkpoint(storage, 1, model, tok, outer, ["w0"])
    host = host_model(model)
    assert host is not model and type(host) is type(model)
    assert {(p.dtype, p.device.type) for p in host.parameters()} == {(torch.float32, "cpu")}
    publish_outer_checkpoint(storage, 1, host, tok, outer, ["w0"])
    assert storage.complete_steps(CHECKPOINTS) == [1]
    loaded, _ = fetch(storage, 1)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert all(torch.equal(a.detach(), s) for a, s in zip(loaded.parameters(), outer.params))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # the inner copy is left as it was


def test_an_fp32_cpu_model_is_its_own_host_model():
    model, _ = build_model(TINY)
    prepare_model(model, ComputeConfig(device="cpu", precision="bf16-mixed"), CPU)  # fp32 master weights
    assert host_model(model) is model


def test_data_sketch_tells_disjoint_reads_from_shared_ones():
    rows = [sequence_hash(torch.arange(i, i + 8).numpy().tobytes()) for i in range(100)]
    a, b = data_sketch(rows[:50]), data_sketch(rows[50:])
    assert len(a) == len(b) == data_mod.SKETCH_SIZE and set(a).isdisjoint(b)
    assert data_sketch(reversed(rows[:50])) == a and data_sketch(rows) == data_sketch(a + b)


def test_worker_logs_live_in_the_run_folder(tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    here = worker_log_dir(storage)
    assert here == tmp_path / "run" / LOGS
    assert save_logs(storage, here) == []  # already there
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    (elsewhere / "w0.log").write_text("step 0 committed\n")
    save_logs(storage, elsewhere)  # what a run on remote storage does when it ends
    assert storage.read_text(f"{LOGS}/w0.log") == "step 0 committed\n"
