"""The user's text corpus as fixed-length training sequences: split, sharded, packed, resumable.

Documents come from :mod:`intellect.data.corpus`. Each one is

* **split** by content: sha256 of its text, as an integer, ``% 100 < data.heldout_percent`` puts it in the
  held-out split (:func:`is_heldout_text`), whatever the seed, shard or file it came from, so training
  never sees a held-out document, not even a copy of one in another file;
* **sharded** by position: shard ``i`` of ``n`` owns the documents whose ``(file name, row)`` hashes to ``i``
  modulo ``n`` (:func:`shard_of`), so workers at the same position read disjoint data and together all of it;
* **packed**: tokenized with the model's tokenizer (``add_special_tokens=False``), EOS after each
  document, cut into ``seq_len`` sequences with no padding; a document's remainder opens the next sequence.

Epoch ``e`` reads the files in an order permuted by ``(data.seed, e)``; rows inside a file keep their order.
The held-out split always reads in one fixed order, so :func:`heldout_batches` is the same on every call.

With ``data.text.document_mask`` each token attends only to its own document: ``position_ids`` restart at
0 at each document start (and at each sequence start) and ``attention_mask`` is a ``[n, 1, L, L]`` bool
block-diagonal causal mask (True = may attend), which transformers passes to the attention as it is. A
bool mask needs the ``sdpa`` (default) or ``flex_attention`` implementation: ``eager`` adds the mask to the
scores and would not isolate anything.

Exact resumption: :meth:`PackedStream.state_dict` is small JSON (the cursor after the last document read,
and the cursors of the few documents whose tokens are still buffered); :meth:`PackedStream.load_state_dict`
re-reads those documents, so the next batches are the ones an uninterrupted stream would have given.
:meth:`PackedStream.reshard` changes the shard in place, keeping the position and the buffer. Workers that
consumed the same number of tokens stand at slightly different positions (their shards' documents differ
in length), so after a membership change a document between two workers' positions could be read twice;
:meth:`PackedStream.align` first moves a worker's reading position up to the members' furthest one
(``intellect.diloco.data`` decides where, and how far a worker may skip).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from typing import Any, Iterator, Literal

import torch

from intellect.config import DataConfig
from intellect.data.corpus import Corpus, CorpusReader, Cursor, FileRef, new_stats
from intellect.progress import Progress

Split = Literal["train", "heldout"]
STATE_VERSION = 1
_TOKENIZE_DOCS = 256  # documents tokenized in one call at most (the tokenizer runs them in parallel)


def is_heldout_text(text: str, percent: int) -> bool:
    """Whether a document belongs to the held-out split: sha256 of its UTF-8 text, mod 100, below ``percent``.

    >>> [is_heldout_text(t, 50) for t in ("a", "b", "c", "d")]   # their hashes mod 100: 99, 65, 58, 40
    [False, False, False, True]
    """
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest(), "big") % 100 < percent


def shard_of(name: str, row: int, shards: int) -> int:
    """The shard of the document at row ``row`` of file ``name``, out of ``shards``.

    >>> [shard_of("corpus/a.jsonl", row, 3) for row in range(6)]
    [1, 2, 1, 1, 0, 1]
    """
    digest = hashlib.blake2b(f"{name}\0{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def packed_positions(starts: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 wherever ``starts`` ([n, L] bool, document starts) is True and at 0.

    >>> packed_positions(torch.tensor([[False, False, True, False, False, True]])).tolist()
    [[0, 1, 0, 1, 2, 0]]
    """
    n, length = starts.shape
    idx = torch.arange(length).expand(n, length)
    first = starts.clone()
    first[:, 0] = True
    last_start = torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


def document_causal_mask(starts: torch.Tensor) -> torch.Tensor:
    """``[n, 1, L, L]`` bool: query ``i`` may attend key ``j`` iff ``j <= i`` and both are in one document.

    >>> document_causal_mask(torch.tensor([[False, False, True]]))[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    doc = starts.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
    return (doc[:, :, None] == doc[:, None, :]).tril_().unsqueeze(1)


def eos_id(tokenizer) -> int:
    value = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(value, int):
        raise ValueError("the tokenizer has no EOS token: packing needs one between documents")
    return value


class PackedStream:
    """Endless fixed-length training sequences of one shard of the corpus (``split`` only).

    ``epochs`` (None: endless) stops the stream after that many passes over the files; ``next_batch``
    then raises ``EOFError``. ``storage_options``: S3 endpoint and credentials (keys
    :data:`~intellect.data.corpus.STORAGE_OPTION_KEYS`; unset ones come from the environment).
    """

    def __init__(self, data: DataConfig, tokenizer, *, shard: int = 0, shards: int = 1, split: Split = "train",
                 storage_options: dict[str, Any] | None = None, epochs: int | None = None) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout' (got {split!r})")
        self.data, self.tokenizer, self.split, self.epochs = data, tokenizer, split, epochs
        self.seq_len = data.text.seq_len
        self._eos = eos_id(tokenizer)
        self.corpus = Corpus(data.text, storage_options)
        self.reader = CorpusReader(self.corpus, self._order_key)
        self.stats = new_stats()
        self._cursor = Cursor()
        self._pending: deque[tuple[Cursor, list[int]]] = deque()  # documents with tokens still to hand out
        self._drop = 0  # tokens of the first pending document already handed out
        self._docs: Iterator[tuple[Cursor, Cursor, str]] | None = None
        self.passed = 0  # rows the reader has looked at (any shard or split, skips aside): its pace
        self._floor: tuple[int, int, int] | None = None  # rows before it are not read, while _skips last
        self._skips = 0
        self.shard, self.shards = 0, 1
        self.reshard(shard, shards)

    # ------------------------------------------------------------------ reading

    def _order_key(self, epoch: int) -> str:
        # the held-out split never depends on the seed: one fixed order
        return "heldout" if self.split == "heldout" else f"train:{self.data.seed}:{epoch}"

    def _keep(self, text: str) -> bool:
        return is_heldout_text(text, self.data.heldout_percent) == (self.split == "heldout")

    def _skip(self, at: Cursor) -> bool:
        """Whether the row at ``at`` is passed unread on the way to the :meth:`align` floor."""
        if self._floor is not None:
            if at.key < self._floor and self._skips > 0:
                self._skips -= 1
                return True
            self._floor = None  # reached, or the skip budget is spent
        return False

    def _mine(self, ref: FileRef, at: Cursor) -> bool:
        self.passed += 1
        return self.shards == 1 or shard_of(ref.name, at.row, self.shards) == self.shard

    @property
    def position(self) -> tuple[int, int, int]:
        """Where the reader goes on: (epoch, file position, row) after the last document read."""
        return self._cursor.key

    def align(self, floor: tuple[int, int, int], max_rows: int) -> None:
        """Read on from ``floor`` (a :attr:`position`) if it is ahead: the rows between are passed unread,
        at most ``max_rows`` of them (a floor further ahead than that is given up at the limit). Buffered
        tokens are kept: their documents were read by this stream already."""
        if max_rows < 0:
            raise ValueError(f"need max_rows >= 0 (got {max_rows})")
        if floor > self.position and max_rows:
            self._floor, self._skips = floor, max_rows
            self._restart()

    def reshard(self, shard: int, shards: int) -> None:
        """Become shard ``shard`` of ``shards`` from the current position on (buffered tokens are kept)."""
        if not (shards >= 1 and 0 <= shard < shards):
            raise ValueError(f"need 0 <= shard < shards (got shard {shard} of {shards})")
        self.shard, self.shards = shard, shards
        self._restart()

    def _restart(self) -> None:
        self._docs = self.reader.stream(self._cursor, self._mine, self._keep, self.epochs, self.stats, skip=self._skip)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        return [list(t) + [self._eos] for t in ids]

    def _buffered(self) -> int:
        return sum(len(t) for _, t in self._pending) - self._drop

    def _fill(self, need: int) -> None:
        """Read and tokenize documents until ``need`` tokens are buffered (EOFError if the stream ends first)."""
        assert self._docs is not None
        while (have := self._buffered()) < need:
            starts, texts, chars = [], [], 0
            # A token spans at most a few characters (about 4 for BPE on code or English, 1 for characters):
            # 4 characters per missing token fills a batch in one call, of several documents, which the
            # tokenizer encodes in parallel.
            while chars < 4 * (need - have) and len(texts) < _TOKENIZE_DOCS:
                doc = next(self._docs, None)
                if doc is None:
                    break
                starts.append(doc[0])
                texts.append(doc[2])
                chars += len(doc[2])
                self._cursor = doc[1]
            if not texts:
                raise EOFError(f"the {self.split} split ended after {self.epochs} pass(es) over the corpus")
            self._pending.extend(zip(starts, self._tokenize(texts)))

    def _take(self, count: int) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        starts: list[bool] = []
        while len(ids) < count:
            _, tokens = self._pending[0]
            piece = tokens[self._drop: self._drop + count - len(ids)]
            starts.extend([self._drop == 0] + [False] * (len(piece) - 1))
            ids.extend(piece)
            self._drop += len(piece)
            if self._drop == len(tokens):
                self._pending.popleft()
                self._drop = 0
        return ids, starts

    def next_batch(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` packed sequences: input_ids, labels (== input_ids), position_ids, and with
        ``document_mask`` a ``[n, 1, seq_len, seq_len]`` bool attention_mask."""
        if n < 1:
            raise ValueError(f"need n >= 1 sequences (got {n})")
        self._fill(n * self.seq_len)
        ids, starts = self._take(n * self.seq_len)
        input_ids = torch.tensor(ids, dtype=torch.long).view(n, self.seq_len)
        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
        if self.data.text.document_mask:
            start = torch.tensor(starts, dtype=torch.bool).view(n, self.seq_len)
            batch["position_ids"] = packed_positions(start)
            batch["attention_mask"] = document_causal_mask(start)
        else:
            batch["position_ids"] = torch.arange(self.seq_len).expand(n, self.seq_len).clone()
        return batch

    # ------------------------------------------------------------------ state

    def _fingerprint(self) -> str:
        """What a saved position means: the files, how they are read and split, the seed, the tokenizer."""
        t = self.data.text
        parts = [self.corpus.digest, t.column, t.max_document_bytes, self.data.heldout_percent, self.data.seed,
                 self.split, len(self.tokenizer), self._eos]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    @property
    def epoch(self) -> int:
        """The epoch of the next document to read."""
        return self._cursor.epoch

    def state_dict(self) -> dict[str, Any]:
        """The stream's position as JSON-serialisable data (the shard is not part of it)."""
        return {"version": STATE_VERSION, "fingerprint": self._fingerprint(), "cursor": self._cursor.to_json(),
                "pending": [c.to_json() for c, _ in self._pending], "drop": self._drop, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (of a stream of the same corpus, split, seed and tokenizer) in this
        stream's shard: the buffered documents are read again and their handed-out tokens dropped."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a PackedStream state of version {STATE_VERSION}")
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError("the stream state belongs to another corpus, split, seed or tokenizer (files listed, "
                             "column, max_document_bytes, heldout_percent, seed or vocabulary differ)")
        cursor = Cursor.from_json(state["cursor"])
        pending = [Cursor.from_json(c) for c in state["pending"]]
        drop = state["drop"]
        if not isinstance(drop, int) or drop < 0 or (drop and not pending):
            raise ValueError(f"invalid drop count {drop!r}")
        texts = self._reread(pending)
        tokens = self._tokenize(texts) if texts else []
        if tokens and drop >= len(tokens[0]):
            raise ValueError("the stream state does not match the corpus (a buffered document is shorter)")
        self._pending = deque(zip(pending, tokens))
        self._drop, self._cursor = drop, cursor
        self.stats = {**new_stats(), **{k: int(v) for k, v in state.get("stats", {}).items() if k in self.stats}}
        self._restart()

    def _reread(self, pending: list[Cursor]) -> list[str]:
        """The texts of the documents at ``pending`` (in stream order), whatever the shard or split."""
        if not pending:
            return []
        wanted = {c.key for c in pending}
        texts = []
        for at, _, text in self.reader.stream(pending[0], lambda _r, c: c.key in wanted, stop=pending[-1]):
            if at.key != pending[len(texts)].key:
                raise ValueError("the stream state does not match the corpus (buffered documents out of order)")
            texts.append(text)
            if len(texts) == len(pending):
                return texts
        raise ValueError("the stream state does not match the corpus (a buffered document is missing)")


def heldout_batches(data: DataConfig, tokenizer, batch_size: int = 16,
                    storage_options: dict[str, Any] | None = None) -> list[dict[str, torch.Tensor]]:
    """``data.text.eval_sequences`` packed held-out sequences (documents whose content hash falls in
    ``heldout_percent``), the same every call, in batches of the :meth:`PackedStream.next_batch` shape.

    One pass over the held-out documents at most: a split with fewer tokens gives fewer sequences (never a
    repeated one); one with less than a single sequence is an error. Reads the corpus on every call, so
    callers keep the list.
    """
    if batch_size < 1:
        raise ValueError(f"need batch_size >= 1 (got {batch_size})")
    stream = PackedStream(data, tokenizer, split="heldout", storage_options=storage_options, epochs=1)
    batches: list[dict[str, torch.Tensor]] = []
    left = data.text.eval_sequences
    # the split is a few percent of the documents: finding enough of them can read much of the corpus
    bar = Progress("held-out split", len(stream.corpus.files), unit="file")
    bar.begin(f"reading the held-out documents ({data.heldout_percent}%) of {len(stream.corpus.files)} files "
              f"for {left} sequences")
    with bar:
        stream.reader.progress = bar
        while left:
            size = min(batch_size, left)
            try:
                batches.append(stream.next_batch(size))
            except EOFError:  # the split is exhausted: the whole sequences still buffered, then stop
                size = min(size, stream._buffered() // stream.seq_len)
                if size:
                    batches.append(stream.next_batch(size))
                break
            left -= size
        bar.close(f"{sum(len(b['input_ids']) for b in batches)} sequences from {bar.done} of {bar.total} files")
    if not batches:
        raise ValueError(f"the held-out split ({data.heldout_percent}% of documents) holds less than one "
                         f"sequence of {data.text.seq_len} tokens")
    return batches


def iter_documents(data: DataConfig, *, split: Split = "train", storage_options: dict[str, Any] | None = None,
                   max_documents: int | None = None) -> Iterator[str]:
    """The texts of one split, one pass, in a fixed order independent of the seed (e.g. to train a tokenizer)."""
    corpus = Corpus(data.text, storage_options)
    reader = CorpusReader(corpus, lambda epoch: f"documents:{epoch}")

    def keep(text: str) -> bool:
        return is_heldout_text(text, data.heldout_percent) == (split == "heldout")

    for count, (_, _, text) in enumerate(reader.stream(Cursor(), lambda _r, _c: True, keep, epochs=1)):
        if max_documents is not None and count >= max_documents:
            return
        yield text


__all__ = ["PackedStream", "document_causal_mask", "heldout_batches", "is_heldout_text", "iter_documents",
           "packed_positions", "shard_of"]
