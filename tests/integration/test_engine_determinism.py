"""How often a validator's recomputation disagrees with the engine, on ~200 samples.

Generation runs under several batch sizes and thread counts; each run is then
checked the validator's way (one prefill, ``sample`` from the prefill logits
with the request's seed) under other batch sizes and thread counts. A token
whose recomputed choice differs is a disagreement: with exact arithmetic
there would be none, so every one is a near-tie flipped by rounding.

Also runnable to print the table for any checkpoint::

    python tests/integration/test_engine_determinism.py [--checkpoint DIR] [--samples 200]
"""

from __future__ import annotations

import argparse

import pytest
import torch

from intellect.config import DataConfig, ModelConfig
from intellect.data.arithmetic import heldout_problems
from intellect.inference import Request, SamplingParams, TorchEngine
from intellect.model.checkpoint import build_model, load_checkpoint

GEN_CONFIGS = [(1, 1), (16, 1), (256, 1), (16, 2), (256, 2)]  # (max_batch_size, torch threads)
VAL_CONFIGS = [(64, 1), (1, 1), (64, 2)]
# the test runs a corner of the grid: batch size 1 and two threads are slow on a shared 2-core box
QUICK_GEN, QUICK_VAL = [(1, 1), (256, 1), (256, 2)], [(64, 1), (1, 1), (64, 2)]
SAMPLINGS = {
    "T=1": SamplingParams(temperature=1.0, max_tokens=16),
    "T=1 top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16),
    "greedy": SamplingParams(temperature=0.0, max_tokens=16),
}


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def measure(model, tok, samples: int = 200, gen_configs=GEN_CONFIGS, val_configs=VAL_CONFIGS) -> list[dict]:
    prompts = [tok(p.prompt)["input_ids"] for p in heldout_problems(DataConfig(), samples)]
    requests = [Request(p, seed=1000 + i) for i, p in enumerate(prompts)]
    rows = []
    restore = torch.get_num_threads()
    try:
        for name, sp in SAMPLINGS.items():
            ref = None
            for bs, th in gen_configs:
                _threads(th)
                gens = TorchEngine.for_tokenizer(model, tok, max_batch_size=bs).generate(requests, sp)
                ref = ref or gens
                diverged = sum(a.tokens != b.tokens for a, b in zip(ref, gens))
                for vbs, vth in val_configs:
                    _threads(vth)
                    val = TorchEngine.for_tokenizer(model, tok, max_batch_size=vbs)
                    scored = val.prefill(requests, [g.tokens for g in gens], sp)
                    bad = [int((s.resampled != torch.tensor(g.tokens)).sum()) for g, s in zip(gens, scored)]
                    h_gen = torch.cat([g.hidden_states for g in gens]).float()
                    h_val = torch.cat([s.hidden_states for s in scored]).float()
                    rows.append({
                        "sampling": name, "gen": f"bs={bs} th={th}", "val": f"bs={vbs} th={vth}",
                        "tokens": sum(len(g.tokens) for g in gens),
                        "token_disagree": sum(bad),
                        "sample_disagree": sum(b > 0 for b in bad),
                        "gen_diverged_from_ref": diverged,
                        "hidden_bf16_differ": float((h_gen != h_val).float().mean()),
                        "hidden_rel_err": float((h_gen - h_val).norm() / h_val.norm()),
                    })
    finally:
        torch.set_num_threads(restore)
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'sampling':14} {'generation':12} {'validation':12} {'tokens':>6} {'tok dis':>7} {'smp dis':>7} "
            f"{'gen!=ref':>8} {'bf16 differ':>11} {'rel err':>8}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['sampling']:14} {r['gen']:12} {r['val']:12} {r['tokens']:6d} {r['token_disagree']:7d} "
            f"{r['sample_disagree']:7d} {r['gen_diverged_from_ref']:8d} {r['hidden_bf16_differ']:11.2e} "
            f"{r['hidden_rel_err']:8.1e}"
        )
    return "\n".join(lines)


def _peaked_tiny(dtype: torch.dtype = torch.float32):
    model, tok = build_model(ModelConfig())
    with torch.no_grad():  # random init is near uniform; x5 on the final norm gives ~2 nats entropy, like a trained model
        model.model.norm.weight.mul_(5)
    return model.to(dtype), tok


@pytest.mark.slow
@pytest.mark.parametrize("dtype,max_rate", [(torch.float32, 0.001), (torch.bfloat16, 0.02)])
def test_validator_recomputation_rarely_disagrees(dtype, max_rate):
    rows = measure(*_peaked_tiny(dtype), gen_configs=QUICK_GEN, val_configs=QUICK_VAL)
    print("\n" + format_rows(rows))
    tokens = sum(r["tokens"] for r in rows)
    assert sum(r["token_disagree"] for r in rows) <= max_rate * tokens
    for r in rows:
        assert r["hidden_rel_err"] < 0.02
    # the noise does not depend on batching, so runs diverge only where rounding flips a near-tie
    assert all(r["gen_diverged_from_ref"] <= 20 * max_rate * 200 for r in rows)


@pytest.mark.slow
def test_a_tampered_sampler_is_caught():
    """Sampling with the wrong seed (or no seed) fails the check on most samples."""
    model, tok = _peaked_tiny()
    prompts = [tok(p.prompt)["input_ids"] for p in heldout_problems(DataConfig(), 50)]
    sp = SamplingParams(temperature=1.0, max_tokens=16)
    engine = TorchEngine.for_tokenizer(model, tok)
    honest = [Request(p, seed=i) for i, p in enumerate(prompts)]
    lying = engine.generate([Request(p, seed=10_000 + i) for i, p in enumerate(prompts)], sp)
    scored = engine.prefill(honest, [g.tokens for g in lying], sp)
    caught = sum(bool((s.resampled != torch.tensor(g.tokens)).any()) for g, s in zip(lying, scored))
    assert caught >= 45


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="HF folder; default: the tiny model with a peaked final norm")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    m, t = load_checkpoint(args.checkpoint, dtype=dtype) if args.checkpoint else _peaked_tiny(dtype)
    print(format_rows(measure(m, t, args.samples)))
