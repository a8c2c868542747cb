"""Parity of our GRPO loss with TRL's GRPOTrainer._compute_loss (delta=4, epsilon=0.2), value and gradient.

Seeded random inputs are saved to a temp .pt file; ours runs here, TRL's own code
runs in benchmarks/peers/trl/venv (``bash benchmarks/peers/trl/setup.sh``) through
``benchmarks/peers/trl/trl_loss.py``. Two levels per mode pairing:

- ``logps``   float64, the loss core: same log-probs in, gradient w.r.t. them.
- ``logits``  float32, end to end from logits at temperature 0.7 through TRL's fused
              LM head (its own log-softmax, entropy and backward) vs our token_logprobs.

PASS when max |diff| of loss and gradient are both <= 1e-6. Also checks our
group advantages (eps=1e-4) against TRL's ``nanstd`` group normalization.

    .venv/bin/python benchmarks/grpo_loss_parity.py [--seed 0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from intellect.rl.advantages import group_advantages
from intellect.rl.trainer.loss import GRPOLossConfig, grpo_loss, token_logprobs

ROOT = Path(__file__).resolve().parent
PEER = ROOT / "peers" / "trl"
TOL = 1e-6
B, P, C, V, K = 8, 3, 12, 32, 4  # batch, prompt len, completion len, vocab, group size
MAX_COMPLETION = 16  # > C, so the constant budget differs from the padded length
TEMPERATURE = 0.7
CLIP = {"epsilon": 0.2, "delta": 4.0}

# (label, our config + call kwargs, TRL GRPOConfig overrides, extra TRL inputs)
PAIRS = [
    ("constant  / dr_grpo", {"normalization": "constant", "max_len": MAX_COMPLETION}, {"loss_type": "dr_grpo"}, {}),
    ("token     / bnpo", {"normalization": "token"}, {"loss_type": "bnpo"}, {}),
    ("token(N)  / dapo", {"normalization": "token", "token_count": "N"}, {"loss_type": "dapo"}, {"dapo": True}),
    ("sequence  / grpo", {"normalization": "sequence"}, {"loss_type": "grpo"}, {}),
    # TRL's default use_bias_correction_kl multiplies k3 by the ratio (DeepSeek-V3.2); ours is I2's plain k3.
    ("token+kl  / bnpo b=.04", {"normalization": "token", "kl_coef": 0.04},
     {"loss_type": "bnpo", "beta": 0.04, "use_bias_correction_kl": False}, {}),
    ("token+ent / bnpo e=.01", {"normalization": "token", "entropy_coef": 0.01},
     {"loss_type": "bnpo", "entropy_coef": 0.01}, {}),
]


def make_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, P + C, V, generator=g) * 2
    completion_ids = torch.randint(2, V, (B, C), generator=g)
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    lengths[0] = C
    mask = (torch.arange(C)[None] < lengths[:, None]).float()
    rewards = torch.rand(B // K, K, generator=g, dtype=torch.float64)
    advantages = group_advantages(rewards).reshape(-1).float()
    logp, _ = token_logprobs(logits[:, P - 1 : -1], completion_ids, TEMPERATURE)
    # ratio = exp(-noise): about 8% of tokens past delta=4, 40% below 1 - eps, 40% above 1 + eps
    old_logp = logp + torch.randn(B, C, generator=g)
    ref_logp = logp + torch.randn(B, C, generator=g) * 0.3
    logp_new = -torch.rand(B, C, generator=g, dtype=torch.float64) * 4
    return {
        "logits": logits, "prompt_ids": torch.randint(2, V, (B, P), generator=g), "completion_ids": completion_ids,
        "mask": mask, "advantages": advantages, "old_logp": old_logp, "ref_logp": ref_logp,
        "logp_new": logp_new, "logp_old": logp_new + torch.randn(B, C, generator=g, dtype=torch.float64),
        "ref_logp_core": logp_new + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3,
        "entropy": torch.rand(B, C, generator=g, dtype=torch.float64) * 3, "rewards": rewards,
        "num_items": float(mask.sum()) + 37.0,  # a global count spanning more than this micro-batch
    }


def ours(data: dict, level: str, ours_kw: dict) -> dict:
    kw = dict(ours_kw)
    call = {"max_len": kw.pop("max_len", None)}
    if kw.pop("token_count", None):
        call["token_count"] = data["num_items"]
    cfg = GRPOLossConfig(epsilon_low=CLIP["epsilon"], epsilon_high=CLIP["epsilon"], delta=CLIP["delta"], **kw)
    if level == "logits":
        leaf = data["logits"].clone().requires_grad_()
        logp, entropy = token_logprobs(
            leaf[:, P - 1 : -1], data["completion_ids"], TEMPERATURE, entropy_grad=cfg.entropy_coef > 0
        )
        old, ref, adv = data["old_logp"], data["ref_logp"], data["advantages"]
    else:
        leaf = data["logp_new"].clone().requires_grad_()
        logp, entropy = leaf, data["entropy"].clone().requires_grad_()
        old, ref, adv = data["logp_old"], data["ref_logp_core"], data["advantages"].double()
    loss, stats = grpo_loss(logp, old, adv, data["mask"], cfg, ref_logp=ref, entropy=entropy, **call)
    (grad,) = torch.autograd.grad(loss, leaf)
    return {"loss": loss.detach(), "grad": grad, "stats": stats}


def run_trl(data: dict) -> dict:
    python = PEER / "venv" / "bin" / "python"
    if not python.exists():
        sys.exit(f"TRL venv missing: run `bash {PEER / 'setup.sh'}` first")
    cases = []
    for level in ("logps", "logits"):
        for _, _, trl_kw, extra in PAIRS:
            case = {"level": level, "trl": {**CLIP, "temperature": TEMPERATURE,
                                            "max_completion_length": MAX_COMPLETION, **trl_kw}}
            if extra.get("dapo"):
                case["num_items_in_batch"] = data["num_items"]
            cases.append(case)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save({**data, "cases": cases}, src)
        subprocess.run([str(python), str(PEER / "trl_loss.py"), str(src), str(dst)], check=True)
        return torch.load(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = make_inputs(args.seed)
    out = run_trl(data)
    results = iter(out["results"])
    print(f"TRL {out['trl_version']} vs intellect.rl.trainer.loss  (B={B} C={C} V={V} T={TEMPERATURE} "
          f"delta={CLIP['delta']} eps={CLIP['epsilon']}, seed {args.seed})")
    print(f"{'level':7} {'ours / TRL loss_type':24} {'loss':>12} {'|d loss|':>9} {'|d grad|':>9} "
          f"{'clip lo/hi/delta (ours)':>24} {'TRL lo/hi':>12}  result")
    ok = True
    for level in ("logps", "logits"):
        for label, ours_kw, _, _ in PAIRS:
            theirs, mine = next(results), ours(data, level, ours_kw)
            d_loss = (mine["loss"].double() - theirs["loss"].double()).abs().item()
            d_grad = (mine["grad"].double() - theirs["grad"].double()).abs().max().item()
            passed = d_loss <= TOL and d_grad <= TOL
            ok &= passed
            s, m = mine["stats"], theirs["metrics"]
            clip = "/".join(f"{s[k].item():.3f}" for k in ("clip_low", "clip_high", "clip_delta"))
            trl_clip = "/".join(f"{m.get(f'clip_ratio/{k}_mean', float('nan')):.3f}" for k in ("low", "high"))
            print(f"{level:7} {label:24} {mine['loss'].item():12.8f} {d_loss:9.2e} {d_grad:9.2e} "
                  f"{clip:>24} {trl_clip:>12}  {'PASS' if passed else 'FAIL'}")
    d_adv = (group_advantages(data["rewards"], eps=1e-4) - out["advantages"]).abs().max().item()
    ok &= d_adv <= TOL
    print(f"advantages (ddof=1, eps=1e-4) vs TRL nanstd group scaling: |d| {d_adv:.2e}  "
          f"{'PASS' if d_adv <= TOL else 'FAIL'}")
    print("ALL PASS" if ok else "SOME FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
