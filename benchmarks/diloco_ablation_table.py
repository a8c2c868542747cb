"""The table and the plot of an outer-optimizer ablation: one row per ``diloco_vs_ddp.py`` JSON.

Each arm is a DiLoCo run against the DDP curve of its seed, lr and warm start (``diloco_outer_ablation.sh``
writes one JSON per arm). The row gives the outer settings, the outer step's steady-state gain
``outer_lr / (1 - momentum)`` (how far a run of equal pseudo-gradients moves theta per outer step, in
pseudo-gradients; 1 is plain averaging), the first step's ``outer_lr * (1 + momentum)`` for Nesterov,
the final held-out losses and their ratio. The plot draws every arm's DiLoCo/DDP loss ratio per outer step
(dashed: from scratch; solid: from a warm start).

    .venv/bin/python benchmarks/diloco_ablation_table.py /tmp/abl/*.json --plot docs/diloco_ablation.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def arm(path: Path) -> dict | None:
    """One arm's settings and figures, or None for a JSON that holds no DiLoCo run (a DDP cache)."""
    d = json.loads(path.read_text())
    if "diloco" not in d or "final_ratio" not in d:
        return None
    c = d["config"]
    o, t = c["diloco"], c["train"]
    mom = o["outer_momentum"]
    nesterov = bool(o["nesterov"] and mom > 0)
    return {
        "arm": path.stem, "seed": c["data"]["seed"], "B": t["batch_size"],
        "warm": (d.get("warm_start") or {}).get("steps", 0),
        "T": o["outer_steps"], "outer": f"{o['outer_lr']:g}/{mom:g}{' N' if nesterov else ''}",
        "gain": o["outer_lr"] / (1 - mom), "first": o["outer_lr"] * (1 + mom) if nesterov else o["outer_lr"],
        "inner_lr": t["lr"], "ddp_lr": d["ddp_config"]["train"]["lr"],
        "diloco": d["diloco"]["loss"][-1], "ddp": d["ddp"]["loss"][-1], "ratio": d["final_ratio"],
        "curve": [a / b for a, b in zip(d["diloco"]["loss"], d["ddp"]["loss"])],
    }


def table(rows: list[dict]) -> str:
    head = ("| arm | seed | B per worker | warm start | T | outer lr/momentum | steady gain | first step | inner lr "
            "| DDP lr | DiLoCo loss | DDP loss | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['arm']} | {r['seed']} | {r['B']} | {r['warm']} | {r['T']} | {r['outer']} | {r['gain']:.2f} | {r['first']:.2f} "
            f"| {r['inner_lr']:g} | {r['ddp_lr']:g} | {r['diloco']:.4f} | {r['ddp']:.4f} | {r['ratio']:.4f} |"
            for r in rows]
    return "\n".join([head, *body])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - optional dependency, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(8, 4.6))
    for r in rows:
        warm = f" warm {r['warm']}" if r["warm"] else ""
        ax.plot(range(len(r["curve"])), r["curve"], "-" if r["warm"] else "--", lw=1.4,
                label=f"{r['outer']} B{r['B']} lr {r['inner_lr']:g}{warm} s{r['seed']}: {r['ratio']:.3f}")
    ax.axhline(1.03, color="k", ls=":", lw=1, label="3% above DDP")
    ax.set(xlabel="outer step (H=50 inner steps each)", ylabel="held-out loss, DiLoCo / DDP", ylim=(0.95, 1.35))
    ax.set_title("DiLoCo (4 workers, H=50, int8) vs DDP on the Python stdlib corpus: outer optimizer ablation",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    rows = [r for p in a.json if (r := arm(p)) is not None]
    rows.sort(key=lambda r: (r["seed"], r["warm"], r["B"], r["T"], r["ddp_lr"], r["ratio"]))
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)
        print("plot:", a.plot)


if __name__ == "__main__":
    main()
