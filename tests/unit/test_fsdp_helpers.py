"""Pure helpers of FSDP inside a worker: shard bounds, launcher ranks, the precision policy, the
blocks that are sharded. No process group (the 2-process runs are tests/integration/test_fsdp_worker.py)."""

from __future__ import annotations

import doctest

import pytest
import torch

import intellect.diloco.mesh as mesh_mod
import intellect.diloco.outer_shard as outer_shard_mod
import intellect.parallel as parallel_mod
from intellect.config import ModelConfig
from intellect.diloco.mesh import launcher_ranks
from intellect.diloco.outer_shard import local_params, shard_extents
from intellect.model.checkpoint import build_model
from intellect.parallel import decoder_blocks, mixed_precision, shard_bounds


def test_docstring_examples():
    for mod in (mesh_mod, outer_shard_mod, parallel_mod):
        assert doctest.testmod(mod).failed == 0, mod.__name__


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 45, 51, 64, 75])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_shard_bounds_is_torch_chunk(rows, ranks):
    """FSDP2 shards dim 0 as torch.chunk does; every row exactly once, in rank order."""
    t = torch.arange(rows)
    chunks = list(torch.chunk(t, ranks)) if rows else []
    sizes = [len(c) for c in chunks] + [0] * (ranks - len(chunks))
    bounds = shard_bounds(rows, ranks)
    assert [e - s for s, e in bounds] == sizes
    assert torch.equal(torch.cat([t[s:e] for s, e in bounds]), t)


def test_shard_bounds_rejects_nonsense():
    with pytest.raises(ValueError):
        shard_bounds(4, 0)
    with pytest.raises(ValueError):
        shard_bounds(-1, 2)


def test_shard_extents_cover_the_flat_tensor():
    shape = torch.Size([5, 3, 2])
    extents = shard_extents(shape, 3)
    assert extents == [(0, 12), (12, 24), (24, 30)]
    flat = torch.arange(30).view(shape)
    for (s, e), (rs, re) in zip(extents, shard_bounds(5, 3)):
        assert torch.equal(flat[rs:re].reshape(-1), flat.reshape(-1)[s:e])


def test_launcher_ranks():
    assert launcher_ranks({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == (3, 8)
    assert launcher_ranks({}) == (0, 1)
    with pytest.raises(ValueError):
        launcher_ranks({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError):
        launcher_ranks({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"})


def test_mixed_precision_policy():
    fp32, mixed = mixed_precision("fp32"), mixed_precision("bf16-mixed")
    assert fp32.param_dtype is None and fp32.reduce_dtype == torch.float32
    assert mixed.param_dtype == torch.bfloat16 and mixed.reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="bf16-mixed"):
        mixed_precision("bf16")  # bf16 master weights are what sharding must not do
    with pytest.raises(ValueError):
        mixed_precision("auto")  # resolved before it gets here


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_blocks_are_the_layers(arch):
    model, _ = build_model(ModelConfig(arch=arch, num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=2,
                                       intermediate_size=64))
    blocks = decoder_blocks(model)
    assert blocks == list(model.model.layers)  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError):
        decoder_blocks(torch.nn.Linear(2, 2))


def test_local_params_of_an_unsharded_model_are_its_parameters():
    model = torch.nn.Linear(3, 2)
    assert all(a is b for a, b in zip(local_params(model), model.parameters()))
