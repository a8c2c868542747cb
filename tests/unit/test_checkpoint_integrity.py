"""Checkpoint identity: the whole-folder digest, and readers that refuse a checkpoint rewritten in place
(issue 17, attack 2)."""

from __future__ import annotations

import doctest
import hashlib
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import intellect.checkpoints as checkpoints_mod
import intellect.model.checkpoint as model_checkpoint_mod
import intellect.pretrain as pretrain_mod
import intellect.rl.trainer.grpo as grpo_mod
from intellect.checkpoints import (
    CHECKPOINTS,
    STEP_REPORT,
    CheckpointMismatch,
    fetch,
    file_sha256,
    local_digest,
    publish,
    verified_copy,
)
from intellect.checkpoints import digest as checkpoint_digest
from intellect.config import ModelConfig
from intellect.model.checkpoint import build_model
from intellect.storage import STABLE, RunStorage

Pair = tuple[Any, Any]  # (model, tokenizer)


@pytest.fixture(scope="module")
def model_and_tok():
    return build_model(ModelConfig())


@pytest.fixture
def published(tmp_path, model_and_tok: Pair):
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(*model_and_tok, storage, 0, {STEP_REPORT: {"loss": 1.0}})
    return storage, checkpoint_digest(storage, 0)


def folder(storage, step=0):
    return storage.local_path(storage.step_path(step, CHECKPOINTS))


@pytest.mark.parametrize("module", [checkpoints_mod, model_checkpoint_mod, grpo_mod, pretrain_mod], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_an_honest_checkpoint_loads_with_its_digest(published, model_and_tok):
    storage, digest = published
    assert len(digest) == 64 and int(digest, 16) >= 0
    model, tok = fetch(storage, 0, sha256=digest)
    want = model_and_tok[0].state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    assert len(tok) == len(model_and_tok[1])
    with verified_copy(storage, sha256=digest) as local:  # newest step, same bytes
        assert local_digest(local) == digest
        assert json.loads((local / "rl_step.json").read_text()) == {"loss": 1.0}


def _rewrite_weights(path):
    tensors = load_file(path)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, path, metadata={"format": "pt"})


def _rewrite_tokenizer(path):
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same files, another model
    path.write_text(json.dumps(tok))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: _rewrite_weights(d / "model.safetensors"),
        lambda d: _rewrite_tokenizer(d / "tokenizer.json"),
        lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("silu", "gelu")),
        lambda d: (d / "rl_step.json").write_text(json.dumps({"loss": -129193.0})),
        lambda d: (d / "extra.safetensors").write_bytes(b"\0" * 16),
        lambda d: (d / "generation_config.json").unlink(),
    ],
    ids=["weights", "tokenizer", "config", "sidecar", "added-file", "removed-file"],
)
def test_a_stable_checkpoint_rewritten_in_place_is_refused_before_loading(published, change, monkeypatch):
    storage, digest = published
    change(folder(storage))
    assert storage.is_stable(0, CHECKPOINTS)
    monkeypatch.setattr(checkpoints_mod, "load_checkpoint_copy", lambda *a: pytest.fail("loaded before verifying"))
    with pytest.raises(CheckpointMismatch) as e:
        fetch(storage, 0, sha256=digest)
    assert e.value.step == 0 and e.value.expected == digest and e.value.got == checkpoint_digest(storage, 0)
    assert "step 0" in str(e.value) and digest in str(e.value) and e.value.got in str(e.value)
    assert isinstance(e.value, ValueError)


def test_the_marker_is_not_part_of_the_identity(published):
    storage, digest = published
    marker = folder(storage) / STABLE
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "time": "2000-01-01T00:00:00+00:00"}))
    assert checkpoint_digest(storage, 0) == digest
    fetch(storage, 0, sha256=digest)


def test_the_digest_is_stable_across_republishing_identical_content(published, model_and_tok: Pair, tmp_path):
    storage, digest = published
    storage.delete(storage.step_path(0, CHECKPOINTS), recursive=True)
    publish(*model_and_tok, storage, 0, {STEP_REPORT: {"loss": 1.0}})
    assert checkpoint_digest(storage, 0) == digest
    other = RunStorage(f"file://{tmp_path}/elsewhere")
    publish(*model_and_tok, other, 7, {STEP_REPORT: {"loss": 1.0}})
    assert checkpoint_digest(other, 7) == digest  # the step number and place are not part of it
    publish(*model_and_tok, other, 8, {STEP_REPORT: {"loss": 2.0}})
    assert checkpoint_digest(other, 8) != digest
    # what inference loads is the same in both: the sidecar alone differs
    assert checkpoint_digest(other, 8, inference=True) == checkpoint_digest(other, 7, inference=True)
    assert checkpoint_digest(other, 8, inference=True) != digest


def test_only_complete_checkpoints_have_a_digest(tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    storage.write_bytes("checkpoints/step_3/config.json", b"{}")  # no STABLE: still being written
    with pytest.raises(FileNotFoundError):
        checkpoint_digest(storage, 3)
    with pytest.raises(FileNotFoundError):
        fetch(storage, 3, sha256="0" * 64)


def test_file_hashing_is_streamed_and_exact(tmp_path):
    data = bytes(range(256)) * ((3 << 20) // 256 + 7)  # several chunks and a partial one
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
