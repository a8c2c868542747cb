"""The plain single-process training loop: AdamW, warmup + cosine, clipping, eval.

It is the smoke run's trainer and DiLoCo's inner loop, so it keeps its
optimizer resident (:class:`Trainer`) and knows nothing about processes,
storage or Prefect. Evaluation reports held-out loss and exact-match
accuracy under greedy decoding.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from intellect.config import TrainConfig
from intellect.model.generate import generate


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


def encode_texts(tokenizer, texts: Sequence[str], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded ``BOS text EOS`` batches with labels (-100 on padding).

    Texts longer than ``max_len`` tokens are truncated, EOS included.
    """
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(texts))["input_ids"]]
    width = min(max(len(r) for r in rows), max_len)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:width]
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class Trainer:
    """AdamW with the schedule of ``cfg``; state persists across :meth:`train_steps` calls."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: TrainConfig):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=False,
        )
        self.step = 0
        self.max_len = getattr(model.config, "max_position_embeddings", 1 << 16)

    def train_step(self, texts: Sequence[str]) -> dict[str, float]:
        self.model.train()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = encode_texts(self.tokenizer, texts, self.max_len)
        loss = self.model(**batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tokens = int(batch["attention_mask"].sum())
        return {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens}

    def train_steps(
        self, n: int, batches: Iterator[list[str]], on_step: Callable[[int, dict], None] | None = None
    ) -> list[dict[str, float]]:
        logs = []
        for _ in range(n):
            log = self.train_step(next(batches))
            logs.append(log)
            if on_step:
                on_step(self.step, log)
        return logs

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    n: int
    answers: list[str] = field(default_factory=list, repr=False)


def _completions(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int,
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> list[str]:
    texts = []
    ids = tokenizer(list(prompts))["input_ids"]
    for start in range(0, len(ids), batch_size):
        gens = generate(
            model, ids[start:start + batch_size], max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
            temperature=temperature, generator=generator,
        )
        texts.extend(tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens)
    return texts


def answer_budget(tasks: Sequence[Task]) -> int:
    """Tokens to generate: longest reference answer plus slack for a wrong, longer one."""
    return max(len(t.answer) for t in tasks) + 2


@torch.no_grad()
def evaluate(model, tokenizer, tasks: Sequence[Task], batch_size: int = 256) -> EvalResult:
    """Held-out token loss on the full texts and greedy exact-match accuracy on the answers."""
    model.eval()
    max_len = getattr(model.config, "max_position_embeddings", 1 << 16)
    total, count = 0.0, 0
    for start in range(0, len(tasks), batch_size):
        batch = encode_texts(tokenizer, [t.text for t in tasks[start:start + batch_size]], max_len)
        n_tok = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n_tok
        count += n_tok
    answers = _completions(model, tokenizer, [t.prompt for t in tasks], answer_budget(tasks), batch_size)
    correct = sum(a.strip() == t.answer for a, t in zip(answers, tasks))
    return EvalResult(loss=total / max(count, 1), accuracy=correct / len(tasks), n=len(tasks), answers=answers)


@torch.no_grad()
def pass_counts(model, tokenizer, tasks: Sequence[Task], k: int, temperature: float = 1.0,
                seed: int = 0, batch_size: int = 512) -> list[int]:
    """How many of ``k`` samples at ``temperature`` solve each task (exact match)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = [t.prompt for t in tasks for _ in range(k)]
    answers = _completions(model, tokenizer, prompts, answer_budget(tasks), batch_size, temperature, gen)
    hits = [a.strip() == t.answer for a, t in zip(answers, (t for t in tasks for _ in range(k)))]
    return [sum(hits[i * k:(i + 1) * k]) for i in range(len(tasks))]


@dataclass
class TrainResult:
    history: list[dict[str, float]]
    seconds: float
    tokens: int


def train(model, tokenizer, cfg: TrainConfig, batches: Iterator[list[str]],
          on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps from ``batches`` (lists of texts)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, tokenizer, cfg)
    t0 = time.perf_counter()
    history = trainer.train_steps(cfg.steps, batches, on_step)
    return TrainResult(
        history=history, seconds=time.perf_counter() - t0, tokens=sum(int(h["tokens"]) for h in history)
    )
