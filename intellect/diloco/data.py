"""What a DiLoCo worker trains on: its shard of the data, and a bounded sketch of what it read.

The sketch lets anyone compare workers' reads from their step reports without the data itself:
workers that read the same sequences report the same sketch, workers with disjoint shards disjoint ones.

A text corpus is read in one order by every worker, each keeping the documents of its shard
(:class:`~intellect.data.text.PackedStream`). Workers that trained the same number of tokens stand
at slightly different positions, and a worker that was away (killed, excluded) stands where it
stopped. So when a worker's membership changes, or it comes back, it does not simply read its new
shard from where it is: the documents between its position and the others' were in someone's shard
and may have been read. Each worker publishes its position for the next boundary (``DATA_AT``,
:func:`publish_position`) as soon as its inner phase ends, before the all-reduce, and again at that
boundary before it arrives; every member whose position is not the one it reached under the step's
members moves up to the furthest position claimed by the step's members and by the members it read
beside (:func:`align_to_members`). The early claim is what lets a worker that dies between committing a
step and the next boundary still count: the survivors, who take over its shard, read on past what it
read (trained on, or holds in its buffer to train on when it comes back from its saved state) instead
of over it. A claim is a peer's word: a liar claiming a far position would make the others skip data,
so a worker passes at most as many rows as its own or the claimants' median pace (rows per outer step,
the larger) gives the steps it is behind, plus two.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from typing import Callable, Iterable, Iterator

from intellect.data.stream import DocumentStream, TrainingStream, resume_stream
from intellect.data.text import PackedStream
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.protocol import DATA_AT, read_count, read_json

log = logging.getLogger("intellect.diloco")
Position = tuple[int, int, int]  # PackedStream.position: (epoch, file position, row)
MAX_POSITION = 1 << 62
SLACK_STEPS = 2  # outer steps of rows a worker may skip beyond the steps it is behind

SKETCH_SIZE = 16


def sequence_hash(data: bytes) -> str:
    """The 64-bit BLAKE2b hash of one training sequence's bytes, in hex."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def data_sketch(hashes: Iterable[str], k: int = SKETCH_SIZE) -> list[str]:
    """The ``k`` smallest distinct ``hashes`` (:func:`sequence_hash` of the sequences read): a bottom-k
    sketch, equal for workers that read the same data and disjoint between workers whose reads are
    (up to sequences the corpus repeats). The sketch of a union is the sketch of its parts' sketches,
    so a reader keeps it bounded as it goes.

    >>> h = [sequence_hash(s) for s in (b"x", b"y", b"z", b"y")]
    >>> data_sketch(h, 2) == data_sketch(data_sketch(h[:2], 2) + h[2:], 2), len(data_sketch(h, 2))
    (True, 2)
    >>> set(data_sketch(h)).isdisjoint(data_sketch([sequence_hash(b"u")]))
    True
    """
    return heapq.nsmallest(k, set(hashes))


def shard_stream(run: DilocoRunConfig, index: int) -> DocumentStream:
    """The arithmetic documents of worker ``index``: its own seed, and its own ops when non-i.i.d."""
    data = run.data
    if run.diloco.data_split == "non_iid":
        data = data.model_copy(update={"ops": [data.ops[index % len(data.ops)]]})
    return DocumentStream(data, seed=data.seed * 1000 + index + 1)


def worker_stream(run: DilocoRunConfig, tokenizer, index: int, saved: dict | None) -> DocumentStream | PackedStream:
    """Worker ``index``'s training stream, continued from its ``saved`` position where that fits: its
    arithmetic documents (:func:`shard_stream`), or the text corpus as shard 0 of 1 until it is given
    its place among a step's members (:meth:`~intellect.data.text.PackedStream.reshard`)."""
    def fresh() -> DocumentStream | PackedStream:
        if run.data.kind == "text":
            return PackedStream(run.data, tokenizer)
        return shard_stream(run, index)

    return resume_stream(fresh(), saved, fresh) if saved else fresh()


def position_claim(position: Position, rows_per_step: int) -> str:
    """A worker's ``DATA_AT`` value: where its reader stands, and how many rows it passed in its last
    inner phase (0: not known yet).

    >>> read_position_claim(position_claim((0, 3, 7), 120))
    ((0, 3, 7), 120)
    """
    return json.dumps({"at": list(position), "rows": rows_per_step})


def read_position_claim(raw) -> tuple[Position, int] | None:
    """A peer's :func:`position_claim` read back, else None (the claim is then ignored).

    >>> read_position_claim(b'{"at": [0, 1, -2], "rows": 5}'), read_position_claim(b"[")
    (None, None)
    """
    v = read_json(raw)
    if not isinstance(v, dict) or not isinstance(at := v.get("at"), list) or len(at) != 3:
        return None
    parts = [read_count(x, 0, MAX_POSITION) for x in at]
    rows = read_count(v.get("rows"), 0, MAX_POSITION)
    if rows is None or any(p is None for p in parts):
        return None
    return (parts[0], parts[1], parts[2]), rows  # type: ignore[return-value]


def alignment(claims: list[tuple[Position, int]], behind: int, pace: int = 0) -> tuple[Position, int]:
    """Where a worker reads on after a membership change, and how many rows it may pass unread to get
    there: the furthest claimed position, within ``(behind + SLACK_STEPS)`` times the pace, this
    worker's own ``pace`` or the median claimed one (rows per outer step, unknown ones left out),
    whichever is larger. ``behind``: outer steps since this worker's position was current (0 for a
    member of the previous step). With honest claims every member ends at
    or past every position another reached, so no document is read twice; a liar's far claim costs each
    member at most that many rows.

    >>> alignment([((0, 5, 0), 100), ((0, 6, 2), 110)], behind=0)        # two veterans
    ((0, 6, 2), 200)
    >>> alignment([((0, 5, 0), 100), ((9, 0, 0), 10**9), ((0, 6, 2), 110)], behind=3)  # a liar
    ((9, 0, 0), 550)
    """
    if behind < 0:
        raise ValueError(f"need behind >= 0 (got {behind})")
    paces = sorted(rows for _, rows in claims if rows > 0)
    if paces:  # the lower median: a minority cannot raise it
        pace = max(pace, paces[(len(paces) - 1) // 2])
    floor = max((at for at, _ in claims), default=(0, 0, 0))
    return floor, (behind + SLACK_STEPS) * pace


def publish_position(put: Callable[[str, str], None], step: int, me: str, stream: PackedStream,
                     rows_per_step: int) -> None:
    """Claim ``stream``'s position for the boundary of ``step`` (``put(key, value)`` writes the rendezvous).
    A worker does so when its inner phase ends (the position it will stand at when it arrives: nothing
    reads between) and again at the boundary (a worker that trained nothing since, such as a rejoiner)."""
    put(DATA_AT(step, me), position_claim(stream.position, rows_per_step))


def align_to_members(stream: PackedStream, get: Callable[[str], bytes | None], step: int, members: list[str],
                     me: str, behind: int, pace: int = 0, previous: Iterable[str] = ()) -> None:
    """Move ``stream`` up to the positions claimed for the boundary of ``step`` (:func:`alignment`) by the
    step's ``members`` and the ``previous`` ones, those this worker's position was current among: one of
    those that left claimed, as its inner phase ended, where it had read to in the shard the survivors now
    share. ``get(key)`` reads the rendezvous (None: absent); ``pace``: this worker's own rows per outer
    step. A worker without a readable claim counts for nothing."""
    claimants = dict.fromkeys([*members, *previous])
    claims = [c for w in claimants if (c := read_position_claim(get(DATA_AT(step, w)))) is not None]
    floor, max_rows = alignment(claims, behind, pace)
    before = stream.position
    if floor > before:
        stream.align(floor, max_rows)
        log.info("%s: step %d: reading on from the members' furthest position %s (was at %s, at most %d rows "
                 "passed)", me, step, list(floor), list(before), max_rows)


def rows_of(batch, rank: int, ranks: int):
    """Rank ``rank``'s part of ``batch`` (a dict of row tensors, or a list of texts) split into ``ranks``
    equal runs of rows: a worker's ranks each train on theirs.

    >>> rows_of(["a", "b", "c", "d"], 1, 2)
    ['c', 'd']
    """
    n = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch)
    if n % ranks:
        raise ValueError(f"a batch of {n} rows does not split over {ranks} ranks")
    lo, hi = rank * n // ranks, (rank + 1) * n // ranks
    return {k: v[lo:hi] for k, v in batch.items()} if isinstance(batch, dict) else batch[lo:hi]


def sketched_batches(stream: TrainingStream, size: int, seen: list[str]) -> Iterator:
    """Batches of ``size`` from ``stream`` (packed text, or arithmetic documents), each sequence's
    :func:`sequence_hash` added to ``seen``, which is folded into its :func:`data_sketch` as it grows."""
    while True:
        batch = stream.next_batch(size)
        if isinstance(batch, dict):
            seen.extend(sequence_hash(row.numpy().tobytes()) for row in batch["input_ids"])
        else:
            seen.extend(sequence_hash(t.encode()) for t in batch)
        if len(seen) > 64 * SKETCH_SIZE:
            seen[:] = data_sketch(seen)
        yield batch
