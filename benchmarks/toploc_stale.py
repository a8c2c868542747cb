"""TOPLOC against a checkpoint a few RL updates stale, on a real RL run's checkpoints.

A worker generates a submission with checkpoint ``k - lag`` and claims ``k``; the validator
prefills checkpoint ``k``. The computation check tolerates the few-update difference (a handful of
rows fail it at most); the seeded re-check sees a few tokens per few hundred differ from its own
seeded choice. This measures, per lag (0 is the honest worker), over submissions of the run's size
(``configs/rl-tiny.toml``: 32 prompts x 8, ``max_tokens`` 8, temperature 1):

* rows failing the computation check, and rows failing the seeded re-check per rollout;
* ``flips``: tokens differing from the seeded choice, and tokens, summed over the rows that passed
  the computation check (what the pooled seeded test counts);
* the pooled test's surprise (``-log10`` of the Chernoff bound,
  :func:`~intellect.toploc.check.low_prob_surprise`) at each ``--rates`` honest flip rate, and
  the share of submissions rejected at ``max_low_prob_surprise``;
* the verdicts of :func:`~intellect.toploc.check.toploc_check` itself at each rate.

Needs a run with every step's checkpoint (``runs/rl-toploc`` by default: ``intellect rl --config
configs/rl-tiny.toml run_name=rl-toploc 'toploc={}'``). Writes ``benchmarks/results/toploc_stale.json``.

    .venv/bin/python benchmarks/toploc_stale.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.data.arithmetic import Problem  # noqa: E402
from intellect.inference.protocol import Request  # noqa: E402
from intellect.inference.torch_engine import TorchEngine  # noqa: E402
from intellect.model.checkpoint import load_checkpoint  # noqa: E402
from intellect.rl.worker.submission import SubmissionConfig, generate_submission  # noqa: E402
from intellect.toploc.check import low_prob_surprise, toploc_check  # noqa: E402
from intellect.toploc.proofs import ToplocConfig, check_many  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RL_TINY = SubmissionConfig(prompts_per_submission=32, group_size=8, max_tokens=8, temperature=1.0)


def flips(engine, rows, sampling, cfg: ToplocConfig) -> tuple[int, int, int]:
    """``(rows failing the computation check, differing tokens, tokens)``, the counts over the rows
    that pass it: what the pooled seeded test sums."""
    requests = [Request(list(r.prompt_tokens), r.seed) for r in rows]
    scored = engine.prefill(requests, [list(r.output_tokens) for r in rows], sampling)
    checks = check_many([s.hidden_states for s in scored], [r.proof for r in rows], cfg.chunk, cfg.k, cfg)
    ok = [all(c.ok for c in chunks) for chunks in checks]
    differ = sum(int((s.resampled != torch.tensor(r.output_tokens)).sum()) for s, r, o in zip(scored, rows, ok) if o)
    return ok.count(False), differ, sum(len(r.output_tokens) for r, o in zip(rows, ok) if o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/rl-toploc", help="run folder with checkpoints/step_<n>")
    ap.add_argument("--claimed", type=int, nargs="+", default=[20, 60, 100, 140, 180], help="claimed checkpoints")
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 3], help="updates the generator is behind")
    ap.add_argument("--submissions", type=int, default=2, help="submissions per claimed checkpoint and lag")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.005, 1e-4, 1e-5], help="honest_flip_rate values")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ToplocConfig()
    sampling = RL_TINY.sampling()
    rng = random.Random(0)
    tasks = [Problem(rng.randrange(100), rng.choice("+-*"), rng.randrange(100)).to_task() for _ in range(4096)]
    loaded: dict[int, tuple[TorchEngine, object]] = {}

    def engine(step: int) -> TorchEngine:
        if step not in loaded:
            model, tok = load_checkpoint(Path(args.run) / "checkpoints" / f"step_{step}")
            loaded[step] = TorchEngine.for_tokenizer(model, tok, capture_hidden=True), tok
        return loaded[step][0]

    limit = cfg.max_low_prob_surprise
    print(f"{args.run}: submissions of {RL_TINY.prompts_per_submission}x{RL_TINY.group_size} rows, "
          f"max_tokens {RL_TINY.max_tokens}; limit {limit}; rates {args.rates}")
    results: dict[str, dict] = {}
    for lag in args.lags:
        per: list[dict] = []
        verdicts = {rate: Counter() for rate in args.rates}
        for k in [k for k in args.claimed if k >= lag]:
            validator, tok = engine(k), loaded[k][1]
            checks = {rate: toploc_check(lambda _p: validator, sampling,
                                         cfg.model_copy(update={"honest_flip_rate": rate}), validator.eos)
                      for rate in args.rates}
            for s in range(args.submissions):
                rows = generate_submission(engine(k - lag), tok, tasks, f"w{s}", k, 0, k, RL_TINY, run="b", proofs=cfg)
                computation, differ, tokens = flips(validator, rows, sampling, cfg)
                point = {"claimed": k, "lag": lag, "rows": len(rows), "computation": computation, "differ": differ,
                         "tokens": tokens}
                for rate, check in checks.items():
                    point[f"surprise@{rate:g}"] = float(low_prob_surprise(float(differ), rate * tokens))
                    verdicts[rate].update(r or "accepted" for r in check(rows))
                per.append(point)
        summary: dict = {"points": per}
        for rate in args.rates:
            summary[f"rejected@{rate:g}"] = sum(p[f"surprise@{rate:g}"] > limit for p in per) / len(per)
            summary[f"verdicts@{rate:g}"] = dict(verdicts[rate])
        results[f"lag {lag}"] = summary
        d, n, c = ([p[key] for p in per] for key in ("differ", "tokens", "computation"))
        print(f"lag {lag}: {len(per)} submissions; rows failing the computation check {min(c)}-{max(c)} of "
              f"{per[0]['rows']}; differing tokens {min(d)}-{max(d)} (median {sorted(d)[len(d) // 2]}) of "
              f"{min(n)}-{max(n)} (pooled {sum(d)} of {sum(n)})")
        for rate in args.rates:
            got = sorted(p[f"surprise@{rate:g}"] for p in per)
            print(f"  rate {rate:g}: surprise {got[0]:.1f}-{got[-1]:.1f} (median {got[len(got) // 2]:.1f}), "
                  f"submissions rejected {summary[f'rejected@{rate:g}']:.2f}; rows {dict(verdicts[rate])}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "toploc_stale.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
