"""Sharded checkpoints that reshard, and the consolidated Hugging Face export of a sharded model.

A worker of M ranks (FSDP2, :func:`intellect.parallel.parallelize`) saves its state with
``torch.distributed.checkpoint`` (DCP) into a run-storage step folder: each rank writes the chunks it
holds, and DCP's index (:data:`~intellect.checkpoints.SHARDS_INDEX`) records where every chunk of
every full tensor lies. Loading on M' ranks reads, for each rank, the pieces of the chunks its own
shards overlap, so the folder reshards to any M' (M' = 1: plain, unsharded tensors). Nothing is saved
per rank with ``torch.save``.

* :func:`save_shards` / :func:`load_shards`: DCP to run storage (local or S3). Each rank writes into a
  local temporary folder and uploads its own data files; after every rank has, the coordinating rank
  uploads the index, the folder's JSON and ``STABLE`` last. Loading checks ``STABLE``'s listing (the
  caps below, every file the index names, each downloaded file's size), downloads only the files its
  own shards need, then loads. Every step that can fail on one rank alone is agreed on by all ranks,
  so a refused folder raises on every rank instead of leaving the others waiting in a collective.
* :func:`save_worker` / :func:`load_worker`: a DiLoCo worker's state at an outer boundary: the model,
  the inner optimizer's state (moments and step counts, through
  ``torch.distributed.checkpoint.state_dict``), ``theta_sync`` and the outer momentum (as ``Shard(0)``
  DTensors of the full shapes: :meth:`~intellect.diloco.outer_shard.ShardedOuterState.as_dtensors`),
  and the caller's JSON (the data position...).
* :func:`consolidate` / :func:`export_hf` / :func:`publish_consolidated`: the full fp32 model on the
  coordinating rank, gathered one parameter at a time, written by the one HF writer
  (:func:`~intellect.model.checkpoint.save_checkpoint`, :func:`~intellect.checkpoints.publish`).

Run storage is written by the run's own processes (DCP's index is a pickle): the checks below make a
torn or truncated folder fail with a clear error, they are no defence against a hostile writer.

Worked example (on each of a worker's ranks; ``storage`` a :class:`~intellect.storage.RunStorage`)::

    rel = storage.step_path(n, state_kind(worker))          # worker_state/<worker>/step_<n>
    save_worker(storage, rel, model, optimizer, outer, {"data": stream.state_dict()}, group=mesh.intra)
    ...                                                       # later, on any number of ranks:
    extra = load_worker(storage, rel, model, optimizer, outer, group=mesh.intra)
    stream.load_state_dict(extra["data"])
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from intellect.checkpoints import CHECKPOINTS, SHARD_FILE, SHARDS_INDEX, SHARDS_STATE, Sidecar, publish
from intellect.diloco.outer import OuterState
from intellect.diloco.outer_shard import ShardedOuterState
from intellect.model.checkpoint import save_checkpoint
from intellect.storage import STABLE, RunStorage, normalize_rel, parse_step

__all__ = ["MAX_INDEX_BYTES", "MAX_SHARD_FILE_BYTES", "MAX_STATE_BYTES", "ShardsRefused", "consolidate",
           "export_hf", "load_shards", "load_worker", "publish_consolidated", "resharded", "save_shards", "save_worker"]

# A rank's data file holds its shards of everything saved (weights, two moments, theta_sync and the
# momentum: 20 bytes per parameter over M ranks); a file over this is no state of a model this code
# trains (a 1T-parameter model on 8 ranks writes about 2.5 TB per rank) and is refused unread.
MAX_SHARD_FILE_BYTES = 4 << 40
MAX_INDEX_BYTES = 1 << 30  # DCP's index: a few hundred bytes per chunk
MAX_STATE_BYTES = 1 << 20  # the folder's JSON (a data position is a few cursors); STABLE's listing too
_FORMAT = 1

T = TypeVar("T")


class ShardsRefused(ValueError):
    """A sharded folder that is not complete and intact (no ``STABLE``, a truncated or missing file, a
    file over its cap), or that another rank of the group refused."""


# ------------------------------------------------------------------ collectives


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _agree(group: dist.ProcessGroup | None, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank, then every rank learns whether all succeeded: a rank's own error is
    raised where it happened, the others raise :class:`ShardsRefused` naming the failing ranks."""
    err: BaseException | None = None
    out: T | None = None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        err = e
    if group is not None:
        rank, ranks = _rank(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        failed = torch.zeros(ranks, dtype=torch.int32, device=dev)
        failed[rank] = int(err is not None)
        dist.all_reduce(failed, group=group)
        bad = [r for r, f in enumerate(failed.tolist()) if f]
        if bad and err is None:
            raise ShardsRefused(f"rank(s) {bad} of the group failed; see their errors")
    if err is not None:
        raise err
    return out  # type: ignore[return-value]  # set when err is None


@contextmanager
def _dcp(group: dist.ProcessGroup | None) -> Iterator[dict[str, Any]]:
    """DCP's arguments for ``group``. None: one process, whether or not it has a default process
    group of its own, and DCP's warning that it assumes as much is what was asked for."""
    if group is not None:
        yield {"process_group": group}
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield {"no_dist": True}


# ------------------------------------------------------------------ DCP to run storage


def _step_folder(rel: str) -> tuple[str, int]:
    """``(kind, step)`` of a step folder ``<kind>/step_<n>``: ``STABLE`` belongs to step folders."""
    rel = normalize_rel(rel)
    kind, _, name = rel.rpartition("/")
    step = parse_step(name)
    if not kind or step is None:
        raise ValueError(f"a sharded checkpoint is a run-storage step folder <kind>/step_<n>, not {rel!r}")
    return kind, step


def save_shards(storage: RunStorage, rel: str, state_dict: dict[str, Any], group: dist.ProcessGroup | None = None,
                *, files: Mapping[str, bytes] | None = None) -> str:
    """Save ``state_dict`` (tensors, DTensors, nested dicts of them) into the step folder ``rel``
    with DCP, ``files`` beside it, then ``STABLE``; its URI. Collective over ``group`` (None: this
    process alone). A folder that is already stable is never rewritten (``FileExistsError`` on every
    rank); an incomplete one (a crashed save) is replaced."""
    kind, step = _step_folder(rel)
    rank, _ = _rank(group)
    for name in files or {}:
        if name in (STABLE, SHARDS_INDEX) or SHARD_FILE.fullmatch(name) or "/" in normalize_rel(name):
            raise ValueError(f"save_shards: {name!r} is not a name for a file of its own in a sharded folder")

    def clear() -> None:
        if storage.is_stable(step, kind):
            raise FileExistsError(f"{storage.uri(rel)} is already stable")
        if rank == 0 and storage.exists(rel):
            storage.delete(rel, recursive=True)

    _agree(group, clear)  # every rank waits for the stale folder to be gone before uploading
    with tempfile.TemporaryDirectory(prefix="intellect-shards-") as tmp:
        with _dcp(group) as kw:
            dcp_save(state_dict, storage_writer=FileSystemWriter(tmp), **kw)

        def upload_data() -> None:  # this rank's own files: __<rank>_<n>.distcp
            for p in sorted(Path(tmp).iterdir()):
                if SHARD_FILE.fullmatch(p.name):
                    storage.put_file(p, f"{rel}/{p.name}")

        _agree(group, upload_data)

        def finish() -> None:
            if rank == 0:
                for name, data in (files or {}).items():
                    storage.write_bytes(f"{rel}/{name}", data)
                storage.put_file(Path(tmp) / SHARDS_INDEX, f"{rel}/{SHARDS_INDEX}")
                storage.mark_stable(step, kind)

        _agree(group, finish)
    return storage.uri(rel)


def _listing(storage: RunStorage, rel: str, max_file_bytes: int) -> dict[str, int]:
    """``STABLE``'s ``{name: size}`` of a complete sharded folder, checked against the caps."""
    uri = storage.uri(rel)
    try:
        raw = storage.read_bytes(f"{rel}/{STABLE}", MAX_STATE_BYTES)
    except FileNotFoundError:
        raise ShardsRefused(f"{uri} has no {STABLE}: not a complete sharded checkpoint (a save that did "
                            "not finish, or no save at all)") from None
    try:
        listed = json.loads(raw)["files"]
        files = {str(k): int(v) for k, v in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShardsRefused(f"{uri}/{STABLE} is not a file listing ({e})") from None
    if SHARDS_INDEX not in files:
        raise ShardsRefused(f"{uri} lists no {SHARDS_INDEX}: not a sharded checkpoint")
    for name, size in files.items():
        cap = MAX_INDEX_BYTES if name == SHARDS_INDEX else MAX_STATE_BYTES if name == SHARDS_STATE else max_file_bytes
        if not 0 <= size <= cap:
            raise ShardsRefused(f"{uri}/{name}: {size} bytes, over the cap of {cap}")
    return files


def _download(storage: RunStorage, rel: str, name: str, size: int, dest: Path) -> None:
    storage.get_file(f"{rel}/{name}", dest / name)
    got = (dest / name).stat().st_size
    if got != size:
        raise ShardsRefused(f"{storage.uri(rel)}/{name} is {got} bytes, not the {size} its {STABLE} lists "
                            "(truncated or rewritten)")


def load_shards(storage: RunStorage, rel: str, state_dict: dict[str, Any], group: dist.ProcessGroup | None = None,
                *, max_file_bytes: int = MAX_SHARD_FILE_BYTES) -> dict[str, int]:
    """Load the complete sharded folder ``rel`` into ``state_dict`` in place, whatever the number of
    ranks that saved it (each tensor of ``state_dict`` names the part it wants: a DTensor its shard, a
    plain tensor the whole); ``STABLE``'s listing ``{name: size}``. Collective over ``group``. A folder
    without ``STABLE``, a file over ``max_file_bytes`` (the index and JSON have caps of their own) or
    not of its listed size, a data file the index names but the listing does not: :class:`ShardsRefused`
    on every rank, ``state_dict`` unchanged."""
    with tempfile.TemporaryDirectory(prefix="intellect-shards-") as tmp:
        local = Path(tmp)

        def fetch() -> dict[str, int]:
            files = _listing(storage, rel, max_file_bytes)
            _download(storage, rel, SHARDS_INDEX, files[SHARDS_INDEX], local)
            try:
                metadata = FileSystemReader(local).read_metadata()
            except Exception as e:  # a pickle that does not load: torch and pickle raise many kinds
                raise ShardsRefused(f"{storage.uri(rel)}/{SHARDS_INDEX} does not load ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from e
            # only the files holding a piece of this rank's shards (DCP's own plan of the reads)
            planner = DefaultLoadPlanner()
            planner.set_up_planner(state_dict, metadata, False)
            wanted = {metadata.storage_data[item.storage_index].relative_path
                      for item in planner.create_local_plan().items}
            for name in sorted(wanted):
                if name not in files or not SHARD_FILE.fullmatch(name):
                    raise ShardsRefused(f"{storage.uri(rel)}: the index names {name!r}, which its {STABLE} "
                                        "does not list")
                _download(storage, rel, name, files[name], local)
            return files

        files = _agree(group, fetch)
        with _dcp(group) as kw:
            dcp_load(state_dict, storage_reader=FileSystemReader(local), **kw)
    return files


# ------------------------------------------------------------------ a DiLoCo worker's state


def _outer_tensors(outer: OuterState, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    return outer.as_dtensors(shards) if isinstance(outer, ShardedOuterState) else shards


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every FSDP2 module's parameters sharded: a forward without a backward (an
    evaluation) leaves the modules that do not reshard after forward (the last block) gathered, and
    their parameters are then plain tensors that neither the optimizer's state nor DCP knows."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model


WORKER_EXTRAS = ("feedback", "in_flight")  # per-parameter tensors a worker state may hold beside theta_sync


def _worker_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, outer: OuterState,
                  momentum: list[torch.Tensor], extras: Mapping[str, list[torch.Tensor]] | None = None,
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dict DCP saves or loads, and the optimizer's full state dict (with ``param_groups``);
    ``extras`` (named in :data:`WORKER_EXTRAS`: the error-feedback residual of ``diloco.compression =
    "topk"``, the pseudo-gradient in flight of ``diloco.overlap``) laid out as ``outer``'s shards, so they
    reshard as ``theta_sync`` does."""
    resharded(model)
    names = [n for n, _ in model.named_parameters()]
    if len(names) != len(outer.params):
        raise ValueError(f"the outer state holds {len(outer.params)} tensors, the model {len(names)} parameters")
    optim = get_optimizer_state_dict(model, optimizer)
    # hyperparameters stay the optimizer's own (the run's config); the state is the moments and step counts
    state = {"model": get_model_state_dict(model), "optimizer": {"state": optim["state"]},
             "outer": {"theta": dict(zip(names, _outer_tensors(outer, outer.params))),
                       "momentum": dict(zip(names, _outer_tensors(outer, momentum)))}}
    for key, tensors in (extras or {}).items():
        if key not in WORKER_EXTRAS:
            raise ValueError(f"a worker state holds no {key!r}")
        state[key] = dict(zip(names, _outer_tensors(outer, tensors)))
    return state, optim


def save_worker(storage: RunStorage, rel: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                outer: OuterState, extra_json: Mapping[str, Any], group: dist.ProcessGroup | None = None,
                extras: Mapping[str, list[torch.Tensor]] | None = None) -> str:
    """Save a worker's state at an outer boundary into the step folder ``rel`` (:func:`save_shards`):
    ``model``'s weights, ``optimizer``'s state (moments, step counts), ``theta_sync`` and the outer
    momentum of ``outer`` (an :class:`OuterState`, or a
    :class:`~intellect.diloco.outer_shard.ShardedOuterState` over ``model``'s shards), and
    ``extra_json`` (JSON-able, e.g. the data position; rank 0's is written), read back by
    :func:`load_worker`; ``extras`` too when given (:func:`_worker_state`). Collective over ``group``;
    its URI."""
    state, _ = _worker_state(model, optimizer, outer, outer.momentum_buffers(), extras)
    _, ranks = _rank(group)
    doc = {"format": _FORMAT, "ranks": ranks, "outer": {"has_momentum": outer.has_momentum()},
           **{key: key in (extras or {}) for key in WORKER_EXTRAS}, "extra": dict(extra_json)}
    raw = json.dumps(doc).encode()
    if len(raw) > MAX_STATE_BYTES:
        raise ValueError(f"save_worker: the JSON is {len(raw)} bytes, over {MAX_STATE_BYTES}")
    return save_shards(storage, rel, state, group, files={SHARDS_STATE: raw})


def load_worker(storage: RunStorage, rel: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                outer: OuterState, group: dist.ProcessGroup | None = None,
                extras: Mapping[str, list[torch.Tensor]] | None = None,
                *, max_file_bytes: int = MAX_SHARD_FILE_BYTES) -> dict[str, Any]:
    """Load what :func:`save_worker` saved, on any number of ranks (the same model, sharded or not,
    and the optimizer built over it), into ``model``, ``optimizer`` and ``outer`` (and the tensors of
    ``extras`` that were saved); the saved ``extra_json``, with each name of ``extras`` mapped to whether
    it was saved. Collective over ``group``. The optimizer keeps its own hyperparameters; any
    gradients are dropped. A torn folder raises :class:`ShardsRefused` before anything changed."""
    def read_doc() -> dict[str, Any]:
        _listing(storage, rel, max_file_bytes)  # STABLE first: a torn folder's JSON is not read
        doc = json.loads(storage.read_bytes(f"{rel}/{SHARDS_STATE}", MAX_STATE_BYTES))
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("extra"), dict):
            raise ShardsRefused(f"{storage.uri(rel)}/{SHARDS_STATE} is not a worker state of format {_FORMAT}")
        return doc

    doc = _agree(group, read_doc)
    # the optimizer's state must exist to be loaded into: DCP fills the tensors get_optimizer_state_dict
    # builds, which it does (a step at lr 0) only when no parameter has a gradient
    optimizer.zero_grad(set_to_none=True)
    fresh = not optimizer.state
    momentum = [torch.zeros_like(p) for p in outer.params]
    saved = {key: t for key, t in (extras or {}).items() if doc.get(key) is True}
    state, optim = _worker_state(model, optimizer, outer, momentum, saved)
    try:
        load_shards(storage, rel, state, group, max_file_bytes=max_file_bytes)
    except BaseException:
        if fresh:  # a refused folder leaves a fresh AdamW fresh (step 0), not one that stepped at lr 0
            optimizer.state.clear()
        raise
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"]["state"],
                                                "param_groups": optim["param_groups"]})
    outer.set_state(outer.params, momentum if doc["outer"].get("has_momentum") else None)
    return {**doc["extra"], **{key: key in saved for key in extras or {}}}


# ------------------------------------------------------------------ consolidated export


def _shell(model: torch.nn.Module) -> PreTrainedModel:
    """An empty fp32 CPU model of ``model``'s class (FSDP2's wrapper class removed) and config, built
    without initialising its weights (they are all overwritten)."""
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        shell = cls(copy.deepcopy(getattr(model, "config")))
    shell.to_empty(device="cpu")
    shell.tie_weights()  # to_empty gives each module its own tensor: tie the shared ones again
    if getattr(model, "generation_config", None) is not None:
        shell.generation_config = copy.deepcopy(getattr(model, "generation_config"))
    return shell.float().eval()


def _full_params(model: torch.nn.Module, outer: OuterState | None) -> Iterator[torch.Tensor]:
    if isinstance(outer, ShardedOuterState):
        yield from outer.iter_gathered()
    elif outer is not None:
        yield from outer.params
    else:
        for p in model.parameters():
            yield p.full_tensor() if isinstance(p, DTensor) else p.detach()


@torch.no_grad()
def consolidate(model: torch.nn.Module, group: dist.ProcessGroup | None = None, *,
                outer: OuterState | None = None) -> PreTrainedModel | None:
    """The full model as fp32 on the CPU, on rank 0 of ``group`` (None on the others): ``model``'s
    weights, or ``theta_sync`` of ``outer`` when given. Collective; the full tensors are gathered one
    parameter at a time, so no rank holds more than the consolidated model and one parameter."""
    rank, _ = _rank(group)
    resharded(model)
    shell = _shell(model) if rank == 0 else None
    names = [n for n, _ in model.named_parameters()]
    if shell is not None and (got := [n for n, _ in shell.named_parameters()]) != names:
        raise ValueError(f"consolidate: the rebuilt model's parameters {got[:3]}... differ from {names[:3]}...")
    targets = list(shell.parameters()) if shell is not None else [None] * len(names)
    full = _full_params(model, outer)
    for target, name in zip(targets, names):
        t = next(full)
        if target is not None:
            if t.shape != target.shape:
                raise ValueError(f"consolidate: {name} is {tuple(t.shape)}, the model's {tuple(target.shape)}")
            target.copy_(t.to("cpu", torch.float32))
    if next(full, None) is not None:
        raise ValueError("consolidate: more tensors than parameters")
    if shell is not None:
        buffers = dict(model.named_buffers())  # FSDP2 shards parameters only: buffers are whole on every rank
        for name, b in shell.named_buffers():
            b.copy_(buffers[name].to("cpu"))
    return shell


def export_hf(model: torch.nn.Module, tokenizer, folder: str | os.PathLike, group: dist.ProcessGroup | None = None,
              *, outer: OuterState | None = None) -> Path | None:
    """Write the consolidated model (:func:`consolidate`) and ``tokenizer`` as an HF folder at
    ``folder`` on rank 0 (:func:`~intellect.model.checkpoint.save_checkpoint`, the folder every
    checkpoint holds), which ``transformers`` loads as it is; the path on rank 0, None elsewhere.
    Collective: every rank returns once the folder is written."""
    shell = consolidate(model, group, outer=outer)
    return _agree(group, lambda: save_checkpoint(shell, tokenizer, folder) if shell is not None else None)


def publish_consolidated(model: torch.nn.Module, tokenizer, storage: RunStorage, step: int,
                         group: dist.ProcessGroup | None = None, *, outer: OuterState | None = None,
                         sidecars: Mapping[Sidecar, Any] | None = None, dtype: torch.dtype | None = None) -> str:
    """:func:`~intellect.checkpoints.publish` the consolidated model as ``checkpoints/step_<step>``
    from rank 0 (what SHARDCAST ships), its weights in ``dtype`` (None: fp32); its URI on every rank,
    once it is stable."""
    shell = consolidate(model, group, outer=outer)
    return _agree(group, lambda: publish(shell, tokenizer, storage, step, sidecars, dtype=dtype) if shell is not None
                  else storage.uri(storage.step_path(step, CHECKPOINTS)))
