"""vLLM as an inference engine of the project: the :class:`~intellect.inference.protocol.InferenceEngine`
protocol on a vLLM ``LLM``, for the inference workers' own environment (``make venv-vllm``, docs/vllm.md).

What a :class:`VllmEngine` returns is what a :class:`~intellect.inference.torch_engine.TorchEngine` on
the same checkpoint returns, up to the rounding of the logits, so a torch validator checks it as it
checks its own workers:

* **tokens**: the project's seeded sampler (:mod:`intellect.inference.sampling`) runs inside vLLM as
  a logits processor (:class:`~intellect.inference.vllm_sampler.ProjectSampler`), and vLLM decodes
  greedily what it leaves; vLLM's own sampler and its seed are never used.
* **log-probs**: :func:`~intellect.inference.sampling.chosen_logprobs` of the engine's logits, after
  the temperature (vLLM's own are taken before it).
* **stop rules**: vLLM stops at the engine's EOS ids and at nothing else (its own EOS handling is
  off), so ``finish_reason`` is ``stop`` exactly when the last token is one of them.
* **hidden states**: the post-norm rows that fed the logits, from the forward that sampled (a hook on
  the model's logits processor, installed through ``collective_rpc``), bf16 on the CPU as
  :class:`~intellect.inference.protocol.Completion` says.

Weights are updated in place (:meth:`VllmEngine.update_weights`): vLLM reloads the new folder into
the running model, the CPU backend's prepared copy of a tied output head is prepared again (vLLM
keeps the old head otherwise), and cached prefixes computed with the old weights are dropped.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the sampler, the hook and the
engine share the tape of :mod:`~intellect.inference.vllm_sampler`). vLLM keeps process-wide state
(its parallel groups) that the teardown of any one engine clears for every other: a process holds
one engine and updates its weights, rather than building engines one after another. On the CPU it runs in eager mode
with its OpenMP threads unpinned unless the environment says otherwise
(``VLLM_CPU_OMP_THREADS_BIND``: a worker shares its machine). ``EngineConfig.max_batch_size`` is
vLLM's ``max_num_seqs`` and ``kv_budget_tokens`` sizes its KV cache (:func:`kv_cache_bytes`); vLLM
always schedules continuously, so ``scheduling`` does not apply.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from intellect.device import resolve_device, resolve_precision
from intellect.inference.engines import folder_stop_ids
from intellect.inference.protocol import Completion, Request, per_request
from intellect.inference.stats import EngineStats

if TYPE_CHECKING:
    from intellect.config import ComputeConfig
    from intellect.inference.config import EngineConfig
    from intellect.inference.sampling import SamplingParams

_INPROC = "VLLM_ENABLE_V1_MULTIPROCESSING"
_ids = itertools.count()


class VllmEngineError(RuntimeError):
    """vLLM returned what the project's sampler did not record (a vLLM version this engine does not fit)."""


def _install_hook(worker, tape: str) -> None:
    """``collective_rpc`` target: the hidden-state hook on the worker's model (one per model)."""
    from intellect.inference.vllm_sampler import hidden_hook  # noqa: PLC0415 - imports vLLM

    model = worker.model_runner.get_model()
    head = getattr(model, "logits_processor", None)
    if head is None:
        raise VllmEngineError(f"{type(model).__name__} has no logits_processor to take hidden states from")
    model._intellect_hidden = head.register_forward_pre_hook(hidden_hook(tape))


def _reload(worker, folder: str) -> None:
    """``collective_rpc`` target: load ``folder``'s weights into the running model.

    On the CPU, vLLM prepares a packed copy of each linear layer's weight after loading; a tied
    output head shares the embedding's weight, loads nothing of its own and so keeps its old copy
    after a reload: it is prepared again here."""
    from vllm.platforms import current_platform  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

    worker.model_runner.reload_weights(weights_path=folder)
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class VllmEngine:
    """``generate`` (the :class:`~intellect.inference.protocol.InferenceEngine` protocol) on a vLLM ``LLM``
    (module docstring). Build it with :meth:`from_folder`."""

    def __init__(self, llm: Any, *, eos_token_id: Sequence[int], capture_hidden: bool, max_tokens_total: int):
        from intellect.inference.vllm_sampler import TAPES, Tape  # noqa: PLC0415 - imports vLLM

        self.llm = llm
        self.eos = sorted(set(eos_token_id))
        self.capture_hidden = capture_hidden
        self.max_model_len = max_tokens_total
        self.tape_id = f"engine-{os.getpid()}-{next(_ids)}"
        self._tape = TAPES[self.tape_id] = Tape()
        if capture_hidden:
            llm.collective_rpc(_install_hook, args=(self.tape_id,))

    @property
    def stats(self) -> EngineStats:
        """Forwards, rows, tokens and weight updates (as :class:`EngineStats` counts them: a vLLM step
        that prefills new requests and decodes running ones counts as one prefill and one decode forward)."""
        return self._tape.stats

    @classmethod
    def from_folder(cls, folder: Path, compute: ComputeConfig, cfg: EngineConfig, *, capture_hidden: bool,
                    **vllm_args: Any) -> "VllmEngine":
        """A vLLM engine on the HF checkpoint ``folder``, computing on ``compute.device`` in
        ``compute.precision`` (fp32 as float32; bf16 and bf16-mixed as bfloat16 weights: vLLM has no
        autocast), at most ``cfg.max_batch_size`` sequences at once. EOS ids: the tokenizer's and the
        generation config's. ``vllm_args`` go to vLLM's ``LLM`` as they are (``max_num_batched_tokens``,
        ``gpu_memory_utilization``...), over the engine's own settings."""
        if os.environ.setdefault(_INPROC, "0") != "0":
            raise ValueError(f"{_INPROC}={os.environ[_INPROC]}: the vLLM engine needs vLLM in this process (set it to 0)")
        device = resolve_device(compute.device)
        precision = resolve_precision(compute.precision, device)
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

        from intellect.inference.vllm_sampler import ProjectSampler  # noqa: PLC0415 - imports vLLM

        folder = Path(folder)
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        settings: dict[str, Any] = dict(
            model=str(folder), tokenizer=str(folder), dtype=str(dtype).removeprefix("torch."),
            seed=0, enforce_eager=device.type == "cpu", max_num_seqs=cfg.max_batch_size, generation_config="vllm",
            kv_cache_memory_bytes=kv_cache_bytes(folder, cfg, dtype) if device.type == "cpu" or cfg.kv_budget_tokens
            else None,
        )
        llm = LLM(**{**settings, **vllm_args}, logits_processors=[ProjectSampler])
        return cls(llm, eos_token_id=folder_stop_ids(folder), capture_hidden=capture_hidden,
                   max_tokens_total=llm.llm_engine.model_config.max_model_len)

    def update_weights(self, folder: str | Path) -> None:
        """Load ``folder``'s weights (same architecture and shapes) into the running engine, in place;
        cached prefixes of the old weights are dropped. The time it took goes to ``stats``."""
        start = time.perf_counter()
        self.llm.collective_rpc(_reload, args=(str(folder),))
        self.llm.reset_prefix_cache()
        self.stats.updated(time.perf_counter() - start)

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Completion]:
        from vllm import SamplingParams as VllmParams  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

        from intellect.inference.vllm_sampler import request_args  # noqa: PLC0415 - imports vLLM

        params = per_request(sampling, len(requests))
        if not requests:
            return []
        for r, p in zip(requests, params):
            if len(r.prompt_ids) + p.max_tokens > self.max_model_len:
                raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens and max_tokens {p.max_tokens} exceed the "
                                 f"engine's max_model_len {self.max_model_len}")
        base = f"{self.tape_id}-{next(_ids)}"
        keys = [f"{base}-{i}" for i in range(len(requests))]
        asked = [
            VllmParams(
                temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True, detokenize=False,
                stop_token_ids=list(self.eos) if p.stop_at_eos else [],
                extra_args=request_args(self.tape_id, k, r.seed, p.temperature, p.top_p),
            )
            for r, p, k in zip(requests, params, keys)
        ]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        try:
            outputs = self.llm.generate(prompts, asked, use_tqdm=False)
            return [self._completion(out.outputs[0].token_ids, self._tape.steps.get(k, {}), p)
                    for out, k, p in zip(outputs, keys, params)]
        finally:
            for k in keys:
                self._tape.steps.pop(k, None)

    def _completion(self, tokens: Sequence[int], steps: dict, p: SamplingParams) -> Completion:
        tokens = list(tokens)
        got = [steps.get(t) for t in range(len(tokens))]
        if any(g is None or g[0] != tok for g, tok in zip(got, tokens)):
            raise VllmEngineError("vLLM's tokens differ from what the project's sampler chose")
        self._tape.stats.tokens += len(tokens)
        stopped = p.stop_at_eos and bool(tokens) and tokens[-1] in self.eos
        hidden = None
        if self.capture_hidden:
            rows = [g[2] for g in got if g is not None]
            if len(rows) != len(tokens) or any(h is None for h in rows):
                raise VllmEngineError("a generated token has no captured hidden state")
            hidden = torch.stack(rows) if rows else torch.empty(0, 0, dtype=torch.bfloat16)
        return Completion(
            tokens=tokens, finish_reason="stop" if stopped else "length", hidden_states=hidden,
            logprobs=torch.tensor([g[1] for g in got if g is not None], dtype=torch.float32),
        )

    def close(self) -> None:
        """Forget this engine's tape; vLLM's memory goes with the ``LLM`` object (module docstring:
        its teardown ends every vLLM engine of the process)."""
        from intellect.inference.vllm_sampler import TAPES  # noqa: PLC0415 - imports vLLM

        TAPES.pop(self.tape_id, None)


#: The KV cache of a CPU engine without ``kv_budget_tokens`` holds at most this many bytes (vLLM's
#: own CPU default before it reserved a share of the machine's memory).
DEFAULT_KV_BYTES = 4 << 30


def kv_cache_bytes(folder: Path, cfg: EngineConfig, dtype: torch.dtype, block: int = 128) -> int:
    """Bytes of KV cache for ``cfg.kv_budget_tokens`` tokens (None: ``max_batch_size`` sequences of the
    model's full length, at most :data:`DEFAULT_KV_BYTES` but one full sequence always), plus a
    ``block`` of tokens per sequence for vLLM's paging.

    On the CPU vLLM otherwise reserves a fixed share of the machine's memory, and refuses to start
    when other processes hold part of it; a worker shares its machine.

    >>> import json, tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
    ...     "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}))
    >>> from intellect.inference.config import EngineConfig
    >>> kv_cache_bytes(d, EngineConfig(max_batch_size=2), torch.float32)   # 2 x (256 + 128) tokens x 512 B
    393216
    """
    from transformers import AutoConfig  # noqa: PLC0415 - only where an engine is built

    hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    text = hf.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    slack = cfg.max_batch_size * block * per_token
    one = text.max_position_embeddings * per_token  # one full-length sequence always fits
    if cfg.kv_budget_tokens is not None:
        return max(cfg.kv_budget_tokens * per_token, one) + slack
    return max(min(cfg.max_batch_size * one, DEFAULT_KV_BYTES), one) + slack
