"""What an RL or filter run needs before its first step: storage, ledger file, checkpoint 0, prompts.

Every function here is idempotent: a rerun of a crashed run finds what the first attempt made
and keeps it (checkpoint 0 is never overwritten once ``STABLE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from intellect.data.arithmetic import heldout_problems, train_stream
from intellect.data.loaders import load_math_tasks
from intellect.model.checkpoint import load_checkpoint
from intellect.pretrain import CHECKPOINTS, fetch_checkpoint, publish_checkpoint
from intellect.storage import RunStorage

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask
    from intellect.rl.config import FilterRunConfig, InitConfig, RLRunConfig, TaskPoolConfig


def run_storage(cfg: RLRunConfig | FilterRunConfig) -> RunStorage:
    return RunStorage.from_config(cfg.storage, cfg.run_name)


def local_run_dir(cfg: RLRunConfig | FilterRunConfig) -> Path:
    """The run folder (local storage) or ``./runs/<run>`` (S3): logs, worker configs, caches."""
    storage = run_storage(cfg)
    return storage.local_path("") or Path("runs") / cfg.run_name


def ledger_path(cfg: RLRunConfig | FilterRunConfig) -> Path:
    """``cfg.ledger``, else ``ledger.duckdb`` in the local run folder, else ``./runs/<run>/ledger.duckdb``."""
    if cfg.ledger:
        return Path(cfg.ledger).expanduser()
    return local_run_dir(cfg) / "ledger.duckdb"


def initial_weights(init: InitConfig, cfg: RLRunConfig | FilterRunConfig):
    """(model, tokenizer, where from) of ``init``; a clear ``FileNotFoundError`` when there is nothing."""
    if init.path is not None:
        if not (Path(init.path) / "config.json").is_file():
            raise FileNotFoundError(f"init.path: {init.path} is not an HF model folder (no config.json)")
        model, tok = load_checkpoint(Path(init.path))
        for p in model.parameters():  # safetensors maps lazily; own the memory
            p.data = p.data.clone()
        return model, tok, init.path
    source = RunStorage.from_config(cfg.storage, init.from_run)
    step = init.step if init.step is not None else source.latest_step(CHECKPOINTS)
    if step is None or not source.is_stable(step, CHECKPOINTS):
        what = "no complete checkpoint" if step is None else f"checkpoint {step} is not complete"
        raise FileNotFoundError(
            f"init.from_run: {what} in {source.uri(CHECKPOINTS)}; train one first "
            f"(e.g. `intellect smoke --config configs/{init.from_run}.toml` when that config exists) "
            "or set init.path"
        )
    model, tok = fetch_checkpoint(source, step)
    return model, tok, source.uri(source.step_path(step, CHECKPOINTS))


def seed_checkpoint(cfg: RLRunConfig, storage: RunStorage) -> str:
    """Publish the initial weights as checkpoint 0 of the run unless it exists; returns their origin."""
    if storage.is_stable(0, CHECKPOINTS):
        return storage.uri(storage.step_path(0, CHECKPOINTS))
    model, tok, origin = initial_weights(cfg.init, cfg)
    publish_checkpoint(model.eval(), tok, storage, 0, {"origin.json": {"origin": origin}})
    return origin


def task_pool(cfg: TaskPoolConfig, storage: RunStorage | None = None) -> list[MathTask]:
    """The training prompts: ``cfg.file`` (a path, or relative to the storage root) or generated
    arithmetic (``cfg.size`` distinct non-held-out problems of ``cfg.data``, in stream order).

    >>> from intellect.rl.config import TaskPoolConfig
    >>> [t.id for t in task_pool(TaskPoolConfig(size=3, seed=1))] == [t.id for t in task_pool(TaskPoolConfig(size=3, seed=1))]
    True
    """
    if cfg.file is not None:
        path = Path(cfg.file).expanduser()
        if not path.is_file() and storage is not None and storage.scheme == "file":
            path = Path(storage.url[len("file://"):]).parent / cfg.file
        if not path.is_file():
            raise FileNotFoundError(f"tasks.file: {cfg.file} not found (absolute, relative to the cwd, or to the storage root)")
        tasks = load_math_tasks(path).tasks
        if not tasks:
            raise ValueError(f"tasks.file: {cfg.file} holds no task")
        return tasks
    seen: dict[str, MathTask] = {}
    stream = train_stream(cfg.data, seed=cfg.seed)
    limit = 50 * cfg.size + 10_000  # a small problem space may hold fewer problems than asked
    for _ in range(limit):
        p = next(stream)
        seen.setdefault(p.id, p.to_task())
        if len(seen) == cfg.size:
            break
    return list(seen.values())


def heldout_tasks(cfg: TaskPoolConfig, n: int) -> list:
    """The held-out problems of the pool's arithmetic (never in a generated pool)."""
    return heldout_problems(cfg.data, n)

