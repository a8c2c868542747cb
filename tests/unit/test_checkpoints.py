"""The checkpoint layout: declared sidecars, what inference receives, the saved step report, and the
checkpoints a run has recorded."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from intellect.checkpoints import (
    CHECKPOINTS,
    STEP_REPORT,
    TRAINER_ONLY,
    CheckpointMismatch,
    SavedStepReport,
    Sidecar,
    adopt,
    digest,
    fetch_recorded,
    inference_files,
    load_step_report,
    publish,
    record,
    recorded_copy,
    recorded_digest,
    recorded_steps,
    verified_copy,
)
from intellect.config import ModelConfig
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model, save_checkpoint
from intellect.storage import STABLE, RunStorage
from intellect.trust.keys import SigningKey

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
Pair = tuple[Any, Any]  # (model, tokenizer)
REPORT = SavedStepReport(policy_step=0, trained_samples=3, loss=0.5, clip_fraction=0.1, ratio_max=1.2,
                         grad_norm=0.3, tokens=40, train_seconds=0.25)


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.duckdb") as led:
        yield led


def every_sidecar() -> dict:
    return {s: REPORT if s is STEP_REPORT else {"s": s.value} if s.value.endswith(".json") else b"\1" * 8
            for s in Sidecar}


def test_no_sidecar_is_for_inference_and_none_is_an_hf_file(tiny: Pair, tmp_path):
    assert TRAINER_ONLY == {s.value for s in Sidecar} and not any(s.for_inference for s in Sidecar)
    hf = {p.name for p in save_checkpoint(*tiny, tmp_path / "m").iterdir()}
    assert not hf & {s.value for s in Sidecar}
    assert inference_files([*hf, *TRAINER_ONLY, STABLE, ".tmp-x"]) == sorted(hf)


def test_publish_writes_only_declared_sidecars(tiny: Pair, tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    with pytest.raises(ValueError, match="not a valid Sidecar"):
        publish(*tiny, storage, 0, {"optimizer_state.pt": b"moments"})  # pyright: ignore[reportArgumentType]
    assert not storage.exists(storage.step_path(0, CHECKPOINTS))
    # a declared name stands for its sidecar
    uri = publish(*tiny, storage, 0, {"optimizer.pt": b"moments"})  # pyright: ignore[reportArgumentType]
    assert uri == storage.uri(storage.step_path(0, CHECKPOINTS))
    assert storage.read_bytes(f"{storage.step_path(0, CHECKPOINTS)}/{Sidecar.OPTIMIZER}") == b"moments"


def test_a_bf16_publish_writes_the_weights_rounded_and_leaves_the_model_as_it_was(tiny: Pair, tmp_path):
    import torch  # noqa: PLC0415 - only here

    from intellect.model.checkpoint import load_checkpoint, weights_as  # noqa: PLC0415

    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(model, tok, storage, 0, dtype=torch.bfloat16)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)
    assert getattr(model.config, "dtype", None) != torch.bfloat16  # the live config says what the model holds
    with verified_copy(storage, 0) as folder:
        loaded, _ = load_checkpoint(folder)
    assert loaded.config.dtype == torch.bfloat16
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name].to(torch.bfloat16)), name
    with pytest.raises(RuntimeError), weights_as(model, torch.bfloat16):  # restored even when the block fails
        raise RuntimeError("save failed")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_shardcast_receives_the_inference_files_and_no_sidecar(tiny: Pair, tmp_path):
    from intellect.rl.config import RLRunConfig  # noqa: PLC0415 - the RL side only in the test of it
    from intellect.rl.trainer.publish import publish_to_origin  # noqa: PLC0415
    from intellect.shardcast.store import VersionStore  # noqa: PLC0415

    storage = RunStorage(f"file://{tmp_path}/run")
    publish(*tiny, storage, 1, every_sidecar())
    folder = storage.local_path(storage.step_path(1, CHECKPOINTS))
    assert folder is not None
    names = [p.name for p in folder.iterdir()]
    assert set(TRAINER_ONLY) <= set(names)
    cfg = RLRunConfig.model_validate({"shardcast": {"shard_size": 4096}})
    out = publish_to_origin(cfg, storage, 1, tmp_path / "origin", signing_key=SigningKey.from_seed(b"\2" * 32))
    manifest = VersionStore(tmp_path / "origin").manifest(1)
    assert manifest is not None
    shipped = [f.name for f in manifest.files]
    assert out["published"] and shipped == inference_files(names) and not set(shipped) & TRAINER_ONLY
    assert digest(storage, 1, inference=True) != digest(storage, 1)


def test_the_step_report_round_trips_through_a_recorded_checkpoint(tiny: Pair, tmp_path, ledger):
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(*tiny, storage, 1, {STEP_REPORT: REPORT})
    record(storage, ledger, 1)
    with recorded_copy(storage, ledger, 1) as folder:
        got = load_step_report(folder)
    assert got == REPORT and got.loss == 0.5 and got.tokens == 40
    assert SavedStepReport(policy_step=2, trained_samples=0).loss is None


@pytest.mark.parametrize("bad", [
    {"policy_step": 0, "trained_samples": 1, "advantage": 9.0},
    {"policy_step": 0, "trained_samples": -1},
    {"trained_samples": 1},
], ids=["unknown-field", "negative", "missing"])
def test_a_malformed_step_report_is_refused(bad):
    with pytest.raises(ValidationError):
        SavedStepReport.model_validate(bad)


def test_only_recorded_checkpoints_are_used_and_adopted(tiny: Pair, tmp_path, ledger):
    storage = RunStorage(f"file://{tmp_path}/run")
    publish(*tiny, storage, 0)
    with pytest.raises(FileNotFoundError, match="not recorded"):
        recorded_digest(ledger, 0)
    assert recorded_steps(storage, ledger) == [] and not adopt(storage, ledger, 0)
    assert not storage.exists(storage.step_path(0, CHECKPOINTS))  # unrecorded: deleted, to be written again

    publish(*tiny, storage, 0)
    uri = record(storage, ledger, 0)
    assert ledger.checkpoint(0) == (uri, digest(storage, 0)) == (uri, recorded_digest(ledger, 0))
    assert recorded_steps(storage, ledger) == [0] and adopt(storage, ledger, 0)
    fetch_recorded(storage, ledger, 0)

    rel = f"{storage.step_path(0, CHECKPOINTS)}/config.json"
    storage.write_bytes(rel, storage.read_bytes(rel) + b" ")
    with pytest.raises(CheckpointMismatch):
        fetch_recorded(storage, ledger, 0)
    assert not adopt(storage, ledger, 0) and not storage.exists(storage.step_path(0, CHECKPOINTS))
