"""A DiLoCo worker's own resumable state, saved beside each outer checkpoint.

The outer checkpoint ``checkpoints/step_<n>`` holds what all members share (``theta_sync`` and the outer
momentum). What each worker holds alone lives under ``worker_state/<worker>/step_<n>`` in run storage:
its inner AdamW state with the inner step count (:meth:`~intellect.train.Trainer.state_bytes`) and its
training stream's position (:mod:`intellect.data.stream`), under the file names of the checkpoint
sidecars that hold the same things for single-machine pretraining, and what that position was reached
under (the step's members, the reader's pace: ``DATA_MEMBERS``), which tells a resumed worker whether
its position is still current (:mod:`intellect.diloco.data`).

A worker writes its state for checkpoint ``n`` after the inner phase of outer step ``n - 1`` and before
its all-reduce: the step commits only once every member has voted, so when checkpoint ``n`` is
complete every member's state for it is too, and a whole run killed at any point resumes every
worker exactly (same next batches, same weights). A worker killed alone rejoins with its newest
state (the others may have published checkpoints since): that AdamW state and data position, read
in the shard the step's membership gives it, from the members' positions on. One without any (a newcomer, a lost disk), or whose
saved state does not load (a garbled copy, another model's moments: :func:`restore` checks before it
changes anything), starts a fresh AdamW at the start of its shard, and says why.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from intellect.diloco.checkpoint_shards import ShardsRefused, load_worker, save_worker
from intellect.checkpoints import DATA_MEMBERS, DATA_STATE, FEEDBACK, IN_FLIGHT, OPTIMIZER, SHARDS_STATE
from intellect.diloco.outer_shard import local_part
from intellect.diloco.protocol import read_count, read_json, read_names
from intellect.diloco.topk_reduce import ErrorFeedback
from intellect.storage import RunStorage
from intellect.train import Trainer

_WORKER = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
MAX_STATE_JSON = 1 << 20  # bytes of a saved stream position at most (it is a few cursors)


def state_kind(worker: str) -> str:
    """The run storage kind of ``worker``'s saved states: ``worker_state/<worker>``.

    >>> state_kind("w0")
    'worker_state/w0'
    """
    if not _WORKER.match(worker) or worker in (".", ".."):
        raise ValueError(f"not a worker name: {worker!r}")
    return f"worker_state/{worker}"


@dataclass(frozen=True)
class WorkerState:
    step: int  # the outer checkpoint it belongs to
    trainer: bytes  # Trainer.state_bytes()
    data: dict[str, Any]  # the training stream's state_dict()
    members: list[str] = field(default_factory=list)  # the members of the step that reached the position
    rows_per_step: int = 0  # rows the reader passed in that step (0: not known)
    feedback: torch.Tensor | None = None  # the error-feedback residual, flat (diloco.compression = "topk")
    in_flight: torch.Tensor | None = None  # overlap: its own pseudo-gradient of the step in flight, flat


def save(storage: RunStorage, worker: str, state: WorkerState, keep: int) -> None:
    """Write ``state`` (a stale one at that step, from an attempt that never reached its checkpoint, is
    replaced) and keep the newest ``keep`` states."""
    kind = state_kind(worker)
    storage.drop_step(state.step, kind)  # a stale one, from an attempt that never reached its checkpoint
    reached = {"members": state.members, "rows_per_step": state.rows_per_step}
    files = {OPTIMIZER.value: state.trainer, DATA_STATE.value: json.dumps(state.data).encode(),
             DATA_MEMBERS.value: json.dumps(reached).encode()}
    if state.feedback is not None:
        buf = io.BytesIO()
        torch.save({"residual": state.feedback.contiguous()}, buf)
        files[FEEDBACK.value] = buf.getvalue()
    if state.in_flight is not None:
        buf = io.BytesIO()
        torch.save({"pseudo_gradient": state.in_flight.contiguous()}, buf)
        files[IN_FLIGHT.value] = buf.getvalue()
    storage.write_step(state.step, kind, files)
    storage.retain(kind, keep)


def load(storage: RunStorage, worker: str, step: int, max_trainer_bytes: int | None = None) -> WorkerState | None:
    """``worker``'s newest complete state for checkpoint ``step`` or an earlier one (a worker killed in an
    inner phase rejoins at a checkpoint the others published without it); None when it has none. Files
    over their bounds (``max_trainer_bytes`` for the AdamW state) raise ValueError unread."""
    kind = state_kind(worker)
    steps = [s for s in storage.complete_steps(kind) if s <= step]
    if not steps:
        return None
    step = steps[-1]
    rel = storage.step_path(step, kind)
    data = json.loads(storage.read_bytes(f"{rel}/{DATA_STATE.value}", MAX_STATE_JSON))
    if not isinstance(data, dict):
        raise ValueError(f"{storage.uri(rel)}: the saved data position is not a JSON object")
    # what the position was reached under; unreadable, it counts as stale (the worker realigns)
    try:
        reached = read_json(storage.read_bytes(f"{rel}/{DATA_MEMBERS.value}", MAX_STATE_JSON))
    except (OSError, ValueError):
        reached = None
    reached = reached if isinstance(reached, dict) else {}
    members, rows = read_names(reached.get("members")), read_count(reached.get("rows_per_step"))
    if members is None or rows is None:
        members, rows = [], 0
    feedback = None
    if storage.exists(f"{rel}/{FEEDBACK.value}"):
        doc = _torch_file(storage.read_bytes(f"{rel}/{FEEDBACK.value}", max_trainer_bytes))
        feedback = doc.get("residual") if isinstance(doc, dict) else None
        if not isinstance(feedback, torch.Tensor):
            raise ValueError(f"{storage.uri(rel)}: the saved error-feedback residual is no tensor")
    in_flight = None
    if storage.exists(f"{rel}/{IN_FLIGHT.value}"):
        doc = _torch_file(storage.read_bytes(f"{rel}/{IN_FLIGHT.value}", max_trainer_bytes))
        in_flight = doc.get("pseudo_gradient") if isinstance(doc, dict) else None
        if not (isinstance(in_flight, torch.Tensor) and in_flight.dim() == 1 and in_flight.is_floating_point()
                and bool(torch.isfinite(in_flight).all())):
            raise ValueError(f"{storage.uri(rel)}: the saved pseudo-gradient in flight is no finite flat tensor")
    return WorkerState(step=step, trainer=storage.read_bytes(f"{rel}/{OPTIMIZER.value}", max_trainer_bytes),
                       data=data, members=members, rows_per_step=rows, feedback=feedback, in_flight=in_flight)


def _torch_file(data: bytes):
    """What a ``torch.save`` file holds (tensors and plain containers only, never arbitrary pickles)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # a truncated zip, a foreign pickle: torch raises many kinds
        raise ValueError(f"not a torch.save file of tensors ({type(e).__name__})") from e


def restore(storage: RunStorage, worker: str, step: int, trainer: Trainer,
            feedback: ErrorFeedback | None = None) -> tuple[WorkerState | None, str]:
    """``worker``'s newest saved state up to checkpoint ``step`` (:func:`load`), its AdamW state and step
    count loaded into ``trainer`` (and its error-feedback residual into ``feedback``, when both are
    there); or None and why not, ``trainer`` untouched. The files are the worker's own, yet a lost disk
    or a garbled copy must cost a fresh AdamW, never the worker."""
    try:
        saved = load(storage, worker, step, trainer.max_state_bytes())
        if saved is None:
            return None, "no saved state"
        trainer.load_state_bytes(saved.trainer)  # checks the state before it changes anything
        if feedback is not None and saved.feedback is not None:
            feedback.load_state_dict({"residual": saved.feedback})
        return saved, ""
    except (OSError, ValueError) as e:
        return None, f"its saved state is unreadable ({str(e)[:300]})"


# ---------------------------------------------------------------------- a worker of several ranks


def save_sharded(storage: RunStorage, worker: str, state: WorkerState, trainer: Trainer, outer, keep: int,
                 group: dist.ProcessGroup | None, barrier) -> None:
    """:func:`save` for a worker whose model is sharded over its ranks (collective over ``group``): the
    inner AdamW state in ``torch.distributed.checkpoint``'s form, which loads on any number of ranks
    (:func:`~intellect.diloco.checkpoint_shards.save_worker`), and the data position as the folder's JSON
    (``state.trainer`` is not used). ``barrier()``: the worker's ranks wait for its first to have
    dropped a stale folder."""
    kind = state_kind(worker)
    rank = dist.get_rank(group) if group is not None else 0
    rel = storage.drop_step(state.step, kind) if rank == 0 else storage.step_path(state.step, kind)
    barrier()
    extras = {key: _as_shards(flat, outer.params) for key, flat in
              (("feedback", state.feedback), ("in_flight", state.in_flight)) if flat is not None}
    save_worker(storage, rel, trainer.model, trainer.optimizer, outer,
                {"data": state.data, "members": state.members, "rows_per_step": state.rows_per_step}, group, extras)
    if rank == 0:
        storage.retain(kind, keep)


def restore_sharded(storage: RunStorage, worker: str, step: int, trainer: Trainer, outer,
                    group: dist.ProcessGroup | None, feedback: ErrorFeedback | None = None,
                    ) -> tuple[WorkerState | None, str]:
    """:func:`restore` from a state :func:`save_sharded` wrote, by a worker of any number of ranks (one
    included: ``group`` None). ``outer`` and the model keep the checkpoint's ``theta_sync``: the
    folder's copies are those the step started from."""
    kind = state_kind(worker)
    steps = [s for s in storage.complete_steps(kind) if s <= step]
    if not steps:
        return None, "no saved state"
    rel = storage.step_path(steps[-1], kind)
    if not storage.exists(f"{rel}/{SHARDS_STATE}"):
        return None, "its saved state is of a worker of one rank (not sharded)"
    theta = [p.clone() for p in outer.params]
    momentum = [m.clone() for m in outer.momentum_buffers()] if outer.has_momentum() else None
    parts = {key: [torch.zeros_like(p) for p in outer.params] for key in ("feedback", "in_flight")
             if key != "feedback" or feedback is not None}
    in_flight = None
    try:
        extra = load_worker(storage, rel, trainer.model, trainer.optimizer, outer, group, parts)
        if feedback is not None and extra["feedback"]:
            feedback.load_state_dict({"residual": torch.cat([t.reshape(-1) for t in parts["feedback"]])})
        if extra["in_flight"]:
            in_flight = torch.cat([t.reshape(-1) for t in parts["in_flight"]])
    except (OSError, ValueError, ShardsRefused) as e:
        return None, f"its saved state is unreadable ({str(e)[:300]})"
    finally:
        outer.set_state(theta, momentum)
        with torch.no_grad():
            outer.load_into(trainer.model)
    members, rows = read_names(extra.get("members")), read_count(extra.get("rows_per_step"))
    data = extra.get("data")
    if not isinstance(data, dict):
        return None, "its saved data position is not a JSON object"
    return WorkerState(step=steps[-1], trainer=b"", data=data, members=members or [], rows_per_step=rows or 0,
                       in_flight=in_flight), ""


def restore_any(storage: RunStorage, worker: str, step: int, trainer: Trainer, outer,
                group: dist.ProcessGroup | None, feedback: ErrorFeedback | None = None,
                ) -> tuple[WorkerState | None, str]:
    """The worker's newest saved state up to checkpoint ``step`` whichever form it was saved in: a
    sharded one (:func:`restore_sharded`) on any number of ranks, a one-rank file (:func:`restore`) by
    a worker of one rank (``group`` None) and, its moments cut into shards, by a worker of several ranks
    (:func:`restore_resharded`)."""
    steps = [s for s in storage.complete_steps(state_kind(worker)) if s <= step]
    if steps and storage.exists(f"{storage.step_path(steps[-1], state_kind(worker))}/{SHARDS_STATE}"):
        return restore_sharded(storage, worker, step, trainer, outer, group, feedback)
    if group is None:
        return restore(storage, worker, step, trainer, feedback)
    if not steps:
        return None, "no saved state of a sharded worker"
    return restore_resharded(storage, worker, step, trainer, outer, feedback)


def restore_resharded(storage: RunStorage, worker: str, step: int, trainer: Trainer, outer,
                      feedback: ErrorFeedback | None = None) -> tuple[WorkerState | None, str]:
    """:func:`restore` by a worker of several ranks from the file a worker of one rank saved: the full
    AdamW moments cut into this rank's shards (``set_optimizer_state_dict`` with full tensors, collective
    over the worker's ranks, which all read the same file and so fail alike). The file is bounded by the
    full model's size and checked (every moment shaped as its parameter's full shape) before anything
    changes; or None and why not, the trainer untouched."""
    full = [tuple(s) for s in outer.full_shapes]
    bound = 8 * sum(math.prod(s) for s in full) + 4096 * len(full) + (1 << 20)  # Trainer.max_state_bytes, unsharded
    opt, model = trainer.optimizer, trainer.model
    try:
        saved = load(storage, worker, step, bound)
        if saved is None:
            return None, "no saved state"
        state = _torch_file(saved.trainer)
        moments, groups = _full_moments(state, model, opt)
        residual = None
        if feedback is not None and saved.feedback is not None:  # the whole model's, cut as theta_sync is
            residual = _cut(saved.feedback, outer, full, "error-feedback residual")
            ErrorFeedback(feedback.numel, feedback.cfg).load_state_dict({"residual": residual})  # checked first
        set_optimizer_state_dict(model, opt, {"state": moments, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))
        trainer.step = int(state["step"])
        if isinstance(state.get("rng"), torch.Tensor):
            torch.set_rng_state(state["rng"])
        if feedback is not None and residual is not None:
            feedback.load_state_dict({"residual": residual})
        if saved.in_flight is not None:
            saved = replace(saved, in_flight=_cut(saved.in_flight, outer, full, "pseudo-gradient in flight"))
        return saved, ""
    except (OSError, ValueError) as e:
        return None, f"its saved state is unreadable ({str(e)[:300]})"


def _cut(flat: torch.Tensor, outer, full: list[tuple[int, ...]], what: str) -> torch.Tensor:
    """This rank's part of a whole model's flat tensor (laid out as the full parameters ``full``), flat."""
    sizes = [math.prod(s) for s in full]
    if flat.numel() != sum(sizes):
        raise ValueError(f"its {what} is not the model's size")
    mine = local_part(outer, [c.view(s) for c, s in zip(flat.split(sizes), full)])
    return torch.cat([t.reshape(-1) for t in mine])


def _as_shards(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """A flat residual as tensors shaped as ``like`` (a worker's local shards, in parameter order)."""
    return [c.view_as(p) for c, p in zip(flat.split([p.numel() for p in like]), like)]


def _full_moments(state: object, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, list]:
    """A one-rank :meth:`~intellect.train.Trainer.state_dict`'s AdamW state keyed by parameter name, as
    ``set_optimizer_state_dict`` takes full tensors; ValueError unless it fits ``opt``'s parameters."""
    if not (isinstance(state, dict) and isinstance(state.get("optimizer"), dict)
            and type(state.get("step")) is int and state["step"] >= 0):
        raise ValueError("not a trainer state")
    saved = state["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    order = [names[id(p)] for p in params]
    groups, moments = saved.get("param_groups"), saved.get("state")
    if not (isinstance(groups, list) and len(groups) == len(opt.param_groups) and isinstance(moments, dict)
            and all(isinstance(g, dict) and g.get("params") == list(range(sum(len(h["params"]) for h in
                    opt.param_groups[:i]), sum(len(h["params"]) for h in opt.param_groups[:i + 1])))
                    for i, g in enumerate(groups))):
        raise ValueError("its parameter groups are not this model's")
    out = {}
    for i, m in moments.items():
        if not (type(i) is int and 0 <= i < len(params) and isinstance(m, dict)):
            raise ValueError(f"a moment of no parameter ({i!r})")
        for k, t in m.items():
            if k != "step" and not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(params[i].shape)):
                raise ValueError(f"{order[i]}: its {k} is not shaped as the parameter {tuple(params[i].shape)}")
        out[order[i]] = m
    return out, [{**g, "params": [order[j] for j in g["params"]]} for g in groups]


__all__ = ["WorkerState", "load", "restore", "restore_any", "restore_resharded", "restore_sharded", "save", "save_sharded", "state_kind"]
