"""One all-reduce call's state and message schedules (``allreduce.all_reduce_mean`` drives them).

:class:`Run` holds the sealed channel, the ring and the contributor flags, and gives each
bucket a generator that yields ``(works, label)`` once per exchange, so ``drive`` can keep up
to ``window`` buckets in flight. Schedules: ``_direct`` (every rank to every owner and back),
``_ring`` (the ring family's reduce-scatter, ``plan.relay_counts`` pieces per message) and
``_ring_gather`` (the owners' bytes forwarded along the ring, unchanged: ``_forwarded``). The
owners' aggregate is ``_owner``; with ``outlier_clip`` it goes through ``claims.Claims``. Only
``Run.to_wire`` messages cross the wire: ``encode`` bytes (``quantize.to_bytes``) under
``compression="int8"``, ``encode_values`` bytes (``quantize.values_to_bytes``) under ``"fp32"``;
receivers read them back with ``Run.from_wire``, which refuses the other kind.
"""

from __future__ import annotations

from collections import deque
from typing import Generator, Iterator, Sequence

import torch

from intellect.diloco.claims import Claims
from intellect.diloco.plan import chunk_bounds, chunk_nbytes, relay_counts, stages
from intellect.diloco.quantize import (
    Quantized,
    dequantize,
    from_bytes,
    message_nbytes,
    quantize_best,
    to_bytes,
    values_from_bytes,
    values_to_bytes,
)
from intellect.diloco.transport import Channel, CommError

__all__ = ["Run", "decode", "decode_values", "encode", "encode_values", "unpack"]

_Step = Generator[tuple[list, str], None, None]
_Chunks = Generator[tuple[list, str], None, list[torch.Tensor | None]]  # returns each chunk decoded (None: empty)


def encode(q: Quantized, codec: str) -> torch.Tensor:
    """``q`` as one message (``quantize.to_bytes``), a uint8 tensor ready to send."""
    return torch.frombuffer(bytearray(to_bytes(q, codec)), dtype=torch.uint8)


def decode(t: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode one message; ``t`` may be a receive buffer longer than the message."""
    return dequantize(from_bytes(t.cpu().numpy().data, numel=numel, prefix=True))


def encode_values(x: torch.Tensor) -> torch.Tensor:
    """``x``'s fp32 values as one message (``quantize.values_to_bytes``), a uint8 tensor ready to send."""
    return torch.frombuffer(bytearray(values_to_bytes(x)), dtype=torch.uint8)


def decode_values(t: torch.Tensor, numel: int) -> torch.Tensor:
    """The values of one ``encode_values`` message; ``t`` may be a receive buffer longer than it.

    >>> decode_values(encode_values(torch.tensor([0.1, -3.0])), 2).tolist() == torch.tensor([0.1, -3.0]).tolist()
    True
    """
    return values_from_bytes(t.cpu().numpy().data, numel=numel, prefix=True)


def unpack(buf: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The ``k`` messages laid back to back at the start of receive buffer ``buf``
    (sized for raw messages; coded ones leave spare room at the end).

    >>> from intellect.diloco.quantize import quantize
    >>> a, b = encode(quantize(torch.full((3,), 0.5)), "zstd"), encode(quantize(torch.zeros(3)), "none")
    >>> buf = torch.cat([a, b, torch.zeros(9, dtype=torch.uint8)])   # spare room at the end
    >>> [decode(m, 3).tolist() for m in unpack(buf, 2)]
    [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]
    """
    mv, off, out = buf.cpu().numpy().data, 0, []
    for _ in range(k):
        m = message_nbytes(mv[off:])
        if off + m > len(mv):
            raise ValueError(f"message {len(out)} of {k} overruns its {len(mv)}-byte buffer")
        out.append(buf[off : off + m])
        off += m
    return out


class Run(Claims):
    """One call's state; ``bucket`` generators yield (works, label) once per exchange."""

    def __init__(self, ch: Channel, tensors, order, pos, algorithm, relay, clip, codec, compression="int8"):
        self.ch, self.tensors, self.order, self.pos = ch, tensors, order, pos
        self.algorithm, self.relay, self.clip, self.codec = algorithm, relay, clip, codec
        self.compression = compression
        self.stages = stages(algorithm, compression)
        self.W = len(order)
        self.nxt, self.prv = order[(pos + 1) % self.W], order[(pos - 1) % self.W]
        self.init_claims()

    def exchange_flags(self, contribute: bool, digest: int) -> list[bool]:
        """Ring all-gather of (plan digest, contributor flag) along ``order``."""
        W, me = self.W, self.order[self.pos]
        vec = torch.full((W + 1,), -1, dtype=torch.int64)
        vec[0], vec[1 + me] = digest, int(contribute)
        for s in range(W - 1):
            raw = self.ch.empty(vec.numel() * vec.element_size())
            works = [self.ch.irecv(raw, self.prv, s), self.ch.isend(vec.clone().view(torch.uint8), self.nxt, s, "control")]
            self.ch.wait(works, f"contributor exchange step {s}")
            body = self.ch.open(raw, self.prv, s)
            if body.numel() != vec.numel() * vec.element_size():
                raise CommError(f"rank {self.prv} sent a contributor vector of {body.numel()} bytes")
            buf = body.clone().view(torch.int64)
            if int(buf[0]) != digest:
                raise CommError(f"rank {self.prv} runs a different plan "
                                "(order, algorithm, compression or bucket shapes)")
            vec[1:] = torch.where(vec[1:] < 0, buf[1:], vec[1:])
        return [bool(v) for v in vec[1:].tolist()]

    def set_contributors(self, flags: Sequence[bool]) -> None:
        self.flags = [flags[r] for r in self.order]  # by ring position
        self.n = sum(self.flags)
        W = self.W
        # pieces[c][s]: pieces in the step-s reduce-scatter message of chunk c, sent by position c+s+1
        self.pieces = [relay_counts([self.flags[(c + 1 + s) % W] for s in range(W - 1)], self.relay) for c in range(W)]

    def tag(self, b: int, phase: int, s: int) -> int:
        return self.W * (1 + 2 * b + phase) + s  # tags < W belong to the flag exchange

    def drive(self, gens: Iterator[_Step], window: int) -> None:
        """Round-robin over up to ``window`` bucket generators, waiting oldest-first."""
        pending: deque = deque()

        def push(g) -> bool:
            try:
                works, what = next(g)
            except StopIteration:
                return False
            pending.append((g, works, what))
            return True

        active = 0

        def fill() -> None:
            nonlocal active
            while active < window and (g := next(gens, None)) is not None:
                active += push(g)

        fill()
        while pending:
            g, works, what = pending.popleft()
            self.ch.wait(works, what)
            if not push(g):
                active -= 1
                fill()

    def bucket(self, b: int, idx: list[int]) -> _Step:
        ts = [self.tensors[i] for i in idx]
        if sum(t.numel() for t in ts) == 0:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in ts])
        parts = [flat[s:e] for s, e in chunk_bounds(flat.numel(), self.W)]
        algo = self._direct if self.algorithm == "direct" else self._ring
        result = yield from algo(b, parts)
        for c, part in enumerate(parts):
            if part.numel():
                chunk = result[c]
                assert chunk is not None  # every non-empty chunk is decoded
                part.copy_(chunk)
        off = 0
        with torch.no_grad():
            for t in ts:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()

    def quantize(self, x: torch.Tensor) -> Quantized:
        """``quantize`` with whichever ``clip_sigmas`` candidate fits ``x`` best in L2.
        Encoder side only; receivers read the values from the codebook."""
        return quantize_best(x, self.clip)

    def to_wire(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat fp32) as one message: quantized once (int8) or as it is (fp32)."""
        if self.compression == "fp32":
            return encode_values(x)
        return encode(self.quantize(x), self.codec)

    def from_wire(self, t: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``numel`` values of one ``to_wire`` message (``t`` may be longer: a receive buffer)."""
        return decode_values(t, numel) if self.compression == "fp32" else decode(t, numel)

    def wire(self, numel: int) -> int:
        """Bytes of a ``to_wire`` message of ``numel`` values sent raw: its receive buffer's size."""
        return chunk_nbytes(numel, self.compression)

    def _piece(self, x: torch.Tensor) -> torch.Tensor:
        """One reduce-scatter piece: ``x`` on the wire, plus (int8 residual) int8 of what that missed."""
        if self.stages == 1:
            return self.to_wire(x)
        q = self.quantize(x)
        return torch.cat([encode(q, self.codec), encode(self.quantize(x - dequantize(q)), self.codec)])

    def _ring(self, b: int, parts: list[torch.Tensor]) -> _Chunks:
        W, pos, ch, st = self.W, self.pos, self.ch, self.stages
        wire = [self.wire(p.numel()) for p in parts]
        me = self.flags[pos]

        def pieces(msgs, c):  # decoded pieces of a reduce-scatter message
            dec = [self.from_wire(m, parts[c].numel()) for m in msgs]
            return dec if st == 1 else [dec[j] + dec[j + 1] for j in range(0, len(dec), 2)]

        got, k_got = None, 0  # message received in the previous step: chunk c_out of this step
        for s in range(W - 1):
            c_out, c_in = (pos - s - 1) % W, (pos - s - 2) % W
            works, buf = [], None
            k_in = self.pieces[c_in][s]
            if k_in and wire[c_in]:
                buf = ch.empty(k_in * st * wire[c_in])
                works.append(ch.irecv(buf, self.prv, self.tag(b, 0, s)))
            if self.pieces[c_out][s] and wire[c_out]:
                if not me:  # forward what came in
                    assert got is not None  # a non-contributor sends only what it received
                    msg = torch.cat([m.cpu() for m in got])
                elif k_got + 1 <= self.relay:
                    own = self._piece(parts[c_out])
                    msg = own if got is None else torch.cat([m.cpu() for m in got] + [own])
                else:  # collapse: partial sum in fp32, requantized once
                    total = parts[c_out].clone()
                    for p in pieces(got, c_out):
                        total += p
                    msg = self._piece(total)
                works.append(ch.isend(msg, self.nxt, self.tag(b, 0, s), "payload"))
            yield works, f"bucket {b} reduce-scatter step {s}"
            got = unpack(ch.open(buf, self.prv, self.tag(b, 0, s)), k_in * st) if buf is not None else None
            k_got = k_in
        senders = [self.order[(pos + 1 + s) % W] for s in range(W - 1) if self.flags[(pos + 1 + s) % W]]
        return (yield from self._ring_gather(b, parts, pieces(got, pos) if got is not None else [], senders))

    def _direct(self, b: int, parts: list[torch.Tensor]) -> _Chunks:
        W, pos, ch = self.W, self.pos, self.ch
        others = [(pos + i) % W for i in range(1, W)]  # staggered so ranks don't all hit one owner
        # Both phases' receives are posted up front: gloo moves a message only once its
        # receive is posted, so a late receiver (busy quantizing) would leave the link idle.
        works, bufs, senders, ag_works, ag_bufs = [], [], [], [], {}
        if parts[pos].numel():
            for p in others:
                if self.flags[p]:
                    bufs.append(ch.empty(self.wire(parts[pos].numel())))
                    senders.append(self.order[p])
                    works.append(ch.irecv(bufs[-1], self.order[p], self.tag(b, 0, 0)))
        for p in others:
            if parts[p].numel():
                ag_bufs[p] = ch.empty(self.wire(parts[p].numel()))
                ag_works.append(ch.irecv(ag_bufs[p], self.order[p], self.tag(b, 1, 0)))
        if self.flags[pos]:
            for p in others:
                if parts[p].numel():
                    msg = self.to_wire(parts[p])
                    works.append(ch.isend(msg, self.order[p], self.tag(b, 0, 0), "payload"))
        yield works, f"bucket {b} direct reduce"
        received = [self.from_wire(ch.open(t, r, self.tag(b, 0, 0)), parts[pos].numel()) for t, r in zip(bufs, senders)]
        mine = self._owner(parts, received, senders, b)
        if mine is not None:
            for p in others:
                ag_works.append(ch.isend(mine, self.order[p], self.tag(b, 1, 0), "payload"))
        yield ag_works, f"bucket {b} direct all-gather"
        res = {c: unpack(ch.open(buf, self.order[c], self.tag(b, 1, 0)), 1)[0] for c, buf in ag_bufs.items()}
        res |= {pos: mine} if mine is not None else {}
        out = [self.from_wire(res[c], p.numel()) if c in res else None for c, p in enumerate(parts)]
        self._check_results(b, out)
        return out

    def _owner(self, parts: list[torch.Tensor], received: list[torch.Tensor],
               senders: Sequence[int] = (), b: int = 0) -> torch.Tensor | None:
        """The owner's message: mean of its fp32 chunk and ``received`` (from group ranks
        ``senders``), or, with ``outlier_clip``, their centred clip within the announced
        norms (``robust``), put on the wire once (``to_wire``)."""
        pos = self.pos
        if not parts[pos].numel():
            return None
        result = None
        if self.outlier_clip and self.n >= 3 and senders:
            result, received = self._clipped_mean(parts, received, senders, b)
        if result is None:
            total = parts[pos].clone() if self.flags[pos] else torch.zeros_like(parts[pos])
            for r in received:
                total += r
            result = total.div_(self.n)
        if self.claims is not None:  # an honest result never needs this; receivers check it
            result = self._bound_result(result, b)
        return self.to_wire(result)

    def _ring_gather(self, b: int, parts: list[torch.Tensor], received: list[torch.Tensor],
                     senders: Sequence[int] = ()) -> _Chunks:
        """``_owner``, then a ring all-gather forwarding the owners' bytes. Returns every
        chunk decoded from its owner's bytes."""
        W, pos, ch = self.W, self.pos, self.ch
        wire = [self.wire(p.numel()) for p in parts]
        res: dict[int, torch.Tensor] = {}
        if wire[pos]:
            # senders: only "ring-owner" relays each contribution as sent (robust aggregation needs that)
            mine = self._owner(parts, received, senders if self.relay >= W - 1 and self.stages == 1 else (), b)
            assert mine is not None  # the owner of a non-empty chunk always has a message
            res[pos] = mine
        for s in range(W - 1):
            c_out, c_in = (pos - s) % W, (pos - s - 1) % W
            works, buf = [], None
            if wire[c_in]:
                buf = ch.empty(wire[c_in])
                works.append(ch.irecv(buf, self.prv, self.tag(b, 1, s)))
            if wire[c_out]:
                msg = res[c_out] if c_out == pos else self._forwarded(res[c_out], parts[c_out].numel())
                works.append(ch.isend(msg, self.nxt, self.tag(b, 1, s), "payload"))
            yield works, f"bucket {b} all-gather step {s}"
            if buf is not None:
                res[c_in] = unpack(ch.open(buf, self.prv, self.tag(b, 1, s)), 1)[0]
        out = [self.from_wire(res[c], p.numel()) if wire[c] else None for c, p in enumerate(parts)]
        self._check_results(b, out)
        return out

    def _forwarded(self, msg: torch.Tensor, numel: int) -> torch.Tensor:
        """The bytes this rank forwards, in the ring all-gather, of another owner's result chunk
        ``msg`` (``numel`` values): the owner's own bytes, so every rank decodes the same values."""
        return msg
