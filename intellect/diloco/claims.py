"""The all-reduce's robust-aggregation plumbing (``outlier_clip``): announced chunk norms, the
owner's clipped aggregate and the receivers' check of every owner's result.

:class:`Claims` is mixed into the executor's per-call state (``schedules.Run``), which holds
the channel, the ring and the contributor flags it reads. The rules themselves, and what they
bound, are ``robust``'s: ``centred_clip`` (the owner's aggregate), ``owner_bound`` (what an
owner may publish) and ``receiver_bound`` (what a receiver accepts).

Each member announces the L2 norm of each of its chunks straight to every other member
(``exchange_claims``). An owner scales any decoded contribution longer than its announcement
down to it and flags its sender (decoding never lengthens a chunk: int8 decodes to bucket means,
fp32 to the values as sent), takes the centred clip,
and clips its result to ``owner_bound``; with 4+ contributors each receiver blames an owner
whose result is longer than ``receiver_bound`` allows (``blamed``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from intellect.diloco.plan import chunk_bounds
from intellect.diloco.robust import DEFAULT_SCREEN, Screen, centred_clip, owner_bound, receiver_bound
from intellect.diloco.transport import Channel

__all__ = ["Claims"]


class Claims:
    """Robust-aggregation state and steps of one all-reduce call. The host class
    (``schedules.Run``) sets the attributes declared here and defines ``tag``."""

    ch: Channel
    tensors: Sequence[torch.Tensor]
    order: list[int]  # the ring: group ranks by position
    pos: int  # this rank's ring position
    W: int
    flags: list[bool]  # contributor flags by ring position
    n: int  # contributors
    tag: Callable[[int, int, int], int]  # (bucket, phase, step) -> message tag

    def init_claims(self, outlier_clip: float = 0.0, screen: Screen = DEFAULT_SCREEN) -> None:
        self.outlier_clip, self.screen = outlier_clip, screen
        self.flagged: dict[int, int] = {}  # group rank -> values of its contributions found outliers
        self.contributed: dict[int, int] = {}  # group rank -> values of its contributions this rank owned
        self.claims: torch.Tensor | None = None  # [group rank, bucket, ring position]: announced chunk norms
        self.blamed: set[int] = set()  # owners whose result chunks broke the receivers' bound

    def exchange_claims(self, buckets: Sequence[Sequence[int]]) -> None:
        """Send every other rank, directly, the L2 norm of each of this rank's chunks (``robust``)."""
        W, me = self.W, self.order[self.pos]
        own = torch.zeros(len(buckets), W, dtype=torch.float64)
        for b, idx in enumerate(buckets if self.flags[self.pos] else ()):
            flat = torch.cat([self.tensors[i].detach().reshape(-1).to("cpu", torch.float32) for i in idx])
            for c, (s, e) in enumerate(chunk_bounds(flat.numel(), W)):
                own[b, c] = float(flat[s:e].norm()) if e > s else 0.0
        self.claims = torch.zeros(W, len(buckets), W, dtype=torch.float64)
        self.claims[me] = own
        tag, works, bufs = self.tag(len(buckets), 0, 0), [], {}
        for r in self.order:
            if r != me:
                bufs[r] = self.ch.empty(own.numel() * 8)
                works.append(self.ch.irecv(bufs[r], r, tag))
        for r in bufs:
            works.append(self.ch.isend(own.view(-1).view(torch.uint8).clone(), r, tag, "control"))
        self.ch.wait(works, "norm announcements")
        for r, buf in bufs.items():
            body = self.ch.open(buf, r, tag)
            if not self.flags[self.order.index(r)]:
                continue  # a non-contributor's announcement is never used
            got = body.clone().view(torch.float64).view(len(buckets), W) if body.numel() == own.numel() * 8 else None
            if got is None or not bool(torch.isfinite(got).all()) or bool((got < 0).any()):
                self.blamed.add(r)  # unusable: the attempt fails and r is blamed; its values count as 0
                continue
            self.claims[r] = got

    def _claimed(self, b: int, c: int) -> list[float]:
        """Announced norms of chunk ``c`` (ring position) of bucket ``b`` by the contributors."""
        claims = self.claims
        assert claims is not None, "only called once exchange_claims() has run"
        return [float(claims[self.order[p], b, c]) for p in range(self.W) if self.flags[p]]

    def _check_results(self, b: int, decoded: list[torch.Tensor | None]) -> None:
        """Blame each owner whose result chunk is longer than ``receiver_bound`` allows."""
        if self.claims is None or self.n < 4:
            return
        for c, v in enumerate(decoded):
            if v is not None and c != self.pos and v.numel():
                bound = receiver_bound(self._claimed(b, c), self.outlier_clip)
                if float(v.norm()) > bound * (1 + 1e-3) + 1e-30:
                    self.blamed.add(self.order[c])

    def _clipped_mean(self, parts: list[torch.Tensor], received: list[torch.Tensor],
                      senders: Sequence[int], b: int) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The centred clip of the owner's chunk and ``received`` (from group ranks ``senders``),
        each cut to its announced norm first, or None when nobody is flagged (then the caller
        takes the mean); and ``received`` as cut."""
        pos = self.pos
        me = [self.order[pos]] if self.flags[pos] else []
        ranks = me + list(senders)
        xs = ([parts[pos]] if me else []) + list(received)
        lied = set()
        if self.claims is not None:  # decoding never lengthens a chunk: longer than announced is a lie
            for i, r in enumerate(ranks):
                claim = float(self.claims[r, b, pos])
                norm = float(xs[i].norm())
                if norm > claim * (1 + 1e-3) + 1e-30:
                    xs[i] = xs[i] * (claim / norm)
                    lied.add(i)
        result, outliers = centred_clip(xs, self.outlier_clip, screen=self.screen)
        for r in ranks:
            self.contributed[r] = self.contributed.get(r, 0) + parts[pos].numel()
        for i in set(outliers) | lied:
            self.flagged[ranks[i]] = self.flagged.get(ranks[i], 0) + parts[pos].numel()
        return result, xs[len(me):]

    def _bound_result(self, result: torch.Tensor, b: int) -> torch.Tensor:
        """``result`` (the owner's chunk of bucket ``b``) clipped to ``owner_bound``."""
        bound = owner_bound(self._claimed(b, self.pos), self.outlier_clip)
        norm = float(result.norm())
        if norm > bound:
            result = result * (bound / norm)
        return result
