"""What a DiLoCo worker trains on: its shard of the data, and a bounded sketch of what it read.

The sketch lets anyone compare workers' reads from their step reports without the data itself:
workers that read the same sequences report the same sketch, workers with disjoint shards disjoint ones.
"""

from __future__ import annotations

import hashlib
import heapq
from typing import Iterable, Iterator

from intellect.data.stream import DocumentStream, TrainingStream
from intellect.diloco.config import DilocoRunConfig

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
