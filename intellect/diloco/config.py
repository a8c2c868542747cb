"""The configs of a DiLoCo run: the outer loop and its all-reduce (:class:`DilocoConfig`), and the
run that composes it with the model, data, inner loop and compute (:class:`DilocoRunConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from intellect.config import (ComputeConfig, DataConfig, DispatchConfig, LoggingConfig, ModelConfig, StorageConfig,
                              StrictModel, TrainConfig)
from intellect.diloco.stragglers import StragglerPolicy
from intellect.trust.keys import VerifyKey


class DilocoConfig(StrictModel):
    """DiLoCo outer loop, int8 all-reduce and elastic membership."""

    workers: int = Field(default=2, ge=1, le=64, description="Worker processes the coordinator starts.")
    ranks_per_worker: int = Field(
        default=1, ge=1, le=64,
        description="M: processes per worker (one per device on GPUs). Inside a worker FSDP2 shards the model, "
        "its gradients and AdamW state over its M ranks; across workers local rank i all-reduces only its own "
        "shard with local rank i of the others (M rings, each 1/M of the bytes). Every worker of a run has the "
        "same M; a worker's first process starts the other M-1. 1: one process holds the whole model.",
    )
    onboarding: Literal["blocking", "non_blocking"] = Field(
        default="blocking",
        description="How a joiner (a new or restarted worker) gets the run's state. blocking: the members wait at "
        "the boundary for newcomers starting up, then for the broadcast of the outer state (INTELLECT-1's first "
        "mode). non_blocking: the members go on without waiting; the joiner enters at the next boundary it "
        "reaches, trains nothing in that step while the onboarding source sends it the state in the background "
        "(rank to rank), and contributes from the step after.",
    )
    overlap: Literal["none", "delayed", "eager"] = Field(
        default="none",
        description="Whether the next inner phase waits for the outer step. none: every worker waits for the "
        "all-reduce, then takes the outer step (INTELLECT-1). delayed: the pseudo-gradient of phase t is reduced "
        "while phase t+1 trains from the outer parameters with the averages up to t-1, and applied one phase late "
        "(PCCL's async DiLoCo). eager: as delayed, but phase t+1 starts from those outer parameters after one "
        "outer step on the worker's own fresh pseudo-gradient at weight 1/n (n: the step's members; DeepMind's "
        "eager updates; eager_weight sets another), so nothing waits on the network and the own step is not one "
        "phase stale. Either way "
        "the committed outer parameters stay bit-identical on every member (their DIGEST), a step that fails "
        "to reduce is rolled back everywhere, and the run's last step is drained before it ends. Needs "
        "non_blocking onboarding: a joiner takes the state of the step in flight once its source committed it.",
    )
    eager_weight: float | None = Field(
        default=None, gt=0, le=1,
        description="overlap eager: the weight of the worker's own fresh pseudo-gradient in the outer step its "
        "next phase starts from. Unset: 1/n (DeepMind's eager update: its own share of the average). 1: its "
        "own pseudo-gradient stands in for the members' average it does not have yet (the best guess of where "
        "the committed step will land when the members' pseudo-gradients agree). Only where the next phase "
        "starts: the committed outer step is the members' average either way.",
    )
    inner_steps: int = Field(default=50, ge=1, le=100000, description="H: inner AdamW steps between outer steps.")
    outer_steps: int = Field(default=10, ge=1, le=1_000_000, description="Outer steps of the run.")
    outer_lr: float = Field(default=0.7, gt=0, le=10, description="Outer SGD learning rate.")
    outer_momentum: float = Field(
        default=0.5, ge=0, lt=1,
        description="Outer SGD momentum. Unless set: 0.5 from scratch, 0.7 when the run continues a checkpoint "
        "(model.pretrained). Not the DiLoCo paper's 0.9: on a real corpus at H=50, from scratch 0.5 ties plain "
        "averaging and beats 0.7 and 0.9; from a warm start 0.7 beats 0.5, 0.9 and averaging "
        "(the ablation: docs/diloco.md).",
    )
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
    compression: Literal["int8", "fp32", "topk"] = Field(
        default="int8",
        description="What the all-reduce sends per value. int8: a codebook index (the quantizer above). fp32: the "
        "pseudo-gradient's values as they are, 4 bytes each: the exact mean (up to fp32 summation order, "
        "bit-identical on every member) for 4x the bytes; for equivalence checks (sharded vs unsharded "
        "workers) and as the full-precision baseline. topk: of pseudo-gradient + error-feedback residual, the "
        "topk_k largest of each topk_chunk values, 2 bits each with Rice-coded indices (about 0.16 bits per "
        "parameter at the defaults, at most 0.234), sent to every member and averaged per index "
        "(intellect/diloco/topk_reduce.py); "
        "algorithm, clip_sigmas and wire_codec do not apply, outlier_clip does (3+ contributors). Every member "
        "must use the same (the plan digest checks).",
    )
    topk_chunk: int = Field(
        default=4096, ge=64, le=1 << 20,
        description="compression topk: values per chunk; indices take ceil(log2(topk_chunk)) bits (12 at 4096).",
    )
    topk_k: int = Field(
        default=64, ge=1, le=4096,
        description="compression topk: values sent per chunk (64 of 4096: 1.56%, SparseLoCo's density); the rest "
        "waits in the error-feedback residual. At most topk_chunk.",
    )
    topk_decay: float = Field(
        default=1.0, gt=0, le=1,
        description="compression topk: the residual is multiplied by this before the next pseudo-gradient is "
        "added (1: nothing unsent is forgotten; SparseLoCo uses 0.95).",
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
    contributors: list[str] = Field(
        default=[], max_length=256,
        description="Public keys (64 hex digits each, `intellect worker keygen`) of outside contributors the "
        "rendezvous admits: each joins with `intellect diloco-join` and its own key, never the run secret, and "
        "gets only its own credentials, as worker <its key id> (docs/deploy.md, DiLoCo peers).",
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
        "median (centred clip), flags those it clipped and leaves the flagged out while they are a minority; "
        "0 turns it off (plain mean).",
    )
    outlier_clip_crowd: float = Field(
        default=2.5, ge=1, le=1000,
        description="With 4+ contributors (the median distance is then an honest member's even with one liar) "
        "the clip multiple is at most this: min(outlier_clip, outlier_clip_crowd).",
    )
    direction_screen: float = Field(
        default=0.6, ge=0, lt=1,
        description="With 4+ contributors, also flag a contribution whose cosine with the coordinate-wise median "
        "of the others is below this times the members' median cosine (a member pushing its own direction "
        "while staying close in distance); 0 turns this screen off.",
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
    quorum: float = Field(
        default=1.0, gt=0, le=1,
        description="Slow members (docs/diloco.md, Stragglers). 1: a step waits for every member's pseudo-gradient "
        "(up to boundary_timeout). Below 1: once this share of the step's members is ready, a grace window opens "
        "(grace_ratio x their median phase time); when it passes, the members still training end their inner "
        "phase after the inner step they are in and contribute what they trained, and every contribution is "
        "weighted by the tokens it holds (at most a full phase's). One that is still not ready after that is "
        "left out of the step, as a dead one is.",
    )
    grace_ratio: float = Field(
        default=0.05, ge=0, le=10,
        description="quorum < 1: the grace window after the quorum is ready, as a share of the median inner phase "
        "time of the members ready.",
    )
    grace_min: float = Field(
        default=1.0, ge=0, le=3600, description="quorum < 1: the shortest grace window, in seconds.",
    )

    def stragglers(self) -> StragglerPolicy | None:
        """The policy for slow members when ``quorum`` is below 1 (:mod:`~intellect.diloco.stragglers`)."""
        if self.quorum >= 1:
            return None
        return StragglerPolicy(self.quorum, self.grace_ratio, self.grace_min, self.inner_steps)

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> "DilocoConfig":
        for k in self.contributors:
            VerifyKey.from_hex(k)  # BadKey is a ValueError: pydantic reports it as the field's error
        if not all(0 < c <= 64 for c in self.clip_sigmas):
            raise ValueError(f"clip_sigmas must lie in (0, 64] (got {self.clip_sigmas})")
        if self.outlier_clip and self.outlier_clip < 1:
            raise ValueError(f"outlier_clip must be 0 (off) or at least 1 (got {self.outlier_clip})")
        if self.outlier_clip and self.algorithm in ("ring", "ring-residual") and self.compression != "topk":
            raise ValueError(f"algorithm {self.algorithm!r} sends partial sums, so no owner sees a contribution "
                             "to clip: set outlier_clip = 0 to run it without robust aggregation")
        if self.overlap != "none" and self.onboarding != "non_blocking":
            raise ValueError(f"overlap {self.overlap!r} needs onboarding = \"non_blocking\": with a step in flight "
                             "a joiner takes the state once its source has committed that step")
        if self.topk_k > self.topk_chunk:
            raise ValueError(f"topk_k ({self.topk_k}) must not exceed topk_chunk ({self.topk_chunk})")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )
        return self


WARM_OUTER_MOMENTUM = 0.7  # the outer momentum of a run from a checkpoint, unless set (docs/diloco.md)


class DilocoRunConfig(StrictModel):
    """A DiLoCo pretraining run: N workers, each training the model on its own data shard.

    The outer momentum follows the start unless the run sets it: a pretrained checkpoint's pseudo-gradients
    are small and consistent, and carry a higher momentum than a fresh model's.

    >>> DilocoRunConfig().diloco.outer_momentum, DilocoRunConfig(model={"pretrained": "ckpt"}).diloco.outer_momentum
    (0.5, 0.7)
    >>> DilocoRunConfig(model={"pretrained": "ckpt"}, diloco={"outer_momentum": 0.5}).diloco.outer_momentum
    0.5
    """

    run_name: str = Field(default="diloco", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Folder name of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig, description="The inner loop (train.steps is ignored).")
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    dispatch: DispatchConfig = Field(
        default_factory=DispatchConfig,
        description="Where the workers run: subprocesses of the coordinator (local), or flow runs of the "
        "diloco-worker deployment on its work pool (deployments; diloco.store_host must be reachable from there).",
    )

    @model_validator(mode="after")
    def _batches_split_over_ranks(self) -> "DilocoRunConfig":
        m = self.diloco.ranks_per_worker
        if self.train.batch_size % m:
            raise ValueError(f"train.batch_size ({self.train.batch_size}) must divide over diloco.ranks_per_worker "
                             f"({m}): each of a worker's ranks trains on an equal part of its batch")
        return self

    @model_validator(mode="after")
    def _outer_momentum_for_the_start(self) -> "DilocoRunConfig":
        if self.model.pretrained and "outer_momentum" not in self.diloco.model_fields_set:
            # a copy, not the caller's DilocoConfig changed under it; the copy counts the field as set, so a
            # dump of this config (to workers, to a checkpoint) keeps it
            object.__setattr__(self, "diloco", self.diloco.model_copy(update={"outer_momentum": WARM_OUTER_MOMENTUM}))
        return self
