"""The RL trainer, the inference engine and the validator's prefill on CUDA (``compute.device =
"cuda"``): what ``tests/unit/test_rl_device.py`` checks on the CPU, plus agreement with the CPU."""

import copy
import math

import pytest
from rl_device_helpers import PROOFS, SUB, TASKS, TINY, adam_state, parity_reward, requests, samples, trainer
import torch

from intellect.checkpoints import CHECKPOINTS, fetch, fetch_recorded, publish, record
from intellect.config import ComputeConfig
from intellect.device import resolve_device
from intellect.inference import Request, SamplingParams, TorchEngine, uniforms
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.step import CheckpointEngines
from intellect.rl.worker.submission import generate_submission
from intellect.rl.trainer.grpo import RLTrainerConfig
from intellect.storage import RunStorage
from intellect.toploc.check import toploc_check
from intellect.toploc.proofs import check_many

pytestmark = pytest.mark.gpu

FP32 = ComputeConfig(device="cuda", precision="fp32")
MIXED = ComputeConfig(device="cuda", precision="bf16-mixed")
BF16 = ComputeConfig(device="cuda", precision="bf16")


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY)


def test_auto_takes_the_gpu_of_the_local_rank(monkeypatch):
    count = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(count + 1))
    assert resolve_device("auto") == torch.device("cuda", (count + 1) % count)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("compute", [FP32, MIXED, BF16], ids=lambda c: c.precision)
def test_trainer_on_cuda(tiny, compute, tmp_path):
    t = trainer(tiny, compute)
    stats = t.train_step(samples())
    assert all(math.isfinite(x) for x in (stats.loss, stats.grad_norm, stats.ratio_mean))
    want = torch.bfloat16 if compute.precision == "bf16" else torch.float32
    assert {(p.device.type, p.dtype) for p in t.model.parameters()} == {("cuda", want)}
    assert {(s.device.type, s.dtype) for s in adam_state(t)} == {("cuda", want)}
    state = t.state_dict()["optimizer"]["state"]
    assert all(v.device.type == "cpu" for s in state.values() for v in s.values())
    # the same step on the CPU in fp32 agrees up to the precision's rounding
    ref = trainer(tiny, ComputeConfig(device="cpu")).train_step(samples())
    assert stats.loss == pytest.approx(ref.loss, rel=0.1, abs=1e-2)
    storage = RunStorage(f"file://{tmp_path}")
    t.publish(storage, 1)
    model, _ = fetch(storage, 1)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}
    for p, q in zip(t.model.parameters(), model.parameters()):
        assert torch.equal(p.float().cpu(), q)
    assert {p.device.type for p in t.model.parameters()} == {"cuda"}  # back where it trains
    assert math.isfinite(t.train_step(samples(seed=1)).loss)


@pytest.mark.parametrize("compute", [FP32, MIXED, BF16], ids=lambda c: c.precision)
def test_engine_on_cuda_is_deterministic(tiny, compute):
    tok = tiny[1]
    assert torch.equal(uniforms(torch.arange(8), 3, 51, device="cuda").cpu(), uniforms(torch.arange(8), 3, 51))
    engine = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok, compute=compute, max_batch_size=3)
    assert engine.device.type == "cuda" and engine.precision == compute.precision
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12)
    first, again = engine.generate(requests(tok), sp), engine.generate(requests(tok), sp)
    for a, b in zip(first, again):
        assert a.tokens == b.tokens and torch.equal(a.hidden_states, b.hidden_states)
        assert a.hidden_states.dtype == torch.bfloat16 and a.hidden_states.device.type == "cpu"
        assert bool(torch.isfinite(a.logprobs).all())
    scored = engine.prefill(requests(tok), [c.tokens for c in first], sp)
    flips = sum(int((s.resampled != torch.tensor(c.tokens)).sum()) for s, c in zip(scored, first))
    assert flips <= 1
    if compute.precision == "fp32":  # in bf16 the logits move by more than a near-tie, and a flip forks the row
        cpu = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok).generate(requests(tok), sp)
        assert sum(a.tokens == b.tokens for a, b in zip(cpu, first)) >= len(cpu) - 1


def test_bf16_mixed_proofs_verify_on_cuda(tiny):
    tok = tiny[1]
    worker = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok, capture_hidden=True, compute=MIXED)
    validator = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok, capture_hidden=True, compute=MIXED)
    rows = generate_submission(worker, tok, TASKS, "w", 0, 0, 0, SUB, run="t", proofs=PROOFS)
    scored = validator.prefill([Request(list(r.prompt_tokens), r.seed) for r in rows],
                               [list(r.output_tokens) for r in rows], SUB.sampling())
    chunks = check_many([s.hidden_states for s in scored], [r.proof for r in rows], PROOFS.chunk, PROOFS.k, PROOFS)
    assert all(c.ok for row in chunks for c in row)
    check = toploc_check(lambda _policy: validator, SUB.sampling(), PROOFS, [tok.eos_token_id])
    assert check(rows) == [None] * len(rows)
    other, _ = build_model(TINY.model_copy(update={"init_seed": 1}))
    cheat = toploc_check(lambda _policy: TorchEngine.for_tokenizer(other, tok, compute=MIXED), SUB.sampling(),
                         PROOFS, [tok.eos_token_id])
    assert all(r is not None and r.startswith("toploc_") for r in cheat(rows))


def test_rl_steps_on_cuda_in_bf16_mixed(tiny, tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(tiny[0], tiny[1], storage, 0)
    cfg = RLRunConfig(run_name="t", compute=MIXED, submission=SUB.model_copy(update={"max_tokens": 6}),
                      trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2), toploc=PROOFS)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        record(storage, ledger, 0)
        engine = CheckpointEngines(storage, ledger, compute=MIXED)(0).engine
        assert engine.device.type == "cuda" and engine.precision == "bf16-mixed"
        for n in (0, 1):
            report = run_rl_step(cfg, storage, ledger, n, ["alice", "bob"], TASKS, reward_fn=parity_reward)
            assert report.committed and report.trained and report.rejected == 0 and report.accepted == 16
            assert report.loss is not None and math.isfinite(report.loss)
        assert storage.complete_steps(CHECKPOINTS) == [0, 1, 2]
        model, _ = fetch_recorded(storage, ledger, 2)
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}
