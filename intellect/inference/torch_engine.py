"""The inference engine in plain torch, for any HF causal LM, on CPU or CUDA.

Left-padded prompts decode with a KV cache; each row is fed its own position (the count of its
real tokens), so padding never shifts RoPE. Each row samples with
:mod:`intellect.inference.sampling`, whose noise depends only on the row's seed and its own
step, so a request decodes the same alone or in any batch up to floating-point rounding of the
logits. The final hidden states are taken by a forward pre-hook on the LM head: its input is
the post-norm state for every HF causal LM, whatever the model calls its norm, and it is already
cut to the positions that get logits.

Scheduling (:class:`~intellect.inference.config.EngineConfig`):

* ``continuous`` (the default): requests wait in a queue, longest ``max_tokens`` first. A row
  leaves the running batch the step it ends (EOS or its ``max_tokens``), and waiting requests
  take the free slots: their prompts are prefilled together in one forward and their KV cache
  joins the running one (:class:`~intellect.inference.kv_slots.KVSlots`), so no forward spends
  a row on a finished request. ``kv_budget_tokens`` holds a request back while the running rows'
  ``len(prompt) + max_tokens`` would leave it no room. Each step's rows (running rows first, then
  that step's newcomers) are the rows of the step's forwards in order, which is how tokens,
  logprobs and captured hidden states find their request. Caches that rows cannot leave or join
  (sliding-window, quantized...) fall back to ``static`` with a warning.
* ``static``: batches of similar prompt length (cut at ``kv_budget_tokens`` reserved too), each
  decoding until its longest row ends; the baseline, and what a model without a spliceable cache gets.

:attr:`TorchEngine.stats` (:class:`EngineStats`) counts forwards and rows across calls, so the
share of decoded row-steps that yielded a returned token can be measured.

The engine computes on its model's device: prompts, masks and the KV cache go there, and only
tokens, per-token vectors and the bf16 hidden states come back. ``precision`` is how a forward
runs, with the run's ``compute.precision`` meaning for inference:

* ``fp32``: float32 weights and compute;
* ``bf16-mixed``: float32 weights (the checkpoint as published) under bf16 autocast, the
  trainer's own forward, at about bf16 speed without a second copy of the weights;
* ``bf16``: bf16 weights and compute.

Sampling always runs in float32 on the logits, whatever their dtype, and its noise depends only
on the row's seed and position (:mod:`intellect.inference.sampling`), so decoding on one device is
deterministic; two devices, or the cached decode and a full prefill, agree up to the rounding of
the logits, which in bf16 flips an occasional near-tie (TOPLOC's seeded re-check allows for it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence, runtime_checkable

import torch

from intellect.device import Precision, autocast, prepare_model, resolve_device, resolve_precision
from intellect.inference.config import EngineConfig
from intellect.inference.kv_slots import KVSlots, UnsupportedCache
from intellect.inference.stats import EngineStats
from intellect.inference.protocol import Completion, Request, Scored, per_request, stop_ids
from intellect.inference.sampling import LowProb, SamplingParams, chosen_logprobs, sample, score_tokens, uniforms
from intellect.inference.weight_folder import load_in_place, read_state_dict
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.model.generate import _cache_kwarg, _cache_of, left_pad

if TYPE_CHECKING:
    from intellect.config import ComputeConfig

log = logging.getLogger("intellect.inference")


@runtime_checkable
class _CausalLM(Protocol):
    """What the engine needs of an HF causal LM beyond ``torch.nn.Module``."""

    def get_output_embeddings(self) -> torch.nn.Module | None: ...


def lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head (``get_output_embeddings()``) of an HF causal LM; ``ValueError`` without one."""
    if not isinstance(model, _CausalLM):
        raise TypeError(f"{type(model).__name__} is not an HF causal LM (no get_output_embeddings)")
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("the model has no LM head (get_output_embeddings() is None)")
    return head


class TorchEngine:
    """``generate`` for the protocol, and ``prefill`` for the validator.

    ``eos_token_id`` may be one id or several. ``config`` says how generation is batched
    (:class:`~intellect.inference.config.EngineConfig`); ``max_batch_size``, when given,
    overrides its field (the rows of one forward, in ``prefill`` too). With
    ``capture_hidden=False`` completions carry no hidden states (and skip the hook).
    ``precision`` is how forwards run (module docstring); the device is the model's.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_batch_size: int | None = None,
        capture_hidden: bool = True,
        precision: Precision = "fp32",
        config: EngineConfig | None = None,
    ):
        lm_head(model)  # ValueError without one
        config = config or EngineConfig()
        if max_batch_size is not None:
            if max_batch_size < 1:
                raise ValueError("max_batch_size must be >= 1")
            config = EngineConfig(**{**config.model_dump(), "max_batch_size": max_batch_size})
        self.config = config
        self.model = model.eval()
        self.eos = sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        self.pad = pad_token_id
        self.capture_hidden = capture_hidden
        self.precision: Precision = precision
        self.device = next(model.parameters()).device
        self.stats = EngineStats()
        self._spliceable = True  # until the model's cache proves otherwise (UnsupportedCache)

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size

    @classmethod
    def for_tokenizer(cls, model: torch.nn.Module, tokenizer, *, compute: ComputeConfig | None = None,
                      **kwargs: Any) -> "TorchEngine":
        """EOS ids from the tokenizer and the model's generation config (chat models often list several);
        the pad id is the tokenizer's, else its EOS (left padding is masked, so any id serves).

        With ``compute``, the model is first moved to ``compute.device`` in the precision's weight
        dtype (:func:`~intellect.device.prepare_model`: float32 for ``fp32`` and ``bf16-mixed``, bf16
        for ``bf16``) and forwards run in ``compute.precision``; without, the model stays as it is.
        Other keyword arguments (``config``, ``max_batch_size``...) go to the constructor.
        """
        eos = stop_ids(tokenizer.eos_token_id,
                       getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token to pad prompts with")
        if compute is not None:
            device = resolve_device(compute.device)
            prepare_model(model, compute, device, train=False)
            kwargs["precision"] = resolve_precision(compute.precision, device)
        return cls(model, eos_token_id=eos, pad_token_id=pad, **kwargs)

    @classmethod
    def from_folder(cls, folder: str | Path, compute: ComputeConfig | None = None, cfg: EngineConfig | None = None,
                    *, capture_hidden: bool = False) -> "TorchEngine":
        """An engine of the HF checkpoint ``folder`` (:meth:`for_tokenizer`), batching as ``cfg`` says.
        The weights are copied into memory, so the folder may go once this returns. Without ``compute``
        they are float32 on the CPU whatever the folder stores (a bf16 checkpoint is upcast, as an fp32
        worker runs it, never computed in bf16 by default)."""
        model, tok = load_checkpoint_copy(folder, torch.float32 if compute is None else None)
        return cls.for_tokenizer(model, tok, compute=compute, capture_hidden=capture_hidden, config=cfg)

    def update_weights(self, folder: str | Path) -> None:
        """Load the weights of the HF checkpoint ``folder`` (same architecture) into this engine's model
        in place (:func:`~intellect.inference.weight_folder.load_in_place`: each parameter keeps its device
        and precision, as a fresh engine's would have them); the time it took goes to ``stats``."""
        t0 = time.perf_counter()
        load_in_place(self.model, read_state_dict(folder))
        self.stats.updated(time.perf_counter() - t0)

    # ------------------------------------------------------------------ helpers

    @contextmanager
    def _lm_head_inputs(self, enabled: bool) -> Iterator[list[torch.Tensor]]:
        seen: list[torch.Tensor] = []
        if not enabled:
            yield seen
            return
        head = lm_head(self.model)
        # bf16 at once: that is what TOPLOC commits to, and it halves what a long decode holds
        handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].to(torch.bfloat16)))
        try:
            yield seen
        finally:
            handle.remove()

    def _forward(self, **kwargs: Any):
        """One forward of the model, in the engine's precision."""
        with autocast(self.device, self.precision):
            return self.model(**kwargs)

    def _batches(self, lengths: Sequence[int], reserve: Sequence[int] | None = None) -> Iterator[list[int]]:
        """Indices in batches of at most ``max_batch_size`` and, with ``reserve`` (tokens per
        index), of at most ``kv_budget_tokens`` reserved unless alone."""
        # similar lengths together to waste less on padding; results do not depend on the grouping
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        budget = self.config.kv_budget_tokens if reserve is not None else None
        batch: list[int] = []
        held = 0
        for i in order:
            full = len(batch) == self.max_batch_size
            if batch and (full or (budget is not None and reserve is not None and held + reserve[i] > budget)):
                yield batch
                batch, held = [], 0
            batch.append(i)
            held += reserve[i] if reserve is not None else 0
        if batch:
            yield batch

    def _row_params(self, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        return temperature, top_p

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(
        self, requests: Sequence[Request], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        params = per_request(sampling, len(requests))
        if not requests:
            return []
        if self.config.scheduling == "continuous" and self._spliceable:
            try:
                return self._generate_continuous(list(requests), params)
            except UnsupportedCache as e:
                self._spliceable = False
                log.warning("continuous batching is not possible for this model (%s): static batches instead", e)
        out: list[Completion | None] = [None] * len(requests)
        reserve = [len(r.prompt_ids) + p.max_tokens for r, p in zip(requests, params)]
        for rows in self._batches([len(r.prompt_ids) for r in requests], reserve):
            for i, c in zip(rows, self._generate_batch([requests[i] for i in rows], [params[i] for i in rows])):
                out[i] = c
        return out  # type: ignore[return-value]

    def _generate_batch(self, requests: list[Request], params: list[SamplingParams]) -> list[Completion]:
        dev, batch = self.device, len(requests)
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad)
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        next_pos = positions[:, -1:] + 1
        temperature, top_p = self._row_params(params)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev)
        limit = torch.tensor([p.max_tokens for p in params], device=dev)
        stops = torch.tensor([p.stop_at_eos for p in params], device=dev)
        eos = torch.tensor(self.eos, device=dev)
        any_hot = any(p.temperature > 0 for p in params)
        cache_kw = _cache_kwarg(self.model)

        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        stopped = torch.zeros_like(done)
        length = limit.clone()
        tokens, logprobs = [], []
        stats = self.stats
        stats.prefilled(batch, batch, sum(len(r.prompt_ids) + p.max_tokens for r, p in zip(requests, params)))
        with self._lm_head_inputs(self.capture_hidden) as hidden:
            fwd = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                logits_to_keep=1)
            for t in range(max(p.max_tokens for p in params)):
                logits = fwd.logits[:, -1, :]
                u = uniforms(seeds, t, logits.shape[-1]) if any_hot else None
                nxt = sample(logits, temperature, top_p, u)
                tokens.append(nxt)
                logprobs.append(chosen_logprobs(logits, nxt, temperature))
                hit_eos = stops & torch.isin(nxt, eos)
                ends = ~done & (hit_eos | (limit == t + 1))
                length = torch.where(ends, t + 1, length)
                stopped |= ends & hit_eos
                done |= ends
                if bool(done.all()):
                    break
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
                stats.decoded(batch)
                fwd = self._forward(
                    input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos,
                    use_cache=True, **{cache_kw: _cache_of(fwd)},
                )
                next_pos = next_pos + 1
            # one hook call per forward and every forward's logits produced a token: no extra decode step
            states = torch.cat([h[:, -1:] for h in hidden], 1).cpu() if self.capture_hidden else None

        tokens_cpu, logprobs_cpu = torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).cpu()
        length, stopped = length.cpu().tolist(), stopped.cpu().tolist()
        stats.tokens += sum(length)
        return [
            Completion(
                tokens=tokens_cpu[i, : length[i]].tolist(),
                finish_reason="stop" if stopped[i] else "length",
                hidden_states=None if states is None else states[i, : length[i]].clone(),
                logprobs=logprobs_cpu[i, : length[i]].clone(),
            )
            for i in range(batch)
        ]

    def _generate_continuous(self, requests: list[Request], params: list[SamplingParams]) -> list[Completion]:
        """Continuous batching (module docstring). Each iteration: one decode forward of the running
        rows (their last tokens), one prefill forward of the newcomers admitted into free slots, then
        one sampling over both, in that row order; rows that ended leave before the next forward."""
        dev, n, stats = self.device, len(requests), self.stats
        prompt_len = [len(r.prompt_ids) for r in requests]
        reserve = [prompt_len[i] + p.max_tokens for i, p in enumerate(params)]
        # longest first, so the last requests to finish are short ones and the batch stays full
        queue = deque(sorted(range(n), key=lambda i: (-params[i].max_tokens, prompt_len[i])))
        eos = torch.tensor(self.eos, device=dev)
        any_hot = any(p.temperature > 0 for p in params)
        cache_kw = _cache_kwarg(self.model)
        stopped = torch.zeros(n, dtype=torch.bool, device=dev)
        slots: KVSlots | None = None
        owners: list[int] = []  # the request of each running row, mirroring slots.rows["req"]
        first_step: dict[int, int] = {}  # the iteration at which each request sampled its first token
        tokens, logprobs, owner_rows = [], [], []  # per iteration, rows in the forwards' order
        with self._lm_head_inputs(self.capture_hidden) as hidden:
            it = 0
            while True:
                logits = []
                if slots is not None and owners:
                    rows = slots.rows
                    fwd = self._forward(input_ids=rows["last"][:, None], attention_mask=slots.grow(),
                                        position_ids=rows["pos"][:, None], use_cache=True,
                                        **{cache_kw: slots.cache})
                    rows["pos"] = rows["pos"] + 1
                    logits.append(fwd.logits[:, -1, :])
                    stats.decoded(len(owners))
                new = self._admit(queue, owners, reserve)
                if new:
                    joining, new_logits = self._prefill_slots([requests[i] for i in new], [params[i] for i in new], new)
                    logits.append(new_logits)
                    if slots is None or not owners:
                        slots = joining
                    else:
                        slots.join(joining)
                    owners += new
                    first_step.update((i, it) for i in new)
                    stats.prefilled(len(new), len(owners), sum(reserve[i] for i in owners))
                if not logits:
                    break
                assert slots is not None
                rows, step_logits = slots.rows, torch.cat(logits)
                u = uniforms(rows["seed"], rows["t"], step_logits.shape[-1]) if any_hot else None
                nxt = sample(step_logits, rows["temp"], rows["top_p"], u)
                tokens.append(nxt)
                logprobs.append(chosen_logprobs(step_logits, nxt, rows["temp"]))
                owner_rows.append(rows["req"])
                hit_eos = rows["stop"] & torch.isin(nxt, eos)
                ends = hit_eos | (rows["t"] + 1 == rows["limit"])
                stopped.scatter_(0, rows["req"], hit_eos)  # a row's last step says why it ended
                rows["t"], rows["last"] = rows["t"] + 1, nxt
                ended = set(ends.nonzero().flatten().tolist())  # the loop's one sync per step
                if ended:
                    alive = [j for j in range(len(owners)) if j not in ended]
                    owners = [owners[j] for j in alive]
                    # cached real tokens of a row: its prompt and the tokens it has fed so far
                    real = max((prompt_len[i] + it - first_step[i] for i in owners), default=0)
                    slots.keep(torch.tensor(alive, dtype=torch.int64, device=dev), real=real)
                it += 1
            # one hook call per forward, in the order of each iteration's rows
            states = torch.cat([h[:, -1] for h in hidden]) if self.capture_hidden else None

        owner = torch.cat(owner_rows)
        order = torch.sort(owner, stable=True).indices  # by request, each request's tokens in step order
        bounds = [0] + torch.bincount(owner, minlength=n).cumsum(0).cpu().tolist()
        tokens_cpu = torch.cat(tokens)[order].cpu()
        logprobs_cpu = torch.cat(logprobs)[order].cpu()
        states_cpu = None if states is None else states[order].cpu()
        stopped_cpu = stopped.cpu().tolist()
        stats.tokens += bounds[-1]
        return [
            Completion(
                tokens=tokens_cpu[a:b].tolist(),
                finish_reason="stop" if stopped_cpu[i] else "length",
                hidden_states=None if states_cpu is None else states_cpu[a:b].clone(),
                logprobs=logprobs_cpu[a:b].clone(),
            )
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]

    def _admit(self, queue: deque[int], owners: list[int], reserve: Sequence[int]) -> list[int]:
        """Waiting requests that take free slots now, in queue order: while rows are free and, with a
        KV budget, the reservations leave room (one request alone always runs)."""
        budget, new = self.config.kv_budget_tokens, []
        held = sum(reserve[i] for i in owners)
        while queue and len(owners) + len(new) < self.max_batch_size:
            i = queue[0]
            if budget is not None and (owners or new) and held + reserve[i] > budget:
                break  # first in, first served: a large request is not overtaken forever
            new.append(queue.popleft())
            held += reserve[i]
        return new

    def _prefill_slots(self, requests: list[Request], params: list[SamplingParams], owners: list[int]
                       ) -> tuple[KVSlots, torch.Tensor]:
        """One forward over newcomers' prompts: their slots (cache, mask, per-row state) and the
        logits of their first tokens [B, V]."""
        dev = self.device
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad)
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        fwd = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
        temperature, top_p = self._row_params(params)
        rows = {
            "req": torch.tensor(owners, dtype=torch.int64, device=dev),
            "seed": torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev),
            "temp": temperature, "top_p": top_p,
            "limit": torch.tensor([p.max_tokens for p in params], dtype=torch.int64, device=dev),
            "stop": torch.tensor([p.stop_at_eos for p in params], dtype=torch.bool, device=dev),
            "t": torch.zeros(len(requests), dtype=torch.int64, device=dev),  # the row's own step
            "pos": mask.sum(-1),  # the position of the next token fed: the count of real tokens
            "last": torch.zeros(len(requests), dtype=torch.int64, device=dev),
        }
        return KVSlots(_cache_of(fwd), mask, rows), fwd.logits[:, -1, :]

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(
        self,
        requests: Sequence[Request],
        outputs: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        low_prob: LowProb | None = None,
    ) -> list[Scored]:
        """Score claimed ``outputs`` in one forward per batch: what a validator recomputes.

        ``resampled[i] != outputs[i]`` marks a position where the claimed token is
        not what this engine's logits and the request's seed select. With ``low_prob``,
        each token's ``low`` flag and ``chance`` come back too (computed on the device,
        see :func:`~intellect.inference.sampling.score_tokens`); logits never do.
        """
        if len(outputs) != len(requests):
            raise ValueError(f"{len(outputs)} outputs for {len(requests)} requests")
        params = per_request(sampling, len(requests))
        out: list[Scored | None] = [None] * len(requests)
        todo = [i for i in range(len(requests)) if outputs[i]]
        for i in set(range(len(requests))) - set(todo):
            out[i] = self._empty_score(low_prob)
        for rows in self._batches([len(requests[i].prompt_ids) + len(outputs[i]) for i in todo]):
            idx = [todo[j] for j in rows]
            scored = self._prefill_batch(
                [requests[i] for i in idx], [list(outputs[i]) for i in idx], [params[i] for i in idx], low_prob
            )
            for i, s in zip(idx, scored):
                out[i] = s
        return out  # type: ignore[return-value]

    def _empty_score(self, low_prob: LowProb | None) -> Scored:
        head = lm_head(self.model).weight
        assert isinstance(head, torch.Tensor)  # [vocab, hidden]: the head is a linear layer
        return Scored(
            hidden_states=torch.empty(0, head.shape[1], dtype=torch.bfloat16),
            logprobs=torch.empty(0), resampled=torch.empty(0, dtype=torch.int64), margin=torch.empty(0),
            low=None if low_prob is None else torch.empty(0, dtype=torch.bool),
            chance=None if low_prob is None else torch.empty(0, dtype=torch.float64),
        )

    def _prefill_batch(
        self, requests: list[Request], outputs: list[list[int]], params: list[SamplingParams],
        low_prob: LowProb | None,
    ) -> list[Scored]:
        dev = self.device
        # the last output token produces nothing we check, so it is not fed
        ids, mask = left_pad([r.prompt_ids + o[:-1] for r, o in zip(requests, outputs)], self.pad)
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        n = [len(o) for o in outputs]
        keep = max(n)  # sequences end in the last column, so each row's producing positions are its last n
        with self._lm_head_inputs(True) as hidden:
            logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                                   logits_to_keep=keep).logits
        rows = [(r, c) for r in range(len(outputs)) for c in range(keep - n[r], keep)]
        r_idx, c_idx = (torch.tensor(x, device=dev) for x in zip(*rows))
        temperature, top_p = self._row_params([p for p, k in zip(params, n) for _ in range(k)])
        return scored_rows(hidden[0][r_idx, c_idx], logits[r_idx, c_idx], outputs, requests, temperature, top_p,
                           low_prob)


def scored_rows(hidden: torch.Tensor, logits: torch.Tensor, outputs: Sequence[Sequence[int]],
                requests: Sequence[Request], temperature: torch.Tensor, top_p: torch.Tensor,
                low_prob: LowProb | None) -> list[Scored]:
    """One :class:`Scored` per row from a batch's producing positions, flattened row after row:
    ``hidden`` [tokens, hidden] and ``logits`` [tokens, V] on the device, ``temperature`` and
    ``top_p`` per token. Only per-token vectors and the hidden states reach the CPU."""
    dev, n = logits.device, [len(o) for o in outputs]
    claimed = torch.tensor([tok for o in outputs for tok in o], device=dev)
    seeds = torch.tensor([r.seed for r, k in zip(requests, n) for _ in range(k)], device=dev)
    pos = torch.tensor([t for k in n for t in range(k)], device=dev)
    got = score_tokens(logits, claimed, temperature, top_p, seeds, pos, low_prob)
    hidden = hidden.cpu()
    bounds = torch.tensor([0] + n).cumsum(0).tolist()
    return [
        Scored(
            hidden_states=hidden[a:b].clone(), logprobs=got["logprobs"][a:b].clone(),
            resampled=got["resampled"][a:b].clone(), margin=got["margin"][a:b].clone(),
            low=got["low"][a:b].clone() if "low" in got else None,
            chance=got["chance"][a:b].clone() if "chance" in got else None,
        )
        for a, b in zip(bounds, bounds[1:])
    ]
