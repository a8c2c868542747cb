"""The whole pipeline as one run config: DiLoCo pretraining, then the pass@k filter, then asynchronous RL.

``intellect demo --config configs/demo.toml`` runs it (``flows/demo.py``). Each phase is its own run
in the same storage, and each one starts from the previous one's output; the validator below keeps
the three configs wired that way, so a TOML that breaks the chain fails at load time with the field.
"""

from __future__ import annotations

import io

from pydantic import Field, model_validator

from intellect.config import StrictModel
from intellect.diloco.config import DilocoRunConfig
from intellect.rl.config import FilterRunConfig, InitConfig, RLRunConfig


class DemoConfig(StrictModel):
    """``intellect demo``: DiLoCo pretraining -> pass@k filter -> RL (TOPLOC, SHARDCAST), one report."""

    diloco: DilocoRunConfig = Field(default_factory=lambda: DilocoRunConfig(run_name="demo-diloco"))
    filter: FilterRunConfig | None = Field(
        default=None, description="The difficulty filter between the phases; None: RL trains on the generated pool."
    )
    rl: RLRunConfig = Field(default_factory=lambda: RLRunConfig(run_name="demo-rl",
                                                                init=InitConfig(from_run="demo-diloco")))

    @model_validator(mode="after")
    def _chained(self) -> "DemoConfig":
        runs = [self.diloco, self.rl] + ([self.filter] if self.filter else [])
        if len({r.storage.url for r in runs}) != 1:
            raise ValueError("diloco, filter and rl must share one storage.url (each phase reads the previous one)")
        if self.rl.init.path is not None or self.rl.init.from_run != self.diloco.run_name:
            raise ValueError(f"rl.init.from_run must be the DiLoCo run ({self.diloco.run_name!r})")
        if self.filter is not None:
            if self.filter.init.path is not None or self.filter.init.from_run != self.diloco.run_name:
                raise ValueError(f"filter.init.from_run must be the DiLoCo run ({self.diloco.run_name!r})")
            wanted = f"{self.filter.run_name}/tasks.jsonl"
            if self.rl.tasks.file != wanted:
                raise ValueError(f"rl.tasks.file must be the filter's output ({wanted!r})")
            if self.filter.tasks.file is None and self.rl.tasks.heldout_source != "arithmetic":
                raise ValueError("rl.tasks.heldout must be 'arithmetic': the filter scores generated problems, "
                                 "and the generator's held-out ones are what none of them is")
        if len({r.run_name for r in runs}) != len(runs):
            raise ValueError("the phases need distinct run_name values")
        return self


def plot_pretraining(rows: list[dict], title: str) -> bytes:
    """PNG of the mean inner loss of each committed DiLoCo outer step (``DilocoReport.steps`` rows)."""
    # matplotlib is heavy and only the report needs it; the Agg backend is chosen before pyplot loads
    import matplotlib  # noqa: PLC0415 - heavy, report only (see above)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["outer_step"] for r in rows], [r["mean_inner_loss"] for r in rows], "o-")
    ax.set(xlabel="outer step", ylabel="mean inner training loss", title=title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
