"""Any ``transformers`` causal-LM architecture, configured from :class:`~intellect.config.ModelConfig`.

``arch`` is a transformers ``model_type`` (``llama``, ``qwen2``, ``mistral``, ...). Its config class
comes from ``AutoConfig.for_model`` and is filled from the size fields and the tokenizer, so a new
model needs no download and no model-specific code. Families name the same quantity differently
(``n_inner`` for the MLP width of GPT-2, ``num_key_value_heads`` absent where there is no GQA): a
size field the family cannot take is an error, never silently dropped, since the model would not be
the shape the config says.

    >>> from intellect.model.tokenizer import build_tokenizer
    >>> config = model_config(ModelConfig(arch="qwen2", num_layers=2), build_tokenizer())
    >>> config.model_type, config.vocab_size, config.num_key_value_heads, config.rope_parameters["rope_theta"]
    ('qwen2', 51, 4, 10000.0)
    >>> model_config(ModelConfig(arch="t5"), build_tokenizer())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    intellect.model.arch.ArchError: arch 't5' has no causal-LM model in transformers; supported include llama, ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from intellect.config import ModelConfig

# transformers builds models under process-wide contexts (meta-device init, patched constructors):
# two threads building at once can leave one model with meta tensors, so builds and loads take turns
BUILD_LOCK = threading.Lock()

# Named first in error messages; any other supported model_type works as well.
_WELL_KNOWN = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "phi3", "olmo2", "gpt_neox", "starcoder2")

# HF config name(s) of each size quantity, first match wins.
_NAMES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
    "max_position_embeddings": ("max_position_embeddings",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}
_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "tie_word_embeddings")
_DEFAULT_THETA = ModelConfig.model_fields["rope_theta"].default


class ArchError(ValueError):
    """An ``arch`` transformers cannot build as a causal LM from the size fields; one line."""


def _declared(config_class: type) -> set[str]:
    """Names a config class takes: dataclass fields (transformers 5), ``__init__`` arguments
    (transformers 4), and the aliases of its ``attribute_map``."""
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    names |= set(inspect.signature(config_class.__init__).parameters)
    return names | set(getattr(config_class, "attribute_map", {}))


def _name_in(declared: set[str], field: str) -> str | None:
    return next((n for n in _NAMES[field] if n in declared), None)


def _sizable(model_type: str) -> bool:
    try:
        declared = _declared(CONFIG_MAPPING[model_type])
    except (KeyError, ImportError, AttributeError, ValueError):
        return False
    return all(_name_in(declared, f) for f in _REQUIRED)


@functools.cache
def supported_archs() -> tuple[str, ...]:
    """Every ``model_type`` with a causal-LM model in the installed transformers whose config takes
    the size fields (imports each config class once: about a second)."""
    return tuple(sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if _sizable(mt)))


def _some_supported() -> str:
    known = [a for a in _WELL_KNOWN if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    return f"supported include {', '.join(known)} (all: intellect.model.arch.supported_archs())"


def _uses_rope(config: PretrainedConfig) -> bool:
    return getattr(config, "rope_parameters", None) is not None or hasattr(config, "rope_theta")


def _set_rope_theta(config: PretrainedConfig, theta: float) -> None:
    """Put ``theta`` where this family reads it: transformers 5 keeps it in ``rope_parameters`` (flat,
    or one dict per attention type, where the global ``full_attention`` layers take it and local ones
    keep the family's own), transformers 4 in ``rope_theta``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        nested = [v for v in params.values() if isinstance(v, dict)]
        if not nested:
            params["rope_theta"] = theta
        else:
            targets = [params["full_attention"]] if isinstance(params.get("full_attention"), dict) else nested
            for entry in targets:
                entry["rope_theta"] = theta
    elif hasattr(config, "rope_theta"):
        config.rope_theta = theta


def _token_id(tok, name: str, *, required: bool) -> int | None:
    value = getattr(tok, f"{name}_token_id")
    if value is None and required:
        raise ArchError(f"the tokenizer has no {name} token: generation and document packing need one")
    if value is not None and not isinstance(value, int):
        raise TypeError(f"{name}_token_id must be one token id, got {value!r}")
    return value


def model_config(cfg: ModelConfig, tok) -> PretrainedConfig:
    """The transformers config of a new ``cfg.arch`` model: sizes from ``cfg``, vocabulary and
    special tokens from ``tok`` (``len(tok)`` ids; a tokenizer without a pad token leaves
    ``pad_token_id`` None). Nothing is downloaded."""
    arch = cfg.arch
    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        what = "no causal-LM model" if arch in CONFIG_MAPPING else "no model type of that name"
        raise ArchError(f"arch {arch!r} has {what} in transformers; {_some_supported()}")
    declared = _declared(CONFIG_MAPPING[arch])
    missing = [f for f in _REQUIRED if not _name_in(declared, f)]
    if missing:
        text = f"{arch}_text" if f"{arch}_text" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else None
        hint = f" (a multimodal wrapper: its text model is arch {text!r})" if text else ""
        raise ArchError(f"arch {arch!r} cannot be sized from the config: its transformers config has no "
                        f"{', '.join(missing)}{hint}; {_some_supported()}")
    values = {
        "vocab_size": len(tok), "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    kwargs: dict[str, object] = {}
    for field, value in values.items():
        name = _name_in(declared, field)
        if name is not None:
            kwargs[name] = value
        elif field == "num_kv_heads" and cfg.num_kv_heads != cfg.num_heads:
            raise ArchError(f"arch {arch!r} has no grouped-query attention: set num_kv_heads = num_heads")
    if "head_dim" in declared:  # some families default to a fixed head width, not hidden / heads
        kwargs["head_dim"] = cfg.hidden_size // cfg.num_heads
    if "use_cache" in declared:
        kwargs["use_cache"] = True
    if "is_decoder" in declared:  # encoder families (BERT, RoBERTa, ...) are causal only as decoders
        kwargs["is_decoder"] = True
    for special in ("bos", "eos", "pad"):
        kwargs[f"{special}_token_id"] = _token_id(tok, special, required=special == "eos")
    config = AutoConfig.for_model(arch, **kwargs)
    if _uses_rope(config):
        _set_rope_theta(config, cfg.rope_theta)
    elif cfg.rope_theta != _DEFAULT_THETA:
        raise ArchError(f"arch {arch!r} has no rotary position embedding: rope_theta does not apply")
    return config


def new_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A freshly initialized fp32 causal LM of ``config``, the same weights for the same seed (the
    global RNG is left as it was)."""
    with BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """``config``'s model on the meta device: every shape and no memory, for counting parameters."""
    with BUILD_LOCK, torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
