"""The run-level record of RL: held-out evaluations (a JSON file in run storage) and the curve PNG.

``metrics/evals.json`` holds ``[{"step": s, "accuracy": a}, ...]`` sorted by step; it is rewritten
whole (atomically) after each evaluation, so a resumed run extends it.
"""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from intellect.storage import RunStorage

EVALS = "metrics/evals.json"
CURVE = "metrics/curve.png"


def load_evals(storage: RunStorage) -> list[dict]:
    return json.loads(storage.read_text(EVALS)) if storage.exists(EVALS) else []


def add_eval(storage: RunStorage, step: int, accuracy: float) -> list[dict]:
    """Record the accuracy of checkpoint ``step`` (replacing an earlier value of the same step).

    >>> from intellect.storage import RunStorage
    >>> import tempfile; s = RunStorage("file://" + tempfile.mkdtemp())
    >>> add_eval(s, 5, 0.5) and add_eval(s, 0, 0.25)
    [{'step': 0, 'accuracy': 0.25}, {'step': 5, 'accuracy': 0.5}]
    """
    evals = {e["step"]: e for e in load_evals(storage)}
    evals[step] = {"step": step, "accuracy": accuracy}
    out = [evals[k] for k in sorted(evals)]
    storage.write_text(EVALS, json.dumps(out))
    return out


def plot_curve(steps: Sequence[dict], evals: Sequence[dict], title: str) -> bytes:
    """PNG of mean accepted reward per step (``steps``: ledger step rows) and held-out accuracy."""
    # matplotlib is heavy and only the report needs it; the Agg backend is chosen before pyplot loads
    import matplotlib  # noqa: PLC0415 - heavy, report only (see above)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-")
    ax[0].set(xlabel="checkpoint (RL step)", ylabel="held-out greedy accuracy (solved share)", title="held-out accuracy")
    pts = [(r["step"], r["mean_reward"]) for r in steps if r.get("mean_reward") is not None]
    ax[1].plot([p[0] for p in pts], [p[1] for p in pts], ".-", lw=0.8)
    ax[1].set(xlabel="RL step", ylabel="mean reward of accepted samples", title="reward")
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
