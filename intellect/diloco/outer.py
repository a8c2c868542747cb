"""DiLoCo's outer loop state: the fp32 synced copy, pseudo-gradients, Nesterov steps.

Every replica keeps ``theta_sync`` (fp32, on the CPU, off the accelerator, whatever the inner
loop's device and precision) and the momentum of an SGD-Nesterov optimizer over it: the all-reduce
and the outer step run on the host, and the bit-identity of replicas rests on fp32 CPU arithmetic,
which every device family shares. When the inner copy lives on CUDA the host copy is page-locked
(``device.pin``), so the copies each way at every outer step are asynchronous DMA. After H inner
steps a worker's pseudo-gradient is ``theta_sync - theta_local``; the all-reduced average is
applied as the gradient of one outer step. Replicas that start bit-identical and apply the
bit-identical average stay bit-identical (:meth:`OuterState.digest` checks it). An outer
checkpoint is ``theta_sync`` as an fp32 HF folder plus the momentum
(:func:`publish_outer_checkpoint`).

Worked example (one parameter, lr 0.7, momentum 0.9, Nesterov)::

    >>> import torch
    >>> model = torch.nn.Linear(1, 1, bias=False)
    >>> _ = model.weight.data.fill_(1.0)
    >>> outer = OuterState(model, lr=0.7, momentum=0.9)
    >>> _ = model.weight.data.fill_(0.8)          # local training moved it by -0.2
    >>> [round(g.item(), 3) for g in outer.pseudo_gradient(model)]
    [0.2]
    >>> outer.step([torch.tensor([[0.2]])])       # average of every worker: 0.2
    >>> round(outer.params[0].item(), 3)          # 1 - 0.7 * (0.2 + 0.9 * 0.2)
    0.734
    >>> outer.load_into(model); round(model.weight.item(), 3)
    0.734
"""

from __future__ import annotations

import copy
import hashlib
import io
import math
from typing import TYPE_CHECKING, Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from intellect.checkpoints import CHECKPOINTS, OUTER_STATE, publish
from intellect.device import pin
from intellect.model.bpe import ensure_tokenizer
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage

if TYPE_CHECKING:
    from intellect.diloco.config import DilocoRunConfig


class OuterState:
    """``theta_sync`` and the outer optimizer for the parameters of ``model``.

    ``device``: where the inner copy will live (default: where ``model``'s parameters are now).
    Build it from the fp32 weights (a checkpoint) before the model is cast to a lower precision,
    so ``theta_sync`` starts exact.
    """

    def __init__(self, model: torch.nn.Module, lr: float = 0.7, momentum: float = 0.5, nesterov: bool = True,
                 *, device: torch.device | None = None):
        params = self._model_params(model)
        self.device = device or (params[0].device if params else torch.device("cpu"))
        self.params = [pin(p.detach().to("cpu", torch.float32, copy=True), self.device) for p in params]
        self._staging: list[torch.Tensor] = []  # pinned fp32 buffers the CUDA copy lands in
        # where the inner phase under way started, when not theta_sync (an eager overlap's own step: preview)
        self.base: list[torch.Tensor] | None = None
        # momentum 0 is plain (scaled) model averaging, where Nesterov means nothing; torch rejects the pair
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    @staticmethod
    def _model_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return list(model.parameters())  # tied weights appear once

    def _host_copy(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The model's parameters as fp32 on the CPU (pinned staging buffers for a CUDA model)."""
        params = self._model_params(model)
        if not any(p.is_cuda for p in params):
            return [p.detach().to(torch.float32) for p in params]
        if not self._staging:
            self._staging = [pin(torch.empty_like(s), p.device) for s, p in zip(self.params, params)]
        for buf, p in zip(self._staging, params):
            # upcast on the device, then one asynchronous device-to-host copy into page-locked memory
            buf.copy_(p.detach().to(torch.float32), non_blocking=True)
        for d in {p.device for p in params if p.is_cuda}:
            torch.cuda.synchronize(d)
        return self._staging

    def pseudo_gradient(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """``theta_sync - theta_local`` per parameter, fp32 on the CPU (whatever the model's dtype and device);
        from :attr:`base` instead when the inner phase started there (:meth:`preview`)."""
        start = self.base if self.base is not None else self.params
        return [s - p for s, p in zip(start, self._host_copy(model))]

    @torch.no_grad()
    def preview(self, pseudo: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
        """Where an eager overlap's next inner phase starts (:attr:`base`, returned): ``theta_sync`` after one
        outer step on ``weight`` times this worker's own fresh pseudo-gradient, taken on copies (the
        momentum too), so ``theta_sync`` waits for the members' average. With weight 1 it is bit for bit the
        outer step the average of one worker would take.

        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> _ = model.weight.data.fill_(1.0)
        >>> outer = OuterState(model, lr=0.5, momentum=0.0)
        >>> [round(b.item(), 3) for b in outer.preview([torch.tensor([[0.4]])], 0.5)], outer.params[0].item()
        ([0.9], 1.0)
        """
        params = [p.detach().clone() for p in self.params]
        group = self.optimizer.param_groups[0]
        opt = torch.optim.SGD(params, lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"])
        for q, p, g in zip(params, self.params, pseudo):
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                opt.state[q]["momentum_buffer"] = buf.clone()
            q.grad = g.to(torch.float32) if weight == 1 else g.to(torch.float32) * weight
        opt.step()
        for q in params:
            q.grad = None
        self.base = params
        return params

    def step(self, average: Sequence[torch.Tensor]) -> None:
        """Apply one outer step with the all-reduced pseudo-gradient ``average``."""
        if len(average) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors, got {len(average)}")
        for p, g in zip(self.params, average):
            if g.shape != p.shape:
                raise ValueError(f"shape {tuple(g.shape)} does not match parameter {tuple(p.shape)}")
            p.grad = g.to(torch.float32)
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None) -> None:
        """Copy ``theta_sync`` (or ``weights``, fp32 CPU tensors of its shapes) into the model, cast to its
        dtype and device, for the next inner phase."""
        params = self._model_params(model)
        for s, p in zip(self.params if weights is None else weights, params):
            # to the device in fp32 first (asynchronous from pinned memory), cast there: the host never
            # materialises a low-precision copy, and the cast rounds exactly as a CPU cast would
            p.copy_(s.to(p.device, non_blocking=True) if p.is_cuda else s)
        for d in {p.device for p in params if p.is_cuda}:
            torch.cuda.synchronize(d)  # theta_sync may change (outer step) once we return

    def digest(self) -> str:
        """SHA-256 over the bytes of ``theta_sync``: equal on bit-identical replicas."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.contiguous().numpy().tobytes())
        return h.hexdigest()

    def momentum_buffers(self) -> list[torch.Tensor]:
        """Momentum per parameter (zeros before the first step), for onboarding and checkpoints."""
        out = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            out.append(torch.zeros_like(p) if buf is None else buf)
        return out

    def has_momentum(self) -> bool:
        return any("momentum_buffer" in self.optimizer.state.get(p, {}) for p in self.params)

    def flat(self, committed: int) -> torch.Tensor:
        """All of the state in one fp32 buffer, for the onboarding broadcast: ``theta_sync``, the
        momentum, then ``[committed, has_momentum]`` (``committed``: the outer steps in it)."""
        return torch.cat([p.flatten() for p in self.params] + [b.flatten() for b in self.momentum_buffers()]
                         + [torch.tensor([float(committed), float(self.has_momentum())])])

    def load_flat(self, flat: torch.Tensor) -> int:
        """Take a peer's :meth:`flat` (a state without momentum clears ours); returns its ``committed``,
        or -1 when that is no step count (the caller refuses such a state and loads its own back)."""
        sizes = [p.numel() for p in self.params]
        n = sum(sizes)
        params = [c.view_as(p) for c, p in zip(flat[:n].split(sizes), self.params)]
        momentum = [c.view_as(p) for c, p in zip(flat[n:2 * n].split(sizes), self.params)]
        self.set_state(params, momentum if flat[-1] > 0 else None)
        if not flat[-1] > 0:
            for p in self.params:
                self.optimizer.state.get(p, {}).pop("momentum_buffer", None)
        count = float(flat[-2])
        return int(count) if math.isfinite(count) and count == int(count) and 0 <= count < 2 ** 40 else -1

    @torch.no_grad()
    def set_state(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None) -> None:
        """Overwrite ``theta_sync`` (and momentum, when given) with a peer's or a checkpoint's."""
        for p, src in zip(self.params, params):
            p.copy_(src)
        if momentum is not None:
            for p, m in zip(self.params, momentum):
                self.optimizer.state[p]["momentum_buffer"] = m.to(torch.float32).clone()


# ---------------------------------------------------------------------- checkpoints


def host_model(model: torch.nn.Module, own: bool = False) -> torch.nn.Module:
    """``model`` itself when its weights are fp32 on the CPU (and not ``own``), else a fresh fp32 CPU model
    of the same class and config (the shell a checkpoint is published from: ``OuterState.load_into`` fills
    it)."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded and not own and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()):
        return model
    config = copy.deepcopy(getattr(model, "config"))
    # FSDP2 makes a model's class a subclass of FSDPModule and of the model's own: the shell is the latter's
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("cpu"):
        shell = cls(config).float()
    if getattr(model, "generation_config", None) is not None:
        shell.generation_config = copy.deepcopy(getattr(model, "generation_config"))
    return shell.eval()


def publish_outer_checkpoint(storage: RunStorage, n: int, model, tokenizer, outer: OuterState, members: list[str]) -> str:
    """``checkpoints/step_<n>``: HF folder of ``theta_sync`` (fp32) plus the outer optimizer state;
    ``model`` is a fp32 CPU model (:func:`host_model`) that is overwritten with ``theta_sync``."""
    if not storage.is_stable(n, CHECKPOINTS):
        if not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()):
            raise ValueError("publish_outer_checkpoint: checkpoints are fp32 CPU weights; pass host_model(model)")
        outer.load_into(model)
        buf = io.BytesIO()
        torch.save({"momentum": outer.momentum_buffers(), "step": n, "members": members,
                    "has_momentum": outer.has_momentum()}, buf)
        publish(model, tokenizer, storage, n, {OUTER_STATE: buf.getvalue()})
    return storage.uri(storage.step_path(n, CHECKPOINTS))


def init_run(run: DilocoRunConfig, storage: RunStorage) -> int:
    """Publish the initial model as outer checkpoint 0 unless the run has one; returns the newest.
    A text run whose ``model.tokenizer`` folder does not exist yet trains it on the corpus first."""
    newest = storage.latest_step(CHECKPOINTS)
    if newest is None:
        if run.data.kind == "text" and run.model.tokenizer:
            ensure_tokenizer(run.model.tokenizer, run.data, run.model.tokenizer_vocab)
        model, tok = build_model(run.model)
        publish_outer_checkpoint(storage, 0, model, tok, OuterState(model), [])
        newest = 0
    return newest


def load_outer_state(storage: RunStorage, n: int, outer: OuterState) -> None:
    """The outer momentum of checkpoint ``n`` into ``outer`` (whose ``theta_sync`` came from its weights);
    a sharded ``outer`` takes its own rows of it (the checkpoint is whole, whatever the ranks per worker)."""
    state = torch.load(io.BytesIO(storage.read_bytes(f"{storage.step_path(n, CHECKPOINTS)}/{OUTER_STATE}")))
    if state["has_momentum"]:
        from intellect.diloco.outer_shard import ShardedOuterState, local_part  # noqa: PLC0415 - it imports this module

        momentum = local_part(outer, state["momentum"]) if isinstance(outer, ShardedOuterState) else state["momentum"]
        outer.set_state(outer.params, momentum)
