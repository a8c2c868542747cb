"""A small text corpus in every format the reader takes, shared by tests/unit/test_text_data.py and
tests/integration/test_text_data_s3.py, with helpers that read it back."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from intellect.config import DataConfig
from intellect.data.text import PackedStream
from intellect.model.bpe import train_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def doc_text(i: int, length: int = 12) -> str:
    """Document ``i``: a unique tag, then words (so documents differ in length and content)."""
    return f"<d{i:03d}> " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(length + i % 9)) + "\n"


def train_tok():
    """A BPE tokenizer of 400 tokens trained on these documents."""
    return train_bpe([doc_text(i) for i in range(200)] * 3, vocab_size=400)


def data_cfg(files: list[str], **text) -> DataConfig:
    return DataConfig(kind="text", heldout_percent=text.pop("heldout_percent", 10), seed=text.pop("seed", 0),
                      text={"files": files, "seq_len": 16, **text})


def write_mixed(root: Path) -> tuple[Path, list[str]]:
    """A folder with text files, a JSONL file and a Parquet file of three row groups: 60 documents."""
    (root / "txt").mkdir(parents=True)
    texts = [doc_text(i) for i in range(60)]
    for i in range(20):
        (root / "txt" / f"{i:02d}.txt").write_text(texts[i])
    (root / "rows.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[20:40])))
    pq.write_table(pa.table({"id": list(range(20)), "text": texts[40:]}), root / "rows.parquet", row_group_size=7)
    (root / ".hidden.txt").write_text("never read\n")
    (root / "notes.csv").write_text("wrong suffix\n")
    return root, texts


def decode_docs(tok, batches: list[dict[str, torch.Tensor]]) -> list[str]:
    """The whole documents in a run of batches (split at EOS; the unfinished last one dropped)."""
    ids = torch.cat([b["input_ids"].flatten() for b in batches]).tolist()
    docs, cur = [], []
    for t in ids:
        if t == tok.eos_token_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def read_all(stream: PackedStream, n: int = 4) -> list[dict[str, torch.Tensor]]:
    out = []
    try:
        while True:
            out.append(stream.next_batch(n))
    except EOFError:
        return out
