"""Checkpoints on S3 (a moto server on 127.0.0.1): the same digest as on local disk, verified on fetch."""

from __future__ import annotations

import pytest

from intellect.checkpoints import CHECKPOINTS, STEP_REPORT, CheckpointMismatch, fetch, publish
from intellect.checkpoints import digest as checkpoint_digest
from intellect.config import ModelConfig
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage


@pytest.mark.slow
def test_s3_checkpoints_have_the_same_digest_and_are_verified(tmp_path, s3_storage: RunStorage):
    model_and_tok = build_model(ModelConfig())
    local = RunStorage(f"file://{tmp_path}/run")
    publish(*model_and_tok, local, 0, {STEP_REPORT: {"loss": 1.0}})
    digest = checkpoint_digest(local, 0)
    publish(*model_and_tok, s3_storage, 0, {STEP_REPORT: {"loss": 1.0}})
    assert checkpoint_digest(s3_storage, 0) == digest
    fetch(s3_storage, 0, sha256=digest)
    rel = f"{s3_storage.step_path(0, CHECKPOINTS)}/tokenizer.json"
    s3_storage.write_bytes(rel, s3_storage.read_bytes(rel).replace(b'"<unk>"', b'"<UNK>"', 1))
    with pytest.raises(CheckpointMismatch):
        fetch(s3_storage, 0, sha256=digest)
