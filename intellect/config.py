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


class ModelConfig(StrictModel):
    """The tiny Llama built from scratch, or any local HF checkpoint folder."""

    pretrained: str | None = Field(
        default=None,
        description="Path of a local HF checkpoint folder to load instead of building a new model "
        "(config.json + safetensors + tokenizer files). Nothing is downloaded.",
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


class DataConfig(StrictModel):
    """Seeded synthetic arithmetic: pretraining text and RL prompts."""

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
        description="Share of all problems (by content hash) reserved for evaluation; training never sees them.",
    )
    slip_rate: float = Field(
        default=0.0, ge=0, le=0.95,
        description="Share of pretraining documents whose answer carries a sign error (Problem.slip): a "
        "corpus of mixed quality. Held-out answers and RL rewards are always exact.",
    )

    @model_validator(mode="after")
    def _digits_ordered(self) -> "DataConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
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
    batch_size: int = Field(default=128, ge=1, le=65536, description="Sequences per optimizer step.")
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


class DilocoConfig(StrictModel):
    """DiLoCo outer loop, int8 all-reduce and elastic membership."""

    workers: int = Field(default=2, ge=1, le=64, description="Worker processes the coordinator starts.")
    inner_steps: int = Field(default=50, ge=1, le=100000, description="H: inner AdamW steps between outer steps.")
    outer_steps: int = Field(default=10, ge=1, le=1_000_000, description="Outer steps of the run.")
    outer_lr: float = Field(default=0.7, gt=0, le=10, description="Outer SGD learning rate.")
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, description="Outer SGD momentum.")
    nesterov: bool = Field(default=True, description="Nesterov momentum for the outer step.")
    algorithm: Literal["auto", "direct", "ring-residual", "ring-owner", "ring"] = Field(
        default="auto",
        description="int8 all-reduce. auto: per membership, from the bandwidth probe, whichever of direct and "
        "ring-owner (on the solved ring) has the smaller link-bandwidth bound: ring-owner when a pair is far "
        "slower than the solved ring's slowest link, else direct (also when "
        "unmeasured: fewer than 3 workers or bandwidth_probe_bytes 0); "
        "direct: each chunk straight to its owner, each result straight to all "
        "(fewest bytes, every value quantized twice, all-to-all; a slow pair slows it); ring-residual: ring "
        "neighbours only, partial sums sent with an int8 residual (lowest error, 1.5x bytes); ring-owner: "
        "ring relaying the original contributions; ring: classic, requantizes every hop (error grows with W).",
    )
    clip_sigmas: list[float] = Field(
        default=[4.0, 6.0], min_length=1, max_length=4,
        description="Quantizer clip ranges in standard deviations; each chunk uses whichever fits it best.",
    )
    wire_codec: Literal["none", "zstd"] = Field(
        default="zstd",
        description="Coding of the int8 indices on the wire. zstd: entropy-coded, fewer bytes for some CPU per "
        "byte, so it pays on slow links; sent raw when coding saves nothing. none: raw uint8 (fast links, "
        "CPU-starved hosts). Peers may differ; NCCL groups always send raw.",
    )
    data_split: Literal["iid", "non_iid"] = Field(
        default="iid",
        description="iid: every worker draws from all ops; non_iid: worker i only from ops[i % len(ops)].",
    )
    heartbeat_interval: float = Field(default=2.0, gt=0, le=60, description="Seconds between heartbeats.")
    heartbeat_timeout: float = Field(
        default=10.0, gt=0, le=600, description="Seconds without a heartbeat before a peer is dead.",
    )
    collective_timeout: float = Field(
        default=60.0, gt=0, le=3600, description="Bound on one all-reduce (gloo timeout).",
    )
    boundary_timeout: float = Field(
        default=120.0, gt=0, le=86400, description="Longest wait at an outer-step boundary for slower peers."
    )
    bandwidth_probe_bytes: int = Field(
        default=1 << 20, ge=0, le=1 << 30,
        description="Bytes sent each way per worker pair to measure throughput when membership changes; "
        "the ring follows the max-min-bandwidth cycle (0: fixed order).",
    )
    store_host: str = Field(
        default="127.0.0.1",
        description="Address of the rendezvous store (the coordinator). It authenticates every request with the "
        "run secret, but values and gloo's traffic travel in clear: off one machine, use a private network "
        "(WireGuard) or TLS.",
    )
    secret_file: str | None = Field(
        default=None,
        description="File holding the run secret (hex, at least 32 digits, mode 0600), held by the coordinator; "
        "the environment variable INTELLECT_DILOCO_SECRET (hex) takes precedence. Unset: the coordinator makes a "
        "fresh secret. Workers it starts never get the secret, only their own rendezvous key and the all-reduce "
        "root derived from it (local: in their environment; deployments: in the flow run's job variables, i.e. "
        "to whoever can read the Prefect API). A worker given the secret file itself derives its own keys. "
        "Never part of the config itself, which travels as flow-run parameters.",
    )
    rendezvous_window: float = Field(
        default=60.0, ge=5, le=3600,
        description="Seconds a rendezvous request's timestamp may differ from the store's clock (hosts need NTP); "
        "nonces are remembered that long, so a captured request cannot be sent again.",
    )
    outlier_clip: float = Field(
        default=4.0, ge=0, le=1000,
        description="Robust aggregation (direct and ring-owner all-reduces, 3+ contributors): each owner clips "
        "every contribution to its chunk to this many times the median distance from the coordinate-wise "
        "median (centred clip) and flags those it clipped; 0 turns it off (plain mean).",
    )
    exclude_after: int = Field(
        default=2, ge=1, le=1000,
        description="Committed outer steps in which a majority of the members flagged a worker as an outlier "
        "before it is banned from the run.",
    )
    store_port: int = Field(default=0, ge=0, le=65535, description="Port of the rendezvous store (0: pick a free one).")
    checkpoint_every: int = Field(
        default=1, ge=1, le=1_000_000, description="Publish an outer checkpoint every N outer steps.",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=100, description="All-reduce attempts per outer step before giving up.",
    )

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> "DilocoConfig":
        if not all(0 < c <= 64 for c in self.clip_sigmas):
            raise ValueError(f"clip_sigmas must lie in (0, 64] (got {self.clip_sigmas})")
        if self.outlier_clip and self.outlier_clip < 1:
            raise ValueError(f"outlier_clip must be 0 (off) or at least 1 (got {self.outlier_clip})")
        if self.outlier_clip and self.algorithm in ("ring", "ring-residual"):
            raise ValueError(f"algorithm {self.algorithm!r} sends partial sums, so no owner sees a contribution "
                             "to clip: set outlier_clip = 0 to run it without robust aggregation")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )
        return self


# --------------------------------------------------------------------- runs


class SmokeConfig(StrictModel):
    """The smoke run: build the tiny model, pretrain it briefly, report accuracy."""

    run_name: str = Field(default="smoke", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Folder name of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    pass_at_k_samples: int = Field(
        default=8, ge=0, le=64, description="Samples per held-out prompt for the pass-rate report (0: skip)."
    )
    pass_at_k_prompts: int = Field(
        default=128, ge=1, le=100000, description="Held-out prompts in the pass-rate report.",
    )
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature of the pass-rate report.")


class DilocoRunConfig(StrictModel):
    """A DiLoCo pretraining run: N workers, each training the model on its own data shard."""

    run_name: str = Field(default="diloco", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Folder name of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig, description="The inner loop (train.steps is ignored).")
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    dispatch: DispatchConfig = Field(
        default_factory=DispatchConfig,
        description="Where the workers run: subprocesses of the coordinator (local), or flow runs of the "
        "diloco-worker deployment on its work pool (deployments; diloco.store_host must be reachable from there).",
    )


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
