"""TOPLOC distribution check: calibration of its defaults on honest and hybrid rollouts.

The statistic (:mod:`intellect.toploc.check`): a chosen token is *low* when the validator's sampling
distribution gives it less than ``min_token_prob``; the *surprise* of some tokens is ``-log10`` of a
Chernoff bound on honest sampling drawing at least as many low tokens as they hold, given the
expected number (each position's low-token mass, at least ``low_prob_floor``). The check rejects a
rollout, and every row of a submission pooled, whose surprise exceeds ``max_low_prob_surprise``.

For each setting, workers answer arithmetic prompts (temperature 1, top-p 1):

* **honest**: the right model samples (and would build the proofs);
* **hybrid**: another model samples; the right one builds the proofs (seed 002, section 4.4).

The right model's prefill then scores every rollout. Settings:

* ``arith``: the RL run's policy (``runs/smoke-slips``, newest checkpoint) against the plain smoke
  model (``runs/smoke``) as the cheap sampler, ``max_tokens`` 8 as in ``configs/rl-tiny.toml``
  (skipped when those runs are absent: ``intellect smoke`` builds them);
* ``sharp``: the attack test's pair, 40 tokens: the one-layer tiny model with its final norm scaled
  by 12 (confident) is the right model, its differently seeded twin, unscaled (near-uniform
  predictions, a weak model), samples. (Scaling the twin too would not do: a random model with tied
  embeddings mostly predicts its input token, so two sharpened ones agree.)
* ``flat``: both unscaled (near-uniform predictions: nothing can be told apart, and nothing must be
  rejected).

Prints, per setting and ``min_token_prob``, the surprise quantiles of single rollouts and of pooled
submissions (``--pools``: rows per submission; 16 is the tests' size, 256 the RL run's, 32 prompts x
8), and the share rejected at ``max_low_prob_surprise``; then the
verdicts of :func:`~intellect.toploc.check.toploc_check` itself at the defaults, seeded re-check and
termination check off, so that only the computation and distribution checks speak, on submissions
of the largest pool size. Writes ``benchmarks/results/toploc_distribution.json``.

    .venv/bin/python benchmarks/toploc_distribution.py
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.config import ModelConfig  # noqa: E402
from intellect.data.arithmetic import Problem  # noqa: E402
from intellect.inference.protocol import Request  # noqa: E402
from intellect.inference.sampling import LowProb, SamplingParams  # noqa: E402
from intellect.inference.torch_engine import TorchEngine  # noqa: E402
from intellect.model.checkpoint import build_model, load_checkpoint  # noqa: E402
from intellect.rl.wire.rollouts import Rollout  # noqa: E402
from intellect.toploc.check import Draws, toploc_check  # noqa: E402
from intellect.toploc.proofs import ToplocConfig, build_proofs_many  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TINY = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
QUANTILES = (0.0, 0.5, 0.99, 1.0)


def sharpened(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy whose logits are ``scale`` times larger (the final norm's weight feeds the LM head only)."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        sharp.get_parameter("model.norm.weight").mul_(scale)
    return sharp


def newest(run: Path) -> Path:
    return max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def settings(max_tokens_tiny: int) -> dict[str, tuple]:
    """name -> (right model, hybrid sampler, tokenizer, sampling)."""
    out = {}
    runs = ROOT / "runs"
    if (runs / "smoke-slips" / "checkpoints").is_dir() and (runs / "smoke" / "checkpoints").is_dir():
        right, tok = load_checkpoint(newest(runs / "smoke-slips"))
        cheap, _ = load_checkpoint(newest(runs / "smoke"))
        out["arith"] = (right, cheap, tok, SamplingParams(temperature=1.0, max_tokens=8))
    else:
        print("arith: skipped (no runs/smoke-slips or runs/smoke checkpoints)")
    model, tok = build_model(TINY)
    other, _ = build_model(TINY.model_copy(update={"init_seed": TINY.init_seed + 1}))
    tiny = SamplingParams(temperature=1.0, max_tokens=max_tokens_tiny)
    out["sharp"] = (sharpened(model, 12.0), other, tok, tiny)
    out["flat"] = (model, other, tok, tiny)
    return out


def rollouts(right, sampler, tok, sampling, n: int, seed: int):
    """``n`` rollouts sampled by ``sampler`` and the right model's prefill of them."""
    rng = random.Random(seed)
    tasks = [Problem(rng.randrange(100), rng.choice("+-*"), rng.randrange(100)).to_task() for _ in range(n)]
    requests = [Request(list(tok(t.prompt)["input_ids"]), seed=seed * 1_000_003 + i) for i, t in enumerate(tasks)]
    done = TorchEngine.for_tokenizer(sampler, tok, capture_hidden=False).generate(requests, sampling)
    validator = TorchEngine.for_tokenizer(right, tok, capture_hidden=True)
    scored = validator.prefill(requests, [c.tokens for c in done], sampling)
    return requests, done, scored


def row_draws(right, tok, sampling, requests, done, cfg: ToplocConfig) -> list[Draws]:
    """Each rollout's low-probability counts at ``cfg``'s min_token_prob: one prefill per setting, as
    the validator's prefill computes the per-token statistics on the device and returns no logits."""
    validator = TorchEngine.for_tokenizer(right, tok, capture_hidden=False)
    scored = validator.prefill(requests, [c.tokens for c in done], sampling,
                               low_prob=LowProb(cfg.min_token_prob, cfg.low_prob_floor))
    draws = []
    for s in scored:
        assert s.low is not None and s.chance is not None  # prefill returns both when low_prob is given
        draws.append(Draws(len(s.low), int(s.low.sum()), float(s.chance.sum())))
    return draws


def summary(surprises: list[float], limit: float) -> dict:
    t = torch.tensor(surprises, dtype=torch.float64).clamp(max=1e3)  # an impossible draw is inf: print it as 1000
    q = t.quantile(torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return {"n": len(surprises), "quantiles": dict(zip(map(str, QUANTILES), q)),
            "rejected": sum(s > limit for s in surprises) / len(surprises)}


def verdicts(right, tok, sampling, requests, done, scored, cfg: ToplocConfig, pool: int) -> Counter:
    """The row check's reasons for rollouts whose proofs the right model built (honest or hybrid alike)."""
    proofs = build_proofs_many([s.hidden_states for s in scored], cfg.chunk, cfg.k)
    rows = [Rollout(run="b", step=0, policy_step=0, worker="w", submission=0, seed=r.seed, prompt_id=str(i),
                    group_id=i, prompt_tokens=tuple(r.prompt_ids), output_tokens=tuple(c.tokens),
                    finish_reason=c.finish_reason, reward=0.0, task_reward=0.0, length_penalty=0.0, advantage=0.0,
                    proof=p)
            for i, (r, c, p) in enumerate(zip(requests, done, proofs))]
    validator = TorchEngine.for_tokenizer(right, tok, capture_hidden=True)
    check = toploc_check(lambda _p: validator, sampling, cfg)
    reasons = [x for s in range(0, len(rows), pool) for x in check(rows[s:s + pool])]
    return Counter(r or "accepted" for r in reasons)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=4096, help="rollouts per setting and side")
    ap.add_argument("--pools", type=int, nargs="+", default=[16, 256], help="rows per pooled submission")
    ap.add_argument("--max-tokens", type=int, default=40, help="max_tokens of the tiny-model settings")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.001, 0.01, 0.05], help="min_token_prob values")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    defaults = ToplocConfig()
    limit = defaults.max_low_prob_surprise
    print(f"defaults: min_token_prob {defaults.min_token_prob}, max_low_prob_surprise {limit}, "
          f"low_prob_floor {defaults.low_prob_floor}; quantiles {QUANTILES} of surprise; rejected share")
    results = {}
    for name, (right, sampler, tok, sampling) in settings(args.max_tokens).items():
        sides = {"honest": rollouts(right, right, tok, sampling, args.rollouts, seed=1),
                 "hybrid": rollouts(right, sampler, tok, sampling, args.rollouts, seed=2)}
        for side, (_, done, _) in sides.items():
            lens = [len(c.tokens) for c in done]
            print(f"{name} {side}: {len(done)} rollouts, {sum(lens) / len(lens):.1f} tokens on average")
        for tau in args.taus:
            cfg = defaults.model_copy(update={"min_token_prob": tau})
            for side, (requests, done, _) in sides.items():
                draws = row_draws(right, tok, sampling, requests, done, cfg)
                scopes = {"rollout": draws}
                for pool in args.pools:
                    scopes[f"pool {pool}"] = [sum(draws[s:s + pool], Draws(0, 0, 0.0))
                                              for s in range(0, len(draws), pool)]
                for scope, ds in scopes.items():
                    got = summary([d.surprise for d in ds], limit)
                    results[f"{name}/{tau}/{side}/{scope}"] = got
                    q = " ".join(f"{v:7.2f}" for v in got["quantiles"].values())
                    print(f"  tau {tau:<6} {side:6} {scope:8} n={got['n']:5}  surprise {q}  "
                          f"rejected {got['rejected']:.3f}")
        cfg = defaults.model_copy(update={"seeded_check": False})
        for side, (requests, done, scored) in sides.items():
            counts = verdicts(right, tok, sampling, requests, done, scored, cfg, max(args.pools))
            results[f"{name}/verdicts/{side}"] = dict(counts)
            print(f"  toploc_check at the defaults, pool {max(args.pools)}, {side}: {dict(counts)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "toploc_distribution.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
