"""The all-reduce of ``diloco.compression = "topk"``: every member's sparse message (``sparse``: top-k
per chunk, 2-bit values, packed indices) goes to every other member, and each averages them per
index. The synchronizer calls :func:`topk_all_reduce_mean` for a shard where the int8 path calls
``allreduce.all_reduce_mean``: same tensors (replaced in place by the mean), group, contributor
flag, MAC key, robust clip and timeout, same :class:`~intellect.diloco.allreduce.AllReduceStats`.

Why a gather and not a ring: a ring of partial sums requantizes at every hop, and below 8 bits
that error grows with the ring (``shared/reference/overlap-compression.md`` section 3); top-k
contributions with their own indices cannot be summed in the wire format at all. Each member sends
and receives W-1 messages of about 0.16 bits per parameter (Rice-coded indices; at most 0.24),
against about 2 (W-1)/W bytes for int8's direct all-reduce: fewer bytes up to about 100 members
(``benchmarks/topk_allreduce.py``).

One call, three exchanges of W-1 direct messages per rank, each sealed under ``mac_key``
(``transport.Channel``) and each wait bounded by ``timeout`` (default: the group's):

1. header: ``plan digest i64 | contributes u8 | payload length u64``. A different plan digest
   fails the call before any payload moves (``AllReduceError``).
2. payload: from a contributor, ``sparse.encode`` of its top-k of ``pg + residual``
   (:class:`ErrorFeedback`). A rank receives as many bytes as the header announced, and none from a
   header announcing more than its own geometry gives (``sparse.wire_nbytes``): gloo aborts the
   whole process on a message longer than the receive buffer, and this bounds memory by the
   receiver's ``numel``.
3. echo: a BLAKE2b digest of each member's header and payload as received, sent to everyone. A
   member that sent different bytes to different peers (the key authenticates *a member*, not
   which) is caught here and the attempt fails, so every rank decodes the same bytes, makes the
   same accept or refuse decisions and sums in the same order: bit-identical averages.

Then each rank decodes every message, its own included (:func:`parse`, ``sparse.decode``). A
message refused there (length, geometry, NaN or oversized scales, an index out of its chunk, a
duplicate index) leaves its sender out of the mean, with the reason in :attr:`TopkStats.refused`,
and counts as an outlier in every value (the synchronizer reports it, as a flagged int8
contribution). The accepted ones go to ``sparse.aggregate``: the mean per index over the accepted
contributors and, with ``outlier_clip`` and 3+ of them, ``robust``'s centred clip per block of
their dense contributions.

What is not bounded. A member that equivocates, or lies in its echo, makes the attempt fail on
every rank without being blamed (who lied cannot be told apart: the key is shared), which costs
retries, not the model; a silent member, the group's timeout. A member that sends more bytes than
its header announced makes gloo abort the receiving process (its receive buffers are exact, as
for every message of the int8 path). With fewer than 3 accepted contributions there is no clip
(``robust``); a scale above ``TopK.max_scale`` is refused outright. Bit-identity holds across
hardware for the plain mean (elementwise adds in sender order); a block the clip flags is
computed with ``robust``'s reductions, the same on every rank of one torch build and CPU type.

Error feedback. The residual lives in :class:`ErrorFeedback`, one per shard; the call stages the
contribution and the residual it would leave, and the synchronizer adopts it with
:meth:`ErrorFeedback.commit` only when the step commits (an aborted attempt leaves the residual as
it was, so a retry resends the same message). A non-contributor stages nothing.

>>> fb = ErrorFeedback(6, TopK(chunk=3, k=1))
>>> s = fb.stage(torch.tensor([1.0, -5.0, 2.0, 0.5, 0.0, 4.0]))
>>> s.indices.tolist(), s.values.tolist()
([1, 5], [-5.0, 4.0])
>>> fb.commit(); fb.residual.tolist()
[1.0, 0.0, 2.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import datetime
import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from intellect.diloco.allreduce import AllReduceError, AllReduceStats
from intellect.diloco.robust import Screen
from intellect.diloco.sparse import SPARSE_SCREEN, Refused, Sparse, TopK, aggregate, compress, decode, encode, wire_nbytes
from intellect.diloco.transport import Channel, CommError, group_timeout

__all__ = ["ALGORITHM", "HEADER_BYTES", "ErrorFeedback", "TopkStats", "message_nbytes", "parse",
           "topk_all_reduce_mean"]

ALGORITHM = "topk-gather"
_HEAD = struct.Struct("<qBQ")  # plan digest, contributes, payload length
HEADER_BYTES = _HEAD.size  # a non-contributor's whole message
_ECHO = 16  # bytes of each message digest in the echo
_TAG_HEAD, _TAG_PAYLOAD, _TAG_ECHO = 1, 2, 3


@dataclass(frozen=True)
class TopkStats(AllReduceStats):
    """``AllReduceStats`` plus the senders whose messages were refused (group rank -> reason)."""

    refused: dict[int, str] = field(default_factory=dict)


class ErrorFeedback:
    """The fp32 error-feedback residual of one shard of ``numel`` values under ``cfg``.

    :meth:`stage` computes what to send for a pseudo-gradient and the residual it would leave
    (``sparse.compress``, pure); :meth:`commit` adopts that residual, :meth:`discard` drops it.
    ``state_dict`` holds tensors only (the worker's checkpoint and onboarding carry it)."""

    def __init__(self, numel: int, cfg: TopK = TopK()):
        self.cfg = cfg
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self._pending: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.residual.numel()

    def stage(self, flat: torch.Tensor) -> Sparse:
        """The contribution for the flat pseudo-gradient ``flat``; its residual waits for :meth:`commit`."""
        if flat.numel() != self.numel:
            raise ValueError(f"ErrorFeedback: pseudo-gradient of {flat.numel()} values, residual of {self.numel}")
        s, self._pending = compress(self.residual, flat, self.cfg)
        return s

    def commit(self) -> None:
        if self._pending is not None:
            self.residual, self._pending = self._pending, None

    def discard(self) -> None:
        self._pending = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual.clone()}

    def state_dict_after(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state once a step to which this rank contributes the flat pseudo-gradient ``flat``
        commits (``sparse.compress`` is pure, so it is known before the reduction runs): what a
        worker's state for the next checkpoint holds, as it is written before the all-reduce. A
        non-finite ``flat`` contributes nothing: the residual stays."""
        try:
            return {"residual": compress(self.residual, flat, self.cfg)[1]}
        except ValueError:
            return self.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        r = state["residual"]
        if not isinstance(r, torch.Tensor) or r.shape != self.residual.shape or not r.is_floating_point():
            raise ValueError(f"ErrorFeedback: residual must be a float tensor of shape {tuple(self.residual.shape)}")
        if not bool(torch.isfinite(r).all()):
            raise ValueError("ErrorFeedback: residual contains NaN or Inf")
        self.residual, self._pending = r.detach().to("cpu", torch.float32).clone(), None


def message_nbytes(numel: int, cfg: TopK) -> int:
    """Bytes of one contributor's message before its seal: header and ``sparse`` payload.

    >>> message_nbytes(1 << 24, TopK()) - wire_nbytes(1 << 24, TopK()) == HEADER_BYTES == 17
    True
    """
    return _HEAD.size + wire_nbytes(numel, cfg)


def topk_all_reduce_mean(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    feedback: ErrorFeedback,
    *,
    order: Sequence[int] | None = None,
    contribute: bool = True,
    timeout: float | None = None,
    mac_key: bytes | None = None,
    outlier_clip: float = 0.0,
    screen: Screen = SPARSE_SCREEN,
) -> TopkStats:
    """Replace ``tensors`` (same shapes on every rank, fp32 on the host) with the mean of the
    accepted members' decoded top-k contributions of their flat concatenation, bit-identical on
    every rank. ``feedback``: this shard's residual (its geometry is part of the plan); the call
    stages ``pg + residual``, the caller commits it with the step. ``order``: accepted for the
    synchronizer's calling shape (a gather has no ring; checked to be a permutation).
    ``contribute=False`` or a non-finite tensor: receive only. ``outlier_clip`` k > 0: the centred
    clip over 3+ accepted contributions. Raises ``AllReduceError`` on a communication failure, a
    plan mismatch or an equivocating member; ``ValueError`` on bad arguments before sending."""
    t0 = time.perf_counter()
    world, rank = group.size(), group.rank()
    if order is not None and sorted(int(r) for r in order) != list(range(world)):
        raise ValueError(f"order must be a permutation of range({world}), got {list(order)}")
    numel = sum(t.numel() for t in tensors)
    if numel != feedback.numel:
        raise ValueError(f"topk_all_reduce_mean: {numel} values, error-feedback residual of {feedback.numel}")
    if not all(t.is_floating_point() and t.device.type == "cpu" for t in tensors):
        raise ValueError("topk_all_reduce_mean: tensors must be floating point, on the host")
    cfg = feedback.cfg
    feedback.discard()
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
    try:
        payload = encode(feedback.stage(flat), cfg) if contribute else b""
    except ValueError:  # a non-finite pseudo-gradient or residual (sparse.compress): receive only
        payload = b""
    contribute = bool(payload)
    plan = (ALGORITHM, world, [tuple(t.shape) for t in tensors], cfg.chunk, cfg.k, cfg.decay, cfg.max_scale,
            mac_key is not None, float(outlier_clip), screen)
    digest = int.from_bytes(hashlib.blake2b(repr(plan).encode(), digest_size=8).digest(), "little", signed=True)
    head = _HEAD.pack(digest, int(contribute), len(payload))

    ch = Channel(group, group_timeout(group) if timeout is None else datetime.timedelta(seconds=timeout), None, mac_key)
    try:
        bodies = (_exchange(ch, rank, world, head, payload, wire_nbytes(numel, cfg), digest) if world > 1
                  else {rank: head + payload})
    except (CommError, ValueError) as e:
        feedback.discard()
        raise AllReduceError(f"topk_all_reduce_mean on rank {rank}/{world}: {e}") from e

    contribs, senders, refused = [], [], {}
    for r in range(world):
        got = parse(bodies[r], numel, cfg)
        if isinstance(got, Refused):
            refused[r] = got.reason
        elif got is not None:
            contribs.append(got)
            senders.append(r)
    mean, flagged = aggregate(contribs, numel, clip=float(outlier_clip), screen=screen)
    with torch.no_grad():
        off = 0
        for t in tensors:
            t.copy_(mean[off : off + t.numel()].view_as(t))
            off += t.numel()
    outliers = {senders[i]: round(share, 6) for i, share in flagged.items()}
    outliers.update({r: 1.0 for r in refused})
    return TopkStats(ALGORITHM, tuple(senders), ch.sent.get("payload", 0), ch.sent.get("control", 0), ch.messages,
                     time.perf_counter() - t0, dict(ch.sent_to), outliers, refused)


def parse(body: bytes, numel: int, cfg: TopK) -> Sparse | Refused | None:
    """A member's message (after its seal and plan digest were checked): its decoded contribution,
    None from a non-contributor, or :class:`~intellect.diloco.sparse.Refused` with the reason.

    >>> cfg = TopK(chunk=4, k=1)
    >>> parse(_HEAD.pack(0, 0, 0), 8, cfg) is None
    True
    >>> parse(_HEAD.pack(0, 1, 3) + b"abc", 8, cfg)
    Refused(reason='length: 3 bytes, expected at most 38')
    """
    _, flag, n = _HEAD.unpack_from(body)
    if flag not in (0, 1):
        return Refused(f"header: contributor flag {flag}")
    if n != len(body) - _HEAD.size:
        return Refused(f"header: payload length {n}, message carries {len(body) - _HEAD.size}")
    if flag == 0:
        return None if n == 0 else Refused(f"header: a non-contributor's message carries {n} bytes")
    return decode(memoryview(body)[_HEAD.size :], numel, cfg)


def _exchange(ch: Channel, rank: int, world: int, head: bytes, payload: bytes, expected: int,
              digest: int) -> dict[int, bytes]:
    """Exchange headers, then payloads of exactly ``expected`` bytes from the members whose header
    announces one, then the echo that checks every rank received the same bytes from every sender.
    Returns each sender's message (header and payload) by rank."""
    peers = [r for r in range(world) if r != rank]
    heads = _all_to_all(ch, peers, {r: head for r in peers}, {r: _HEAD.size for r in peers}, _TAG_HEAD, "control")
    for r, h in heads.items():
        if len(h) != _HEAD.size:
            raise CommError(f"rank {r} sent a header of {len(h)} bytes, expected {_HEAD.size}")
        if _HEAD.unpack(h)[0] != digest:
            raise CommError(f"rank {r} runs a different plan (geometry, shapes, clip or members)")
    # gloo aborts the process on a message longer than its receive buffer: a payload is received
    # only as long as its header announced, and only up to the length this rank's geometry gives
    announced = {r: n for r in peers for _, flag, n in [_HEAD.unpack(heads[r])] if flag == 1 and 0 < n <= expected}
    got = _all_to_all(ch, peers, {r: payload for r in peers} if payload else {}, announced, _TAG_PAYLOAD, "payload")
    bodies = {rank: head + payload, **{r: heads[r] + got.get(r, b"") for r in peers}}
    seen = b"".join(hashlib.blake2b(bodies[r], digest_size=_ECHO).digest() for r in range(world))
    echoes = _all_to_all(ch, peers, {r: seen for r in peers}, {r: len(seen) for r in peers}, _TAG_ECHO, "control")
    for r, theirs in echoes.items():
        if len(theirs) != len(seen):
            raise CommError(f"rank {r} sent an echo of {len(theirs)} bytes, expected {len(seen)}")
        differ = [s for s in range(world) if theirs[s * _ECHO : (s + 1) * _ECHO] != seen[s * _ECHO : (s + 1) * _ECHO]]
        if differ:
            raise CommError(f"rank {r} received other messages from ranks {differ} than this rank did "
                            "(a member sent different bytes to different peers)")
    return bodies


def _all_to_all(ch: Channel, peers: list[int], send: dict[int, bytes], recv: dict[int, int], tag: int,
                kind: str) -> dict[int, bytes]:
    """Send ``send[r]`` to each ``r`` and receive ``recv[r]`` bytes from each ``r``, sealed, at once."""
    bufs = {r: ch.empty(n) for r, n in recv.items()}
    works = [ch.irecv(bufs[r], r, tag) for r in peers if r in bufs]
    works += [ch.isend(torch.frombuffer(bytearray(send[r]), dtype=torch.uint8), r, tag, kind) for r in peers
              if r in send]
    ch.wait(works, f"top-k exchange (tag {tag})")
    return {r: ch.open(buf, r, tag).numpy().tobytes() for r, buf in bufs.items()}
