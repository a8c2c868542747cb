"""The GRPO trainer: one RL step turns the accepted samples of a step into the next checkpoint.

As in INTELLECT-2 (prime-rl I2 ``train.py``, which loads ``batch_size x step_per_rollout``
samples per rollout step), the step's samples are split in order into ``steps_per_rollout``
mini-batches and each mini-batch is one AdamW step. The old log-probs are those of the weights
before the first update: for the later mini-batches they are computed once, with no grad, before
it; for the first one they are its own log-probs, detached (no update has happened yet), which
saves a forward pass. The ratio is exactly 1 on the first mini-step and measures only the drift of
the later ones. ``loss.old_logprobs = "behaviour"``
takes the inference engine's log-probs instead (each :class:`Sample` must carry them), which
also importance-corrects the async lag.

A sequence is ``prompt + output``; logits at position ``t`` predict token ``t + 1``, so a prompt
of ``P`` tokens has its ``O`` output tokens predicted at positions ``P - 1 .. P + O - 2``, and only
those positions are in the loss. Logits are divided by the sampling temperature. A mini-batch is
packed (:mod:`intellect.rl.trainer.packing`) into rows of at most ``micro_batch_tokens`` tokens, several
samples to a row with attention kept within each sample (a longer sample has a row to itself);
one row is one micro-batch, one forward and backward. Its log-probs come from the last hidden
states through the LM head a chunk of tokens at a time (:mod:`intellect.rl.trainer.logprobs`), so no
``[tokens x vocab]`` float32 logits of a whole row are ever held. The row's per-token log-probs are
laid out ``[samples, T]`` for :func:`~intellect.rl.trainer.loss.grpo_loss`, and the micro-batch gradients
are accumulated so that their sum equals the gradient of the whole mini-batch of ``B`` samples in
every normalization: ``token`` divides every micro-batch by the mini-batch's completion-token
count; ``constant`` (a micro-batch of ``b`` samples divided by ``b x max_len``) and ``sequence``
(the mean of its ``b`` per-sample means) weigh it by ``b / B``. Each sample's terms depend only on
its own tokens, so how samples are grouped into rows changes no sum.

Given a :class:`~intellect.config.ComputeConfig`, the trainer places its model (and the reference
model) on ``compute.device`` in the precision's weight dtype (:func:`~intellect.device.prepare_model`)
and runs the forward passes under :func:`~intellect.device.autocast`. Whatever the precision, the
loss math (log-softmax, ratios, clipping, KL and entropy) is float32 at least: bf16 logits are
upcast before the log-softmax. ``bf16-mixed`` keeps float32 master weights and AdamW state; the
published checkpoints and the saved optimizer state are always on the CPU, the weights in float32.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from pydantic import Field

from intellect import checkpoints
from intellect.config import ComputeConfig, StrictModel, TrainConfig
from intellect.device import Precision, autocast, pin, prepare_model, resolve_device, resolve_precision
from intellect.rl.trainer.logprobs import DEFAULT_CHUNK_TOKENS, packing_isolates, row_logprobs, split_causal_lm
from intellect.rl.trainer.loss import GRPOLossConfig, grpo_loss
from intellect.rl.trainer.packing import PackedRow, output_mask, pack, unpack
from intellect.rl.trainer.sharding import LOGPROBS_METHOD, full_value, rank_rows, reduce_stats, shard_model
from intellect.train import lr_at

if TYPE_CHECKING:
    from intellect.diloco.mesh import WorkerMesh
    from intellect.rl.wire.rollout_schema import Rollout, RolloutLimits
    from intellect.storage import RunStorage


class RLTrainerConfig(StrictModel):
    """The GRPO trainer: AdamW, schedule, batching and the loss."""

    lr: float = Field(default=3e-4, gt=0, le=1.0, description="Peak AdamW learning rate.")
    min_lr_ratio: float = Field(
        default=1.0, ge=0, le=1, description="Final lr as a fraction of the peak (1: constant).",
    )
    warmup_steps: int = Field(default=10, ge=0, le=1_000_000, description="Linear warmup, in optimizer steps.")
    total_steps: int = Field(
        default=1000, ge=1, le=10_000_000,
        description="Optimizer steps the cosine decay spans (RL steps x steps_per_rollout).",
    )
    weight_decay: float = Field(default=0.0, ge=0, le=1, description="AdamW decoupled weight decay (matrices only).")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.99, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, description="Max global gradient norm of each optimizer step.")
    steps_per_rollout: int = Field(
        default=8, ge=1, le=1024,
        description="Optimizer steps per RL step; the step's samples are split into this many mini-batches "
        "(INTELLECT-2: 8). A step with fewer samples takes one optimizer step per sample.",
    )
    micro_batch_tokens: int = Field(
        default=8192, ge=1, le=1 << 22,
        description="Tokens (prompt + output) per forward/backward pass: samples are packed into rows of "
        "at most this many; a longer sample gets a row to itself.",
    )
    logit_chunk_tokens: int = Field(
        default=DEFAULT_CHUNK_TOKENS, ge=1, le=1 << 20,
        description="Output tokens whose logits are alive at once when computing log-probs (memory: a few "
        "times this x vocab float32 values, forward and backward).",
    )
    temperature: float = Field(default=1.0, gt=0, le=100, description="Sampling temperature; logits are divided by it.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=1 << 22,
        description="Per-sequence token budget of constant normalization (the sampler's max tokens); "
        "None: the longest completion of each mini-batch.",
    )
    loss: GRPOLossConfig = Field(default_factory=GRPOLossConfig)
    ranks: int = Field(
        default=1, ge=1, le=1024,
        description="Processes the trainer runs as, one per device (gloo on the CPU): the model, its gradients "
        "and AdamW state sharded over them with FSDP2, micro-batches split among them; 1: one process.",
    )
    inference_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="Weights of the checkpoints the trainer publishes: what workers (through SHARDCAST), the "
        "validator and evaluation load. bf16 (what INTELLECT-2 broadcasts): half the bytes, and most elements "
        "keep their bits from one step to the next, so a weight patch (shardcast.anchor_every > 1) carries few; "
        "the trainer's fp32 master weights and AdamW state then live in its trainer-only state "
        "(trainer_state/step_<n>), which it resumes from. fp32: the trainer's weights as they are.",
    )

    @property
    def published_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`inference_dtype`.

        >>> RLTrainerConfig(inference_dtype="bf16").published_dtype
        torch.bfloat16
        """
        return torch.bfloat16 if self.inference_dtype == "bf16" else torch.float32


@dataclass(frozen=True, slots=True)
class Sample:
    """What the trainer needs of one completion."""

    prompt_tokens: Sequence[int]
    output_tokens: Sequence[int]
    advantage: float
    behaviour_logprobs: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_tokens) == 0:
            raise ValueError("a sample needs at least one prompt token to predict its first output token")
        if self.behaviour_logprobs is not None and len(self.behaviour_logprobs) != len(self.output_tokens):
            raise ValueError(
                f"{len(self.behaviour_logprobs)} behaviour log-probs for {len(self.output_tokens)} output tokens"
            )


def load_accepted(
    storage: RunStorage, rows: Iterable[Mapping[str, Any]], limits: RolloutLimits
) -> list[Rollout]:
    """The rollouts of ledger rows, read from their files; each must still hash as the ledger says."""
    from intellect.rl.wire.rollouts import load_submission  # noqa: PLC0415 - keeps pyarrow off the import path

    files: dict[str, list[Rollout]] = {}
    out = []
    for row in rows:
        if row["file"] not in files:
            files[row["file"]] = load_submission(storage, row["file"], limits)
        loaded = files[row["file"]]
        i = row["row_index"]
        if not 0 <= i < len(loaded) or loaded[i].content_hash != row["content_hash"]:
            raise ValueError(f"{row['file']} row {i} is not what the ledger accepted (file overwritten?)")
        out.append(loaded[i])
    return out


@dataclass(frozen=True, slots=True)
class MiniStepStats:
    """One optimizer step. Token means are over completion tokens; ``grad_norm`` is before clipping."""

    loss: float
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    grad_norm: float
    lr: float
    tokens: int
    samples: int
    kl: float | None = None
    entropy: float | None = None


@dataclass(frozen=True, slots=True)
class StepStats(MiniStepStats):
    """One RL step: token-weighted means over its mini-steps (``loss``, ``grad_norm``: plain means;
    ``lr``: the last), extremes of the ratio, sums of tokens and samples."""

    seconds: float = 0.0
    mini_steps: tuple[MiniStepStats, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, minis: Sequence[MiniStepStats], seconds: float) -> StepStats:
        n = sum(m.tokens for m in minis)

        def wmean(key: str) -> float:
            return sum(getattr(m, key) * m.tokens for m in minis) / n if n else math.nan

        def tmean(key: str) -> float | None:  # None when a mini-step has none (kl without a reference model)
            return None if any(getattr(m, key) is None for m in minis) else wmean(key)

        return cls(
            loss=sum(m.loss for m in minis) / len(minis),
            clip_fraction=wmean("clip_fraction"),
            ratio_mean=wmean("ratio_mean"),
            ratio_min=min(m.ratio_min for m in minis),
            ratio_max=max(m.ratio_max for m in minis),
            grad_norm=sum(m.grad_norm for m in minis) / len(minis),
            lr=minis[-1].lr,
            tokens=n,
            samples=sum(m.samples for m in minis),
            kl=tmean("kl"),
            entropy=tmean("entropy"),
            seconds=seconds,
            mini_steps=tuple(minis),
        )


@dataclass
class _Micro:
    row: PackedRow  # on the trainer's device
    advantages: torch.Tensor  # [b]: one per sample of the row
    behaviour: torch.Tensor | None  # [N]: per output token, row order (as every log-prob below)
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None

    @property
    def samples(self) -> int:
        return len(self.row.members)

    @property
    def tokens(self) -> int:
        return self.row.tokens


def _split(items: Sequence, n: int) -> list[Sequence]:
    """``n`` contiguous near-equal chunks (the first ones one longer)."""
    q, r = divmod(len(items), n)
    bounds = [i * q + min(i, r) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _to_cpu(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples of tensors) with every tensor on the CPU; CPU tensors are
    returned as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


@contextlib.contextmanager
def cpu_weights(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` on the CPU with half-precision weights in float32 for the duration (what a published
    checkpoint holds), then back where and as it was. The parameters are moved in place, so an
    optimizer over them stays valid; a model already on the CPU in float32 (or float64) is untouched.
    """
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    half = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cpu" and not half:
        yield model
        return
    model.to(device="cpu", dtype=torch.float32 if half else None)
    try:
        yield model
    finally:
        model.to(device=device, dtype=dtype)


class GRPOTrainer:
    """AdamW and the GRPO loss over ``model``; optimizer state and step count persist across RL steps.

    ``ref_model`` (never updated) is required by ``loss.kl_coef > 0``; whenever given, the KL to
    it is logged. ``compute`` places both models on its device in its precision (module docstring);
    None leaves them where and as they are, in the precision they have, without autocast.

    ``mesh``: this rank's place among the trainer's ranks (``trainer.ranks``); the fp32 model is then
    sharded over them (:mod:`intellect.rl.trainer.sharding`) on ``mesh.device``, and every rank must call
    each method that computes with the same arguments (the step's samples), as FSDP's collectives do.
    """

    def __init__(
        self, model: torch.nn.Module, tokenizer, cfg: RLTrainerConfig, ref_model: torch.nn.Module | None = None,
        compute: ComputeConfig | None = None, mesh: WorkerMesh | None = None,
    ):
        if cfg.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a ref_model")
        self.model, self.tokenizer, self.cfg, self.ref_model = model, tokenizer, cfg, ref_model
        self.mesh = mesh
        self.precision: Precision = "fp32"
        if mesh is not None:
            compute = compute or ComputeConfig(device=mesh.device.type)
            self.device = mesh.device
            self.precision = resolve_precision(compute.precision, self.device)
            model.to(self.device)
            # before sharding: the check calls the head and the base model outside any FSDP hook
            self.packs = packing_isolates(model, context=self._autocast)
            shard_model(model, mesh.fsdp_mesh, compute)
            if ref_model is not None:  # sharded like the policy: 1/M of its memory per rank
                ref_model.requires_grad_(False)
                shard_model(ref_model.to(self.device).eval(), mesh.fsdp_mesh, compute)
        elif compute is None:
            self.device = next(model.parameters()).device
        else:
            self.device = resolve_device(compute.device)
            self.precision = resolve_precision(compute.precision, self.device)
            # the log-probs run the base model, not the causal LM's forward: the base is what is compiled
            prepare_model(model, compute.model_copy(update={"compile": False}), self.device, train=True)
            if ref_model is not None:
                prepare_model(ref_model, compute, self.device, train=False).eval()
        if mesh is None:
            self.packs = all(packing_isolates(m, context=self._autocast) for m in (model, ref_model) if m is not None)
        if not self.packs:
            warnings.warn(f"{type(model).__name__} does not keep packed samples apart with this transformers: "
                          "one sample per forward pass", stacklevel=2)
        if compute is not None and compute.compile and mesh is None:  # parallelize compiles each block
            split_causal_lm(model)[0].compile()
        # after placement: AdamW's state takes each parameter's device and dtype (fp32 master weights
        # under bf16-mixed)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False,
        )
        self._schedule = TrainConfig(
            steps=cfg.total_steps, lr=cfg.lr, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        self.step = 0  # optimizer steps taken

    # ------------------------------------------------------------------ batches

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return pin(t, self.device).to(self.device, non_blocking=True)

    def _micro(self, samples: Sequence[Sample], row: PackedRow) -> _Micro:
        members = [samples[i] for i in row.members]
        behaviour = None
        if all(s.behaviour_logprobs is not None for s in members):
            behaviour = torch.tensor([lp for s in members for lp in s.behaviour_logprobs or ()], dtype=torch.float64)
        return _Micro(
            row=row.to(self.device),
            advantages=self._to_device(torch.tensor([s.advantage for s in members], dtype=torch.float64)),
            behaviour=None if behaviour is None else self._to_device(behaviour),
        )

    def _micro_batches(self, samples: Sequence[Sample]) -> list[_Micro]:
        rows = pack(samples, self.cfg.micro_batch_tokens, one_per_row=not self.packs)
        return [self._micro(samples, row) for row in rows]

    def _passes(self, mini: list[_Micro]) -> list[tuple[_Micro, bool]]:
        """The micro-batches this rank runs, each with whether it counts: all of them in one process;
        its share under a mesh, padded with uncounted one-token rows (``sharding`` module docstring)."""
        if self.mesh is None:
            return [(mb, True) for mb in mini]
        dummy = Sample([0], [0], 0.0, behaviour_logprobs=[0.0])  # behaviour: old_logprobs = "behaviour" reads it
        return [(mb, True) if mb is not None else (self._micro([dummy], pack([dummy], 2)[0]), False)
                for mb in rank_rows(mini, self.mesh.local_rank, self.mesh.local_size)]

    def _logprobs(self, model: torch.nn.Module, mb: _Micro, entropy_grad: bool = False):
        """Log-prob and entropy of every output token of the row, ``[N]`` in row order."""
        kw = {"entropy_grad": entropy_grad, "chunk_tokens": self.cfg.logit_chunk_tokens, "context": self._autocast}
        if self.mesh is not None:  # through the root FSDP module's hooks
            return getattr(model, LOGPROBS_METHOD)(mb.row, self.cfg.temperature, **kw)
        return row_logprobs(model, mb.row, self.cfg.temperature, **kw)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.precision)

    @torch.no_grad()
    def _prepare(self, minis: list[list[_Micro]]) -> None:
        """Old (and reference) log-probs of every micro-batch, from the weights before any update.
        The first mini-batch's are left unset: :meth:`_accumulate` takes its own, detached."""
        behaviour = self.cfg.loss.old_logprobs == "behaviour"
        for i, mini in enumerate(minis):
            for mb, _ in self._passes(mini):
                if behaviour:
                    if mb.behaviour is None:
                        raise ValueError("loss.old_logprobs='behaviour' needs behaviour_logprobs on every sample")
                    mb.old = mb.behaviour
                elif i > 0:
                    mb.old = self._logprobs(self.model, mb)[0]
                if self.ref_model is not None:
                    mb.ref = self._logprobs(self.ref_model, mb)[0]

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Each sample's output-token log-probs under the current weights (1-d, float)."""
        out: dict[int, torch.Tensor] = {}
        for mb in self._micro_batches(samples):  # every row on every rank: each returns them all
            out.update(zip(mb.row.members, self._logprobs(self.model, mb)[0].split(mb.row.output_lengths)))
        return [out[i] for i in range(len(samples))]

    # ------------------------------------------------------------------ steps

    def _accumulate(self, mini: list[_Micro]) -> dict[str, Any]:
        """Backward over one mini-batch; ``.grad`` ends up holding its full-batch gradient."""
        cfg = self.cfg.loss
        samples = sum(mb.samples for mb in mini)
        tokens = sum(mb.tokens for mb in mini)
        max_len = self.cfg.max_completion_tokens or max(max(mb.row.output_lengths) for mb in mini)
        max_len = max(max_len, 1)
        acc: dict[str, Any] = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl": 0.0, "entropy": 0.0}
        lo, hi = math.inf, -math.inf
        for mb, counts in self._passes(mini):
            logp, entropy = self._logprobs(self.model, mb, entropy_grad=cfg.entropy_coef > 0)
            dt = logp.dtype
            old = logp.detach() if mb.old is None else mb.old.to(dt)
            ref = mb.ref
            if ref is None and self.ref_model is not None and not counts:
                ref = logp.detach()  # a dummy pass, built anew for this loop: uncounted (its reference ran in _prepare)
            loss, st = grpo_loss(
                unpack(logp, mb.row), unpack(old, mb.row), mb.advantages.to(dt), output_mask(mb.row), cfg,
                ref_logp=None if ref is None else unpack(ref.to(dt), mb.row),
                entropy=unpack(entropy, mb.row), max_len=max_len, token_count=tokens,
            )
            scale = 1.0 if cfg.normalization == "token" else mb.samples / samples
            (loss * (scale if counts else 0.0)).backward()
            if not counts:
                continue
            n = mb.tokens
            acc["loss"] += loss.item() * scale
            for key in ("clip_fraction", "ratio_mean", "kl", "entropy"):
                if key in st:
                    acc[key] += st[key].item() * n
            if n:
                lo, hi = min(lo, st["ratio_min"].item()), max(hi, st["ratio_max"].item())
        if self.mesh is not None:
            lo, hi = reduce_stats(acc, lo, hi, self.mesh.intra)
        for key in ("clip_fraction", "ratio_mean", "kl", "entropy"):
            acc[key] = acc[key] / tokens if tokens else (0.0 if key == "clip_fraction" else math.nan)
        acc.update(ratio_min=lo if tokens else math.nan, ratio_max=hi if tokens else math.nan,
                   tokens=tokens, samples=samples)
        if self.ref_model is None:
            acc["kl"] = None
        return acc

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """One RL step: ``steps_per_rollout`` optimizer steps over ``samples``, split in order."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        t0 = time.perf_counter()
        self.model.train()
        minis = [self._micro_batches(chunk) for chunk in _split(samples, min(self.cfg.steps_per_rollout, len(samples)))]
        self._prepare(minis)
        stats = []
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for mini in minis:
            lr = lr_at(self.step, self._schedule)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            acc = self._accumulate(mini)
            grad_norm = full_value(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            stats.append(MiniStepStats(grad_norm=grad_norm, lr=lr, **acc))
        return StepStats.of(stats, time.perf_counter() - t0)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Optimizer state (on the CPU, so that it loads on any machine) and the step count."""
        return {"optimizer": _to_cpu(self.optimizer.state_dict()), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def publish(self, storage: RunStorage, step: int,
                sidecars: Mapping[checkpoints.Sidecar, Any] | None = None) -> str:
        """Write the weights as ``checkpoints/step_<step>`` (HF folder, then ``STABLE``; the weights in
        ``inference_dtype`` whatever the training precision); returns its URI. Sharded: the consolidated model,
        written by rank 0 (:func:`~intellect.diloco.checkpoint_shards.publish_consolidated`), collective."""
        self.model.eval()
        if self.mesh is not None:
            from intellect.diloco.checkpoint_shards import publish_consolidated  # noqa: PLC0415 - DCP's imports

            return publish_consolidated(self.model, self.tokenizer, storage, step, self.mesh.intra, sidecars=sidecars,
                                        dtype=self.cfg.published_dtype)
        with cpu_weights(self.model) as model:
            return checkpoints.publish(model, self.tokenizer, storage, step, sidecars, dtype=self.cfg.published_dtype)
