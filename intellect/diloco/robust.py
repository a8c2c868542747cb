"""Bounding what an admitted DiLoCo member can do to the average: a centred clip per chunk, a screen
of each contribution's distance and direction, and who gets flagged and banned for it.

Where it runs. The all-reduce (``allreduce.py``) splits every bucket into W chunks, and the
owner of chunk c receives each member's contribution to it as that member sent it (``"direct"``:
straight from the member; ``"ring-owner"``: relayed unchanged, the relays' messages sealed). So
the owner can look at each sender's chunk, which a ring of partial sums would hide: those are the
only algorithms a worker runs while robust aggregation is on (``plan.SCREENED``). The owner
replaces the mean of the n contributions ``x_i`` by :func:`centred_clip` (CenteredClip,
Karimireddy et al. 2021, started from the coordinate-wise median)::

    v0  = coordinate-wise median of the x_i
    tau = k * median_i ||x_i - v0||
    v  <- v + mean_i (x_i - v) * min(1, tau / ||x_i - v||)      (3 iterations)

and flags every ``i`` that is

* far: ``||x_i - v0|| > tau``, where k is ``Screen.k`` and, once there are ``Screen.crowd`` or
  more contributors, at most ``Screen.k_crowd``: with 4+ the median distance is an honest
  member's even with one liar, so a tighter multiple is safe (on the tiny model's 4 honest
  workers, fewer than a fifth of any member's values ever lie beyond 2.5x, far from the half
  that gets it reported);
* against the consensus: ``<x_i, v0> < 0`` (a sign-flipped contribution is no farther from the
  median than a few honest ones when honest members disagree, at a cosine similarity of 0.6-0.8
  between workers' pseudo-gradients on the tiny model, but it points the other way);
* astray (``Screen.direction``, 4+ contributors): its cosine with the coordinate-wise median of
  the *others* (leave-one-out, :func:`astray`) is below ``direction`` times the upper median of
  those cosines, where that median is at least ``DIRECTION_FLOOR`` (members agree enough to
  judge by). A member that adds 1.5x its own norm along a fixed direction every step stays
  within 4x the median distance, but its cosine falls to about half of the honest members'.
  Scaling does not hide it: the cosine ignores norms.

Flagged contributions are left out of the average while they are a minority; the others are
clipped as above. When nobody is flagged the result is the plain mean, computed as before (a run
without liars is bit-identical with and without the clip wherever no chunk flags anyone).

What is bounded, with n >= 3 contributors of which fewer than half lie, for each chunk an
honest member owns: whatever a liar sends (1e6 everywhere, a sign flip, 100x), it moves each
iteration by at most ``tau / n``, where ``tau`` is k times the median honest distance from the
median, i.e. no more than an honest member k times as far from the consensus; a flagged liar
that is a minority moves it by nothing. Its values are read through the codebook only (under
``compression="fp32"``: as sent), and their size only enters through that distance, so no
separate range check on the codebook or values is needed beyond finiteness
(``quantize.from_bytes``, ``quantize.values_from_bytes``).

Announced norms. Before the reduce, every member sends every other member, directly (no relay
can alter it), the L2 norm of each of its chunks. An owner refuses to believe more than that:
the int8 codebook is made of bucket means, so decoding is a projection and never lengthens a
chunk; a decoded contribution longer than its announcement is a lie, scaled down to it and
flagged. The owner then clips its result chunk to :func:`owner_bound`, and every receiver
checks each owner's result against :func:`receiver_bound` (4+ contributors, one liar: an
honest member's claim times k); an owner over it is blamed, the attempt fails, and a member
blamed by a majority is left out of the retry and struck.

What is not bounded. (1) A lying owner may still publish any direction within that norm for
its own chunk (1/W of every bucket). (2) Under ``"ring-owner"`` a relay could replace the
contributions it forwards by others of the announced norms (the MAC key is shared by all
members, so it authenticates *a member*). (3) With fewer than 3 contributors there is no
majority to judge by: the plain mean is used, and the owner bound and the screens need 4.
(4) A liar that stays within the honest spread in distance and in angle (at 4 members: 2.5x the
median distance, 0.6x the members' cosine) is not detected; it is bounded by the clip instead,
and may push a fixed direction by that much every step. (5) A liar can make an attempt fail (a
bad result to a minority of the receivers) without being blamed by a majority: that costs
retries, not the model.

Flags and bans (:func:`majority_flagged`, :class:`Strikes`): each member reports the senders its
chunks flagged in more than half of their values; a worker flagged by more than half of the
other members in a committed step gets a strike, and after ``exclude_after`` strikes it is
banned from the run (``banned/<w>``: it is left out of every later membership).

>>> import torch
>>> honest = [torch.tensor([1.0, 1.0]) + 0.1 * torch.tensor([i, -i]) for i in (-1.0, 0.0, 1.0)]
>>> v, out = centred_clip(honest + [torch.tensor([1e6, 1e6])], k=4)
>>> out, [round(x, 2) for x in v.tolist()]                # the liar is flagged and left out
([3], [1.0, 1.0])
>>> centred_clip(honest, k=4)                             # nobody flagged: the caller takes the mean
(None, [])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

ITERATIONS = 3
FLAG_SHARE = 0.5  # a sender is reported when more than this share of its values were outliers
DIRECTION_FLOOR = 0.2  # below this median cosine members agree too little to judge a direction by


@dataclass(frozen=True)
class Screen:
    """The screens of :func:`centred_clip` beyond its clip multiple k (``diloco.outlier_clip``):
    from ``crowd`` contributors on, the multiple is at most ``k_crowd`` and a contribution whose
    leave-one-out cosine is below ``direction`` times the members' (upper) median is flagged
    (0: that screen off). Defaults: ``diloco.outlier_clip_crowd`` and ``diloco.direction_screen``."""

    k_crowd: float = 2.5
    direction: float = 0.6
    crowd: int = 4


DEFAULT_SCREEN = Screen()


def astray(x: torch.Tensor, share: float) -> list[bool]:
    """Which rows of ``x`` (n contributions, n >= 3) point away from the others: cosine with the
    coordinate-wise (lower) median of the other n-1 rows below ``share`` times the upper median of
    those cosines, when that median is at least ``DIRECTION_FLOOR``.

    One sort gives every leave-one-out median: row i's is the sorted column's element ``j`` when
    i ranks above it, else element ``j + 1`` (``j`` the lower-median index among n-1).

    >>> base = torch.tensor([1.0, 1.0, 0.0, 0.0])
    >>> x = torch.stack([base + torch.tensor([0.0, 0.1 * i, 0.2, -0.1 * i]) for i in range(3)]
    ...                 + [base + torch.tensor([0.0, 0.0, 3.0, 3.0])])
    >>> astray(x, 0.6)
    [False, False, False, True]
    """
    n = x.shape[0]
    s, idx = x.sort(dim=0)
    rank = torch.empty_like(idx).scatter_(0, idx, torch.arange(n).unsqueeze(1).expand_as(idx).contiguous())
    j = (n - 2) // 2
    loo = torch.where(rank > j, s[j], s[j + 1])
    cos = torch.nn.functional.cosine_similarity(x, loo, dim=1, eps=1e-30)
    top = float(cos.sort().values[n // 2])
    if not top >= DIRECTION_FLOOR:  # also NaN
        return [False] * n
    return (cos < share * top).tolist()


def centred_clip(xs: Sequence[torch.Tensor], k: float, iterations: int = ITERATIONS,
                 screen: Screen = DEFAULT_SCREEN) -> tuple[torch.Tensor | None, list[int]]:
    """The centred clip of the flat fp32 tensors ``xs`` and the indices of the outliers (far,
    against the consensus, or astray: the module docstring).

    Returns ``(None, [])`` when no contribution is flagged (the caller uses the plain mean), and
    also for fewer than 3 tensors or ``k <= 0``.
    """
    n = len(xs)
    if n < 3 or k <= 0 or xs[0].numel() == 0:
        return None, []
    x = torch.stack([t.reshape(-1).to(torch.float32) for t in xs])
    v = x.t().contiguous().median(dim=1).values  # the lower median; faster along contiguous rows
    d = (x - v).norm(dim=1)
    crowd = n >= screen.crowd
    tau = float(min(k, screen.k_crowd) * d.median()) if crowd else float(k * d.median())
    against = (x @ v < 0).tolist() if float(v.norm()) > 0 else [False] * n
    off = astray(x, screen.direction) if crowd and screen.direction > 0 else [False] * n
    outliers = [i for i in range(n) if float(d[i]) > tau or against[i] or off[i]]
    if not outliers:
        return None, []
    if 2 * len(outliers) < n:  # flagged contributions are left out, while they are a minority
        x = x[[i for i in range(n) if i not in outliers]]
    elif 2 * sum(against) < n:  # else at least those pulling against the consensus
        x = x[[i for i in range(n) if not against[i]]]
    if all(float(e) <= tau for e in (x - v).norm(dim=1)):
        return x.mean(dim=0), outliers
    for _ in range(iterations):
        r = x - v
        scale = (tau / r.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)
        # a value near the fp32 range can make r infinite; clipped to nothing, it must add 0, not NaN
        v = v + torch.nan_to_num(r * scale[:, None], nan=0.0, posinf=0.0, neginf=0.0).mean(dim=0)
    return v, outliers


def owner_bound(claims: Sequence[float], k: float) -> float:
    """The norm an honest owner clips its result chunk to: k times the lower median of the
    contributors' announced norms of that chunk.

    >>> owner_bound([1.0, 2.0, 3.0, 1e9], 4), receiver_bound([1.0, 2.0, 3.0, 1e9], 4)
    (8.0, 12.0)
    """
    s = sorted(claims)
    return k * s[(len(s) - 1) // 2] if s else 0.0


def receiver_bound(claims: Sequence[float], k: float) -> float:
    """The norm a receiver accepts for an owner's result chunk: k times the order statistic one
    above the owner's. Views differ only in a liar's own (equivocated) claim, which moves an order
    statistic by one place, so an honest owner is never refused; with 4+ contributors and one liar
    the statistic is still an honest member's claim, so a lying owner is held to it."""
    s = sorted(claims)
    return k * s[min((len(s) - 1) // 2 + 1, len(s) - 1)] if s else 0.0


def reported(outliers: Mapping[int, float], members: Sequence[str]) -> list[str]:
    """The members to report, from ``AllReduceStats.outliers`` (group rank -> share of values).

    >>> reported({3: 1.0, 1: 0.2}, ["a", "b", "c", "d"])
    ['d']
    """
    return [members[r] for r, share in sorted(outliers.items()) if share > FLAG_SHARE and r < len(members)]


def majority_flagged(reports: Mapping[str, Sequence[str]], members: Sequence[str]) -> list[str]:
    """Members reported by more than half of the *other* members (``reports``: reporter -> reported).

    Reports of non-members are ignored, so a liar's report alone flags nobody.

    >>> majority_flagged({"a": ["d"], "b": ["d"], "c": ["d"], "d": ["a"]}, ["a", "b", "c", "d"])
    ['d']
    >>> majority_flagged({"a": ["d"], "d": ["a", "b"]}, ["a", "b", "c", "d"])
    []
    """
    counts = {w: 0 for w in members}
    for reporter, flagged in reports.items():
        if reporter in counts:
            for w in set(flagged):
                if w in counts and w != reporter:
                    counts[w] += 1
    return [w for w in members if counts[w] * 2 > len(members) - 1]


class Strikes:
    """Committed steps in which each worker was majority-flagged; :meth:`add` returns who is out.

    >>> s = Strikes(2)
    >>> s.add(["d"]), s.add([]), s.add(["d"])
    ([], [], ['d'])
    """

    def __init__(self, exclude_after: int):
        self.exclude_after = exclude_after
        self.count: dict[str, int] = {}

    def add(self, flagged: Sequence[str]) -> list[str]:
        out = []
        for w in flagged:
            self.count[w] = self.count.get(w, 0) + 1
            if self.count[w] == self.exclude_after:
                out.append(w)
        return out
