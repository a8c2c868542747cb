"""The GRPO trainer's resumable state as a sharded checkpoint: ``trainer_state/step_<n>`` in run storage.

Beside checkpoint ``n`` (the consolidated HF folder workers load), the trainer saves the weights and
AdamW's state (moments and step counts) of checkpoint ``n`` with DCP, through the DiLoCo worker's
code (:func:`~intellect.diloco.checkpoint_shards.save_shards` / ``load_shards``): each rank writes its
own shards, and a trainer of any number of ranks (1: plain tensors) loads the folder, each rank reading
only the pieces of its own shards. Its JSON (:data:`~intellect.checkpoints.SHARDS_STATE`) holds the
optimizer step count the learning-rate schedule reads, and the ranks that saved it. The folder is
trainer-only: no worker reads it, SHARDCAST never ships it.

On each of the trainer's ranks (``group`` its ranks' group, None in one process)::

    save_state(storage, n, trainer, group)          # after publishing checkpoint n
    ...                                              # a killed trainer, restarted on M' ranks:
    load_state(storage, n, trainer, group)           # trainer built from checkpoint n's weights
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from intellect.checkpoints import SHARDS_STATE
from intellect.diloco.checkpoint_shards import MAX_STATE_BYTES, ShardsRefused, load_shards, resharded, save_shards
from intellect.storage import RunStorage

if TYPE_CHECKING:
    from intellect.rl.trainer.grpo import GRPOTrainer

__all__ = ["TRAINER_STATE", "drop_state", "has_state", "load_one_process_state", "load_state", "save_state"]

TRAINER_STATE = "trainer_state"  # the run-storage kind: trainer_state/step_<n>/
_FORMAT = 1


def _state(trainer: GRPOTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP saves or loads (the model's weights, the optimizer's moments and step counts), and the
    optimizer's full state dict (its ``param_groups`` stay the run's config)."""
    resharded(trainer.model)
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    return {"model": get_model_state_dict(trainer.model), "optimizer": {"state": optim["state"]}}, optim


def has_state(storage: RunStorage, step: int) -> bool:
    """Whether the trainer's state of checkpoint ``step`` is complete in ``storage``."""
    return storage.is_stable(step, TRAINER_STATE)


def drop_state(storage: RunStorage, step: int) -> None:
    """Delete ``trainer_state/step_<step>``, stable or not: the state of an attempt whose checkpoint
    ``step`` was never recorded (the step is trained again)."""
    storage.drop_step(step, TRAINER_STATE)


def save_state(storage: RunStorage, step: int, trainer: GRPOTrainer, group: dist.ProcessGroup | None = None) -> str:
    """Save ``trainer``'s weights and optimizer state as ``trainer_state/step_<step>`` (collective over
    ``group``); its URI. A stable folder is never rewritten (``FileExistsError``)."""
    state, _ = _state(trainer)
    ranks = 1 if group is None else dist.get_world_size(group)
    doc = json.dumps({"format": _FORMAT, "ranks": ranks, "optimizer_steps": trainer.step}).encode()
    return save_shards(storage, storage.step_path(step, TRAINER_STATE), state, group, files={SHARDS_STATE: doc})


def load_state(storage: RunStorage, step: int, trainer: GRPOTrainer, group: dist.ProcessGroup | None = None) -> int:
    """Load ``trainer_state/step_<step>`` into ``trainer`` (weights, AdamW state, step count), whatever
    the number of ranks that saved it; the ranks that did. Collective over ``group``; a torn folder
    raises :class:`~intellect.diloco.checkpoint_shards.ShardsRefused` on every rank, the trainer unchanged."""
    rel = storage.step_path(step, TRAINER_STATE)
    try:
        doc = json.loads(storage.read_bytes(f"{rel}/{SHARDS_STATE}", MAX_STATE_BYTES))
    except FileNotFoundError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("optimizer_steps"), int):
        raise ShardsRefused(f"{storage.uri(rel)} holds no trainer state of format {_FORMAT}")
    # DCP loads into the optimizer's state tensors, which get_optimizer_state_dict creates (a step at
    # lr 0) only when no parameter has a gradient
    trainer.optimizer.zero_grad(set_to_none=True)
    fresh = not trainer.optimizer.state
    state, optim = _state(trainer)
    try:
        load_shards(storage, rel, state, group)
    except BaseException:
        if fresh:  # a refused folder leaves a fresh AdamW fresh
            trainer.optimizer.state.clear()
        raise
    set_model_state_dict(trainer.model, state["model"])
    set_optimizer_state_dict(trainer.model, trainer.optimizer,
                             {"state": state["optimizer"]["state"], "param_groups": optim["param_groups"]})
    trainer.step = int(doc["optimizer_steps"])
    return int(doc.get("ranks", 0))


def load_one_process_state(trainer: GRPOTrainer, saved: dict[str, Any]) -> None:
    """Load a one-process trainer's state (:meth:`~intellect.rl.trainer.grpo.GRPOTrainer.state_dict`:
    whole tensors, parameters by their index in the optimizer) into ``trainer`` of any number of ranks,
    each keeping its shards: a run that goes from ``trainer.ranks = 1`` to M keeps its AdamW state.
    Every rank passes the same ``saved``; the optimizer keeps its own hyperparameters."""
    osd = saved["optimizer"]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    fqns = [names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    if len(ids) != len(fqns):
        raise ValueError(f"the saved optimizer has {len(ids)} parameters, the trainer's {len(fqns)}")
    fqn_of = dict(zip(ids, fqns))
    trainer.optimizer.zero_grad(set_to_none=True)
    _, optim = _state(trainer)
    state = {fqn_of[i]: v for i, v in osd["state"].items()}
    set_optimizer_state_dict(trainer.model, trainer.optimizer, {"state": state, "param_groups": optim["param_groups"]},
                             options=StateDictOptions(full_state_dict=True))
    trainer.step = int(saved["step"])
