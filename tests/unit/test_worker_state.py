"""A DiLoCo worker's saved state (inner AdamW, data position): a garbled or foreign copy costs a fresh
AdamW and the shard's start, with the reason logged, never the worker and never a half-loaded optimizer."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from intellect.checkpoints import DATA_MEMBERS, DATA_STATE, IN_FLIGHT, OPTIMIZER
from intellect.config import DataConfig, TrainConfig
from intellect.data.stream import DocumentStream, resume_stream
from intellect.diloco import worker_state
from intellect.storage import RunStorage
from intellect.train import Trainer


def _trainer(width: int = 4, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
    return Trainer(model, None, TrainConfig(steps=10, lr=1e-2, warmup_steps=0))


def _stepped(width: int = 4) -> Trainer:
    t = _trainer(width)
    loss = t.model(torch.randn(8, width)).pow(2).mean()
    loss.backward()
    t.optimizer.step()
    t.step = 7
    return t


def _moments(t: Trainer) -> list[torch.Tensor]:
    return [v.clone() for s in t.optimizer.state.values() for k, v in sorted(s.items()) if k != "step"]


@pytest.fixture
def storage(tmp_path) -> RunStorage:
    return RunStorage(f"file://{tmp_path}/run")


def _save(storage: RunStorage, trainer_bytes: bytes, data: bytes, step: int = 2) -> None:
    storage.write_step(step, worker_state.state_kind("w0"), {OPTIMIZER.value: trainer_bytes, DATA_STATE.value: data})


def test_a_saved_state_restores_adamw_and_the_data_position(storage):
    source, stream = _stepped(), DocumentStream(DataConfig(seed=1))
    stream.next_batch(5)
    worker_state.save(storage, "w0", worker_state.WorkerState(2, source.state_bytes(), stream.state_dict()), keep=2)
    target = _trainer()
    saved, why = worker_state.restore(storage, "w0", 3, target)  # checkpoint 3: the newest state up to it
    assert saved is not None and saved.step == 2 and why == ""
    assert target.step == 7 and all(torch.equal(a, b) for a, b in zip(_moments(target), _moments(source)))
    resumed = resume_stream(DocumentStream(DataConfig(seed=1)), saved.data,
                                         lambda: DocumentStream(DataConfig(seed=1)))
    assert resumed.next_batch(2) == stream.next_batch(2)


@pytest.mark.parametrize("garble", [
    b"", b"not a zip at all", b"PK\x03\x04" + b"\x00" * 64,  # truncated zip
])
def test_a_garbled_optimizer_file_gives_a_fresh_adamw_with_the_reason(storage, garble):
    _save(storage, garble, json.dumps({"version": 1}).encode())
    target = _trainer()
    saved, why = worker_state.restore(storage, "w0", 2, target)
    assert saved is None and "unreadable" in why and "not a trainer state file" in why
    assert target.step == 0 and not target.optimizer.state


def test_an_optimizer_file_larger_than_any_state_of_the_model_is_refused_unread(storage, monkeypatch):
    """Anyone with the run's storage credentials could leave a huge file for a rejoiner to load."""
    target = _trainer()
    _save(storage, b"\0" * (target.max_state_bytes() + 1), json.dumps({"version": 1}).encode())
    asked: list[int | None] = []
    read = RunStorage.read_bytes
    monkeypatch.setattr(RunStorage, "read_bytes", lambda self, rel, max_bytes=None: (
        asked.append(max_bytes), read(self, rel, max_bytes))[1])
    saved, why = worker_state.restore(storage, "w0", 2, target)
    assert saved is None and f"over {target.max_state_bytes()} bytes" in why
    assert None not in asked  # every file of the state was read with a bound
    assert target.step == 0 and not target.optimizer.state
    assert len(_stepped().state_bytes()) <= _trainer().max_state_bytes()


def test_another_models_state_is_refused_before_anything_changes(storage):
    _save(storage, _stepped(width=6).state_bytes(), b"{}")  # same structure, other shapes
    target = _stepped(width=4)
    before = _moments(target)
    saved, why = worker_state.restore(storage, "w0", 2, target)
    assert saved is None and "does not fit its shape" in why
    assert target.step == 7 and all(torch.equal(a, b) for a, b in zip(_moments(target), before))


@pytest.mark.parametrize("edit, reason", [
    (lambda s: s.update(step=-3), "step count"),
    (lambda s: s.update(step=True), "step count"),
    (lambda s: s.pop("optimizer"), "no optimizer state"),
    (lambda s: s["optimizer"]["param_groups"].pop(), "parameter groups differ"),
    (lambda s: s["optimizer"]["state"].update({99: {}}), "names parameter 99"),
    (lambda s: s.update(rng=torch.zeros(3)), "generator state"),
])
def test_each_malformed_part_of_a_trainer_state_is_named(edit, reason):
    state = _stepped().state_dict()
    edit(state)
    target = _trainer()
    with pytest.raises(ValueError, match=reason):
        target.load_state_dict(state)
    assert not target.optimizer.state and target.step == 0


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"x" * (worker_state.MAX_STATE_JSON + 1)])
def test_a_garbled_data_position_gives_a_fresh_adamw_too(storage, data):
    _save(storage, _stepped().state_bytes(), data)
    saved, why = worker_state.restore(storage, "w0", 2, _trainer())
    assert saved is None and "unreadable" in why


def test_a_position_that_does_not_fit_the_stream_reads_the_shard_from_its_start(caplog):
    other = DocumentStream(DataConfig(seed=2))
    other.next_batch(3)
    caplog.set_level(logging.WARNING)
    for state in (other.state_dict(), {"version": 1, "kind": "arithmetic"}, {"read": "many"}):
        stream = resume_stream(DocumentStream(DataConfig(seed=1)), state,
                                            lambda: DocumentStream(DataConfig(seed=1)))
        assert stream.read == 0 and stream.next_batch(2) == DocumentStream(DataConfig(seed=1)).next_batch(2)
    assert caplog.text.count("does not fit") == 3


@pytest.mark.parametrize("reached", [None, b"[", b'{"members": "w0", "rows_per_step": 5}',
                                     b'{"members": ["w0", "w0"], "rows_per_step": -1}', b"x" * (2 << 20)])
def test_what_a_position_was_reached_under_round_trips_and_a_garbled_record_counts_as_stale(storage, reached):
    source = _stepped()
    state = worker_state.WorkerState(2, source.state_bytes(), {"read": 0}, ["w0", "w1"], 42)
    worker_state.save(storage, "w0", state, keep=2)
    saved, _ = worker_state.restore(storage, "w0", 2, _trainer())
    assert saved is not None and (saved.members, saved.rows_per_step) == (["w0", "w1"], 42)
    rel = f"{storage.step_path(2, worker_state.state_kind('w0'))}/{DATA_MEMBERS.value}"
    storage.delete(rel)
    if reached is not None:
        storage.write_bytes(rel, reached)
    saved, why = worker_state.restore(storage, "w0", 2, _trainer())
    # the AdamW state and position still load; the worker realigns its position with the members'
    assert saved is not None and why == "" and (saved.members, saved.rows_per_step) == ([], 0)


def test_the_pseudo_gradient_in_flight_round_trips_and_a_garbled_one_gives_a_fresh_state(storage):
    # overlap: the worker's own pseudo-gradient of the step in flight at its checkpoint
    flat = torch.arange(6, dtype=torch.float32)
    state = worker_state.WorkerState(2, _stepped().state_bytes(), {"version": 1}, in_flight=flat)
    worker_state.save(storage, "w0", state, keep=2)
    saved, why = worker_state.restore(storage, "w0", 2, _trainer())
    assert saved is not None and why == "" and saved.in_flight is not None and torch.equal(saved.in_flight, flat)
    rel = storage.step_path(2, worker_state.state_kind("w0"))
    for bad in (b"not a zip", torch.tensor([[1.0, 2.0]]), torch.tensor([1.0, float("nan")]), torch.tensor([1, 2])):
        if isinstance(bad, torch.Tensor):
            buf = io.BytesIO()
            torch.save({"pseudo_gradient": bad}, buf)
            bad = buf.getvalue()
        storage.write_bytes(f"{rel}/{IN_FLIGHT.value}", bad)
        target = _trainer()
        saved, why = worker_state.restore(storage, "w0", 2, target)
        assert saved is None and "unreadable" in why and not target.optimizer.state
