"""Single-machine pretraining on the synthetic task, with checkpoints in run storage.

The smoke run's steps, each a plain function over run storage so that a
Prefect task, a script or a test can call it: build and publish the initial
checkpoint, train from a checkpoint, evaluate a checkpoint, and measure
pass@k rates on held-out prompts. Checkpoints are HF folders published at
``checkpoints/step_<n>/`` with ``STABLE`` written last.

**Checkpoint identity.** :func:`checkpoint_digest` is the sha256 of a whole checkpoint folder: every
file in it except the ``STABLE`` marker (which holds a time), the trainer's sidecars
(``rl_step.json``, ``optimizer.pt``) included, since the trainer adopts the saved report and loads
the optimizer state from the same folder, and ``tokenizer.json`` or ``config.json`` change a model as
much as its weights do. The ledger records it per step; a reader that passes it to
:func:`fetch_checkpoint` (or :func:`verified_checkpoint`) gets exactly those bytes or a
:class:`CheckpointMismatch`, because the digest is taken over the downloaded copy that is then
loaded, not over the storage folder a writer could change in between.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator

import torch

from intellect.config import SmokeConfig
from intellect.data.arithmetic import documents, heldout_problems
from intellect.model.checkpoint import build_model, load_checkpoint_copy, save_checkpoint
from intellect.storage import STABLE, TMP_PREFIX, RunStorage
from intellect.train import evaluate, pass_counts, train

CHECKPOINTS = "checkpoints"


def publish_checkpoint(model, tokenizer, storage: RunStorage, step: int, extra: dict | None = None) -> str:
    """Write ``checkpoints/step_<step>`` (HF folder plus ``extra`` files) and mark it stable.

    ``extra`` maps file names to bytes (written as they are) or to JSON-able objects.
    """
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        folder = save_checkpoint(model, tokenizer, Path(tmp) / "model")
        files: dict[str, bytes | Path] = _folder_files(folder)
        files.update({name: obj if isinstance(obj, bytes) else json.dumps(obj, indent=1).encode()
                      for name, obj in (extra or {}).items()})
        storage.write_step(step, CHECKPOINTS, files)
    return storage.uri(storage.step_path(step, CHECKPOINTS))


def _folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


_DIGEST_DOMAIN = b"intellect/checkpoint/v1\0"
_CHUNK = 1 << 20


class CheckpointMismatch(ValueError):
    """A checkpoint folder whose digest is not the one recorded for its step (it was rewritten)."""

    def __init__(self, step: int, expected: str, got: str, where: str) -> None:
        super().__init__(f"checkpoint step {step} at {where} has digest {got}, not the recorded {expected}")
        self.step, self.expected, self.got = step, expected, got


def folder_digest(files: Iterable[tuple[str, str]]) -> str:
    """The digest of a folder from its ``(relative name, hex sha256 of the bytes)`` pairs, in any order.

    Each name is length-prefixed, so no two different folders encode alike.

    >>> h = hashlib.sha256(b"{}").hexdigest()
    >>> folder_digest([("config.json", h), ("a", h)]) == folder_digest([("a", h), ("config.json", h)])
    True
    >>> folder_digest([("a", h)]) == folder_digest([("b", h)])
    False
    """
    d = hashlib.sha256(_DIGEST_DOMAIN)
    for name, sha in sorted(files):
        raw = name.encode()
        d.update(len(raw).to_bytes(8, "big") + raw + bytes.fromhex(sha))
    return d.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a local file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def local_checkpoint_digest(folder: str | Path, *, exclude: Collection[str] = ()) -> str:
    """:func:`folder_digest` of every file below ``folder`` except a top-level ``STABLE``, the
    ``.tmp-*`` names that run storage hides from every listing, and the names in ``exclude``."""
    folder = Path(folder)
    skip = {STABLE, *exclude}
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    names = [n for n in names if n not in skip and not any(part.startswith(TMP_PREFIX) for part in n.split("/"))]
    if not names:
        raise FileNotFoundError(f"{folder} holds no checkpoint files")
    return folder_digest((n, file_sha256(folder / n)) for n in names)


def _complete_step(storage: RunStorage, step: int | None) -> int:
    if step is None:
        step = storage.latest_step(CHECKPOINTS)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {storage.uri(CHECKPOINTS)}")
    elif not storage.is_stable(step, CHECKPOINTS):
        raise FileNotFoundError(f"checkpoint step {step} is not complete in {storage.uri(CHECKPOINTS)}")
    return step


def checkpoint_digest(storage: RunStorage, step: int, *, exclude: Collection[str] = ()) -> str:
    """The sha256 that identifies complete checkpoint ``step`` (see the module docstring). Local storage
    is hashed in place; S3 is downloaded to a temporary folder first (memory stays bounded).

    ``exclude`` leaves files out, e.g. ``intellect.rl.weights.TRAINER_ONLY`` for the digest of what
    inference loads (the sidecars hold timings, so two runs with equal weights differ in them); the
    ledger records the digest of everything."""
    _complete_step(storage, step)
    rel = storage.step_path(step, CHECKPOINTS)
    if (local := storage.local_path(rel)) is not None:
        return local_checkpoint_digest(local, exclude=exclude)
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        storage.get_dir(rel, Path(tmp) / "ckpt")
        return local_checkpoint_digest(Path(tmp) / "ckpt", exclude=exclude)


@contextmanager
def verified_checkpoint(storage: RunStorage, step: int | None = None, *, sha256: str | None = None) -> Iterator[Path]:
    """A local copy of complete checkpoint ``step`` (the newest when None), removed on exit. With
    ``sha256`` the copy's :func:`local_checkpoint_digest` must equal it (else :class:`CheckpointMismatch`),
    so everything read from the folder (weights, tokenizer, ``rl_step.json``...) is what was recorded."""
    step = _complete_step(storage, step)
    rel = storage.step_path(step, CHECKPOINTS)
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        folder = Path(tmp) / "model"
        storage.get_dir(rel, folder)
        if sha256 is not None and (got := local_checkpoint_digest(folder)) != sha256:
            raise CheckpointMismatch(step, sha256, got, storage.uri(rel))
        yield folder


def fetch_checkpoint(storage: RunStorage, step: int | None = None, *, sha256: str | None = None):
    """Model and tokenizer of a complete checkpoint (the newest when ``step`` is None). With ``sha256``
    (the ledger's digest of that step) the downloaded bytes are verified before anything is loaded."""
    with verified_checkpoint(storage, step, sha256=sha256) as folder:
        return load_checkpoint_copy(folder)


def init_checkpoint(cfg: SmokeConfig, storage: RunStorage) -> int:
    """Build the configured model and publish it as step 0 (kept if already there)."""
    if not storage.is_stable(0, CHECKPOINTS):
        model, tok = build_model(cfg.model)
        publish_checkpoint(model, tok, storage, 0)
    return 0


TRAIN_REPORT = "train_report.json"


@dataclass(frozen=True)
class PretrainOutcome:
    step: int
    seconds: float
    tokens: int
    first_loss: float
    final_loss: float
    resumed: bool = False  # True when the target checkpoint already existed and was reused

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pretrain(
    cfg: SmokeConfig,
    storage: RunStorage,
    from_step: int,
    on_step: Callable[[int, dict], None] | None = None,
) -> PretrainOutcome:
    """Train ``cfg.train.steps`` steps from checkpoint ``from_step``; publish the result.

    Idempotent: when the target checkpoint is already complete (a retried task,
    a rerun of the same run) it is reused and its saved report returned.
    """
    step = from_step + cfg.train.steps
    if storage.is_stable(step, CHECKPOINTS):
        saved = json.loads(storage.read_text(f"{storage.step_path(step, CHECKPOINTS)}/{TRAIN_REPORT}"))
        return PretrainOutcome(**{**saved, "resumed": True})
    model, tok = fetch_checkpoint(storage, from_step)
    docs = documents(cfg.data)
    batches = iter(lambda: [next(docs) for _ in range(cfg.train.batch_size)], None)
    result = train(model, tok, cfg.train, batches, on_step)
    outcome = PretrainOutcome(
        step=step,
        seconds=result.seconds,
        tokens=result.tokens,
        first_loss=result.history[0]["loss"],
        final_loss=result.history[-1]["loss"],
    )
    publish_checkpoint(model.eval(), tok, storage, step, {TRAIN_REPORT: asdict(outcome)})
    return outcome


def heldout_eval(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Held-out loss and greedy exact-match accuracy of checkpoint ``step``."""
    model, tok = fetch_checkpoint(storage, step)
    t0 = time.perf_counter()
    res = evaluate(model, tok, heldout_problems(cfg.data, cfg.train.eval_size))
    return {"step": step, "loss": res.loss, "accuracy": res.accuracy, "n": res.n,
            "seconds": time.perf_counter() - t0}


def pass_rate_window(counts: list[int], k: int, low: int = 1, high: int = 4) -> float:
    """Share of prompts solved by at least ``low`` and at most ``high`` of ``k`` samples.

    The RL stage learns only from such prompts (the pass@k filter of INTELLECT-2).

    >>> pass_rate_window([0, 1, 4, 5, 8, 2], k=8)
    0.5
    """
    if not counts:
        return 0.0
    return sum(low <= c <= high for c in counts) / len(counts)


def pass_rate_report(cfg: SmokeConfig, storage: RunStorage, step: int) -> dict:
    """Sample ``k`` answers per held-out prompt and report how the pass counts spread."""
    k = cfg.pass_at_k_samples
    model, tok = fetch_checkpoint(storage, step)
    tasks = heldout_problems(cfg.data, cfg.pass_at_k_prompts)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        counts = pass_counts(model, tok, tasks, k=k, temperature=cfg.temperature, seed=cfg.data.seed)
    histogram = [counts.count(c) for c in range(k + 1)]
    return {
        "step": step,
        "k": k,
        "prompts": len(tasks),
        "temperature": cfg.temperature,
        "histogram": histogram,
        "share_in_window": pass_rate_window(counts, k, 1, k // 2),
        "mean_pass_rate": sum(counts) / (k * len(tasks)),
        "seconds": time.perf_counter() - t0,
    }
