"""The RL trainer, the inference engine and the validator's prefill on a configured device and
precision (``compute``), here on the CPU: bf16-mixed keeps float32 master weights and AdamW state
and computes the loss in float32, the engine samples deterministically and its TOPLOC proofs verify
under a validator computing alike, checkpoints are published in float32 on the CPU, and ``fp32``
on the CPU is bit for bit what no ``compute`` at all gives."""

import copy
import math

import pytest
from rl_device_helpers import PROOFS, SUB, TASKS, TINY, adam_state, parity_reward, requests, samples, trainer
import torch

from intellect.checkpoints import CHECKPOINTS, fetch, fetch_recorded, publish, record
from intellect.config import ComputeConfig
from intellect.inference import Request, SamplingParams, TorchEngine
from intellect.inference.torch_engine import lm_head
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.step import CheckpointEngines
from intellect.rl.worker.submission import generate_submission
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig
from intellect.rl.worker.worker import WorkerRunInfo, keygen, main as worker_main
from intellect.storage import RunStorage
from intellect.toploc.check import right_padded_prefill, toploc_check
from intellect.toploc.proofs import check_many
from intellect.trust.keys import SigningKey

MIXED = ComputeConfig(device="cpu", precision="bf16-mixed")
BF16 = ComputeConfig(device="cpu", precision="bf16")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY)


# ---------------------------------------------------------------------- trainer


def test_fp32_on_the_cpu_is_bit_identical_to_no_compute(tiny):
    plain, placed = trainer(tiny, None), trainer(tiny, ComputeConfig(device="cpu", precision="fp32"))
    a, b = plain.train_step(samples()), placed.train_step(samples())
    assert (a.loss, a.grad_norm, a.ratio_max, a.tokens) == (b.loss, b.grad_norm, b.ratio_max, b.tokens)
    for (n, p), q in zip(plain.model.named_parameters(), placed.model.parameters()):
        assert torch.equal(p, q), n
    assert all(torch.equal(x, y) for x, y in zip(adam_state(plain), adam_state(placed)))


def test_bf16_mixed_keeps_fp32_master_weights_and_state_and_computes_in_bf16(tiny):
    t = trainer(tiny, MIXED, loss={"entropy_coef": 0.01})
    before = [p.detach().clone() for p in t.model.parameters()]
    matmuls: list[torch.dtype] = []
    hook = lm_head(t.model).register_forward_hook(lambda _m, _a, out: matmuls.append(out.dtype))
    try:
        stats = t.train_step(samples())
    finally:
        hook.remove()
    assert matmuls and set(matmuls) == {torch.bfloat16}  # the forward ran under bf16 autocast
    assert all(math.isfinite(x) for x in (stats.loss, stats.grad_norm, stats.ratio_mean, stats.entropy or 0.0))
    assert stats.tokens > 0 and t.step == 2
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    assert adam_state(t) and {s.dtype for s in adam_state(t)} == {torch.float32}
    assert any(not torch.equal(p, q) for p, q in zip(before, t.model.parameters()))
    # the loss math is float32 on bf16 logits
    lp = t.logprobs(samples()[:2])
    assert all(x.dtype == torch.float32 and bool(torch.isfinite(x).all()) for x in lp)


def test_bf16_trains_in_bf16_and_publishes_fp32_on_the_cpu(tiny, tmp_path):
    t = trainer(tiny, BF16)
    stats = t.train_step(samples(seed=1))
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert {s.dtype for s in adam_state(t)} == {torch.bfloat16}
    storage = RunStorage(f"file://{tmp_path}")
    t.publish(storage, 1)
    model, _ = fetch(storage, 1)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for (n, p), q in zip(t.model.named_parameters(), model.parameters()):
        assert torch.equal(p.float(), q), n  # bf16 values are exact in float32
    # the live model is back as it trained, and the optimizer still steps its parameters
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} <= {id(p) for p in t.model.parameters()}
    assert math.isfinite(t.train_step(samples(seed=2)).loss)
    state = t.state_dict()["optimizer"]["state"]
    assert all(v.device.type == "cpu" for s in state.values() for v in s.values())


def test_a_reference_model_is_placed_too(tiny):
    ref = copy.deepcopy(tiny[0]).to(torch.float64)
    t = GRPOTrainer(copy.deepcopy(tiny[0]), tiny[1], RLTrainerConfig(warmup_steps=0, loss={"kl_coef": 0.1}),
                    ref_model=ref, compute=MIXED)
    assert {p.dtype for p in ref.parameters()} == {torch.float32} and not ref.training
    stats = t.train_step(samples(seed=3))
    assert stats.kl is not None and math.isfinite(stats.kl)


# ---------------------------------------------------------------------- engine


@pytest.mark.parametrize("compute", [MIXED, BF16], ids=["bf16-mixed", "bf16"])
def test_engine_places_the_model_and_decodes_deterministically(tiny, compute):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    engine = TorchEngine.for_tokenizer(model, tok, compute=compute, max_batch_size=3)
    assert engine.precision == compute.precision and engine.device == torch.device("cpu")
    want = torch.bfloat16 if compute.precision == "bf16" else torch.float32
    assert {p.dtype for p in model.parameters()} == {want}
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12)
    first, again = engine.generate(requests(tok), sp), engine.generate(requests(tok), sp)
    for a, b in zip(first, again):
        assert a.tokens == b.tokens and torch.equal(a.hidden_states, b.hidden_states)
        assert torch.equal(a.logprobs, b.logprobs)
        assert a.hidden_states.dtype == torch.bfloat16 and a.logprobs.dtype == torch.float32
        assert bool(torch.isfinite(a.logprobs).all()) and bool(torch.isfinite(a.hidden_states.float()).all())
    # the noise is the seed's: another seed draws other tokens
    other = engine.generate([Request(r.prompt_ids, seed=100 + r.seed) for r in requests(tok)], sp)
    assert any(a.tokens != b.tokens for a, b in zip(first, other))
    # the prefill in the same precision recomputes the choices
    scored = engine.prefill(requests(tok), [c.tokens for c in first], sp)
    for c, s in zip(first, scored):
        assert s.resampled.tolist() == c.tokens
        assert torch.allclose(s.hidden_states.float(), c.hidden_states.float(), rtol=5e-2, atol=5e-2)
    right = right_padded_prefill(engine, requests(tok), [c.tokens for c in first], sp)
    assert [s.resampled.tolist() for s in right] == [c.tokens for c in first]


def test_for_tokenizer_pads_with_eos_when_the_tokenizer_has_no_pad_token(tiny):
    model, tok = tiny
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None and no_pad.eos_token_id is not None
    engine = TorchEngine.for_tokenizer(model, no_pad)
    assert engine.pad == no_pad.eos_token_id
    sp = SamplingParams(temperature=0, max_tokens=5, stop_at_eos=False)
    # left padding is masked: rows decode as they do alone
    batch = engine.generate(requests(tok), sp)
    assert [c.tokens for c in batch] == [engine.generate([r], sp)[0].tokens for r in requests(tok)]
    neither = copy.deepcopy(no_pad)
    neither.eos_token = None
    model_eos = copy.deepcopy(model)
    model_eos.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        TorchEngine.for_tokenizer(model_eos, neither)


# ---------------------------------------------------------------------- validator


def test_bf16_mixed_proofs_verify_under_a_bf16_mixed_validator(tiny):
    tok = tiny[1]
    worker = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok, capture_hidden=True, compute=MIXED)
    validator = TorchEngine.for_tokenizer(copy.deepcopy(tiny[0]), tok, capture_hidden=True, compute=MIXED)
    rows = generate_submission(worker, tok, TASKS, "w", 0, 0, 0, SUB, run="t", proofs=PROOFS)
    # the computation check alone: every chunk's proof matches the validator's bf16-mixed hidden states
    scored = validator.prefill([Request(list(r.prompt_tokens), r.seed) for r in rows],
                               [list(r.output_tokens) for r in rows], SUB.sampling())
    chunks = check_many([s.hidden_states for s in scored], [r.proof for r in rows], PROOFS.chunk, PROOFS.k, PROOFS)
    assert all(c.ok for row in chunks for c in row)
    flips = sum(int((s.resampled != torch.tensor(r.output_tokens)).sum()) for s, r in zip(scored, rows))
    assert flips <= 0.01 * sum(len(r.output_tokens) for r in rows)
    check = toploc_check(lambda _policy: validator, SUB.sampling(), PROOFS, [tok.eos_token_id])
    assert check(rows) == [None] * len(rows)
    other, _ = build_model(TINY.model_copy(update={"init_seed": 1}))
    cheat = toploc_check(lambda _policy: TorchEngine.for_tokenizer(other, tok, compute=MIXED), SUB.sampling(),
                         PROOFS, [tok.eos_token_id])
    assert all(r is not None and r.startswith("toploc_") for r in cheat(rows))


@pytest.fixture
def seeded(tmp_path, tiny):
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(tiny[0], tiny[1], storage, 0)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        record(storage, ledger, 0)
        yield storage, ledger


def test_checkpoint_engines_prefill_in_the_configured_precision(seeded):
    storage, ledger = seeded
    engine = CheckpointEngines(storage, ledger, compute=BF16)(0).engine
    assert engine.precision == "bf16" and {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert CheckpointEngines(storage, ledger)(0).engine.precision == "fp32"


def test_rl_steps_in_bf16_mixed_with_toploc(seeded):
    """Two RL steps on the CPU in bf16-mixed: the workers' engines, the validator's prefill and the
    trainer all compute under bf16 autocast on fp32 weights, every honest sample passes TOPLOC, and
    the trainer resumes from its published fp32 checkpoint and saved optimizer state."""
    storage, ledger = seeded
    cfg = RLRunConfig(run_name="t", compute=MIXED, submission=SUB.model_copy(update={"max_tokens": 6}),
                      trainer=RLTrainerConfig(lr=1e-2, warmup_steps=0, steps_per_rollout=2), toploc=PROOFS)
    forwards: list[tuple[bool, torch.dtype, bool]] = []

    def seen(module, _args, _out):
        if hasattr(module, "embed_tokens"):  # the base model, which every forward runs (the trainer's log-probs
            # run it without the causal LM's forward around it), not its layers
            forwards.append((torch.is_autocast_enabled("cpu"), next(module.parameters()).dtype, module.training))

    hook = torch.nn.modules.module.register_module_forward_hook(seen)
    try:
        for n in (0, 1):
            report = run_rl_step(cfg, storage, ledger, n, ["alice", "bob"], TASKS, reward_fn=parity_reward)
            assert report.committed and report.trained and report.rejected == 0 and report.accepted == 16
            assert report.loss is not None and math.isfinite(report.loss)
    finally:
        hook.remove()
    assert {(autocast, dtype) for autocast, dtype, _ in forwards} == {(True, torch.float32)}
    assert {training for *_, training in forwards} == {True, False}  # the trainer's and the engines'
    assert storage.complete_steps(CHECKPOINTS) == [0, 1, 2]
    model, _ = fetch_recorded(storage, ledger, 2)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len({ledger.checkpoint(n)[1] for n in (1, 2)}) == 2


# ---------------------------------------------------------------------- worker process


def test_workers_learn_the_runs_precision_and_reject_a_bad_device(tmp_path, capsys):
    info = WorkerRunInfo.of(RLRunConfig(compute=MIXED), committed=-1, relays=["http://127.0.0.1:1"])
    assert info.precision == "bf16-mixed"
    assert WorkerRunInfo.model_validate(info.model_dump(mode="json")).precision == "bf16-mixed"
    keygen(tmp_path / "worker.key")
    args = ["--run-url", "http://127.0.0.1:1", "--key", str(tmp_path / "worker.key"),
            "--trainer-key", SigningKey.generate().public.hex]
    assert worker_main([*args, "--device", "tpu"]) == 2
    assert "--device must be auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert worker_main([*args, "--device", "cuda:0"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
