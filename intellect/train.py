"""The plain single-process training loop: AdamW, warmup + cosine, clipping, eval.

It is the smoke run's trainer and DiLoCo's inner loop, so it keeps its
optimizer resident (:class:`Trainer`) and knows nothing about processes,
storage or Prefect. It trains on texts (the arithmetic task) or on packed
batch dicts (a text corpus), on whatever device and in whatever precision
the caller placed the model. Evaluation reports held-out loss (and
perplexity) and, for tasks with answers, exact-match accuracy under greedy
decoding.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import torch

from intellect.config import ComputeConfig, TrainConfig
from intellect.device import autocast, pin
from intellect.model.generate import generate
from intellect.progress import Progress


class Task(Protocol):
    """Anything with a prompt, its reference answer and the full training text (read-only:
    :class:`~intellect.data.arithmetic.Problem` computes them)."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...

    @property
    def text(self) -> str: ...


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate before optimizer step ``step`` (0-based): linear warmup, cosine decay.

    >>> cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    >>> [round(lr_at(s, cfg), 3) for s in (0, 9, 10, 54, 99, 150)]
    [0.1, 1.0, 1.0, 0.558, 0.1, 0.1]
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


Batch = Sequence[str] | Mapping[str, torch.Tensor]


def pad_id(tokenizer) -> int:
    """The id that fills padding: the tokenizer's pad token, or EOS when it has none (the attention mask
    and -100 labels mark padding either way, so its id never reaches the loss)."""
    pid = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pid is None else pid


def encode_texts(tokenizer, texts: Sequence[str], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded ``BOS text EOS`` batches with labels (-100 on padding).

    Texts longer than ``max_len`` tokens are truncated, EOS included.
    """
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(texts))["input_ids"]]
    width = min(max(len(r) for r in rows), max_len)
    input_ids = torch.full((len(rows), width), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:width]
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def target_tokens(labels: torch.Tensor) -> int:
    """Next-token targets of a batch: labels after the first position that are not -100.

    >>> target_tokens(torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100]]))
    3
    """
    return int((labels[:, 1:] != -100).sum())


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the targets (labels shifted by one, -100 ignored), in fp32.

    Dividing by :func:`target_tokens` gives the HF causal-LM loss; summing first lets micro-batches
    add up to exactly the loss of the whole batch.

    >>> logits = torch.zeros(1, 3, 4)                     # uniform over 4 tokens
    >>> round(float(summed_token_loss(logits, torch.tensor([[1, 2, -100]]))), 4)   # one target: ln 4
    1.3863
    """
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def micro_batches(batch: Mapping[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` split along its rows into pieces of ``size`` rows (0: one piece, the whole batch).

    >>> [b["input_ids"].shape[0] for b in micro_batches({"input_ids": torch.zeros(5, 2)}, 2)]
    [2, 2, 1]
    """
    rows = len(next(iter(batch.values())))
    if not size or size >= rows:
        return [dict(batch)]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the caller placed it, see :func:`intellect.device.prepare_model`)."""
    return next(model.parameters()).device


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: pin(v, device).to(device, non_blocking=True) for k, v in batch.items()}


def _max_len(model: torch.nn.Module) -> int:
    config = getattr(getattr(model, "module", model), "config", None)  # a DDP wrapper holds the model
    return getattr(config, "max_position_embeddings", 1 << 16)


class Trainer:
    """AdamW with the schedule of ``cfg``; state persists across :meth:`train_steps` calls.

    The model is already placed (:func:`~intellect.device.prepare_model`): the trainer computes where
    its parameters are, under the autocast of ``compute.precision``, and accumulates gradients over
    ``cfg.micro_batch_size``-row micro-batches so that a step is the step of the whole batch.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: TrainConfig, compute: ComputeConfig | None = None):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.compute = compute or ComputeConfig()
        self.device = model_device(model)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=False,
        )
        self.step = 0
        self.max_len = _max_len(model)

    def encode(self, batch: Batch) -> dict[str, torch.Tensor]:
        """A training batch on the trainer's device: texts are encoded (:func:`encode_texts`), a batch
        dict (``input_ids``, ``labels``, optional ``position_ids`` and ``attention_mask``) is moved."""
        if isinstance(batch, Mapping):
            unknown = set(batch) - {"input_ids", "labels", "position_ids", "attention_mask"}
            if unknown or "labels" not in batch or "input_ids" not in batch:
                raise ValueError(f"a batch dict needs input_ids and labels, and nothing but position_ids and "
                                 f"attention_mask besides (got {sorted(batch)})")
            return to_device(batch, self.device)
        return to_device(encode_texts(self.tokenizer, batch, self.max_len), self.device)

    def backward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Accumulate into ``.grad`` the gradients of ``batch``'s loss: the mean over every target token
        of the whole batch, whatever the micro-batching (each micro-batch's summed loss is divided by
        the batch's target count before its backward). Returns that loss (detached) and the count."""
        self.model.train()
        full = self.encode(batch)
        tokens = target_tokens(full["labels"])
        total = torch.zeros((), device=self.device)
        for mb in micro_batches(full, self.cfg.micro_batch_size):
            labels = mb.pop("labels")
            with autocast(self.device, self.compute.precision):
                logits = self.model(**mb, use_cache=False).logits
            loss = summed_token_loss(logits, labels) / max(tokens, 1)
            loss.backward()
            total += loss.detach()
        return total, tokens

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch`` (texts or a batch dict, see :meth:`encode`); its log:
        ``loss``, ``lr``, ``grad_norm`` (before clipping), ``tokens`` (target tokens) and ``seconds``."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, tokens = self.backward(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss_value, norm = loss.item(), float(grad_norm)  # both wait for the device: seconds is the step's
        return {"loss": loss_value, "lr": lr, "grad_norm": norm, "tokens": tokens,
                "seconds": time.perf_counter() - t0}

    def train_steps(
        self, n: int, batches: Iterator[Batch], on_step: Callable[[int, dict], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """``n`` steps, or fewer once ``stop()`` says so (asked before every step but the first)."""
        logs = []
        for _ in range(n):
            if stop is not None and logs and stop():
                break
            log = self.train_step(next(batches))
            logs.append(log)
            if on_step:
                on_step(self.step, log)
        return logs

    def state_dict(self) -> dict:
        """AdamW's state, the step count (the schedule's position) and torch's CPU generator."""
        return {"optimizer": self.optimizer.state_dict(), "step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`. A state that does not fit this trainer's parameters (another
        model, a garbled file) raises ValueError before anything is changed."""
        check_state(state, self.optimizer)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])

    def state_bytes(self) -> bytes:
        """:meth:`state_dict` as a ``torch.save`` file (tensors on the CPU), for a checkpoint sidecar."""
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return buf.getvalue()

    def max_state_bytes(self) -> int:
        """An upper bound of :meth:`state_bytes`' size: two moments of at most 4 bytes per parameter, a
        generous allowance per tensor for the file's own records, and 1 MiB for the rest (the generator
        state, the step count). A larger file is no state of this trainer's and need not be read."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return 8 * sum(p.numel() for p in params) + 4096 * len(params) + (1 << 20)

    def load_state_bytes(self, data: bytes) -> None:
        """Load what :meth:`state_bytes` wrote (tensors only: ``weights_only``, never arbitrary pickles);
        AdamW moves each state tensor to its parameter's device and dtype. Bytes that are no such file raise
        ValueError, with nothing changed."""
        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:  # a truncated zip, a foreign pickle: torch raises many kinds
            raise ValueError(f"not a trainer state file ({type(e).__name__}: {str(e)[:200]})") from e
        self.load_state_dict(state)


def check_state(state: object, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless ``state`` is a :meth:`Trainer.state_dict` for ``optimizer``'s parameters:
    the step count, the same parameter groups, moment tensors shaped as their parameters, a CPU generator
    state. Checked before loading, because AdamW takes mismatched moments silently and fails at its next step.

    >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    >>> check_state({"optimizer": opt.state_dict(), "step": 0}, opt)
    >>> check_state({"optimizer": opt.state_dict(), "step": -1}, opt)
    Traceback (most recent call last):
    ...
    ValueError: not a trainer state: the step count is -1
    """
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
        raise ValueError("not a trainer state: no optimizer state")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"not a trainer state: the step count is {step!r}")
    groups, moments = state["optimizer"].get("param_groups"), state["optimizer"].get("state")
    ours = [g["params"] for g in optimizer.param_groups]
    if (not isinstance(groups, list) or len(groups) != len(ours)
            or any(not isinstance(g, dict) or len(g.get("params", ())) != len(o) for g, o in zip(groups, ours))):
        raise ValueError("the optimizer state belongs to other parameters (its parameter groups differ)")
    params = [p for group in ours for p in group]
    if not isinstance(moments, dict):
        raise ValueError("not a trainer state: no optimizer moments")
    for index, entry in moments.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params) \
                or not isinstance(entry, dict):
            raise ValueError(f"the optimizer state names parameter {index!r}, which this model lacks")
        for key, value in entry.items():
            if key != "step" and (not isinstance(value, torch.Tensor) or value.shape != params[index].shape):
                raise ValueError(f"the optimizer state's {key} of parameter {index} does not fit its shape "
                                 f"{tuple(params[index].shape)}")
    rng = state.get("rng")
    if rng is not None and (not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8
                            or rng.shape != torch.get_rng_state().shape):
        raise ValueError("not a trainer state: the generator state is not torch's CPU generator state")


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    n: int
    answers: list[str] = field(default_factory=list, repr=False)
    tokens: int = 0  # target tokens the loss is the mean over


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean token loss in nats (inf where that overflows a float).

    >>> round(perplexity(2.0), 3)
    7.389
    >>> perplexity(1e4)
    inf
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _completions(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int,
                 temperature: float = 0.0, generator: torch.Generator | None = None,
                 progress: Progress | None = None) -> list[str]:
    texts = []
    ids = tokenizer(list(prompts))["input_ids"]
    for start in range(0, len(ids), batch_size):
        gens = generate(
            model, ids[start:start + batch_size], max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id, pad_id=pad_id(tokenizer),
            temperature=temperature, generator=generator,
        )
        texts.extend(tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens)
        if progress is not None:
            progress.update(advance=len(gens))
    return texts


def answer_budget(tasks: Sequence[Task]) -> int:
    """Tokens to generate: longest reference answer plus slack for a wrong, longer one."""
    return max(len(t.answer) for t in tasks) + 2


@dataclass(frozen=True)
class LossResult:
    loss: float  # mean next-token loss over every target token, nats
    tokens: int  # target tokens
    sequences: int

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)


@torch.no_grad()
def heldout_loss(model, batches: Iterable[Mapping[str, torch.Tensor]], progress: Progress | None = None) -> LossResult:
    """Token-weighted mean loss of ``model`` over batch dicts (keys as :meth:`Trainer.encode` takes),
    computed where the model is, in its own dtype; ``progress`` counts the sequences."""
    model.eval()
    device = model_device(model)
    total, count, rows = 0.0, 0, 0
    for batch in batches:
        b = to_device(batch, device)
        labels = b.pop("labels")
        total += float(summed_token_loss(model(**b, use_cache=False).logits, labels))
        count += target_tokens(labels)
        rows += len(labels)
        if progress is not None:
            progress.update(advance=len(labels), tokens=target_tokens(labels))
    return LossResult(loss=total / max(count, 1), tokens=count, sequences=rows)


@torch.no_grad()
def evaluate(model, tokenizer, tasks: Sequence[Task], batch_size: int = 256,
             progress: Progress | None = None) -> EvalResult:
    """Held-out token loss on the full texts and greedy exact-match accuracy on the answers; ``progress``
    (its total twice the tasks) counts the texts scored, then the answers generated."""
    max_len = _max_len(model)
    texts = [t.text for t in tasks]
    loss = heldout_loss(model, (encode_texts(tokenizer, texts[i:i + batch_size], max_len)
                                for i in range(0, len(texts), batch_size)), progress)
    answers = _completions(model, tokenizer, [t.prompt for t in tasks], answer_budget(tasks), batch_size,
                           progress=progress)
    correct = sum(a.strip() == t.answer for a, t in zip(answers, tasks))
    return EvalResult(loss=loss.loss, accuracy=correct / len(tasks), n=len(tasks), answers=answers,
                      tokens=loss.tokens)


@torch.no_grad()
def pass_counts(model, tokenizer, tasks: Sequence[Task], k: int, temperature: float = 1.0,
                seed: int = 0, batch_size: int = 512, progress: Progress | None = None) -> list[int]:
    """How many of ``k`` samples at ``temperature`` solve each task (exact match); ``progress`` counts
    the samples."""
    model.eval()
    gen = torch.Generator(device=model_device(model)).manual_seed(seed)  # sampling draws where the model is
    prompts = [t.prompt for t in tasks for _ in range(k)]
    answers = _completions(model, tokenizer, prompts, answer_budget(tasks), batch_size, temperature, gen, progress)
    hits = [a.strip() == t.answer for a, t in zip(answers, (t for t in tasks for _ in range(k)))]
    return [sum(hits[i * k:(i + 1) * k]) for i in range(len(tasks))]


@dataclass
class TrainResult:
    history: list[dict[str, float]]
    seconds: float
    tokens: int


def train(model, tokenizer, cfg: TrainConfig, batches: Iterator[Batch],
          on_step: Callable[[int, dict], None] | None = None, compute: ComputeConfig | None = None) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps of a :class:`Trainer` from ``batches`` (lists of texts or batch
    dicts) on the placed ``model``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, tokenizer, cfg, compute)
    t0 = time.perf_counter()
    history = trainer.train_steps(cfg.steps, batches, on_step)
    return TrainResult(
        history=history, seconds=time.perf_counter() - t0, tokens=sum(int(h["tokens"]) for h in history)
    )
