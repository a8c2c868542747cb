"""The text corpus: reading (files, dirs, globs, JSONL, Parquet, S3, the stdlib), the held-out split,
sharding, packing, the document mask on a real Llama, and exact resumption."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from text_corpus import data_cfg, decode_docs, doc_text, read_all, train_tok, write_mixed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from intellect.data.corpus import STDLIB, Corpus, CorpusReader, Cursor, cut_utf8, stdlib_files
from intellect.data.text import PackedStream, heldout_batches, is_heldout_text, shard_of
from intellect.model.bpe import train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_tok()


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, list[str]]:
    return write_mixed(tmp_path / "corpus")


# --------------------------------------------------------------------- reading


def test_dir_glob_and_file_entries_resolve_sorted_and_filtered(mixed) -> None:
    root, _ = mixed
    names = [r.name for r in Corpus(data_cfg([str(root)]).text).files]
    assert names == sorted(names) and len(names) == 22
    assert not any(".hidden" in n or n.endswith(".csv") for n in names)
    globbed = Corpus(data_cfg([str(root / "txt" / "0*.txt"), str(root / "rows.jsonl")]).text).files
    assert [Path(r.name).name for r in globbed] == [f"0{i}.txt" for i in range(10)] + ["rows.jsonl"]
    with pytest.raises(FileNotFoundError, match="no such file"):
        Corpus(data_cfg([str(root / "missing")]).text)
    with pytest.raises(FileNotFoundError, match="holds no file"):
        Corpus(data_cfg([str(root / "*.nothing")]).text)


def test_every_format_is_read_whole_and_in_order(mixed) -> None:
    root, texts = mixed
    corpus = Corpus(data_cfg([str(root)]).text)
    reader = CorpusReader(corpus, lambda e: "fixed")
    stats: dict[str, int] = {}
    docs = list(reader.stream(Cursor(), lambda r, c: True, epochs=1, stats=stats))
    assert sorted(d[2] for d in docs) == sorted(texts)
    assert stats["documents"] == 60 and stats["row_groups"] == 3  # 20 Parquet rows in groups of 7
    for at, after, _ in docs:
        assert after > at  # each document's cursor after it is past its cursor


def test_parquet_is_read_by_row_group_from_any_row(mixed) -> None:
    root, texts = mixed
    corpus = Corpus(data_cfg([str(root / "rows.parquet")]).text)
    reader = CorpusReader(corpus, lambda e: "fixed")
    stats: dict[str, int] = {}
    docs = list(reader.stream(Cursor(0, 0, 15, 0), lambda r, c: True, epochs=1, stats=stats))
    assert [d[2] for d in docs] == texts[55:] and stats["row_groups"] == 1  # rows 14-19: only the last group
    stats = {}
    odd = list(reader.stream(Cursor(), lambda r, c: c.row in (1, 2), epochs=1, stats=stats))
    assert [d[2] for d in odd] == texts[41:43] and stats["row_groups"] == 1  # groups with no wanted row unread


def test_bad_parquet_files_are_skipped_and_counted(tmp_path: Path, mixed) -> None:
    root, _ = mixed
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "other.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 10)
    files = [str(tmp_path / n) for n in ("ints.parquet", "other.parquet", "junk.parquet")] + [str(root / "rows.parquet")]
    reader = CorpusReader(Corpus(data_cfg(files).text), lambda e: "fixed")
    stats: dict[str, int] = {}
    assert len(list(reader.stream(Cursor(), lambda r, c: True, epochs=1, stats=stats))) == 20
    assert stats["bad_files"] == 3


def test_oversize_and_bad_jsonl_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    limit = 1024
    lines = [json.dumps({"text": "first"}), json.dumps({"text": "x" * 5000}), "{not json", json.dumps({"text": 5}),
             json.dumps(["text"]), "", json.dumps({"text": "y" * 1000}), json.dumps({"text": "last"})]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(("\n".join(lines)).encode() + b"\n\xff\xfe\n")
    reader = CorpusReader(Corpus(data_cfg([str(path)], max_document_bytes=limit).text), lambda e: "fixed")
    stats: dict[str, int] = {}
    docs = list(reader.stream(Cursor(), lambda r, c: True, epochs=1, stats=stats))
    assert [d[2] for d in docs] == ["first", "y" * 1000, "last"]
    assert [d[0].row for d in docs] == [0, 6, 7]  # rows are line numbers, blank and skipped lines included
    assert (stats["oversize_lines"], stats["bad_json"], stats["bad_rows"]) == (1, 2, 2)
    # resuming at a document's cursor reads from its byte offset on
    again = list(reader.stream(docs[1][0], lambda r, c: True, epochs=1))
    assert [d[2] for d in again] == ["y" * 1000, "last"]


def test_documents_are_cut_at_max_document_bytes(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("é" * 3000)  # 6000 bytes
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "ü" * 400}, ensure_ascii=False) + "\n")  # 800 bytes, a 810-byte line
    reader = CorpusReader(Corpus(data_cfg([str(tmp_path)], max_document_bytes=1025).text), lambda e: "fixed")
    docs = sorted((d[2] for d in reader.stream(Cursor(), lambda r, c: True, epochs=1)), key=len)
    assert docs == ["ü" * 400, "é" * 512]  # 1025 bytes: the half character at the end dropped
    assert cut_utf8("ab€".encode(), 4) == "ab"


def test_stdlib_corpus_is_the_standard_library_sources() -> None:
    files = stdlib_files()
    names = [f.name for f in files]
    assert names == sorted(names) and len(files) > 500
    assert all(n.startswith(STDLIB + "/") and n.endswith(".py") for n in names)
    assert f"{STDLIB}/json/decoder.py" in names
    assert not any("site-packages" in n or "__pycache__" in n or "/encodings/" in n for n in names)
    assert all(f.location.startswith(sysconfig.get_paths()["stdlib"]) for f in files)


# --------------------------------------------------------------------- splits, shards, packing


def test_heldout_split_is_by_content_and_disjoint_from_training(mixed, tok) -> None:
    root, texts = mixed
    data = data_cfg([str(root)], heldout_percent=20, eval_sequences=6)
    held_texts = {t for t in texts if is_heldout_text(t, 20)}
    assert 0 < len(held_texts) < len(texts)
    train = decode_docs(tok, read_all(PackedStream(data, tok, epochs=2)))
    assert set(train) == set(texts) - held_texts
    held = heldout_batches(data, tok, batch_size=4)
    assert [b["input_ids"].shape[0] for b in held] == [4, 2]
    assert set(decode_docs(tok, held)) <= held_texts
    again = heldout_batches(data, tok, batch_size=4)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(held, again) for k in a)
    # the split does not move with the seed
    reseeded = heldout_batches(data.model_copy(update={"seed": 7}), tok, batch_size=4)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(held, reseeded))


def test_heldout_batches_stop_at_one_pass_and_fail_clearly_when_empty(mixed, tok) -> None:
    root, texts = mixed
    data = data_cfg([str(root)], heldout_percent=20, eval_sequences=10000)
    held = heldout_batches(data, tok, batch_size=8)
    tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts if is_heldout_text(t, 20))
    assert sum(b["input_ids"].shape[0] for b in held) == tokens // 16  # every whole sequence, none twice
    one = data_cfg([str(root / "txt" / "00.txt")], heldout_percent=1)
    assert not is_heldout_text(texts[0], 1)
    with pytest.raises(ValueError, match="found no document"):
        heldout_batches(one, tok)


def test_shards_are_disjoint_and_cover_the_train_split(mixed, tok) -> None:
    root, texts = mixed
    data = data_cfg([str(root)])
    train = {t for t in texts if not is_heldout_text(t, 10)}
    seen = [set(decode_docs(tok, read_all(PackedStream(data, tok, shard=i, shards=3, epochs=2)))) for i in range(3)]
    assert all(seen) and not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert seen[0] | seen[1] | seen[2] == train


def test_epochs_permute_the_file_order_by_seed(mixed, tok) -> None:
    root, texts = mixed
    data = data_cfg([str(root / "txt")], heldout_percent=1)
    train = [t for t in texts[:20] if not is_heldout_text(t, 1)]
    docs = decode_docs(tok, read_all(PackedStream(data, tok, epochs=2), n=1))
    first, second = docs[:len(train)], docs[len(train):]
    assert sorted(first) == sorted(train) and len(second) >= len(train) - 1
    assert first[:len(train) - 1] != second[:len(train) - 1]  # epoch 1 reads the files in another order
    other_seed = decode_docs(tok, read_all(PackedStream(data.model_copy(update={"seed": 1}), tok, epochs=1)))
    assert other_seed != first[:len(other_seed)]


def test_packed_batches_have_no_pad_and_fixed_shape(mixed, tok) -> None:
    root, _ = mixed
    assert tok.pad_token is None
    stream = PackedStream(data_cfg([str(root)]), tok)
    batch = stream.next_batch(5)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (5, 16) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(5, 16))
    ids = torch.cat([stream.next_batch(8)["input_ids"] for _ in range(20)])
    assert (ids == tok.eos_token_id).sum() > 10 and (ids >= 0).all() and (ids < len(tok)).all()
    from intellect.model.tokenizer import build_tokenizer  # noqa: PLC0415 - a tokenizer that has a pad token

    char = build_tokenizer()
    pad, eos = char.pad_token_id, char.eos_token_id
    assert isinstance(pad, int) and isinstance(eos, int)
    ids = PackedStream(data_cfg([str(root)]), char).next_batch(32)["input_ids"]
    assert not ids.eq(pad).any() and ids.eq(eos).any()


def test_document_mask_positions_and_shape(mixed, tok) -> None:
    root, _ = mixed
    batch = PackedStream(data_cfg([str(root)], document_mask=True), tok).next_batch(3)
    mask, pos, ids = batch["attention_mask"], batch["position_ids"], batch["input_ids"]
    assert mask.shape == (3, 1, 16, 16) and mask.dtype == torch.bool
    for row in range(3):
        after_eos = torch.cat([torch.tensor([True]), ids[row, :-1] == tok.eos_token_id])
        assert torch.equal(pos[row] == 0, after_eos)  # a document starts after each EOS (and at 0)
        doc = after_eos.cumsum(0)
        want = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
        assert torch.equal(mask[row, 0], want)


def test_document_mask_isolates_documents_in_a_real_llama(tmp_path: Path, tok) -> None:
    texts = [doc_text(i, length=4 + 3 * i) for i in range(6)]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    data = data_cfg([str(tmp_path)], heldout_percent=1, seq_len=96, document_mask=True)
    batch = PackedStream(data, tok).next_batch(1)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    assert model.config._attn_implementation == "sdpa"  # a bool mask needs sdpa (eager would add it)
    with torch.no_grad():
        packed = model(**batch)
        unmasked = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    whole = [(a, b) for a, b in zip(starts, starts[1:]) if ids[b - 1] == tok.eos_token_id]
    assert len(whole) >= 3
    ce = torch.nn.functional.cross_entropy
    for a, b in whole:
        with torch.no_grad():
            alone = model(input_ids=ids[None, a:b], labels=ids[None, a:b])
        inside = ce(packed.logits[0, a:b - 1].float(), ids[a + 1:b])
        assert abs(inside.item() - alone.loss.item()) < 1e-5
        assert torch.allclose(packed.logits[0, a:b], alone.logits[0], atol=1e-5)
        if a > 0:  # without the mask a later document sees the ones before it
            assert not torch.allclose(unmasked[0, a:b], alone.logits[0], atol=1e-3)
    assert packed.loss is not None and torch.isfinite(packed.loss)


# --------------------------------------------------------------------- state


@pytest.mark.parametrize("document_mask", [False, True])
def test_exact_resume_across_epochs(mixed, tok, document_mask: bool) -> None:
    root, _ = mixed
    data = data_cfg([str(root)], document_mask=document_mask)
    for k in (0, 1, 7, 23):  # 23 batches of 3 cross an epoch boundary
        stream = PackedStream(data, tok, shard=1, shards=2)
        for _ in range(k):
            stream.next_batch(3)
        state = json.loads(json.dumps(stream.state_dict()))
        expected = [stream.next_batch(3) for _ in range(6)]
        fresh = PackedStream(data, tok, shard=1, shards=2)
        fresh.load_state_dict(state)
        got = [fresh.next_batch(3) for _ in range(6)]
        for e, g in zip(expected, got):
            assert e.keys() == g.keys() and all(torch.equal(e[key], g[key]) for key in e)
        assert fresh.state_dict()["cursor"] == stream.state_dict()["cursor"]
    assert stream.epoch >= 1


def test_state_of_another_corpus_is_refused(mixed, tok) -> None:
    root, _ = mixed
    stream = PackedStream(data_cfg([str(root)]), tok)
    stream.next_batch(2)
    state = stream.state_dict()
    for other in (data_cfg([str(root / "txt")]), data_cfg([str(root)], seed=3), data_cfg([str(root)], heldout_percent=5)):
        with pytest.raises(ValueError, match="another corpus"):
            PackedStream(other, tok).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        PackedStream(data_cfg([str(root)]), tok).load_state_dict({"version": 0})


def test_reshard_keeps_the_position_and_reads_only_the_new_shard(mixed, tok) -> None:
    root, texts = mixed
    folder = root / "txt"  # one document per file: a document's key is (its file name, row 0)
    data = data_cfg([str(folder)], heldout_percent=1)
    name_of = {t: str(folder / f"{i:02d}.txt") for i, t in enumerate(texts[:20])}
    stream = PackedStream(data, tok, shard=0, shards=2)
    before = decode_docs(tok, [stream.next_batch(2) for _ in range(3)])
    assert all(shard_of(name_of[t], 0, 2) == 0 for t in before)
    state = stream.state_dict()
    stream.reshard(2, 3)
    assert stream.state_dict()["cursor"] == state["cursor"]
    after = decode_docs(tok, [stream.next_batch(2) for _ in range(12)])
    buffered = len(state["pending"])  # read before the reshard: they finish first
    if state["drop"]:  # the first one was cut by a batch end: its rest is no whole document
        after, buffered = after[1:], buffered - 1
    assert all(shard_of(name_of[t], 0, 2) == 0 for t in after[:buffered])
    assert after[buffered:] and all(shard_of(name_of[t], 0, 3) == 2 for t in after[buffered:])
    with pytest.raises(ValueError, match="shard"):
        stream.reshard(3, 3)


def test_tokenizer_without_eos_is_refused(mixed) -> None:
    root, _ = mixed
    no_eos = train_bpe(["abc"] * 10, vocab_size=300)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="EOS"):
        PackedStream(data_cfg([str(root)]), no_eos)
