"""Build a new model (any causal-LM architecture, :mod:`intellect.model.arch`), and save/load the HF
folder at the heart of every checkpoint.

The HF folder is exactly what ``transformers`` (and so vLLM) loads: ``config.json``,
``model.safetensors``, ``generation_config.json`` and the tokenizer files. The tiny model and a
user's local checkpoint (a Qwen, say) go through the same :func:`load_checkpoint`; nothing is ever
downloaded. A run's checkpoints (this folder plus sidecars, published to run storage and verified by
digest) are :mod:`intellect.checkpoints`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from intellect.config import ModelConfig
from intellect.model.arch import BUILD_LOCK, model_config, new_model
from intellect.model.tokenizer import tokenizer_for

# transformers 5 writes its own class name, which transformers 4 (used by
# many vLLM releases) does not know; the old name loads in both.
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def build_model(cfg: ModelConfig):
    """A freshly initialized ``cfg.arch`` model (seeded by ``cfg.init_seed``) and its tokenizer
    (:func:`~intellect.model.tokenizer.tokenizer_for`), or ``cfg.pretrained`` loaded. Generation pads
    with the tokenizer's pad token, or with EOS when it has none.

    >>> model, tok = build_model(ModelConfig())
    >>> round(sum(p.numel() for p in model.parameters()) / 1e6, 2)   # million parameters
    0.86
    >>> build_model(ModelConfig(arch="qwen2", num_layers=1))[0].config.model_type
    'qwen2'
    """
    if cfg.pretrained:
        return load_checkpoint(cfg.pretrained)
    tok = tokenizer_for(cfg)
    model = new_model(model_config(cfg, tok), cfg.init_seed)
    model.generation_config.pad_token_id = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    return model.eval(), tok


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """Model and tokenizer from a local HF checkpoint folder, in its stored dtype by default."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint folder (no config.json)")
    hf_logging.disable_progress_bar()  # per-shard bars drown the run's own progress output
    with BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok


def load_checkpoint_copy(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """:func:`load_checkpoint` with every parameter in memory of its own: safetensors maps the file
    lazily, so a model that must outlive its folder (a temporary download, a pruned cache) is copied."""
    model, tok = load_checkpoint(path, dtype)
    for p in model.parameters():
        p.data = p.data.clone()
    return model, tok


def make_tokenizer_portable(folder: str | os.PathLike) -> None:
    """Name a saved tokenizer's class as transformers 4 (many vLLM releases) knows it too."""
    cfg_file = Path(folder) / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    if tok_cfg.get("tokenizer_class") in ("TokenizersBackend", _PORTABLE_TOKENIZER_CLASS):
        tok_cfg["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
        cfg_file.write_text(json.dumps(tok_cfg, indent=2))


@contextlib.contextmanager
def weights_as(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[torch.nn.Module]:
    """``model`` with its floating-point parameters cast to ``dtype`` for the duration (None: as they
    are), then holding its own tensors again, untouched: a bf16 copy of fp32 master weights to save,
    never a round trip through bf16. Buffers keep their dtype (RoPE's frequencies stay fp32).

    >>> m = torch.nn.Linear(2, 1)
    >>> with weights_as(m, torch.bfloat16):
    ...     m.weight.dtype
    torch.bfloat16
    >>> m.weight.dtype
    torch.float32
    """
    if dtype is None:
        yield model
        return
    kept = {}
    for p in model.parameters():  # a tied parameter appears once
        if p.is_floating_point() and p.dtype != dtype:
            kept[p] = p.data
            p.data = p.data.to(dtype)
    config = getattr(model, "config", None)
    said = getattr(config, "dtype", None)  # save_pretrained writes the saved dtype into the live config
    try:
        yield model
    finally:
        for p, data in kept.items():
            p.data = data
        if config is not None:
            config.dtype = said


def save_checkpoint(model: PreTrainedModel, tokenizer, path: str | os.PathLike,
                    dtype: torch.dtype | None = None) -> Path:
    """Write an HF folder atomically: assemble in a sibling temp folder, then rename. ``dtype``: the
    weights as written (the model keeps its own, :func:`weights_as`); None: as they are."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    hf_logging.disable_progress_bar()
    try:
        with weights_as(model, dtype):
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        make_tokenizer_portable(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def parameter_count(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
