"""DiLoCo's outer loop state: the fp32 synced copy, pseudo-gradients, Nesterov steps.

Every replica keeps ``theta_sync`` (fp32, on the CPU, off the accelerator)
and the momentum of an SGD-Nesterov optimizer over it. After H inner steps a
worker's pseudo-gradient is ``theta_sync - theta_local``; the all-reduced
average is applied as the gradient of one outer step. Replicas that start
bit-identical and apply the bit-identical average stay bit-identical
(:meth:`OuterState.digest` checks it).

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

import hashlib
from typing import Sequence

import torch


class OuterState:
    """``theta_sync`` and the outer optimizer for the parameters of ``model``."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in self._model_params(model)]
        # momentum 0 is plain (scaled) model averaging, where Nesterov means nothing; torch rejects the pair
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    @staticmethod
    def _model_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return list(model.parameters())  # tied weights appear once

    def pseudo_gradient(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """``theta_sync - theta_local`` per parameter, fp32 on the CPU."""
        return [s - p.detach().to("cpu", torch.float32) for s, p in zip(self.params, self._model_params(model))]

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
    def load_into(self, model: torch.nn.Module) -> None:
        """Copy ``theta_sync`` into the model (its dtype and device) for the next inner phase."""
        for s, p in zip(self.params, self._model_params(model)):
            p.copy_(s.to(p.device, p.dtype))

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

    @torch.no_grad()
    def set_state(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None) -> None:
        """Overwrite ``theta_sync`` (and momentum, when given) with a peer's or a checkpoint's."""
        for p, src in zip(self.params, params):
            p.copy_(src)
        if momentum is not None:
            for p, m in zip(self.params, momentum):
                self.optimizer.state[p]["momentum_buffer"] = m.to(torch.float32).clone()
