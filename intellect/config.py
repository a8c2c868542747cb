"""Strict run configs: one pydantic model per component, TOML + env + CLI.

Every model forbids unknown keys and bounds every field, so a typo or an
out-of-range value fails at load time with a one-line message that names the
field and what it accepts::

    >>> load_config(SmokeConfig, overrides=["train.lr=-1"])
    Traceback (most recent call last):
    ...
    intellect.config.ConfigError: invalid config: train.lr: Input should be greater than 0 (got -1)

Precedence, lowest first: model defaults, the TOML file, environment
variables (``INTELLECT_TRAIN__LR=3e-4``; ``__`` separates levels), then CLI
overrides (``train.lr=3e-4``). Values from env and CLI are read as TOML
literals when they parse as one (``3e-4``, ``true``, ``["+", "-"]``) and as
strings otherwise.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

ENV_PREFIX = "INTELLECT_"


class ConfigError(ValueError):
    """A config that does not validate; the message is one line."""


class StrictModel(BaseModel):
    """Base of every config: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------- components


# Named model shapes: a preset fills the size fields a config leaves unset.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": {"arch": "llama", "hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4,
                   "intermediate_size": 384},
    "llama-20m": {"arch": "llama", "hidden_size": 384, "num_layers": 6, "num_heads": 6, "num_kv_heads": 6,
                  "intermediate_size": 1024, "max_position_embeddings": 1024},
    "llama-150m": {"arch": "llama", "hidden_size": 768, "num_layers": 18, "num_heads": 12, "num_kv_heads": 12,
                   "intermediate_size": 2048, "max_position_embeddings": 2048},
    "llama-1b": {"arch": "llama", "hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                 "intermediate_size": 8192, "max_position_embeddings": 4096, "rope_theta": 500000.0},
    "qwen2.5-0.5b": {"arch": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                     "intermediate_size": 4864, "max_position_embeddings": 4096, "rope_theta": 1000000.0},
}
SIZE_FIELDS = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "max_position_embeddings", "rope_theta")


class ModelConfig(StrictModel):
    """A model built from scratch (any ``transformers`` causal-LM architecture, sized by the fields
    below or a named preset), or any local HF checkpoint folder."""

    pretrained: str | None = Field(
        default=None,
        description="Path of a local HF checkpoint folder to load instead of building a new model "
        "(config.json + safetensors + tokenizer files). Nothing is downloaded.",
    )
    preset: str | None = Field(
        default=None,
        description=f"Named shape filling the size fields not set explicitly: {', '.join(MODEL_PRESETS)}.",
    )
    arch: str = Field(
        default="llama", pattern=r"^[a-z0-9_]{1,40}$",
        description="transformers model_type with causal-LM support (llama, qwen2, mistral, ...), built from "
        "the size fields without a download.",
    )
    tokenizer: str | None = Field(
        default=None,
        description="Local HF tokenizer folder (e.g. from `intellect tokenizer train`); None: the built-in "
        "character tokenizer of the arithmetic task. The model's vocabulary follows the tokenizer. A text run "
        "whose folder does not exist yet trains a BPE tokenizer on its corpus there first.",
    )
    tokenizer_vocab: int = Field(
        default=8192, ge=258, le=262144,
        description="Vocabulary size of a BPE tokenizer trained on the corpus (see tokenizer).",
    )
    hidden_size: int = Field(default=128, ge=8, le=8192, description="Width of the residual stream.")
    num_layers: int = Field(default=4, ge=1, le=128, description="Number of decoder blocks.")
    num_heads: int = Field(default=4, ge=1, le=128, description="Attention heads (query).")
    num_kv_heads: int = Field(default=4, ge=1, le=128, description="Key/value heads (GQA when < num_heads).")
    intermediate_size: int = Field(default=384, ge=8, le=65536, description="Width of the SwiGLU MLP.")
    max_position_embeddings: int = Field(
        default=64, ge=8, le=131072, description="Longest sequence (prompt + completion) in tokens."
    )
    rope_theta: float = Field(default=10000.0, gt=0, le=1e8, description="RoPE base frequency.")
    tie_word_embeddings: bool = Field(default=True, description="Share the input embedding and the LM head.")
    init_seed: int = Field(default=0, ge=0, description="Seed of the random initialization.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            shape = MODEL_PRESETS.get(data["preset"])
            if shape is None:
                raise ValueError(f"unknown preset {data['preset']!r}; known: {', '.join(MODEL_PRESETS)}")
            data = {**shape, **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


class TextDataConfig(StrictModel):
    """A text corpus: Parquet, JSONL or plain-text files, local or ``s3://``, read as a stream."""

    files: list[str] = Field(
        default_factory=list, max_length=10000,
        description="Files, directories (searched recursively for the suffixes below) or glob patterns, local "
        "or s3://BUCKET/KEY (a prefix ending in / lists it); the entry 'python:stdlib' is the Python standard "
        "library's own source, a corpus every machine has.",
    )
    column: str = Field(default="text", min_length=1, max_length=128, description="Text column of Parquet/JSONL rows.")
    suffixes: list[str] = Field(
        default=[".parquet", ".jsonl", ".txt", ".md", ".py"], min_length=1,
        description="File suffixes taken from directories and prefixes (.parquet and .jsonl are read by row, "
        "anything else as one document per file).",
    )
    seq_len: int = Field(default=256, ge=8, le=131072, description="Tokens per packed training sequence.")
    document_mask: bool = Field(
        default=False,
        description="Mask attention across the document boundaries inside a packed sequence (each token sees "
        "only its own document); False: causal attention over the whole packed sequence.",
    )
    max_document_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30,
        description="Bytes read of one document at most (longer ones are cut): memory stays bounded whatever "
        "the corpus holds.",
    )
    eval_sequences: int = Field(default=64, ge=1, le=100000, description="Held-out packed sequences per evaluation.")


class DataConfig(StrictModel):
    """The training data: seeded synthetic arithmetic (pretraining text and RL prompts), or a text corpus."""

    kind: Literal["arithmetic", "text"] = Field(
        default="arithmetic", description="arithmetic: the synthetic task; text: the corpus of [data.text].",
    )
    text: TextDataConfig = Field(default_factory=TextDataConfig)
    seed: int = Field(
        default=0, ge=0, description="Seed of the training stream (the held-out split never depends on it).",
    )
    ops: list[Literal["+", "-", "*"]] = Field(
        default=["+", "-", "*"], min_length=1, description="Operators to draw from, uniformly."
    )
    min_digits: int = Field(default=1, ge=1, le=6, description="Fewest digits of an operand.")
    max_digits: int = Field(
        default=2, ge=1, le=6,
        description="Most digits of an operand: the difficulty knob. 2 leaves the pretrained tiny model "
        "a wide spread of pass rates for RL; 3 is far harder.",
    )
    heldout_percent: int = Field(
        default=5, ge=1, le=50,
        description="Share of all problems, or of the corpus's documents (by content hash), reserved for "
        "evaluation; training never sees them.",
    )
    slip_rate: float = Field(
        default=0.0, ge=0, le=0.95,
        description="Share of pretraining documents whose answer carries a sign error (Problem.slip): a "
        "corpus of mixed quality. Held-out answers and RL rewards are always exact.",
    )
    chat: bool = Field(
        default=False,
        description="Arithmetic documents as one-turn chats (the problem as the user's turn, the answer as the "
        "assistant's) in the tokenizer's chat template, and evaluated so; needs model.tokenizer, where a chat "
        "BPE tokenizer is trained on the documents first if the folder does not exist.",
    )

    @model_validator(mode="after")
    def _digits_ordered(self) -> "DataConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        if self.kind == "text" and not self.text.files:
            raise ValueError("data.kind = 'text' needs data.text.files")
        if self.chat and self.kind != "arithmetic":
            raise ValueError("data.chat renders arithmetic documents: set data.kind = 'arithmetic'")
        return self


class StorageConfig(StrictModel):
    """Where a run lives: a local folder or an S3 prefix."""

    url: str = Field(
        default="file://./runs",
        description="Root of all runs: file://PATH or s3://BUCKET/PREFIX. A run is stored under URL/<run_name>.",
    )
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint (MinIO, moto, R2...). Defaults to AWS_ENDPOINT_URL or AWS itself."
    )
    key: str | None = Field(default=None, description="S3 access key id. Defaults to AWS_ACCESS_KEY_ID.")
    secret: SecretStr | None = Field(default=None, description="S3 secret key. Defaults to AWS_SECRET_ACCESS_KEY.")
    region: str | None = Field(default=None, description="S3 region. Defaults to AWS_DEFAULT_REGION.")
    keep_last: int = Field(default=5, ge=1, le=100000, description="Complete steps kept by retention (newest first).")

    @model_validator(mode="after")
    def _scheme_known(self) -> "StorageConfig":
        if not (self.url.startswith("file://") or self.url.startswith("s3://") or "://" not in self.url):
            raise ValueError(f"url must start with file:// or s3:// (got {self.url!r})")
        return self


class DispatchConfig(StrictModel):
    """Where a flow's stages run: as sub-flows in this process (one machine, the default), or as
    flow runs of their deployments (``prefect.yaml``), each on its work pool's workers."""

    mode: Literal["local", "deployments"] = Field(
        default="local", description="local: call each stage flow here; deployments: run_deployment and wait."
    )
    timeout: float = Field(
        default=3600.0, gt=0, le=7 * 86400, description="Seconds to wait for a deployment's flow run to finish."
    )
    poll_interval: float = Field(
        default=1.0, gt=0, le=60, description="Seconds between looks at a dispatched flow run.",
    )
    deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Flow name -> 'flow-name/deployment-name' to run; a flow not listed runs the deployment named "
        "like the flow (e.g. 'rl-generate/rl-generate').",
    )


class TrainConfig(StrictModel):
    """The plain single-process training loop (also DiLoCo's inner loop)."""

    steps: int = Field(default=1000, ge=1, le=10_000_000, description="Optimizer steps.")
    batch_size: int = Field(default=128, ge=1, le=65536, description="Sequences per optimizer step (global batch).")
    micro_batch_size: int = Field(
        default=0, ge=0, le=65536,
        description="Sequences per forward/backward; gradients accumulate over batch_size / micro_batch_size "
        "micro-batches (0: the whole batch at once). Must divide batch_size.",
    )
    lr: float = Field(default=3e-3, gt=0, le=1.0, description="Peak learning rate of AdamW.")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine floor).",
    )
    warmup_steps: int = Field(default=50, ge=0, le=1_000_000, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.01, ge=0, le=1, description="AdamW decoupled weight decay.")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.99, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, description="Max global gradient norm.")
    eval_every: int = Field(default=0, ge=0, le=10_000_000, description="Evaluate every N steps (0: only at the end).")
    eval_size: int = Field(default=256, ge=1, le=100000, description="Held-out problems per evaluation.")
    seed: int = Field(default=0, ge=0, description="Seed of dropout-free training noise (batch order).")
    threads: int = Field(default=0, ge=0, le=1024, description="torch intra-op threads (0: leave torch's default).")

    @model_validator(mode="after")
    def _micro_divides(self) -> "TrainConfig":
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size})"
            )
        return self


class ComputeConfig(StrictModel):
    """Where and in what precision a process computes (:mod:`intellect.device`)."""

    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda|cuda:[0-9]{1,2})$",
        description="auto: CUDA when present (a worker process takes the GPU of its local rank, within "
        "CUDA_VISIBLE_DEVICES), else the CPU; cpu; cuda; cuda:N.",
    )
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = Field(
        default="fp32",
        description="auto (what the text configs say): bf16-mixed where the device computes bf16 fast (a "
        "CUDA GPU of compute capability >= 8.0; a CPU whose measured bf16 matmuls are >= 1.5x fp32's, as "
        "with AMX or AVX512-BF16), else fp32; each process decides it and logs why. fp32 (the default: the "
        "same arithmetic on every machine); bf16-mixed: fp32 master weights and optimizer state, bf16 "
        "autocast compute (DiLoCo's synced copy, pseudo-gradients and outer state stay fp32 on the CPU); "
        "bf16: weights, gradients and optimizer state in bf16.",
    )
    compile: bool = Field(default=False, description="torch.compile the model for training.")
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each decoder block's activations in the backward pass (less memory).",
    )
    peak_tflops: float = Field(
        default=0.0, ge=0, le=100000,
        description="Peak TFLOP/s of one device at the run's precision, for MFU; 0: a table of known GPUs by "
        "name, or on the CPU a matmul benchmark measured once per process.",
    )


class LoggingConfig(StrictModel):
    """Per-step metrics (always a JSONL time series in run storage; TensorBoard event files optionally) and
    the progress lines of long runs (:mod:`intellect.progress`)."""

    every: int = Field(default=1, ge=1, le=1_000_000, description="Write a metrics row every N steps.")
    tensorboard: bool = Field(
        default=False, description="Also write TensorBoard event files in the run folder (the tensorboard extra).",
    )
    progress_seconds: float = Field(
        default=30.0, ge=0.5, le=30.0,
        description="Most seconds between two progress lines of a long run (step, loss, tokens/s, ETA; a "
        "heartbeat while one step runs longer), in the console and the run's logs; also on a terminal.",
    )
    progress_steps: int = Field(
        default=0, ge=0, le=1_000_000, description="Also a progress line every N steps (0: by time only).",
    )


# --------------------------------------------------------------------- runs


class SmokeConfig(StrictModel):
    """The smoke run: build the tiny model, pretrain it briefly, report accuracy."""

    run_name: str = Field(default="smoke", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Folder name of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint_every: int = Field(
        default=0, ge=0, le=10_000_000,
        description="Publish a resumable checkpoint (weights, AdamW state, data position) every N training "
        "steps (0: only the phase's last); a killed run resumes from the newest one, exactly.",
    )
    pass_at_k_samples: int = Field(
        default=8, ge=0, le=64, description="Samples per held-out prompt for the pass-rate report (0: skip)."
    )
    pass_at_k_prompts: int = Field(
        default=128, ge=1, le=100000, description="Held-out prompts in the pass-rate report.",
    )
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature of the pass-rate report.")

    @model_validator(mode="after")
    def _chat_has_tokenizer(self) -> "SmokeConfig":
        if self.data.chat and not self.model.tokenizer:
            raise ValueError("data.chat needs model.tokenizer (a folder; a chat BPE tokenizer is trained there)")
        return self


# --------------------------------------------------------------------- loading

C = TypeVar("C", bound=BaseModel)


def parse_value(text: str) -> Any:
    """Read a CLI/env value as a TOML literal, falling back to the raw string.

    >>> parse_value("3e-4"), parse_value("true"), parse_value('["+", "-"]'), parse_value("a/b")
    (0.0003, True, ['+', '-'], 'a/b')
    """
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(data: dict[str, Any], dotted: Sequence[str], value: Any) -> None:
    node = data
    for part in dotted[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[dotted[-1]] = value


def _allowed_fields(cls: type[BaseModel], loc: Sequence[Any]) -> list[str] | None:
    model: Any = cls
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return sorted(getattr(model, "model_fields", {}))


def format_validation_error(err: ValidationError, cls: type[BaseModel]) -> str:
    """One line per config: ``field.path: what is wrong (got value)`` joined by ``; ``."""
    parts = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not isinstance(p, int)]
        name = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(cls, loc[:-1])
            hint = f"; allowed: {', '.join(allowed)}" if allowed else ""
            parts.append(f"{name}: unknown field{hint}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if e["type"] in ("missing",) or isinstance(e.get("input"), (dict, BaseModel)) else f" (got {e['input']!r})"
        parts.append(f"{name}: {msg}{got}")
    return "; ".join(parts)


def env_overrides(environ: Mapping[str, str], cls: type[BaseModel], prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """Nested dict from ``PREFIX_SECTION__FIELD=value`` variables naming known top-level fields."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(prefix):
            continue
        path = key[len(prefix):].lower().split("__")
        if path[0] in cls.model_fields:
            _set_path(out, path, parse_value(value))
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> C:
    """Build ``cls`` from defaults, a TOML file, ``INTELLECT_*`` env vars and ``a.b=v`` overrides."""
    where = f" {path}" if path else ""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML in {path}: {e}") from None
    _merge(data, env_overrides(os.environ if environ is None else environ, cls))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _set_path(data, key.strip().split("."), parse_value(value.strip()))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config{where}: {format_validation_error(e, cls)}") from None
