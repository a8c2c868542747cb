"""Polynomial arithmetic over GF(65497), batched over rows: interpolation, expansion, evaluation.

TOPLOC commits to ``k`` points ``(x, y)`` of a chunk with the unique polynomial of degree ``< k``
through them over the prime field of :data:`MOD` (the reference's ``MOD_N``). Every function here
works on ``[rows, k]`` int64 tensors, one polynomial per row, so building or checking a whole
rollout's proofs is ``O(k)`` vectorized steps instead of ``O(rows * k^2)`` Python operations.
Values stay below ``MOD < 2^16``, so products fit int64 without overflow.

    >>> x = torch.tensor([[0, 1, 2]]); y = torch.tensor([[1, 3, 7]])   # 1 + x + x^2
    >>> coeffs = interpolate(x, y); coeffs
    tensor([[1, 1, 1]])
    >>> evaluate(coeffs, torch.tensor([[3, 10]]))
    tensor([[ 13, 111]])
"""

from __future__ import annotations

from functools import lru_cache

import torch

#: The prime of the reference implementation (toploc ``MOD_N``).
MOD = 65497


@lru_cache(maxsize=1)
def inverses() -> torch.Tensor:
    """``inv[a] = a^(MOD-2) mod MOD`` for every residue (``inv[0] = 0``), computed once, vectorized.

    >>> inv = inverses(); int(inv[2]) * 2 % MOD, int(inv[0])
    (1, 0)
    """
    base = torch.arange(MOD, dtype=torch.int64)
    out = torch.ones(MOD, dtype=torch.int64)
    e = MOD - 2
    while e:
        if e & 1:
            out = out * base % MOD
        base = base * base % MOD
        e >>= 1
    return out


def newton(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Newton divided differences of the points ``(x, y)`` per row (``x`` distinct mod ``MOD``).

    >>> newton(torch.tensor([[0, 1, 2]]), torch.tensor([[1, 3, 7]]))   # 1 + 2x + 1*x(x-1)
    tensor([[1, 2, 1]])
    """
    inv = inverses()
    x = x % MOD
    dd = y % MOD
    for j in range(1, x.shape[-1]):
        # level j from level j - 1: both operands are read before the slice is overwritten
        num = (dd[..., j:] - dd[..., j - 1:-1]) % MOD
        den = (x[..., j:] - x[..., :-j]) % MOD
        dd[..., j:] = num * inv[den] % MOD
    return dd


def expand(x: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """Monomial coefficients (ascending degree) of the Newton form ``sum dd_i prod_{j<i} (X - x_j)``.

    >>> expand(torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, 1]]))
    tensor([[1, 1, 1]])
    """
    rows, k = dd.shape
    coeffs = torch.zeros_like(dd)
    factor = torch.zeros_like(dd)
    factor[:, 0] = 1
    minus = (-x) % MOD
    zero = torch.zeros((rows, 1), dtype=dd.dtype)
    for i in range(k):
        coeffs = (coeffs + dd[:, i:i + 1] * factor) % MOD
        if i + 1 < k:  # factor *= (X - x_i)
            factor = (torch.cat([zero, factor[:, :-1]], 1) + factor * minus[:, i:i + 1]) % MOD
    return coeffs


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients (ascending) of the polynomial of degree ``< k`` through ``(x, y)``, per row."""
    x = x.to(torch.int64)
    return expand(x % MOD, newton(x, y.to(torch.int64)))


def evaluate(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``p(x) mod MOD`` of each row's polynomial at each of that row's points (Horner).

    Runs in float64, two Horner steps per reduction: with operands in ``[-MOD, 2*MOD)`` every
    intermediate stays below ``2^50``, exact in float64, and ``v - floor(v / MOD) * MOD`` (off by at
    most one ``MOD`` from rounding) keeps them there; one fix-up at the end lands in ``[0, MOD)``.
    Vectorized float multiplies are faster than int64 division.
    """
    xf = (x.to(torch.int64) % MOD).to(torch.float64)
    cf = coeffs.to(torch.float64)
    acc = torch.zeros_like(xf)
    t = coeffs.shape[-1] - 1
    if t % 2 == 0:  # an odd count of coefficients: take one alone so the rest go in pairs
        acc = cf[:, t:t + 1].expand_as(xf).clone()
        t -= 1
    while t > 0:
        acc = (acc * xf + cf[:, t:t + 1]) * xf + cf[:, t - 1:t]
        acc -= torch.floor(acc * (1.0 / MOD)) * MOD
        t -= 2
    acc = torch.where(acc < 0, acc + MOD, acc)
    acc = torch.where(acc >= MOD, acc - MOD, acc)
    return acc.to(torch.int64)
