"""Build the tiny Llama, and save/load the HF folder at the heart of every checkpoint.

The HF folder is exactly what ``transformers`` (and so vLLM) loads: ``config.json``,
``model.safetensors``, ``generation_config.json`` and the tokenizer files. The tiny model and a
user's local checkpoint (a Qwen, say) go through the same :func:`load_checkpoint`; nothing is ever
downloaded. A run's checkpoints (this folder plus sidecars, published to run storage and verified by
digest) are :mod:`intellect.checkpoints`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from intellect.config import ModelConfig
from intellect.model.tokenizer import build_tokenizer

# transformers builds models under process-wide contexts (meta-device init, patched constructors):
# two threads loading at once can leave one model with meta tensors, so loads take turns
_LOAD_LOCK = threading.Lock()

# transformers 5 writes its own class name, which transformers 4 (used by
# many vLLM releases) does not know; the old name loads in both.
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _token_id(value: object) -> int:
    """The id of one special token of :func:`build_tokenizer` (which defines each as one token)."""
    if not isinstance(value, int):
        raise TypeError(f"expected a special token id, got {value!r}")
    return value


def build_model(cfg: ModelConfig):
    """A freshly initialized tiny Llama and its tokenizer, or ``cfg.pretrained`` loaded.

    >>> model, tok = build_model(ModelConfig())
    >>> round(sum(p.numel() for p in model.parameters()) / 1e6, 2)   # million parameters
    0.86
    """
    if cfg.pretrained:
        return load_checkpoint(cfg.pretrained)
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=_token_id(tok.bos_token_id),
        eos_token_id=_token_id(tok.eos_token_id),
        pad_token_id=_token_id(tok.pad_token_id),
        use_cache=True,
    )
    with _LOAD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.float().eval(), tok


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """Model and tokenizer from a local HF checkpoint folder, in its stored dtype by default."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint folder (no config.json)")
    hf_logging.disable_progress_bar()  # per-shard bars drown the run's own progress output
    with _LOAD_LOCK:
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


def save_checkpoint(model: PreTrainedModel, tokenizer, path: str | os.PathLike) -> Path:
    """Write an HF folder atomically: assemble in a sibling temp folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        cfg_file = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_file.read_text())
        if tok_cfg.get("tokenizer_class") == "TokenizersBackend":
            tok_cfg["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
            cfg_file.write_text(json.dumps(tok_cfg, indent=2))
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
