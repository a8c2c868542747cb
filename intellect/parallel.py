"""FSDP2 inside one worker: a model sharded over its ranks, in torchtitan's order of wrappers.

:func:`parallelize` applies, in this order (each wrapper sees what the previous one built):

1. activation checkpointing (``compute.activation_checkpointing``), per decoder block;
2. ``torch.compile`` of each block (``compute.compile``): after checkpointing, before sharding,
   so the compiled region is the block and FSDP's hooks stay outside it;
3. ``fully_shard`` on each decoder block, then on the root (embeddings, final norm, head).

Weights stay fp32 (master weights): the model is never cast before sharding, since the optimizer
steps sharded parameters in their original dtype and a bf16 model would train with bf16 masters and
bf16 AdamW state. Under ``bf16-mixed`` FSDP casts the gathered parameters to bf16 for compute
(``MixedPrecisionPolicy.param_dtype``) and reduces gradients in fp32 (``reduce_dtype``); under fp32
nothing is cast. Every parameter becomes a ``DTensor`` sharded on dim 0 (``Shard(0)``), rank *r*
holding rows ``shard_bounds(rows, M)[r]``, uneven when M does not divide the rows.

The inner optimizer must be built after :func:`parallelize` (over the sharded parameters).

    >>> shard_bounds(5, 2)           # torch.chunk's split: ceil(5/2) rows, the rest to the last
    [(0, 3), (3, 5)]
    >>> shard_bounds(2, 4)           # fewer rows than ranks: the last ranks hold nothing
    [(0, 1), (1, 2), (2, 2), (2, 2)]
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from intellect.config import ComputeConfig
from intellect.device import enable_activation_checkpointing, resolve_precision

__all__ = ["decoder_blocks", "mixed_precision", "parallelize", "shard_bounds"]


def shard_bounds(rows: int, ranks: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` rows of dim 0 each of ``ranks`` ranks holds under FSDP2's ``Shard(0)``
    (``torch.chunk``: chunks of ``ceil(rows / ranks)``, the last ones shorter or empty)."""
    if rows < 0 or ranks < 1:
        raise ValueError(f"shard_bounds: need rows >= 0 and ranks >= 1, got {rows}, {ranks}")
    step = -(-rows // ranks) if rows else 0
    return [(min(r * step, rows), min((r + 1) * step, rows)) for r in range(ranks)]


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of ``model``: the modules whose class a ``transformers`` model
    names in ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``...), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise TypeError(f"{type(model).__name__}: no decoder blocks found (its _no_split_modules: {sorted(names)})")
    return blocks


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a resolved precision: bf16 compute for ``bf16-mixed``, fp32 otherwise;
    gradients always reduced in fp32. ``bf16`` (bf16 master weights) is refused: sharding needs fp32
    masters, bf16 compute is ``bf16-mixed``."""
    if precision == "bf16":
        raise ValueError("precision bf16 (bf16 weights and AdamW state) is not sharded; use bf16-mixed "
                         "(fp32 master weights, bf16 compute)")
    if precision not in ("fp32", "bf16-mixed"):
        raise ValueError(f"mixed_precision: unknown precision {precision!r}")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
                                reduce_dtype=torch.float32)


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, compute: ComputeConfig) -> torch.nn.Module:
    """Shard ``model`` (fp32, any device) over the 1-D ``mesh`` (a worker's ranks, e.g.
    :attr:`intellect.diloco.mesh.WorkerMesh.fsdp_mesh`); returns the same module, now an
    ``FSDPModule`` whose parameters are fp32 ``DTensor`` shards on ``mesh``'s device type."""
    if mesh.ndim != 1:
        raise ValueError(f"parallelize: a 1-D mesh of the worker's ranks, got {mesh.ndim}-D")
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("parallelize: the model must be fp32 before sharding (fp32 master weights)")
    policy = mixed_precision(resolve_precision(compute.precision, device))
    model.to(device)
    blocks = decoder_blocks(model)
    if compute.activation_checkpointing:
        enable_activation_checkpointing(model)
    if compute.compile:
        for block in blocks:
            block.compile()  # in place: the module tree and state_dict keys stay as they are
    for i, block in enumerate(blocks):
        # the last block's parameters are gathered again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
