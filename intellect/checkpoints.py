"""What a checkpoint is: its folder layout, how it is published and fetched, and its identity.

A checkpoint is run storage's ``checkpoints/step_<n>/``, complete once ``STABLE`` is written (last):

* the HF folder of :func:`~intellect.model.checkpoint.save_checkpoint` (model files and tokenizer
  files), which is what inference loads;
* named :class:`Sidecar` files, each declared once below with whether inference needs it.
  :func:`publish` writes no other file, so :func:`inference_files` (what SHARDCAST ships to
  workers) can never carry trainer state under a name nobody declared.

**Identity.** :func:`digest` is the sha256 of every file of the folder except ``STABLE`` (which holds
a time), sidecars included: the trainer adopts the saved report and the optimizer state from the same
folder, and ``tokenizer.json`` or ``config.json`` change a model as much as its weights do. The
ledger records it per step (:func:`record`); a reader that passes it to :func:`fetch` (or
:func:`verified_copy`) gets exactly those bytes or a :class:`CheckpointMismatch`, because the digest
is taken over the downloaded copy that is then loaded, not over the storage folder a writer could
change in between.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol

from pydantic import BaseModel, ConfigDict, Field

from intellect.model.checkpoint import load_checkpoint_copy, save_checkpoint
from intellect.progress import Progress, quantity
from intellect.storage import STABLE, TMP_PREFIX, RunStorage

if TYPE_CHECKING:
    import torch

CHECKPOINTS = "checkpoints"  # the run-storage kind: checkpoints/step_<n>/


class Sidecar(StrEnum):
    """A file saved beside the HF folder; its value is the file name, ``for_inference`` says whether
    inference workers receive it.

    >>> Sidecar("optimizer.pt") is Sidecar.OPTIMIZER, f"step_3/{Sidecar.OPTIMIZER}"
    (True, 'step_3/optimizer.pt')
    >>> Sidecar.OPTIMIZER.for_inference
    False
    """

    for_inference: bool

    def __new__(cls, name: str, for_inference: bool) -> Sidecar:
        member = str.__new__(cls, name)
        member._value_ = name
        member.for_inference = for_inference
        return member

    # the RL trainer's report of the step that produced this checkpoint (:class:`SavedStepReport`),
    # so a rerun that skips training can still commit
    STEP_REPORT = "rl_step.json", False
    # a trainer's AdamW state and step count (about twice the weights): the RL trainer's, and a mid-phase
    # pretraining checkpoint's, so a resumed run keeps its moments
    OPTIMIZER = "optimizer.pt", False
    # a mid-phase pretraining checkpoint's data position (a training stream's ``state_dict``)
    DATA_STATE = "data_state.json", False
    # what a DiLoCo worker's saved data position was reached under: ``{"members": [...], "rows_per_step": n}``
    DATA_MEMBERS = "data_members.json", False
    # what a mid-phase pretraining checkpoint belongs to and how far its phase got (:class:`PhaseProgress`)
    PHASE = "pretrain_phase.json", False
    # where checkpoint 0 of an RL run came from: ``{"origin": <path or URI>}``
    ORIGIN = "origin.json", False
    # DiLoCo's outer optimizer state (Nesterov momentum), so a resumed run keeps it
    OUTER_STATE = "outer_state.pt", False
    # single-machine pretraining's outcome, returned again when the step is reused
    TRAIN_REPORT = "train_report.json", False
    # a DiLoCo worker's error-feedback residual (``diloco.compression = "topk"``): what it has not sent yet
    FEEDBACK = "feedback.pt", False
    # an overlapped DiLoCo worker's own pseudo-gradient of the step in flight at its checkpoint
    # (``diloco.overlap``): a resumed run reduces it again instead of losing the phase
    IN_FLIGHT = "in_flight.pt", False


STEP_REPORT = Sidecar.STEP_REPORT
OPTIMIZER = Sidecar.OPTIMIZER
ORIGIN = Sidecar.ORIGIN
OUTER_STATE = Sidecar.OUTER_STATE
TRAIN_REPORT = Sidecar.TRAIN_REPORT
DATA_STATE = Sidecar.DATA_STATE
DATA_MEMBERS = Sidecar.DATA_MEMBERS
PHASE = Sidecar.PHASE
FEEDBACK = Sidecar.FEEDBACK
IN_FLIGHT = Sidecar.IN_FLIGHT

TRAINER_ONLY = frozenset(s.value for s in Sidecar if not s.for_inference)

# A sharded folder (:mod:`intellect.diloco.checkpoint_shards`) is a run-storage step folder, e.g. a DiLoCo
# worker's ``worker_state/<worker>/step_<n>``: torch.distributed.checkpoint's files, the JSON below,
# then ``STABLE``. The two DCP names are DCP's own (its FileSystemWriter picks them).
SHARDS_INDEX = ".metadata"  # DCP's index of every saved chunk, written by the coordinating rank
SHARD_FILE = re.compile(r"__(0|[1-9][0-9]*)_(0|[1-9][0-9]*)\.distcp")  # each rank's data: __<rank>_<n>.distcp
SHARDS_STATE = "shards.json"  # what is not a tensor: the caller's JSON, the outer momentum flag, the ranks


def inference_files(names: Iterable[str]) -> list[str]:
    """The names of a checkpoint folder that inference receives: not ``STABLE``, not a ``.tmp-*`` name
    (run storage hides those), not a trainer-only sidecar. Sorted.

    >>> inference_files(["model.safetensors", "optimizer.pt", "STABLE", "config.json", "rl_step.json"])
    ['config.json', 'model.safetensors']
    """
    return sorted(
        n for n in names
        if n != STABLE and n not in TRAINER_ONLY and not any(p.startswith(TMP_PREFIX) for p in n.split("/"))
    )


class SavedStepReport(BaseModel):
    """The content of :data:`STEP_REPORT`: what training RL step ``n`` did, saved with checkpoint ``n + 1``.

    >>> r = SavedStepReport(policy_step=0, trained_samples=0)
    >>> SavedStepReport.model_validate_json(r.model_dump_json()) == r, r.loss
    (True, None)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy_step: int = Field(ge=0, description="Checkpoint the step's samples were generated with.")
    trained_samples: int = Field(ge=0, description="Accepted samples with signal trained on (0: weights unchanged).")
    loss: float | None = Field(default=None, description="GRPO loss of the update; None when nothing was trained.")
    clip_fraction: float | None = Field(default=None, description="Share of tokens whose ratio was clipped.")
    ratio_max: float | None = Field(default=None, description="Largest importance ratio seen.")
    grad_norm: float | None = Field(default=None, description="Gradient norm before clipping.")
    kl: float | None = Field(default=None, description="Mean per-token KL (k3) to the reference model; None "
                             "without one (``loss.kl_coef = 0``) or when nothing was trained.")
    tokens: int = Field(default=0, ge=0, description="Tokens trained on.")
    train_seconds: float = Field(default=0.0, ge=0, description="Wall time of the update.")


def load_step_report(folder: str | Path) -> SavedStepReport:
    """The :data:`STEP_REPORT` of a local checkpoint folder (verified by the caller)."""
    return SavedStepReport.model_validate(json.loads((Path(folder) / STEP_REPORT).read_text()))


# ------------------------------------------------------------------ publish and fetch


def _encode(content: bytes | BaseModel | Any) -> bytes:
    if isinstance(content, bytes):
        return content
    if isinstance(content, BaseModel):
        content = content.model_dump()
    return json.dumps(content, indent=1).encode()


def publish(model, tokenizer, storage: RunStorage, step: int,
            sidecars: Mapping[Sidecar, bytes | BaseModel | Any] | None = None, *,
            dtype: torch.dtype | None = None) -> str:
    """Write ``checkpoints/step_<step>`` (the HF folder plus ``sidecars``) and mark it stable; its URI.

    A sidecar's content is written as it is (bytes) or as JSON (a pydantic model or a JSON-able
    object). ``dtype``: the weights as the folder holds them (the model keeps its own; None: as they
    are). ``FileExistsError`` when the step is already stable (readers may be using it).
    """
    files: dict[str, bytes | Path] = {}
    for key, content in (sidecars or {}).items():
        files[Sidecar(key).value] = _encode(content)  # ValueError for a name nobody declared
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        folder = save_checkpoint(model, tokenizer, Path(tmp) / "model", dtype)
        hf = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
        if clash := hf.keys() & files.keys():
            raise ValueError(f"the HF folder already holds {sorted(clash)}: a sidecar may not replace it")
        uri = storage.uri(storage.step_path(step, CHECKPOINTS))
        size = sum(p.stat().st_size for p in hf.values()) + sum(len(b) for b in files.values() if isinstance(b, bytes))
        # silent unless the upload (S3, a slow disk) outlasts a progress interval
        bar = Progress(f"checkpoint {step}", unit="", heartbeat=True)
        bar.begin(quiet=True)
        with bar:
            bar.waiting(f"writing {quantity(size)}B in {len(hf) + len(files)} files to {uri}")
            storage.write_step(step, CHECKPOINTS, {**hf, **files})
    return uri


def _complete_step(storage: RunStorage, step: int | None) -> int:
    if step is None:
        step = storage.latest_step(CHECKPOINTS)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {storage.uri(CHECKPOINTS)}")
    elif not storage.is_stable(step, CHECKPOINTS):
        raise FileNotFoundError(f"checkpoint step {step} is not complete in {storage.uri(CHECKPOINTS)}")
    return step


class CheckpointMismatch(ValueError):
    """A checkpoint folder whose digest is not the one recorded for its step (it was rewritten)."""

    def __init__(self, step: int, expected: str, got: str, where: str) -> None:
        super().__init__(f"checkpoint step {step} at {where} has digest {got}, not the recorded {expected}")
        self.step, self.expected, self.got = step, expected, got


@contextmanager
def verified_copy(storage: RunStorage, step: int | None = None, *, sha256: str | None = None) -> Iterator[Path]:
    """A local copy of complete checkpoint ``step`` (the newest when None), removed on exit. With
    ``sha256`` the copy's :func:`local_digest` must equal it (else :class:`CheckpointMismatch`), so
    everything read from the folder (weights, tokenizer, sidecars) is what was recorded."""
    step = _complete_step(storage, step)
    rel = storage.step_path(step, CHECKPOINTS)
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        folder = Path(tmp) / "model"
        bar = Progress(f"checkpoint {step}", unit="", heartbeat=True)  # silent unless the download is long
        bar.begin(quiet=True)
        with bar:
            bar.waiting(f"reading {storage.uri(rel)}")
            storage.get_dir(rel, folder)
        if sha256 is not None and (got := local_digest(folder)) != sha256:
            raise CheckpointMismatch(step, sha256, got, storage.uri(rel))
        yield folder


def fetch(storage: RunStorage, step: int | None = None, *, sha256: str | None = None):
    """Model and tokenizer of a complete checkpoint (the newest when ``step`` is None). With ``sha256``
    (the ledger's digest of that step) the downloaded bytes are verified before anything is loaded."""
    with verified_copy(storage, step, sha256=sha256) as folder:
        return load_checkpoint_copy(folder)


# ------------------------------------------------------------------ identity

_DIGEST_DOMAIN = b"intellect/checkpoint/v1\0"
_CHUNK = 1 << 20


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


def local_digest(folder: str | Path, *, inference: bool = False) -> str:
    """:func:`folder_digest` of every file below ``folder`` except a top-level ``STABLE`` and the
    ``.tmp-*`` names that run storage hides from every listing; with ``inference``, of
    :func:`inference_files` only."""
    folder = Path(folder)
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    keep = set(inference_files(names)) if inference else set(names)
    names = [n for n in names if n in keep and n != STABLE and not any(p.startswith(TMP_PREFIX) for p in n.split("/"))]
    if not names:
        raise FileNotFoundError(f"{folder} holds no checkpoint files")
    return folder_digest((n, file_sha256(folder / n)) for n in names)


def digest(storage: RunStorage, step: int, *, inference: bool = False) -> str:
    """The sha256 that identifies complete checkpoint ``step`` (see the module docstring); with
    ``inference``, of what inference loads (sidecars hold timings, so two runs with equal weights
    differ in them). Local storage is hashed in place; S3 is downloaded to a temporary folder first."""
    _complete_step(storage, step)
    rel = storage.step_path(step, CHECKPOINTS)
    if (local := storage.local_path(rel)) is not None:
        return local_digest(local, inference=inference)
    with tempfile.TemporaryDirectory(prefix="intellect-ckpt-") as tmp:
        storage.get_dir(rel, Path(tmp) / "ckpt")
        return local_digest(Path(tmp) / "ckpt", inference=inference)


# ------------------------------------------------------------------ recorded checkpoints


class CheckpointRecords(Protocol):
    """Where a run records each checkpoint's digest (:class:`intellect.ledger.Ledger`)."""

    def checkpoint(self, step: int) -> tuple[str, str] | None: ...  # (uri, sha256)

    def record_checkpoint(self, step: int, uri: str, sha256: str) -> None: ...


def record(storage: RunStorage, records: CheckpointRecords, step: int) -> str:
    """Record complete checkpoint ``step``'s digest (right after publishing it); its URI."""
    uri = storage.uri(storage.step_path(step, CHECKPOINTS))
    records.record_checkpoint(step, uri, digest(storage, step))
    return uri


def recorded_digest(records: CheckpointRecords, step: int) -> str:
    """The digest recorded for checkpoint ``step``; ``FileNotFoundError`` when none is."""
    got = records.checkpoint(step)
    if got is None:
        raise FileNotFoundError(f"checkpoint {step} is not recorded in the ledger")
    return got[1]


def recorded_steps(storage: RunStorage, records: CheckpointRecords) -> list[int]:
    """The complete checkpoints whose digest is recorded: the only ones a run uses."""
    return [c for c in storage.complete_steps(CHECKPOINTS) if records.checkpoint(c) is not None]


def recorded_copy(storage: RunStorage, records: CheckpointRecords, step: int):
    """:func:`verified_copy` of checkpoint ``step`` against its recorded digest."""
    return verified_copy(storage, step, sha256=recorded_digest(records, step))


def fetch_recorded(storage: RunStorage, records: CheckpointRecords, step: int):
    """Model and tokenizer of checkpoint ``step``, verified against its recorded digest."""
    return fetch(storage, step, sha256=recorded_digest(records, step))


def adopt(storage: RunStorage, records: CheckpointRecords, step: int) -> bool:
    """Whether checkpoint ``step`` is complete with its recorded digest. Any other folder at that step
    (half-written, published by a crashed attempt before its record, or written by someone else) is
    deleted, and False means: write it (again)."""
    rel = storage.step_path(step, CHECKPOINTS)
    rec = records.checkpoint(step)
    if storage.is_stable(step, CHECKPOINTS) and rec is not None:
        try:
            if digest(storage, step) == rec[1]:
                return True
        except FileNotFoundError:
            pass
    if storage.exists(rel):
        storage.delete(rel, recursive=True)
    return False
