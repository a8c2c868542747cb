"""The project's seeded sampler inside vLLM, and the per-token tape a :class:`~intellect.inference.vllm_engine.VllmEngine`
reads its completions from.

vLLM's own sampler is not :mod:`intellect.inference.sampling`: a validator's seeded re-check of its
tokens agrees on about one token in a hundred, and its log-probs are taken before the temperature.
So every request of a :class:`VllmEngine` is decoded greedily by vLLM after :class:`ProjectSampler`,
a vLLM logits processor, has left exactly one finite logit per row: the token
:func:`~intellect.inference.sampling.sample` picks from that row's logits, its request's seed and its
generated position. The same processor records, per request and position, that token, its
:func:`~intellect.inference.sampling.chosen_logprobs` and, when the engine captures them, the row of
post-norm hidden states that fed the logits (a forward pre-hook on the model's logits processor,
:func:`hidden_hook`), all from the one forward that sampled.

The tape lives in this process: the engine requires vLLM's in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the processor, the hook and the engine share it.
Rows are keyed by position, and a later write for the same position wins: a prompt prefilled in
chunks samples (and vLLM discards) a token per partial chunk, and a preempted request recomputes
positions it had, with the same seed and so the same choice. The engine's ``EngineStats`` count
what ran: a partial chunk's row counts as a prefill row (its logits were computed and dropped).

This module imports vLLM; the rest of ``intellect`` does not (only the vLLM engine imports this).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # pyright: ignore[reportMissingImports]

from intellect.inference.sampling import chosen_logprobs, sample, uniforms
from intellect.inference.stats import EngineStats

#: The key of a request's ``SamplingParams.extra_args`` that :class:`ProjectSampler` reads.
ARGS_KEY = "intellect"


@dataclass
class Tape:
    """What one engine's requests recorded: per request key, per generated position, the token, its
    log-prob and its hidden row (or None); and the engine's forward/row counts."""

    steps: dict[str, dict[int, tuple[int, float, torch.Tensor | None]]] = field(default_factory=dict)
    stats: EngineStats = field(default_factory=EngineStats)
    hidden: torch.Tensor | None = None  # the rows the last logits came from (bf16), until a processor reads them


#: Engine id -> its tape. Module state because vLLM builds the processor itself, from a class.
TAPES: dict[str, Tape] = {}


@dataclass(frozen=True, slots=True)
class _Row:
    tape: str
    key: str
    seed: int
    temperature: float
    top_p: float
    reserve: int  # len(prompt) + max_tokens, as EngineStats counts a row's reservation
    output: list[int]  # vLLM's live list of the request's generated tokens: its length is the position


def request_args(tape: str, key: str, seed: int, temperature: float, top_p: float) -> dict:
    """``SamplingParams.extra_args`` of one request (:class:`ProjectSampler` reads them)."""
    return {ARGS_KEY: {"tape": tape, "key": key, "seed": seed, "temperature": temperature, "top_p": top_p}}


def hidden_hook(tape: str):
    """A forward pre-hook for a vLLM model's ``logits_processor`` (called as ``(lm_head, hidden)``):
    keeps the post-norm rows of the positions that get logits, in bf16, for the tape's next
    :meth:`ProjectSampler.apply`."""

    def hook(_module, args):
        TAPES[tape].hidden = args[1].detach().to(torch.bfloat16)

    return hook


class ProjectSampler(LogitsProcessor):
    """vLLM logits processor (module docstring): rows of requests without :data:`ARGS_KEY` pass untouched."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):  # noqa: ARG002 - vLLM's signature
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy requests included

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, prompt, output in batch_update.added:
            args = (params.extra_args or {}).get(ARGS_KEY)
            if args is None:
                self.rows.pop(i, None)
                continue
            reserve = len(prompt or ()) + (params.max_tokens or 0)
            self.rows[i] = _Row(args["tape"], args["key"], int(args["seed"]), float(args["temperature"]),
                                float(args["top_p"]), reserve, output)
        for a, b, how in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        idx = sorted(i for i in self.rows if i < logits.shape[0])
        if not idx:
            return logits
        rows = [self.rows[i] for i in idx]
        tapes = {r.tape for r in rows}
        hidden = {t: TAPES[t].hidden for t in tapes if t in TAPES}
        for t in hidden:
            TAPES[t].hidden = None  # read once: a stale row must never pass for a later forward's
        dev = logits.device
        at = torch.tensor(idx, device=dev)
        mine = logits[at].float()
        temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
        positions = [len(r.output) for r in rows]
        u = None
        if any(r.temperature > 0 for r in rows):
            seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64, device=dev)
            u = uniforms(seeds, torch.tensor(positions, dtype=torch.int64, device=dev), mine.shape[-1])
        tokens = sample(mine, temperature, top_p, u)
        logprobs = chosen_logprobs(mine, tokens, temperature).cpu().tolist()
        forced = torch.full_like(mine, float("-inf")).scatter_(-1, tokens[:, None], 0.0)
        logits[at] = forced.to(logits.dtype)
        tokens_cpu = tokens.cpu().tolist()
        # each tape's hidden rows of this forward, for the rows sampled here, in one copy to the CPU
        kept = {name: h[at].cpu() for name, h in hidden.items() if h is not None and h.shape[0] == logits.shape[0]}
        for j, (r, t) in enumerate(zip(rows, positions)):
            tape = TAPES.get(r.tape)
            if tape is not None:
                h = kept.get(r.tape)
                tape.steps.setdefault(r.key, {})[t] = (tokens_cpu[j], logprobs[j], None if h is None else h[j])
        for name in tapes & TAPES.keys():
            mine_rows = [(r, t) for r, t in zip(rows, positions) if r.tape == name]
            new = sum(t == 0 for _, t in mine_rows)
            stats = TAPES[name].stats
            if new:
                stats.prefilled(new, len(mine_rows), sum(r.reserve for r, _ in mine_rows))
            if len(mine_rows) > new:
                stats.decoded(len(mine_rows) - new)
        return logits
