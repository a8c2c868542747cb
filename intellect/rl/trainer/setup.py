"""What an RL or filter run needs before its first step: storage, ledger file, checkpoint 0, prompts,
and the trainer's own secrets.

Every function here is idempotent: a rerun of a crashed run finds what the first attempt made
and keeps it (checkpoint 0 is never overwritten once its digest is in the ledger).

The trainer's secrets live in ``trainer/`` of the local run folder (:func:`trainer_dir`), never
handed to a worker: ``secret`` (32 random bytes, mode 0600: the key of the verdict files' MACs,
:mod:`intellect.rl.service.verdicts`) and ``trainer.key`` (the Ed25519 key that signs every SHARDCAST
version; workers pin its public half).
"""

from __future__ import annotations

import logging
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from intellect.data.arithmetic import heldout_problems, train_stream
from intellect.data.loaders import RowError, TaskFileError, load_tasks, split_heldout
from intellect.checkpoints import CHECKPOINTS, ORIGIN, publish, record, verified_copy
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.prompts import PromptConfig, PromptError, render_prompt
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey
from intellect.trust.mac import SECRET_BYTES, new_secret

log = logging.getLogger("intellect.rl.trainer.setup")

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask, Task, TaskKind
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


#: The submission service's folder in :func:`trainer_dir` (its registry: admitted keys and salts).
SERVICE_DIR = "service"


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


@contextmanager
def initial_folder(init: InitConfig, cfg: RLRunConfig | FilterRunConfig) -> Iterator[tuple[Path, str]]:
    """(HF folder, where from) of ``init``, for the duration of the block (another run's checkpoint is a
    local copy, removed after); a clear ``FileNotFoundError`` when there is nothing."""
    if init.path is not None:
        if not (Path(init.path) / "config.json").is_file():
            raise FileNotFoundError(f"init.path: {init.path} is not an HF model folder (no config.json)")
        yield Path(init.path), init.path
        return
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
    with verified_copy(source, step) as folder:
        yield folder, source.uri(source.step_path(step, CHECKPOINTS))


def initial_weights(init: InitConfig, cfg: RLRunConfig | FilterRunConfig):
    """(model, tokenizer, where from) of ``init`` (:func:`initial_folder`)."""
    with initial_folder(init, cfg) as (folder, origin):
        model, tok = load_checkpoint_copy(folder)
    return model, tok, origin


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
    publish(model.eval(), tok, storage, 0, {ORIGIN: {"origin": origin}}, dtype=cfg.trainer.published_dtype)
    record(storage, ledger, 0)
    return origin


def _task_file(name: str, storage: RunStorage | None, what: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_file() and storage is not None and storage.scheme == "file":
        path = Path(storage.url[len("file://"):]).parent / name
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {name} not found (absolute, relative to the cwd, or to the storage root)")
    return path


def load_task_file(name: str, storage: RunStorage | None, kind: TaskKind = "math", *, lenient: bool = False,
                   tokenizer=None, prompt: PromptConfig | None = None, what: str = "tasks.file") -> list[Task]:
    """The ``kind`` tasks of task file ``name`` (a path, or relative to the storage root). With ``tokenizer``,
    every prompt must render under ``prompt`` too. A bad row is a one-line :class:`TaskFileError`
    naming it, or, ``lenient``, skipped and logged."""
    path = _task_file(name, storage, what)
    loaded = load_tasks(path, kind, lenient=lenient)
    skipped = list(loaded.errors)
    tasks = []
    for task, row in zip(loaded.tasks, loaded.rows):
        if tokenizer is not None:
            try:
                render_prompt(tokenizer, task.prompt, prompt or PromptConfig())
            except PromptError as e:
                if not lenient:
                    raise TaskFileError(f"{path} row {row}: prompt: {e}") from None
                skipped.append(RowError(row, f"prompt: {e}"))
                continue
        tasks.append(task)
    for row, reason in sorted(skipped):
        log.warning("%s row %d skipped: %s", path, row, reason)
    if not tasks:
        raise TaskFileError(f"{path}: no usable task ({len(skipped)} rows skipped)")
    return tasks


def task_pool(cfg: TaskPoolConfig, storage: RunStorage | None = None, *, tokenizer=None,
              prompt: PromptConfig | None = None) -> list[Task]:
    """The training prompts: ``cfg.file`` (less its held-out split, or the prompts of
    ``cfg.heldout_file``) or generated arithmetic (``cfg.size`` distinct non-held-out problems of
    ``cfg.data``, in stream order). With ``tokenizer``, a file's prompts must render under ``prompt``
    (:func:`load_task_file`); every process that builds the pool of a lenient run must pass it, so
    that all skip the same rows.

    >>> from intellect.rl.config import TaskPoolConfig
    >>> [t.id for t in task_pool(TaskPoolConfig(size=3, seed=1))] == [t.id for t in task_pool(TaskPoolConfig(size=3, seed=1))]
    True
    """
    if cfg.file is not None:
        tasks = load_task_file(cfg.file, storage, cfg.kind, lenient=cfg.lenient, tokenizer=tokenizer, prompt=prompt)
        if cfg.heldout_source == "split":
            tasks = split_heldout(tasks, cfg.heldout_percent)[0]
        elif cfg.heldout_source == "file":
            held = {t.prompt for t in heldout_task_file(cfg, storage)}
            tasks = [t for t in tasks if t.prompt not in held]
        if not tasks:
            raise ValueError(f"tasks.file: {cfg.file} holds no training task outside the held-out ones")
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


def heldout_task_file(cfg: TaskPoolConfig, storage: RunStorage | None = None, *, tokenizer=None,
                      prompt: PromptConfig | None = None) -> list[Task]:
    """The held-out tasks of a file-based pool (``heldout`` = split or file), in file order."""
    if cfg.heldout_source == "file":
        assert cfg.heldout_file is not None  # TaskPoolConfig requires it
        return load_task_file(cfg.heldout_file, storage, cfg.kind, lenient=cfg.lenient, tokenizer=tokenizer,
                              prompt=prompt, what="tasks.heldout_file")
    if cfg.heldout_source == "split":
        assert cfg.file is not None  # TaskPoolConfig requires it
        tasks = load_task_file(cfg.file, storage, cfg.kind, lenient=cfg.lenient, tokenizer=tokenizer, prompt=prompt)
        held = split_heldout(tasks, cfg.heldout_percent)[1]
        if not held:
            raise ValueError(f"tasks.file: no task of {cfg.file} falls in its {cfg.heldout_percent}% held-out split")
        return held
    raise ValueError(f"tasks.heldout = {cfg.heldout_source!r} is not a file's split")


def heldout_tasks(cfg: TaskPoolConfig, n: int) -> list:
    """The held-out problems of the pool's arithmetic (never in a generated pool)."""
    return heldout_problems(cfg.data, n)

