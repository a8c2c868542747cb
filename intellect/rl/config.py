"""The run configs of RL: ``intellect rl`` (:class:`RLRunConfig`) and ``intellect filter`` (:class:`FilterRunConfig`).

Components keep their own configs next to their code (:class:`SubmissionConfig`,
:class:`RLTrainerConfig`, :class:`GRPOLossConfig`, :class:`RolloutLimits`); this module composes
them with what a run needs besides: where the starting weights come from, which prompts it
trains on, the inference workers, evaluation. Every field is bounded and documented, and
unknown keys are errors (:class:`~intellect.config.StrictModel`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal

from pydantic import Field, field_validator, model_validator

from intellect.config import ComputeConfig, DataConfig, DispatchConfig, LoggingConfig, StorageConfig, StrictModel
from intellect.inference.config import EngineConfig
from intellect.rl.service.admission import submission_bytes
from intellect.rl.wire.lag import DEFAULT_ASYNC_LEVEL, PolicyLag
from intellect.prompts import PromptConfig
from intellect.rl.wire.rollout_schema import RolloutLimits
from intellect.rl.service.config import ServiceConfig
from intellect.rl.rewards.code import CodeRewardConfig
from intellect.rl.worker.submission import RewardFn, SubmissionConfig, task_reward_fn
from intellect.rl.trainer.grpo import RLTrainerConfig
from intellect.shardcast.config import ShardcastConfig
from intellect.toploc.proofs import ToplocConfig, proof_size
from intellect.trust.keys import is_key_id

RUN_NAME = r"^[A-Za-z0-9._-]{1,64}$"


class InitConfig(StrictModel):
    """The weights of checkpoint 0: the newest (or a given) checkpoint of another run in the same storage,
    or any HF model folder."""

    from_run: str | None = Field(
        default="smoke", pattern=RUN_NAME,
        description="Run (in this storage) whose checkpoint starts RL, e.g. the smoke or DiLoCo run.",
    )
    step: int | None = Field(
        default=None, ge=0, description="Checkpoint step of from_run; None: its newest complete one.",
    )
    path: str | None = Field(default=None, description="A local HF model folder; when set, from_run is not used.")

    @model_validator(mode="after")
    def _a_source(self) -> "InitConfig":
        if self.from_run is None and self.path is None:
            raise ValueError("set from_run or path")
        return self


class TaskPoolConfig(StrictModel):
    """The prompts RL trains on: a file (e.g. the output of ``intellect filter``) or generated arithmetic."""

    kind: Literal["math", "code"] = Field(
        default="math",
        description="math: rows (prompt, answer), scored by the final or boxed answer; code: rows (prompt, tests), "
        "scored by running the completion's last Python block against the tests in the sandbox (`code`).",
    )
    file: str | None = Field(
        default=None,
        description="A .jsonl/.parquet task file of `kind` (see intellect/data/loaders.py), a path or a path relative "
        "to the run storage root (e.g. 'filter/tasks.jsonl' of a filter run); None: generate arithmetic (math only).",
    )
    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig,
        description="The code reward (kind = code): its sandbox, the sandboxes a file's rows share and its budgets.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="The arithmetic generator (held-out excluded).")
    size: int = Field(default=20000, ge=1, le=10_000_000, description="Distinct generated problems in the pool.")
    seed: int = Field(default=1234, ge=0, description="Seed of the generated pool (not of the held-out split).")
    heldout: Literal["split", "file", "arithmetic"] | None = Field(
        default=None,
        description="What held-out evaluation scores: split, the heldout_percent split of `file` by prompt hash "
        "(kept out of training); file, the tasks of heldout_file (their prompts kept out of training); "
        "arithmetic, the generator's held-out problems (for a file `intellect filter` made from the generator). "
        "None: file with heldout_file set, split with only `file` set, arithmetic otherwise.",
    )
    heldout_file: str | None = Field(
        default=None, description="The held-out task file (as `file`: a path, or relative to the storage root).",
    )
    heldout_percent: int = Field(
        default=10, ge=1, le=50, description="Share of `file`'s prompts in the held-out split (heldout = split).",
    )
    lenient: bool = Field(
        default=False,
        description="Skip bad rows of the task files (and prompts the template cannot render), reporting them, "
        "instead of failing at the first with a one-line error naming the row.",
    )

    @property
    def heldout_source(self) -> Literal["split", "file", "arithmetic"]:
        """``heldout``, its default resolved.

        >>> TaskPoolConfig(file="tasks.jsonl").heldout_source, TaskPoolConfig().heldout_source
        ('split', 'arithmetic')
        """
        if self.heldout is not None:
            return self.heldout
        return "file" if self.heldout_file else "split" if self.file else "arithmetic"

    def reward_fn(self) -> RewardFn:
        """The reward workers claim and the validator recomputes for these tasks."""
        return task_reward_fn(self.kind, self.code)

    @model_validator(mode="after")
    def _heldout_given(self) -> "TaskPoolConfig":
        if self.kind == "code" and not self.file:
            raise ValueError("kind = 'code' needs a task file (only arithmetic is generated)")
        source = self.heldout_source
        if self.kind == "code" and source == "arithmetic":
            raise ValueError("kind = 'code' is evaluated on its file: heldout must be 'split' or 'file'")
        if source == "file" and not self.heldout_file:
            raise ValueError("heldout = 'file' needs heldout_file")
        if self.heldout_file and source != "file":
            raise ValueError(f"heldout_file is set but heldout = {source!r}")
        if source == "split" and not self.file:
            raise ValueError("heldout = 'split' splits `file`: set file")
        return self


class WorkersConfig(StrictModel):
    """The inference workers the flow starts (local ``intellect worker`` processes) and how long the
    trainer waits for them."""

    names: list[str] = Field(
        default_factory=lambda: ["worker-a", "worker-b"], min_length=1, max_length=256,
        description="The workers rl-train starts (one process and one key each). They are known by their key ids: "
        "from keys/<name>.key of the local run folder (launch = local), or as their rl-worker flow runs announce "
        "them (launch = deployments); rl-step and rl-generate use the names as ids.",
    )
    remote: list[str] = Field(
        default_factory=list, max_length=4096,
        description="Key ids of remote `intellect worker`s whose done the trainer also waits for each step (up to "
        "submission_timeout), e.g. the allowlisted ones. Submissions of workers not listed count when they "
        "arrive before their step is validated.",
    )
    threads: int = Field(default=1, ge=1, le=256, description="torch threads of each worker process.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Each worker's engine: kind (torch, or vllm from the vLLM environment) and how it batches "
        "generation (continuous by default; rows, KV budget).",
    )
    launch: Literal["local", "deployments"] = Field(
        default="local",
        description="Where rl-train starts its workers: local subprocesses, or flow runs of the rl-worker "
        "deployment on its work pool (gpu-rollout); remote workers need the submission service reachable "
        "from there (service.host).",
    )
    validate_parallel: int = Field(
        default=4, ge=1, le=256,
        description="Workers' files the validator checks at once: however many keys submit, the trusted "
        "process holds at most this many files in memory.",
    )
    max_submissions: int = Field(
        default=4, ge=1, le=1024,
        description="Most submissions per worker and step: its first one, and one per round of the online filter "
        "(online_filter) it answers.",
    )
    poll_interval: float = Field(default=0.05, gt=0, le=60, description="Seconds between looks for a new checkpoint.")
    checkpoint_timeout: float = Field(
        default=600.0, gt=0, le=86400, description="A worker gives up after waiting this long for a fresh checkpoint."
    )
    submission_timeout: float = Field(
        default=600.0, gt=0, le=86400,
        description="The trainer waits this long for a worker's submissions of a step, then goes on without it.",
    )


    @field_validator("remote")
    @classmethod
    def _key_ids(cls, ids: list[str]) -> list[str]:
        bad = [i for i in ids if not is_key_id(i)]
        if bad:
            raise ValueError(f"not worker key ids (k + 20 hex digits): {bad[:4]}")
        return ids


class OnlineFilterConfig(StrictModel):
    """INTELLECT-2's online filter (``intellect/rl/trainer/online_filter.py``): a step trains once it holds
    this many validated samples with signal (non-zero advantage), and until then the service asks the
    workers for more of the step in rounds."""

    min_signal_samples: int = Field(
        default=0, ge=0, le=1 << 20,
        description="Accepted samples in groups with unequal (validator-computed) rewards a step trains on at "
        "least (0: off, a step trains on what its first submissions bring).",
    )
    max_rounds: int = Field(
        default=4, ge=1, le=1024,
        description="Rounds of assignment past the first a step may ask for: each lets every worker add one "
        "submission (up to workers.max_submissions). A step still short after them trains on what it holds.",
    )
    round_timeout: float = Field(
        default=300.0, gt=0, le=86400,
        description="Seconds a round waits for every worker's added submission; a round that brings none ends "
        "the filter (the step trains on what it holds).",
    )


class EvalConfig(StrictModel):
    """Held-out greedy accuracy of published checkpoints (intellect/rl/trainer/evaluation.py)."""

    every: int = Field(default=10, ge=0, le=1_000_000, description="Evaluate every N steps (0: only first and last).")
    size: int = Field(default=512, ge=1, le=100_000, description="Held-out problems per evaluation.")


class RLRunConfig(StrictModel):
    """An RL run: ``intellect rl --config configs/rl-tiny.toml``."""

    run_name: str = Field(default="rl", pattern=RUN_NAME, description="Folder of the run; written into every rollout.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ledger: str | None = Field(
        default=None, description="Local DuckDB file of the run; None: ledger.duckdb in the run folder (local storage) "
        "or ./runs/<run_name>/ledger.duckdb (S3 storage).",
    )
    init: InitConfig = Field(default_factory=InitConfig)
    tasks: TaskPoolConfig = Field(default_factory=TaskPoolConfig)
    steps: int = Field(default=100, ge=1, le=10_000_000, description="RL steps (checkpoints 1..steps are written).")
    async_level: int = Field(default=DEFAULT_ASYNC_LEVEL, ge=0, le=1024, description="Most policy lag of a sample.")
    policy_lag: PolicyLag = Field(
        default="newest", description="Which fresh checkpoint generates step n: the newest one (lag 0..async_level, "
        "set by how fast the trainer ran) or 'fixed', checkpoint n - async_level (what the run learns does not "
        "depend on the machine's speed; intellect/rl/wire/lag.py).",
    )
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    submission: SubmissionConfig = Field(default_factory=SubmissionConfig)
    online_filter: OnlineFilterConfig = Field(
        default_factory=OnlineFilterConfig,
        description="INTELLECT-2's online filter: the validated samples with signal a step waits for, in rounds.",
    )
    trainer: RLTrainerConfig = Field(default_factory=RLTrainerConfig)
    compute: ComputeConfig = Field(
        default_factory=ComputeConfig,
        description="Device and precision of the trainer, of local workers' engines and of the validator's prefill.",
    )
    trainer_threads: int = Field(
        default=0, ge=0, le=1024, description="torch threads of the trainer (0: torch's default).",
    )
    limits: RolloutLimits | None = Field(
        default=None, description="Validator bounds; None: defaults, vocab from the model.",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress lines (progress_seconds).")
    seed: int = Field(default=0, ge=0, description="Seed of the trainer's torch RNG.")
    toploc: ToplocConfig | None = Field(
        default_factory=ToplocConfig,
        description="TOPLOC proofs: workers commit to their hidden states, the validator checks them "
        "with one prefill per checkpoint (k must not exceed the model's hidden size). On by default: without "
        "it a worker may hand-write completions. Off (None; `toploc = false` in TOML) needs trusted_workers = true.",
    )
    trusted_workers: bool = Field(
        default=False, description="Every inference worker is the operator's own: only then may toploc be None.",
    )
    alert_rejection_rate: float = Field(
        default=0.5, ge=0, le=1,
        description="A worker whose share of rejected samples in a step reaches this emits the event "
        "intellect.rl.worker.rejections-high (the automation intellect-worker-rejections reacts to it).",
    )
    dispatch: DispatchConfig = Field(
        default_factory=DispatchConfig,
        description="rl-orchestrate: run the stage flows (rl-generate, rl-validate, rl-update) in this process "
        "or as flow runs of their deployments on their work pools.",
    )
    service: ServiceConfig = Field(
        default_factory=ServiceConfig,
        description="The submission service rl-train starts beside the trainer: the one door of `intellect worker` "
        "processes into the run (listen address, admission, body caps). Unless set, its `ahead` is async_level + 1 "
        "and its max_submissions_per_step workers.max_submissions (service_config()).",
    )
    shardcast: ShardcastConfig | None = Field(
        default=None, description="SHARDCAST weight broadcast: the trainer publishes each signed checkpoint to an "
        "origin, workers download it from relays (by default an origin and two relays the run starts on this "
        "machine). None: rl-train still starts a local origin, without relays, which its workers download "
        "from (they never read run storage); rl-step and the rl-generate stage read run storage.",
    )

    @field_validator("toploc", mode="before")
    @classmethod
    def _false_is_off(cls, value):
        return None if value is False else value  # TOML has no null

    @model_validator(mode="after")
    def _toploc_or_trusted(self) -> "RLRunConfig":
        if self.toploc is None and not self.trusted_workers:
            raise ValueError("toploc is off: set trusted_workers = true to run without TOPLOC proofs "
                             "(only when every inference worker is the operator's own)")
        return self

    @model_validator(mode="after")
    def _service_admits_the_workers(self) -> "RLRunConfig":
        svc = self.service
        if svc.ahead == 0:
            raise ValueError("service.ahead = 0 admits no step: workers submit for the step after the newest "
                             "committed one at least")
        if svc.max_submissions_per_step is not None and svc.max_submissions_per_step < self.workers.max_submissions:
            raise ValueError(f"service.max_submissions_per_step ({svc.max_submissions_per_step}) is below "
                             f"workers.max_submissions ({self.workers.max_submissions}): workers would be refused")
        return self

    def service_config(self, prompt_tokens: int | None = None) -> ServiceConfig:
        """``service`` as the run's submission service applies it: ``ahead`` (async_level + 1),
        ``max_submissions_per_step`` (workers.max_submissions) and ``max_submission_bytes`` (the
        largest file of this run's rows, tokens and proofs, :func:`~intellect.rl.service.admission.submission_bytes`,
        its prompts at most ``prompt_tokens`` long: the pool's longest rendered prompt, else
        ``limits.max_prompt_tokens``) from the run where it leaves them unset.

        >>> c = RLRunConfig(async_level=1, service={"ahead": 5}).service_config()
        >>> c.ahead, c.max_submissions_per_step, c.max_submission_bytes < c.max_body_bytes
        (5, 4, True)
        """
        sub, lim = self.submission, self.limits or RolloutLimits(vocab_size=1)  # a vocabulary adds no bytes
        out = min(sub.max_tokens, lim.max_output_tokens)
        proof = 0 if self.toploc is None else min(lim.max_proof_bytes,
                                                  -(-out // self.toploc.chunk) * proof_size(self.toploc.k))
        prompt = min(prompt_tokens or lim.max_prompt_tokens, lim.max_prompt_tokens)
        size = submission_bytes(sub.prompts_per_submission * sub.group_size, prompt, out, proof)
        run = {"ahead": self.async_level + 1, "max_submissions_per_step": self.workers.max_submissions,
               "max_submission_bytes": min(size, self.service.max_body_bytes)}
        return self.service.model_copy(update={k: v for k, v in run.items() if getattr(self.service, k) is None})

    def weights_broadcast(self) -> ShardcastConfig:
        """The SHARDCAST settings rl-train's workers get weights with: ``shardcast``, or a local origin
        without relays.

        >>> RLRunConfig().weights_broadcast().local_relays
        0
        """
        return self.shardcast if self.shardcast is not None else ShardcastConfig(local_relays=0)


class FilterConfig(StrictModel):
    """Offline difficulty filter: keep prompts the current model solves sometimes, not always."""

    k: int = Field(default=8, ge=1, le=1024, description="Samples per prompt.")
    min_rate: float = Field(default=1 / 8, ge=0, le=1, description="Lowest kept pass rate (inclusive).")
    max_rate: float = Field(default=4 / 8, ge=0, le=1, description="Highest kept pass rate (inclusive).")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Sampling temperature.")
    max_tokens: int = Field(default=16, ge=1, le=1 << 20, description="Most completion tokens.")
    chunk_size: int = Field(default=256, ge=1, le=1 << 20, description="Prompts per Prefect task.")
    seed: int = Field(default=0, ge=0, description="Base of the per-sample seeds.")
    prompt: PromptConfig = Field(
        default_factory=PromptConfig, description="How task prompts are rendered (as the RL run's submission.prompt).",
    )

    @model_validator(mode="after")
    def _window(self) -> "FilterConfig":
        if self.min_rate > self.max_rate:
            raise ValueError(f"min_rate ({self.min_rate}) must be <= max_rate ({self.max_rate})")
        return self

    def keeps(self, solved: int) -> bool:
        """Whether ``solved`` of ``k`` lies in the window (exact: 4/8 is 0.5, not 0.4999...).

        >>> [FilterConfig(k=8).keeps(n) for n in range(9)]
        [False, True, True, True, True, False, False, False, False]
        """
        rate = Fraction(solved, self.k)
        lo = Fraction(self.min_rate).limit_denominator(1 << 20)
        hi = Fraction(self.max_rate).limit_denominator(1 << 20)
        return lo <= rate <= hi


class FilterRunConfig(StrictModel):
    """``intellect filter --config configs/filter-tiny.toml``: score a task pool with the current model."""

    run_name: str = Field(default="filter", pattern=RUN_NAME, description="Folder of the filter's outputs.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ledger: str | None = Field(
        default=None, description="Local DuckDB file for the solve rates; None: as RLRunConfig.ledger.",
    )
    init: InitConfig = Field(default_factory=InitConfig)
    tasks: TaskPoolConfig = Field(default_factory=TaskPoolConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    threads: int = Field(default=0, ge=0, le=1024, description="torch threads (0: torch's default).")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="Device and precision of the engine.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The engine that samples (kind: torch or vllm) and its batching.",
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress lines (progress_seconds).")
