"""TOPLOC proofs of a rollout's final hidden states: build, encode, check.

A rollout's generated tokens are cut into chunks of ``chunk`` tokens (default 32; the last may be
shorter). For each chunk, the bf16 hidden states ``[tokens, hidden]`` are flattened; the ``k``
largest magnitudes (default 128) give points ``x = index mod m`` and ``y = raw bf16 bits``, where
``m`` is the largest modulus ``<= 65497`` that keeps the ``x`` distinct; the proof is the
polynomial through those points over GF(65497): ``m`` then the ``k`` coefficients (ascending), all
big-endian uint16, ``2 + 2k`` bytes (258 for ``k = 128``). The bytes equal those of the reference
package ``toploc`` 0.1.6 (``build_proofs_bytes(acts, 32, 128, skip_prefill=True)``, checked by
``benchmarks/peers/toploc_compat.py``).

The check (:func:`check_chunks`) recomputes the hidden states, takes the validator's own top-k
(found by block maxima rather than a general top-k, :func:`magnitude_candidates`; values tied at
the k-th magnitude go the prover's way where its values show it, :func:`tie_break_topk`),
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
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from pydantic import Field

from intellect.config import StrictModel
from intellect.toploc.field import MOD, evaluate, interpolate

if TYPE_CHECKING:
    from intellect.inference.protocol import Completion


class ToplocConfig(StrictModel):
    """Proof shape and the thresholds of the computation, sampling and termination checks (defaults:
    the paper code's and INTELLECT-2's).

    The defaults keep honest workers far from every bound and catch the attacks the checks
    exist for; ``benchmarks/toploc_distribution.py`` (the distribution check, honest vs hybrid
    rollouts) and ``benchmarks/toploc_stale.py`` (the seeded re-check against stale
    checkpoints) measure both sides, and their figures are in ``benchmarks/results/``:

    * ``max_low_prob_surprise = 6``: honest rollouts and submissions stay decades below it, and
      a hybrid (the right model proves what another one sampled) pooled over a submission is
      far above it; a single short rollout holds too few tokens to tell, hence the pooling;
    * ``min_token_prob = 0.01`` separates the hybrids best at the same honest maximum;
    * ``low_prob_floor = 0.001`` is not measured (at temperature 1 every position has some low
      mass): it is what greedy or top-p decoding needs so that rounding flips do not reject; a
      40-token greedy rollout needs 4 tokens off the validator's argmax (10%) to reach a surprise
      of 6, over 30 times the near-tie flip rate of bf16 GPUs (0.1-0.3%);
    * ``honest_flip_rate = 0.005`` is safe on bf16 GPUs and catches a checkpoint two or three
      RL updates stale; CPU workers in fp32 flip no near-tie, so a CPU run
      (``configs/rl-tiny.toml``) may set 1e-4, which catches one update stale.
    """

    chunk: int = Field(default=32, ge=1, le=4096, description="Generated tokens per proof.")
    k: int = Field(default=128, ge=1, le=4096, description="Top-k magnitudes committed per chunk.")
    max_exp_mismatches: int = Field(
        default=38, ge=0, description="Most positions (of k) whose bf16 exponent may differ (reference: 38 of 128)."
    )
    max_mant_err_mean: float = Field(default=10.0, ge=0, description="Largest mean mantissa error over matching exponents.")
    max_mant_err_median: float = Field(default=8.0, ge=0, description="Largest median mantissa error over matching exponents.")
    max_sign_mismatches: int = Field(
        default=0, ge=0, description="Most sign mismatches among positions whose exponents match (the reference has no "
        "sign check); the top magnitudes of honest recomputations never change sign.",
    )
    seeded_check: bool = Field(
        default=True, description="Sampling check, seeded layer: recompute every token from the validator's logits and the "
        "request seed. Needs workers with the engine's reproducible seeded sampler (a vLLM worker has none: off).",
    )
    max_resampled_fraction: float = Field(
        default=0.01, ge=0, le=1,
        description="Sampling check: largest share of a rollout's tokens that may differ from the token the "
        "validator's logits and the request seed select (near-ties flip under bf16 nondeterminism: 0.1-0.3% "
        "in INTELLECT-2; on CPU in fp32 none do). A rollout fails beyond it only when honest near-tie flips at "
        "honest_flip_rate cannot plausibly make its count (as pooled, per rollout), so one flip in a short "
        "rollout passes.",
    )
    flip_margin: float = Field(
        default=0.5, ge=0, le=100,
        description="Sampling check: a differing token counts as a near-tie flip only when it scores within "
        "this of the seeded choice (Gumbel-max score z + g, logit units over temperature; raw logits when "
        "greedy); a single token further away fails the rollout, since no rounding noise moves a choice that "
        "far. Must exceed the logit noise between the workers' and the validator's hardware (bf16 logits are "
        "off by well under 0.1 on typical models).",
    )
    honest_flip_rate: float = Field(
        default=0.005, gt=0, le=0.1,
        description="Sampling check, seeded layer pooled per submission: the share of an honest worker's tokens "
        "assumed to differ from the validator's seeded choice (near-tie flips). A submission's rows that passed "
        "the computation check fail together when a Chernoff bound on honest flips reaching their summed count "
        "is below 10**-max_low_prob_surprise. Over many tokens the bound is tight around this rate, so it must "
        "bound the hardware's rate from above: 0.005 is 1.7x the 0.1-0.3% of bf16 GPUs (INTELLECT-2), and "
        "catches a submission only from ~2% of its tokens differing. CPU workers in fp32 flip none, so a CPU "
        "run may set far less (configs/rl-tiny.toml: 1e-4; see the class docstring).",
    )
    distribution_check: bool = Field(
        default=True, description="Sampling check, distribution layer (INTELLECT-2's): reject rollouts, and submissions "
        "pooled, whose tokens hold more low-probability draws under the validator's model than honest sampling "
        "plausibly makes. Works without a reproducible sampler.",
    )
    min_token_prob: float = Field(
        default=0.01, gt=0, le=1,
        description="Distribution check: a chosen token is low-probability when the validator's sampling "
        "distribution (temperature, top-p) gives it less than this.",
    )
    max_low_prob_surprise: float = Field(
        default=6.0, gt=0, le=100,
        description="Distribution check, and the seeded re-check pooled per submission: reject when a Chernoff "
        "bound on honest sampling drawing at least the observed number of low-probability tokens (or of "
        "near-tie flips) is below 10**-this (6: at most one honest rollout or submission in a million).",
    )
    low_prob_floor: float = Field(
        default=0.001, ge=0, le=1,
        description="Distribution check: the least chance of an honest low-probability draw assumed at any "
        "token, also where the validator's distribution says none (greedy, or a token outside the nucleus): "
        "rounding can move an honest choice across min_token_prob, the top-p cut or a greedy tie.",
    )
    min_eos_prob: float = Field(
        default=0.1, ge=0, le=1,
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


def completion_proofs(completions: Sequence[Completion], cfg: ToplocConfig) -> list[bytes]:
    """The proof blob of each of a worker's completions (its engine must capture hidden states)."""
    states = [c.hidden_states for c in completions if c.hidden_states is not None]
    if len(states) != len(completions):
        raise ValueError("TOPLOC proofs need hidden states: build the engine with capture_hidden=True")
    return build_proofs_many(states, cfg.chunk, cfg.k)


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
    size = proof_size(k)
    todo = []
    for i, (acts, blob) in enumerate(zip(acts_list, blobs, strict=True)):
        expected = n_chunks(acts.shape[0], chunk) if acts.ndim == 2 else 0
        # a rejected rollout gets at least one rejection, also when it has no chunk to check
        if acts.ndim != 2 or acts.dtype != torch.bfloat16:
            out[i] = [_reject("dtype")] * max(expected, 1)
        elif not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) % size:
            out[i] = [_reject("malformed")] * max(expected, 1)
        elif len(blob) // size != expected:
            out[i] = [_reject("proof_count")] * max(expected, 1)
        else:
            out[i] = [_reject("unchecked")] * expected
            todo.append(i)
    # every accepted blob decoded at once; rollout todo[t]'s proofs start at row first[t]
    moduli, coeffs = decode_proofs(b"".join(bytes(blobs[i]) for i in todo), k)
    first = dict(zip(todo, torch.tensor([0] + [len(out[i]) for i in todo]).cumsum(0).tolist()))
    # each size group searches its own top-k candidates; evaluation, tie-break and statistics then
    # run once over every group's candidates (padded to one width): a rollout's short last chunk
    # would otherwise cost a whole pass of small operations
    checked, positions, bits = [], [], []
    for size, (members, raw) in _groups([acts_list[i] for i in todo], chunk).items():
        members = [(todo[i], j) for i, j in members]
        if size < k:
            for i, j in members:
                out[i][j] = _reject("short_chunk")
            continue
        pos, mine = _candidates(raw, k)
        checked += members
        positions.append(pos)
        bits.append(mine)
    if checked:
        width = max(p.shape[1] for p in positions)
        pos = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in positions])
        mine = torch.cat([torch.nn.functional.pad(b, (0, width - b.shape[1]), value=-1) for b in bits])
        rows = torch.tensor([first[i] + j for i, j in checked])
        m, c = moduli[rows], coeffs[rows]
        for (i, j), check in zip(checked, _check_rows(pos, mine, m, c, cfg)):
            out[i][j] = check
    return out


def _compact(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, the ``values`` where ``mask`` is set, in order, padded with -1 to the longest row.

    >>> _compact(torch.tensor([[True, False, True], [False, True, False]]), torch.tensor([[5, 6, 7], [8, 9, 10]]))
    tensor([[ 5,  7],
            [ 9, -1]])
    """
    r, c = mask.nonzero(as_tuple=True)
    counts = torch.bincount(r, minlength=mask.shape[0])
    slot = torch.arange(r.numel()) - (counts.cumsum(0) - counts)[r]
    out = torch.full((mask.shape[0], int(counts.max()) if r.numel() else 0), -1, dtype=torch.int64)
    out[r, slot] = values[r, c]
    return out


def _block_rows(row_bytes: int) -> int:
    # rows per pass over a big tensor: ~256 KiB a thread, so each piece stays in cache and reuses
    # freed memory (a fresh 16 MiB temporary costs more in page faults than the arithmetic on it;
    # 2x faster than 1 MiB pieces on one core of a 2-core EPYC), and each parallel op has work
    return max(1, (torch.get_num_threads() << 18) // max(row_bytes, 1))


def magnitude_candidates(raw: torch.Tensor, k: int, fan: int = 8) -> torch.Tensor:
    """Positions ``[rows, c]`` (in no set order, -1 padded) of each row's ``k`` largest magnitudes
    and of every one tied with the ``k``-th: the top-``k`` with all its ties. ``raw``: bf16 bits as
    int16 ``[rows, n]``, ``n >= k``; the magnitude order is that of the bits with the sign cleared.

    A general top-k walks every value with its index; here every value is read once by a
    vectorized max over slabs, and only the few blocks that can hold a winner are opened. Block
    maxima are built up in levels (``fan`` blocks each) while a level keeps ``>= 2k`` blocks; the
    ``k``-th largest maximum of the top level is a threshold ``t`` that at least ``k`` values reach
    (in ``k`` distinct blocks), so it never exceeds the row's ``k``-th value, and every block
    holding a winner reaches it: the blocks reaching ``t`` name the children to look at below, and
    the values reached last hold the exact ``k``-th. E.g. 32 x 4096 Gaussian values, ``k = 128``:
    16,384 maxima of 8, then 2,048 of 64, then 256 of 512; ``t`` is the 128th of those 256, and
    the search opens ~130 blocks of 512, ~170 of 64 and ~180 of 8 (reading ~1,400 of the 131,072
    values again) to find the ~131 positions.

    >>> raw = torch.tensor([[5, 1, 9, -32768 + 9, 0, 3, 7, 2]], dtype=torch.int16)   # -32768 + 9: -9
    >>> magnitude_candidates(raw, 3, fan=2)   # 9, -9, 7
    tensor([[2, 3, 6]])
    >>> magnitude_candidates(torch.tensor([[4, 1, 4, 4]], dtype=torch.int16), 2, fan=2)   # three 4s tie
    tensor([[0, 2, 3]])
    """
    rows, n = raw.shape

    def maxima(level: torch.Tensor) -> torch.Tensor:
        # slab j holds elements j, j + m, j + 2m, ...: an elementwise max of fan contiguous slabs;
        # -1 pads the last one (below every magnitude)
        if level.shape[1] % fan:
            level = torch.cat([level, level.new_full((level.shape[0], fan - level.shape[1] % fan), -1)], 1)
        return level.view(level.shape[0], fan, -1).amax(1)

    levels = [raw]
    if n // fan >= 2 * k:
        levels.append(torch.cat([maxima(b & 0x7FFF) for b in raw.split(_block_rows(2 * n))]))
    while levels[-1].shape[1] // fan >= 2 * k:
        levels.append(maxima(levels[-1]))
    if len(levels) == 1:
        levels[0] = raw & 0x7FFF
    t = levels[-1].topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    pos, v = torch.arange(levels[-1].shape[1]).expand(rows, -1), levels[-1]
    for lower in reversed(levels[:-1]):
        parent = _compact(v >= t, pos)
        size, width = lower.shape[1], -(-lower.shape[1] // fan)
        pos = torch.where(parent[:, :, None] >= 0, parent[:, :, None] + torch.arange(fan) * width, size).view(rows, -1)
        v = torch.where(pos < size, lower.gather(1, pos.clamp(max=size - 1)) & 0x7FFF, -1)
    # the exact k-th among the few values reaching t
    pos = _compact(v >= t, pos)
    v = torch.where(pos >= 0, raw.gather(1, pos.clamp(min=0)) & 0x7FFF, -1)
    return _compact(v >= v.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True), pos)


def _candidates(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, mine)``: :func:`magnitude_candidates` of rows of raw bf16 bits and the bits there
    (int64, -1 where ``pos`` pads)."""
    pos = magnitude_candidates(raw, k)
    if pos.shape[1] > 4 * k:
        # a degenerate chunk (thousands of equal values at the k-th magnitude, e.g. ternary):
        # evaluating every tie would cost more than the prover's own kernel, which decides instead
        many = (pos >= 0).sum(-1) > 4 * k
        pos = pos[:, :4 * k].clone()  # valid positions come first in a row
        pos[many] = -1
        pos[many, :k] = _topk(raw[many], k)
    mine = torch.where(pos >= 0, raw.gather(1, pos.clamp(min=0)).to(torch.int64) & 0xFFFF, -1)
    return pos, mine


def tie_break_topk(pos: torch.Tensor, mine: torch.Tensor, theirs: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The validator's top-``k`` magnitudes among candidates (a top-``k`` with all its ties,
    :func:`magnitude_candidates`): ``(mine, theirs)`` int64 ``[rows, k]`` bf16 bit patterns, given
    the candidates' positions ``pos``, the validator's bits ``mine`` and the committed polynomial's
    values ``theirs`` there (``[rows, c]``, ``pos`` -1 where padded).

    Values tied at the ``k``-th magnitude are interchangeable (any choice is a top-``k``; the
    prover's depends on its top-k kernel), so the tie goes to the positions whose committed value is
    closest to the validator's (same exponent, nearest mantissa, then same sign), then to the lowest
    index: an honest prover's choice among equal values does not count against it, and nothing but
    the tie moves.

    >>> pos, mine = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[9, 3, 32768 + 3, 3]])  # |.| 9, 3, 3, 3
    >>> theirs = torch.tensor([[9, 700, 40000, 3]])   # k = 2: the prover took 9 and the last 3
    >>> tie_break_topk(pos, mine, theirs, 2)
    (tensor([[9, 3]]), tensor([[9, 3]]))
    """
    # closeness: 128 - |mantissa error| where the exponents agree, else 0, then the sign: an honest
    # prover's value is within rounding of ours, while a position outside its set evaluates to a
    # pseudo-random value (or, aliased by index mod m, to another point's: a random mantissa and
    # sign). The sign comes last so that a sign-flipped tensor still meets the prover's choice.
    close = torch.where(((theirs ^ mine) >> 7) & 0xFF == 0, 128 - ((theirs & 0x7F) - (mine & 0x7F)).abs(), 0)
    close = 2 * close + (theirs >> 15 == mine >> 15).long()
    score = (mine & 0x7FFF) << 48 | close << 39 | ((1 << 39) - 1 - pos)
    pick = torch.where(pos >= 0, score, -1).topk(k, dim=-1).indices
    return mine.gather(1, pick), theirs.gather(1, pick)


def _check_rows(pos: torch.Tensor, mine: torch.Tensor, m: torch.Tensor, c: torch.Tensor, cfg: ToplocConfig
                ) -> list[ChunkCheck]:
    """The statistics and verdicts of chunks against their proofs, vectorized, from each chunk's
    top-k candidates (:func:`_candidates`)."""
    k = c.shape[1]
    theirs = evaluate(c, pos.clamp(min=0) % m.clamp(min=1)[:, None])
    mine, theirs = tie_break_topk(pos, mine, theirs, k)
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
