"""An HF checkpoint folder's weights, read into memory and copied into a running model in place.

An engine that holds a policy takes the next one as a folder (:meth:`TorchEngine.update_weights
<intellect.inference.torch_engine.TorchEngine.update_weights>`): every parameter keeps its storage,
device and dtype, so nothing that points at the model (hooks, a compiled graph, a KV-cache layout) has
to be rebuilt. HF writes a tied parameter once (the LM head of a model with tied embeddings is the
input embedding), so a key the folder leaves out is accepted only when its tensor is one the folder
fills.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: the index's shards, else ``model.safetensors``."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        shards = json.loads((folder / INDEX).read_text())["weight_map"].values()
        return [folder / name for name in sorted(set(shards))]
    if not (folder / SINGLE).is_file():
        raise FileNotFoundError(f"{folder} holds no {SINGLE} nor {INDEX}")
    return [folder / SINGLE]


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, on the CPU, in the stored dtype."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        state.update(load_file(path, device="cpu"))
    return state


def load_in_place(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s own tensors (each keeps its device and dtype).

    ``ValueError`` when a key is not the model's, when a shape differs, or when a tensor of the model
    is left out and is not tied to one ``state`` fills: a folder of another architecture never loads
    half-way into the model.

    >>> lin = torch.nn.Linear(2, 1)
    >>> load_in_place(lin, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
    >>> lin.weight.tolist()
    [[1.0, 1.0]]
    """
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(f"the folder's weights name tensors the model lacks: {unknown[:4]}")
    shapes = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if shapes:
        raise ValueError(f"shapes differ from the model's: {[(k, tuple(state[k].shape)) for k in shapes[:4]]}")
    filled = {own[k].data_ptr() for k in state}
    left = sorted(k for k in set(own) - set(state) if own[k].data_ptr() not in filled)
    if left:
        raise ValueError(f"the folder leaves out tensors of the model that are not tied to one it holds: {left[:4]}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
