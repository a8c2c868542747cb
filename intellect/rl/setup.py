"""What an RL or filter run needs before its first step: storage, ledger file, checkpoint 0, prompts,
and the trainer's own secrets.

Every function here is idempotent: a rerun of a crashed run finds what the first attempt made
and keeps it (checkpoint 0 is never overwritten once its digest is in the ledger).

The trainer's secrets live in ``trainer/`` of the local run folder (:func:`trainer_dir`), never
handed to a worker: ``secret`` (32 random bytes, mode 0600: the key of the verdict files' MACs,
:mod:`intellect.rl.verdicts`) and ``trainer.key`` (the Ed25519 key that signs every SHARDCAST
version; workers pin its public half).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from intellect.data.arithmetic import heldout_problems, train_stream
from intellect.data.loaders import load_math_tasks
from intellect.checkpoints import CHECKPOINTS, ORIGIN, fetch, publish, record
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.mac import SECRET_BYTES, new_secret

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask
    from intellect.ledger import Ledger
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


def trainer_dir(cfg: RLRunConfig) -> Path:
    """``trainer/`` of the local run folder: what only the trainer may read (see the module docstring)."""
    return local_run_dir(cfg) / "trainer"


def trainer_secret(cfg: RLRunConfig) -> bytes:
    """The run's secret (created on first use, mode 0600); ``PermissionError`` if others can read it."""
    path = trainer_dir(cfg) / "secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, new_secret().hex().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise PermissionError(f"{path} is accessible by others: chmod 600 it")
    text = path.read_text().strip()
    if len(text) != 2 * SECRET_BYTES:
        raise ValueError(f"{path} is not a run secret ({2 * SECRET_BYTES} hex digits)")
    return bytes.fromhex(text)


def trainer_key(cfg: RLRunConfig) -> SigningKey:
    """The trainer's signing key (``trainer/trainer.key``, created on first use, mode 0600)."""
    path = trainer_dir(cfg) / "trainer.key"
    if not path.exists():
        try:
            SigningKey.generate().save(path)
        except FileExistsError:  # another process of the run made it first
            pass
    return SigningKey.load(path)


def initial_weights(init: InitConfig, cfg: RLRunConfig | FilterRunConfig):
    """(model, tokenizer, where from) of ``init``; a clear ``FileNotFoundError`` when there is nothing."""
    if init.path is not None:
        if not (Path(init.path) / "config.json").is_file():
            raise FileNotFoundError(f"init.path: {init.path} is not an HF model folder (no config.json)")
        model, tok = load_checkpoint_copy(Path(init.path))
        return model, tok, init.path
    assert init.from_run is not None  # InitConfig requires path or from_run
    source = RunStorage.from_config(cfg.storage, init.from_run)
    step = init.step if init.step is not None else source.latest_step(CHECKPOINTS)
    if step is None or not source.is_stable(step, CHECKPOINTS):
        what = "no complete checkpoint" if step is None else f"checkpoint {step} is not complete"
        raise FileNotFoundError(
            f"init.from_run: {what} in {source.uri(CHECKPOINTS)}; train one first "
            f"(e.g. `intellect smoke --config configs/{init.from_run}.toml` when that config exists) "
            "or set init.path"
        )
    model, tok = fetch(source, step)
    return model, tok, source.uri(source.step_path(step, CHECKPOINTS))


def seed_checkpoint(cfg: RLRunConfig, storage: RunStorage, ledger: Ledger) -> str:
    """Publish the initial weights as checkpoint 0 of the run and record its digest in ``ledger``;
    returns their origin. A checkpoint 0 whose digest the ledger holds is kept; one it does not hold
    (a crash before the record, or a folder the trainer did not write) is replaced."""
    rel = storage.step_path(0, CHECKPOINTS)
    if ledger.checkpoint(0) is not None:
        return storage.uri(rel)
    if storage.exists(rel):
        storage.delete(rel, recursive=True)
    model, tok, origin = initial_weights(cfg.init, cfg)
    publish(model.eval(), tok, storage, 0, {ORIGIN: {"origin": origin}})
    record(storage, ledger, 0)
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

