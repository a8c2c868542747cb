"""torch.compile of the training model on the CPU: inductor starts a compiler (g++) and its worker
processes, so this lives with the tests that start processes."""

from __future__ import annotations

import copy

import pytest
import torch

from intellect.config import ComputeConfig, ModelConfig, TrainConfig
from intellect.device import prepare_model
from intellect.model.checkpoint import build_model
from intellect.train import Trainer
from packed_batch import packed

CPU = torch.device("cpu")


def test_compiled_model_trains_a_step_on_the_cpu_like_the_eager_one():
    model, tok = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                         intermediate_size=64))
    batch = packed(2, length=16)
    eager = Trainer(copy.deepcopy(model), tok, TrainConfig(batch_size=2, warmup_steps=0)).train_step(batch)
    compute = ComputeConfig(device="cpu", compile=True)
    compiled = prepare_model(model, compute, CPU)
    log = Trainer(compiled, tok, TrainConfig(batch_size=2, warmup_steps=0), compute).train_step(batch)
    assert log["loss"] == pytest.approx(eager["loss"], rel=1e-4)
    assert log["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-3)
