"""DiLoCo workers on a text corpus never read a document another worker read, across membership changes.

Three workers read one JSONL corpus through real :class:`PackedStream` s, as the DiLoCo worker does:
each publishes its position claim at a boundary, and a worker whose position is not the one it reached
under the step's members realigns (``align_to_members``) before it reads its new shard. One worker is
killed and rejoins from an older saved position. The documents each worker read (their tags) must be
disjoint between workers; without the alignment they are not, which the control case shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from intellect.config import DataConfig
from intellect.data.corpus import CorpusError
from intellect.data.text import PackedStream, is_heldout_text, shard_of
from intellect.diloco.data import align_to_members, alignment, position_claim, read_position_claim
from intellect.diloco.protocol import DATA_AT
from intellect.model.bpe import train_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TAG = re.compile(r"<d(\d{4})>")


def doc_text(i: int) -> str:
    return f"<d{i:04d}> " + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + (i * 7) % 23)) + "\n"


@pytest.fixture(scope="module")
def tok():
    return train_bpe([doc_text(i) for i in range(300)], vocab_size=400)


@pytest.fixture
def corpus(tmp_path: Path) -> DataConfig:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc_text(i)}) + "\n" for i in range(3000)))
    return DataConfig(kind="text", heldout_percent=1, text={"files": [str(path)], "seq_len": 32})


def first_training_doc(row: int) -> int:
    """The first document at or after ``row`` that is not in the 1% held-out split."""
    return next(i for i in range(row, 3000) if not is_heldout_text(doc_text(i), 1))


def tags(tok, batch) -> set[int]:
    """The documents whose opening tag is in ``batch``: read by whoever trained on it."""
    return {int(n) for n in TAG.findall(tok.decode(batch["input_ids"].flatten().tolist()))}


class Sim:
    """Workers as :class:`~intellect.diloco.worker.DilocoWorker` drives their streams, without the model."""

    def __init__(self, data: DataConfig, tok, align: bool = True) -> None:
        self.data, self.tok, self.align = data, tok, align
        self.store: dict[str, bytes] = {}
        self.streams: dict[str, PackedStream] = {}
        self.at: dict[str, tuple[int, list[str]]] = {}  # DilocoWorker.data_at
        self.pace: dict[str, int] = {}
        self.read: dict[str, set[int]] = {}

    def step(self, t: int, members: list[str], batches: int = 10) -> dict[str, set[int]]:
        for w in members:  # a boundary: every member claims its position before it arrives
            s = self.streams.setdefault(w, PackedStream(self.data, self.tok))
            self.at.setdefault(w, (0, []))
            self.store[DATA_AT(t, w)] = position_claim(s.position, self.pace.get(w, 0)).encode()
        out = {}
        for i, w in enumerate(members):
            s = self.streams[w]
            s.reshard(i, len(members))
            if self.align and self.at[w] != (t, members):
                align_to_members(s, self.store.get, t, members, w, t - self.at[w][0], self.pace.get(w, 0))
            rows = s.passed
            out[w] = set().union(*(tags(self.tok, s.next_batch(4)) for _ in range(batches)))
            self.pace[w], self.at[w] = s.passed - rows, (t + 1, list(members))
        return out


def run(sim: Sim) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """3 workers; c is killed after step 3 (its step-3 reads never commit) and rejoins at step 7 from
    its state saved at checkpoint 3; a and b carry on alone meanwhile."""
    kept: dict[str, set[int]] = {w: set() for w in "abc"}
    lost: dict[str, set[int]] = {w: set() for w in "abc"}
    saved = None
    for t in range(10):
        members = ["a", "b", "c"] if t < 4 or t >= 7 else ["a", "b"]
        if t == 3:
            saved = (sim.streams["c"].state_dict(), sim.at["c"], sim.pace["c"])
        if t == 7:  # a new process: the saved position, reached under the members of step 2
            assert saved is not None
            sim.streams["c"] = PackedStream(sim.data, sim.tok)
            sim.streams["c"].load_state_dict(saved[0])
            sim.at["c"], sim.pace["c"] = saved[1], saved[2]
        for w, docs in sim.step(t, members).items():
            (lost if (w == "c" and t == 3) else kept)[w] |= docs
    return kept, lost


def overlaps(kept: dict[str, set[int]]) -> set[int]:
    return (kept["a"] & kept["b"]) | (kept["a"] & kept["c"]) | (kept["b"] & kept["c"])


def test_a_rejoining_worker_and_the_survivors_never_read_the_same_document(corpus, tok) -> None:
    kept, lost = run(Sim(corpus, tok))
    assert all(len(docs) > 100 for docs in kept.values()), {w: len(d) for w, d in kept.items()}
    assert overlaps(kept) == set()
    # c's killed step never committed: the survivors may (and do) read on over its documents
    assert lost["c"] and not lost["c"] <= kept["c"]


def test_without_alignment_the_rejoiner_reads_what_the_survivors_read(corpus, tok) -> None:
    kept, _ = run(Sim(corpus, tok, align=False))
    assert len(overlaps(kept)) > 20


def test_a_liars_far_claim_makes_a_worker_skip_at_most_its_budget(corpus, tok) -> None:
    store = {DATA_AT(0, "a"): position_claim((0, 0, 0), 50).encode(),
             DATA_AT(0, "b"): position_claim((0, 0, 0), 60).encode(),
             DATA_AT(0, "liar"): json.dumps({"at": [5, 0, 999_999], "rows": 10**12}).encode()}
    s = PackedStream(corpus, tok)
    align_to_members(s, store.get, 0, ["a", "b", "liar"], "a", behind=0)
    # (0 + SLACK_STEPS) x the median pace: rows 0..119 passed unread, no further
    assert min(tags(tok, s.next_batch(2))) == first_training_doc(120)
    assert s.position[0] == 0


@pytest.mark.parametrize("raw", [b"", b"[", b"null", b'{"at": [0, 1], "rows": 3}', b'{"at": [0, 1, 2], "rows": -1}',
                                 b'{"at": [0, 1, 1e9], "rows": 3}', b'{"at": [true, 1, 2], "rows": 3}',
                                 b'{"at": [0, 1, 2]}', json.dumps({"at": [0, 0, 1 << 70], "rows": 1}).encode()])
def test_garbled_claims_are_ignored(raw: bytes, corpus, tok) -> None:
    assert read_position_claim(raw) is None
    s = PackedStream(corpus, tok)
    align_to_members(s, {DATA_AT(0, "x"): raw}.get, 0, ["x", "a"], "a", behind=4)
    assert min(tags(tok, s.next_batch(2))) == first_training_doc(0)


def small_corpus(folder: Path, docs: int) -> DataConfig:
    path = folder / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc_text(i)}) + "\n" for i in range(docs)))
    return DataConfig(kind="text", heldout_percent=1, text={"files": [str(path)], "seq_len": 32})


def test_a_rejoiner_reads_its_shard_from_a_claim_whole_epochs_ahead(tmp_path: Path, tok) -> None:
    # a worker away for long rejoins where the survivors stand, several passes over a small corpus
    # later: the epochs it passes unread are no "pass that found no document" for its shard
    data = small_corpus(tmp_path, 40)
    store = {DATA_AT(9, "a"): position_claim((5, 0, 7), 100).encode(),
             DATA_AT(9, "b"): position_claim((0, 0, 0), 0).encode()}
    s = PackedStream(data, tok)
    s.reshard(1, 2)
    align_to_members(s, store.get, 9, ["a", "b"], "b", behind=3)  # (3 + SLACK_STEPS) x 100 rows >= 5 x 40 + 7
    first = int(TAG.findall(tok.decode(s.next_batch(1)["input_ids"].flatten().tolist()))[0])
    name = data.text.files[0]
    assert first == next(i for i in range(7, 40) if shard_of(name, i, 2) == 1 and not is_heldout_text(doc_text(i), 1))
    assert s.position[0] == 5


def test_a_shard_with_no_document_still_fails_after_the_rows_it_passed(tmp_path: Path, tok) -> None:
    data = small_corpus(tmp_path, 1)
    s = PackedStream(data, tok)
    s.reshard(1 - shard_of(data.text.files[0], 0, 2), 2)  # the shard that owns nothing
    s.align((3, 0, 0), 10)
    with pytest.raises(CorpusError, match="found no document"):
        s.next_batch(1)


def test_alignment_without_claims_or_pace_moves_nothing() -> None:
    assert alignment([], behind=3) == ((0, 0, 0), 0)
    assert alignment([((0, 4, 0), 0)], behind=3) == ((0, 4, 0), 0)  # no pace known: no budget
    assert alignment([((0, 4, 0), 0), ((0, 2, 0), 7)], behind=1, pace=10) == ((0, 4, 0), 30)  # its own pace
    with pytest.raises(ValueError):
        alignment([], behind=-1)
