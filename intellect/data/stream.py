"""Training streams that know where they are, so a checkpoint can hold the data position.

Both kinds of pretraining data sit behind one small interface (:class:`TrainingStream`):
``next_batch(n)``, and ``state_dict()`` / ``load_state_dict()`` with JSON-serialisable state. A run
saves the state next to its weights and optimizer state; a resumed run that loads it gets the same
next batches (equal token ids) as a run that was never stopped.

* text: :class:`~intellect.data.text.PackedStream` (its state is the corpus cursor and the few
  documents whose tokens are still buffered);
* arithmetic: :class:`DocumentStream` below (its state is the count of documents read, as the seeded
  generator is replayed to that count: documents cost microseconds each).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterator, Protocol, TypeVar

from intellect.config import DataConfig
from intellect.data.arithmetic import document_pairs
from intellect.data.text import PackedStream
from intellect.prompts import chat_document

log = logging.getLogger(__name__)
STATE_VERSION = 1
MAX_REPLAY = 1 << 31  # documents a loaded DocumentStream state may replay: a bound, not a typical count


class TrainingStream(Protocol):
    """What training reads from and a checkpoint saves the position of."""

    def next_batch(self, n: int) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


S = TypeVar("S", bound=TrainingStream)


def resume_stream(stream: S, state: object, fresh: Callable[[], S]) -> S:
    """``stream`` continued from the saved position ``state``, or ``fresh()`` (the data from its start,
    logged) when ``state`` does not fit: another corpus, tokenizer, task, seed or settings (the state's
    fingerprint says so), or a garbled file. A run's own saved position, never a reason to stop the run.

    >>> a = DocumentStream(DataConfig(seed=3)); _ = a.next_batch(5)
    >>> resume_stream(DocumentStream(DataConfig(seed=3)), a.state_dict(), lambda: None).read
    5
    >>> resume_stream(DocumentStream(DataConfig(seed=4)), a.state_dict(), lambda: DocumentStream(DataConfig())).read
    0
    """
    try:
        if not isinstance(state, dict):
            raise ValueError(f"a data position is a JSON object, not {type(state).__name__}")
        stream.load_state_dict(state)
        return stream
    except (ValueError, KeyError, TypeError) as e:
        log.warning("the saved data position does not fit (%s): reading from the start", str(e)[:300])
        return fresh()


class DocumentStream:
    """Seeded arithmetic documents (:func:`~intellect.data.arithmetic.documents`), counted.

    >>> a = DocumentStream(DataConfig(seed=3))
    >>> _ = a.next_batch(5)
    >>> b = DocumentStream(DataConfig(seed=3))
    >>> b.load_state_dict(a.state_dict())
    >>> b.next_batch(2) == a.next_batch(2), b.state_dict()["read"]
    (True, 7)
    """

    def __init__(self, data: DataConfig, seed: int | None = None,
                 layout: Callable[[str, str], str] | None = None) -> None:
        """``layout(prompt, answer)`` writes a document (e.g. as a chat); None: prompt then answer."""
        self.data, self.seed = data, data.seed if seed is None else seed
        self.layout = layout or (lambda prompt, answer: prompt + answer)
        self._docs: Iterator[tuple[str, str]] = document_pairs(data, seed=self.seed)
        self.read = 0

    def next_batch(self, n: int) -> list[str]:
        if n < 1:
            raise ValueError(f"need n >= 1 documents (got {n})")
        self.read += n
        return [self.layout(*next(self._docs)) for _ in range(n)]

    def _fingerprint(self) -> str:
        """What a count means: the task's settings and the seed of this stream."""
        return hashlib.sha256(f"{self.data.model_dump_json()}\0{self.seed}".encode()).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "arithmetic", "fingerprint": self._fingerprint(), "read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["read"]`` documents of a stream with the same settings and seed."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or state.get("kind") != "arithmetic":
            raise ValueError(f"not a DocumentStream state of version {STATE_VERSION}")
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError("the stream state belongs to another arithmetic task or seed")
        read = state.get("read")
        if isinstance(read, bool) or not isinstance(read, int) or not 0 <= read <= MAX_REPLAY:
            raise ValueError(f"invalid document count {read!r}")
        self._docs, self.read = document_pairs(self.data, seed=self.seed), 0
        for _ in range(read):
            next(self._docs)
        self.read = read


def open_stream(data: DataConfig, tokenizer, *, shard: int = 0, shards: int = 1,
                seed: int | None = None) -> DocumentStream | PackedStream:
    """The training stream of ``data``: shard ``shard`` of ``shards`` of a text corpus, or the arithmetic
    documents of ``seed`` (``data.seed`` when None; arithmetic streams are told apart by seed, not sharded),
    as one-turn chats in ``tokenizer``'s template with ``data.chat``."""
    if data.kind == "text":
        return PackedStream(data, tokenizer, shard=shard, shards=shards)
    if data.chat:
        return DocumentStream(data, seed, lambda prompt, answer: chat_document(tokenizer, prompt, answer)[1])
    return DocumentStream(data, seed)


__all__ = ["DocumentStream", "TrainingStream", "open_stream"]
