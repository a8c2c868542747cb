"""TOPLOC proofs of a rollout's final hidden states: build, encode, check.

A rollout's generated tokens are cut into chunks of ``chunk`` tokens (default 32; the last may be
shorter). For each chunk, the bf16 hidden states ``[tokens, hidden]`` are flattened; the ``k``
largest magnitudes (default 128) give points ``x = index mod m`` and ``y = raw bf16 bits``, where
``m`` is the largest modulus ``<= 65497`` that keeps the ``x`` distinct; the proof is the
polynomial through those points over GF(65497): ``m`` then the ``k`` coefficients (ascending), all
big-endian uint16, ``2 + 2k`` bytes (258 for ``k = 128``). The bytes equal those of the reference
package ``toploc`` 0.1.6 (``build_proofs_bytes(acts, 32, 128, skip_prefill=True)``, checked by
``benchmarks/peers/toploc_compat.py``).

The check (:func:`check_chunks`) recomputes the hidden states, takes the validator's own top-k,
evaluates the committed polynomial at ``index mod m`` and compares with the validator's values:
exponent mismatches, mean and median mantissa error over the positions whose exponents match (as
the reference), and, unlike the reference, sign mismatches there too (a sign-flipped tensor passes
the reference's check). Malformed proofs are verdicts, never exceptions.

    >>> g = torch.Generator().manual_seed(0)
    >>> acts = torch.randn(40, 64, generator=g).to(torch.bfloat16)   # 40 tokens: chunks of 32 and 8
    >>> blob = build_proofs(acts, chunk=32, k=16)
    >>> len(blob), [r.ok for r in check_chunks(acts, blob, chunk=32, k=16)]
    (68, [True, True])
    >>> [r.reason for r in check_chunks(-acts, blob, chunk=32, k=16)]
    ['sign', 'sign']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field

from intellect.config import StrictModel
from intellect.toploc.field import MOD, evaluate, interpolate


class ToplocConfig(StrictModel):
    """Proof shape and the thresholds of the computation, sampling and termination checks (defaults:
    the paper code's and INTELLECT-2's).

    The distribution check's defaults were chosen with ``benchmarks/toploc_distribution.py`` (4,096
    honest and 4,096 hybrid rollouts per setting, temperature 1; the statistic is the *surprise*,
    ``-log10`` of the Chernoff bound, see :func:`~intellect.toploc.check.low_prob_surprise`):

    * honest: the largest surprise of any rollout, or any submission pooled (16 or 256 rows), was
      2.3 (the RL run's policy on arithmetic, 4.2 tokens a rollout: 2.1; the tests' confident and
      near-uniform tiny models, 40 tokens: 1.8 and 2.3), so ``max_low_prob_surprise = 6`` leaves
      3.7 decades of margin, and 0 of the 12,288 honest rollouts was rejected;
    * hybrid (the right model proves what another one sampled): pooled over the RL run's
      submissions (256 rows) the smallest surprise was 274 (arithmetic, the plain smoke model
      sampling) and over 1,000 (the confident tiny model, its twin sampling): every row rejected.
      Alone, an arithmetic rollout holds too few tokens (largest surprise 7.1, 0.1% rejected); a
      rollout of the tiny pair (up to 40 tokens) is rejected 96% of the time (the rest have 1 to 6
      tokens: the twin drew EOS early). At the tests' 16 rows a submission, 254 of 256 arithmetic
      ones are rejected (smallest surprise 4.1);
    * ``min_token_prob = 0.01`` gave the arithmetic hybrids the largest surprises (median 19.6 at
      16 rows, against 17.8 at 0.001 and 14.9 at 0.05) at the same honest maximum (2.1);
    * ``low_prob_floor = 0.001`` is not measured (at temperature 1 every position has some low
      mass): it is what greedy or top-p decoding needs so that rounding flips do not reject; a
      40-token greedy rollout needs 4 tokens off the validator's argmax (10%) to reach a surprise
      of 6 (3 give 4.3), over 30 times the near-tie flip rate of bf16 GPUs (0.1-0.3%).
    """

    chunk: int = Field(32, ge=1, le=4096, description="Generated tokens per proof.")
    k: int = Field(128, ge=1, le=4096, description="Top-k magnitudes committed per chunk.")
    max_exp_mismatches: int = Field(
        38, ge=0, description="Most positions (of k) whose bf16 exponent may differ (reference: 38 of 128)."
    )
    max_mant_err_mean: float = Field(10.0, ge=0, description="Largest mean mantissa error over matching exponents.")
    max_mant_err_median: float = Field(8.0, ge=0, description="Largest median mantissa error over matching exponents.")
    max_sign_mismatches: int = Field(
        0, ge=0, description="Most sign mismatches among positions whose exponents match (the reference has no "
        "sign check); the top magnitudes of honest recomputations never change sign.",
    )
    seeded_check: bool = Field(
        True, description="Sampling check, seeded layer: recompute every token from the validator's logits and the "
        "request seed. Needs workers with the engine's reproducible seeded sampler (a vLLM worker has none: off).",
    )
    max_resampled_fraction: float = Field(
        0.01, ge=0, le=1,
        description="Sampling check: largest share of a rollout's tokens that may differ from the token the "
        "validator's logits and the request seed select (near-ties flip under bf16 nondeterminism: 0.1-0.3% "
        "in INTELLECT-2; on CPU in fp32 none do).",
    )
    distribution_check: bool = Field(
        True, description="Sampling check, distribution layer (INTELLECT-2's): reject rollouts, and submissions "
        "pooled, whose tokens hold more low-probability draws under the validator's model than honest sampling "
        "plausibly makes. Works without a reproducible sampler.",
    )
    min_token_prob: float = Field(
        0.01, gt=0, le=1,
        description="Distribution check: a chosen token is low-probability when the validator's sampling "
        "distribution (temperature, top-p) gives it less than this.",
    )
    max_low_prob_surprise: float = Field(
        6.0, gt=0, le=100,
        description="Distribution check: reject when a Chernoff bound on honest sampling drawing at least the "
        "observed number of low-probability tokens is below 10**-this (6: at most one honest rollout in a million).",
    )
    low_prob_floor: float = Field(
        0.001, ge=0, le=1,
        description="Distribution check: the least chance of an honest low-probability draw assumed at any "
        "token, also where the validator's distribution says none (greedy, or a token outside the nucleus): "
        "rounding can move an honest choice across min_token_prob, the top-p cut or a greedy tie.",
    )
    min_eos_prob: float = Field(
        0.1, ge=0, le=1,
        description="Termination check: an output shorter than max_tokens must end with EOS, and an EOS the "
        "validator's seeded sampler does not pick there must have at least this probability (INTELLECT-2: 0.1).",
    )


def proof_size(k: int) -> int:
    """Bytes of one chunk's proof: ``2 + 2k``.

    >>> proof_size(128)
    258
    """
    return 2 + 2 * k


def n_chunks(tokens: int, chunk: int) -> int:
    """Proofs a rollout of ``tokens`` generated tokens carries.

    >>> n_chunks(0, 32), n_chunks(32, 32), n_chunks(33, 32)
    (0, 1, 2)
    """
    return -(-tokens // chunk)


def _groups(acts_list: list[torch.Tensor], chunk: int) -> dict[int, tuple[list[tuple[int, int]], torch.Tensor]]:
    """Every rollout's chunks as rows of raw bf16 bits, grouped by flattened size:
    ``{size: ([(rollout, chunk index), ...], int16 [rows, size])}``, so each group is one batched
    top-k and one batched interpolation. A rollout's full chunks are a view, not a copy."""
    parts: dict[int, list[tuple[list[tuple[int, int]], torch.Tensor]]] = {}
    for i, acts in enumerate(acts_list):
        if acts.ndim != 2:
            raise ValueError(f"activations must be [tokens, hidden], got shape {tuple(acts.shape)}")
        raw = acts.detach().cpu().contiguous().view(torch.int16)
        tokens, hidden = raw.shape
        full = tokens // chunk * chunk
        if full:
            parts.setdefault(chunk * hidden, []).append(
                ([(i, j) for j in range(full // chunk)], raw[:full].reshape(full // chunk, -1)))
        if full < tokens:
            parts.setdefault((tokens - full) * hidden, []).append(([(i, full // chunk)], raw[full:].reshape(1, -1)))
    return {size: ([m for members, _ in ps for m in members],
                   ps[0][1] if len(ps) == 1 else torch.cat([t for _, t in ps]))
            for size, ps in parts.items()}


def _topk(raw: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest magnitudes of each row of raw bf16 bits: the reference's
    ``abs().topk(k)`` on the floats (the same kernel, so ties break the same way)."""
    if raw.shape[-1] < k:
        raise ValueError(f"a chunk holds {raw.shape[-1]} values, fewer than k = {k}")
    return raw.view(torch.bfloat16).abs().topk(k, dim=-1).indices


def _bits(raw: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The raw bf16 bit patterns at ``idx``, as int64 in ``[0, 65536)``."""
    return raw.gather(-1, idx).to(torch.int64) & 0xFFFF


def injective_moduli(idx: torch.Tensor) -> torch.Tensor:
    """Per row, the largest ``m <= 65497`` with ``idx % m`` all distinct (the reference's search).

    >>> injective_moduli(torch.tensor([[1, 2, 3], [0, 65497, 5]]))
    tensor([65497, 65496])
    """
    m = torch.full((idx.shape[0],), MOD, dtype=torch.int64)
    todo = torch.arange(idx.shape[0])
    cand = MOD
    while todo.numel():
        s = (idx[todo] % cand).sort(-1).values
        ok = (s[:, 1:] != s[:, :-1]).all(-1)
        m[todo[ok]] = cand
        todo = todo[~ok]
        cand -= 1
        if cand < idx.shape[1]:
            raise ValueError("no injective modulus")  # k distinct indices always have one >= k
    return m


def _encode(moduli: torch.Tensor, coeffs: torch.Tensor) -> bytes:
    rows = torch.cat([moduli[:, None], coeffs], 1).numpy().astype(">u2")
    return rows.tobytes()


def build_proofs(acts: torch.Tensor, chunk: int = 32, k: int = 128) -> bytes:
    """The concatenated proofs of ``acts`` (``[tokens, hidden]``, bf16), ``2 + 2k`` bytes per chunk."""
    return build_proofs_many([acts], chunk, k)[0]


def build_proofs_many(acts_list: list[torch.Tensor], chunk: int = 32, k: int = 128) -> list[bytes]:
    """:func:`build_proofs` of many rollouts at once: every chunk of the same size in one batch."""
    for acts in acts_list:
        if acts.dtype != torch.bfloat16:
            raise TypeError(f"TOPLOC commits to bf16 hidden states, got {acts.dtype}")
    rows: list[dict[int, bytes]] = [{} for _ in acts_list]
    size = proof_size(k)
    for members, raw in _groups(acts_list, chunk).values():
        idx = _topk(raw, k)
        m = injective_moduli(idx)
        encoded = _encode(m, interpolate(idx % m[:, None], _bits(raw, idx)))
        for r, (i, j) in enumerate(members):
            rows[i][j] = encoded[r * size:(r + 1) * size]
    return [b"".join(r[j] for j in range(len(r))) for r in rows]


@dataclass(frozen=True, slots=True)
class ChunkCheck:
    """The computation check of one chunk: the reference's statistics, our sign count, the verdict."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    sign_mismatches: int
    reason: str | None = None  # None: accepted

    @property
    def ok(self) -> bool:
        return self.reason is None


def _reject(reason: str) -> ChunkCheck:
    return ChunkCheck(-1, float("inf"), float("inf"), -1, reason)


def decode_proofs(blob: bytes, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(moduli [n], coeffs [n, k])`` of a proof blob; ``ValueError`` if it is not whole proofs."""
    size = proof_size(k)
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError(f"a proof blob is bytes, not {type(blob).__name__}")
    if len(blob) % size:
        raise ValueError(f"proof blob of {len(blob)} bytes is not a multiple of {size}")
    rows = np.frombuffer(bytes(blob), dtype=">u2").astype(np.int64).reshape(-1, 1 + k)
    t = torch.from_numpy(rows)
    return t[:, 0].clone(), t[:, 1:].clone()


def check_chunks(acts: torch.Tensor, blob: bytes, chunk: int = 32, k: int = 128,
                 cfg: ToplocConfig | None = None) -> list[ChunkCheck]:
    """The validator's check of ``blob`` against its own hidden states ``acts`` ([tokens, hidden]).

    One :class:`ChunkCheck` per expected chunk. A blob of the wrong length, a null or out-of-range
    modulus, a coefficient outside the field, or activations that are not bf16 reject chunks with
    a reason (``malformed``, ``proof_count``, ``null_proof``, ``dtype``, ``short_chunk``).
    """
    return check_many([acts], [blob], chunk, k, cfg)[0]


def check_many(acts_list: list[torch.Tensor], blobs: list[bytes], chunk: int = 32, k: int = 128,
               cfg: ToplocConfig | None = None) -> list[list[ChunkCheck]]:
    """:func:`check_chunks` of many rollouts at once: every chunk of the same size in one batch."""
    cfg = cfg or ToplocConfig(chunk=chunk, k=k)
    out: list[list[ChunkCheck]] = [[] for _ in acts_list]
    proofs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    todo = []
    for i, (acts, blob) in enumerate(zip(acts_list, blobs, strict=True)):
        expected = n_chunks(acts.shape[0], chunk) if acts.ndim == 2 else 0
        # a rejected rollout gets at least one rejection, also when it has no chunk to check
        if acts.ndim != 2 or acts.dtype != torch.bfloat16:
            out[i] = [_reject("dtype")] * max(expected, 1)
            continue
        try:
            moduli, coeffs = decode_proofs(blob, k)
        except ValueError:
            out[i] = [_reject("malformed")] * max(expected, 1)
            continue
        if moduli.numel() != expected:
            out[i] = [_reject("proof_count")] * max(expected, 1)
            continue
        proofs[i] = (moduli, coeffs)
        out[i] = [_reject("unchecked")] * expected
        todo.append(i)
    for size, (members, raw) in _groups([acts_list[i] for i in todo], chunk).items():
        members = [(todo[i], j) for i, j in members]
        if size < k:
            for i, j in members:
                out[i][j] = _reject("short_chunk")
            continue
        m = torch.stack([proofs[i][0][j] for i, j in members])
        c = torch.stack([proofs[i][1][j] for i, j in members])
        for (i, j), check in zip(members, _check_rows(raw, m, c, cfg)):
            out[i][j] = check
    return out


def _check_rows(raw: torch.Tensor, m: torch.Tensor, c: torch.Tensor, cfg: ToplocConfig) -> list[ChunkCheck]:
    """The statistics and verdicts of chunks (rows of raw bf16 bits) against their proofs, vectorized."""
    k = c.shape[1]
    idx = _topk(raw, k)
    mine = _bits(raw, idx)
    theirs = evaluate(c, idx % m.clamp(min=1)[:, None])
    exp_diff = ((theirs >> 7) & 0xFF) != ((mine >> 7) & 0xFF)
    mant_err = ((theirs & 0x7F) - (mine & 0x7F)).abs()
    matched = ~exp_diff
    n_matched = matched.sum(-1)
    exp_n = k - n_matched
    sign_n = (((theirs >> 15) != (mine >> 15)) & matched).sum(-1)
    mean = (mant_err * matched).sum(-1).double() / n_matched.clamp(min=1)
    # upper median of the matched errors (as the reference's C++): unmatched sort last
    ranked = mant_err.masked_fill(~matched, 1 << 20).sort(-1).values
    median = ranked.gather(-1, (n_matched // 2).clamp(max=k - 1)[:, None])[:, 0].double()
    none = n_matched == 0
    mean, median = mean.masked_fill(none, 2.0**64), median.masked_fill(none, 2.0**64)
    bad = ((m < k) | (m > MOD) | (c >= MOD).any(-1)).tolist()
    out = []
    for mod, b, e, mu, med, sg in zip(m.tolist(), bad, exp_n.tolist(), mean.tolist(), median.tolist(), sign_n.tolist()):
        if mod == 0:
            out.append(_reject("null_proof"))
        elif b:
            out.append(_reject("malformed"))
        else:
            reason = ("exponent" if e > cfg.max_exp_mismatches
                      else "mantissa" if mu > cfg.max_mant_err_mean or med > cfg.max_mant_err_median
                      else "sign" if sg > cfg.max_sign_mismatches else None)
            out.append(ChunkCheck(e, mu, med, sg, reason))
    return out
