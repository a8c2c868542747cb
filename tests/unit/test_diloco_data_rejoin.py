"""A DiLoCo worker that dies between committing a step and the next boundary, then rejoins from its saved
state: neither it nor the survivor reads a document the other read.

Two workers read one corpus of one-sequence documents (so a sequence names its document) through real
:class:`PackedStream` s, claiming their positions as the DiLoCo worker does (``publish_position`` as the
inner phase ends and at the boundary, ``align_to_members`` over the step's and the previous members). The
one further ahead after step 1 dies before it arrives at step 2, so it never claims at that boundary, and
the one behind reads every shard alone from its own position. Without the claim made as the inner phase
ends, the survivor reads over the documents the dead worker read, trained on or buffered (and trained on
when it comes back from its saved state): the control case shows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from intellect.config import DataConfig
from intellect.data.text import PackedStream, is_heldout_text
from intellect.diloco.data import align_to_members, position_claim, publish_position
from intellect.diloco.protocol import DATA_AT
from intellect.model.tokenizer import build_tokenizer

SEQ, BATCH, BATCHES = 32, 4, 10
WORDS = "the cat dog sat ran on mat log and a big red box of six".split()


def doc_text(i: int) -> str:
    text = f"doc {i:05d}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(8))
    return text[:SEQ - 1].ljust(SEQ - 1, ".")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def corpus(tmp_path: Path) -> DataConfig:
    """Distinct documents of SEQ - 1 characters (one token each) and EOS: one packed sequence apiece."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": doc_text(i)}) + "\n" for i in range(4000)))
    return DataConfig(kind="text", heldout_percent=20, text={"files": [str(tmp_path / "docs.jsonl")], "seq_len": SEQ})


class Worker:
    """What :class:`~intellect.diloco.worker.DilocoWorker` keeps for its data: the stream, the boundary
    and members its position is current at (``data_at``), its pace."""

    def __init__(self, name: str, stream: PackedStream, at: tuple[int, list[str]] = (0, []), pace: int = 0):
        self.name, self.stream, self.at, self.pace = name, stream, at, pace

    def saved(self) -> tuple[dict, tuple[int, list[str]], int]:
        return self.stream.state_dict(), self.at, self.pace


class Run:
    def __init__(self, data: DataConfig, tok, early_claims: bool) -> None:
        self.data, self.tok, self.early = data, tok, early_claims
        self.store: dict[str, bytes] = {}
        self.read: dict[str, set[str]] = {}

    def put(self, key: str, value: str) -> None:
        self.store[key] = value.encode()

    def step(self, t: int, workers: list[Worker]) -> None:
        """Outer step ``t`` of ``workers`` (all of them commit it): the boundary, then the inner phase."""
        members = [w.name for w in workers]
        for w in workers:  # every member claims before it arrives
            publish_position(self.put, t, w.name, w.stream, w.pace)
        for i, w in enumerate(workers):
            w.stream.reshard(i, len(members))
            if w.at != (t, members):
                align_to_members(w.stream, self.store.get, t, members, w.name, max(0, t - w.at[0]), w.pace,
                                 w.at[1] if self.early else ())
            rows = w.stream.passed
            for _ in range(BATCHES):
                batch = w.stream.next_batch(BATCH)["input_ids"]
                self.read.setdefault(w.name, set()).update(self.tok.decode(r.tolist()) for r in batch)
            w.pace, w.at = w.stream.passed - rows, (t + 1, members)
            if self.early:
                publish_position(self.put, t + 1, w.name, w.stream, w.pace)


def run(data: DataConfig, tok, early_claims: bool = True) -> tuple[dict[str, set[str]], int]:
    """Steps 0-1 with both workers; the one ahead dies and is away for steps 2-4; back from its state saved
    for checkpoint 2 for steps 5-7. The documents each read, and how far apart they stood after step 1."""
    r = Run(data, tok, early_claims)
    a, b = Worker("a", PackedStream(data, tok)), Worker("b", PackedStream(data, tok))
    for t in (0, 1):
        r.step(t, [a, b])
    ahead, survivor = (a, b) if a.stream.position > b.stream.position else (b, a)
    gap = ahead.stream.position[2] - survivor.stream.position[2]  # rows of the one file
    state, at, pace = ahead.saved()  # checkpoint 2's worker state, saved before step 1's all-reduce
    for t in (2, 3, 4):
        r.step(t, [survivor])
    stream = PackedStream(data, tok)  # a new process
    stream.load_state_dict(state)
    back = Worker(ahead.name, stream, at, pace)
    for t in (5, 6, 7):
        r.step(t, sorted([survivor, back], key=lambda w: w.name))
    return r.read, gap


def test_a_worker_that_dies_before_the_boundary_and_rejoins_reads_nothing_the_survivor_read(corpus, tok) -> None:
    read, gap = run(corpus, tok)
    assert gap > 0  # the survivor stood behind the worker that died
    assert all(len(docs) >= 5 * BATCH * BATCHES for docs in read.values()), {w: len(d) for w, d in read.items()}
    assert read["a"].isdisjoint(read["b"]), sorted(read["a"] & read["b"])


def test_without_the_claim_made_as_the_inner_phase_ends_the_survivor_reads_over_the_dead_workers_documents(
        corpus, tok) -> None:
    read, gap = run(corpus, tok, early_claims=False)
    # at least the last document the dead worker read before it died: it stood past it, the survivor before
    assert read["a"] & read["b"], gap


def test_a_departed_liars_far_claim_makes_a_survivor_skip_at_most_its_budget(corpus, tok) -> None:
    # a worker that left claims, for the boundary the survivor realigns at, a position epochs ahead at a
    # huge pace: the lower median of the claimed paces is the survivor's own, so it passes
    # (0 steps behind + SLACK_STEPS) x 50 rows unread and reads on from row 100, in the same epoch
    store = {DATA_AT(2, "a"): position_claim((0, 0, 0), 50).encode(),
             DATA_AT(2, "liar"): position_claim((7, 0, 3999), 10**12).encode()}
    s = PackedStream(corpus, tok)
    align_to_members(s, store.get, 2, ["a"], "a", behind=0, pace=50, previous=["a", "liar"])
    first = tok.decode(s.next_batch(1)["input_ids"][0].tolist(), skip_special_tokens=True)
    assert first == doc_text(next(i for i in range(100, 4000) if not is_heldout_text(doc_text(i), 20)))
    assert s.position[0] == 0
