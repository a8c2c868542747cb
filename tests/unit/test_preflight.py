"""Bad pretraining data fails before any process starts, with one line naming the field or the file."""

from __future__ import annotations

import json

import pytest

from intellect.config import DataConfig, ModelConfig
from intellect.preflight import DATA_ERRORS, TokenizerMismatch, check_data
from intellect.data.corpus import CorpusError, CorpusNotFound
from intellect.model.bpe import save_tokenizer, train_bpe
from intellect.model.checkpoint import build_model, save_checkpoint


def text(files, **fields) -> DataConfig:
    return DataConfig.model_validate({"kind": "text", "text": {"files": [str(f) for f in files], **fields}})


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"content": f"def f{i}():\n    return {i}\n"}) + "\n" for i in range(40)))
    return path


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message and isinstance(e.value, DATA_ERRORS)
    return message


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(CorpusNotFound) as e:
        check_data(text([tmp_path / "nope.jsonl"]), ModelConfig())
    assert f"data.text.files entry '{tmp_path / 'nope.jsonl'}': no such file" in one_line(e)


def test_a_folder_without_corpus_files_names_the_suffixes(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(CorpusNotFound) as e:
        check_data(text([tmp_path]), ModelConfig())
    assert "holds no file with suffix" in one_line(e) and "data.text.suffixes" in str(e.value)


def test_a_missing_column_names_the_column_field_and_the_file(corpus):
    with pytest.raises(CorpusError) as e:
        check_data(text([corpus]), ModelConfig())  # rows hold "content", the column is "text"
    msg = one_line(e)
    assert "40 rows without a string 'text' field (data.text.column)" in msg and str(corpus) in msg
    check_data(text([corpus], column="content"), ModelConfig())  # the right column reads


@pytest.mark.parametrize("content, why", [(b"", "no rows"), (b"not json\n{]\n", "2 lines that are not JSON")])
def test_an_empty_or_unparseable_jsonl_corpus_says_why(tmp_path, content, why):
    path = tmp_path / "c.jsonl"
    path.write_bytes(content)
    with pytest.raises(CorpusError) as e:
        check_data(text([path]), ModelConfig())
    assert why in one_line(e)


def test_an_unreadable_parquet_file_is_counted_and_named(tmp_path):
    path = tmp_path / "c.parquet"
    path.write_bytes(b"garbage, not parquet")
    with pytest.raises(CorpusError) as e:
        check_data(text([path]), ModelConfig())
    assert "1 unreadable files" in one_line(e) and str(path) in str(e.value)


def test_a_tokenizer_folder_larger_than_tokenizer_vocab_is_a_mismatch(tmp_path, corpus):
    tok = train_bpe((f"def f{i}(): return {i * 7}" for i in range(300)), 400)
    save_tokenizer(tok, tmp_path / "tok")
    data = text([corpus], column="content")
    check_data(data, ModelConfig(tokenizer=str(tmp_path / "tok"), tokenizer_vocab=len(tok)))
    with pytest.raises(TokenizerMismatch) as e:
        check_data(data, ModelConfig(tokenizer=str(tmp_path / "tok"), tokenizer_vocab=300))
    assert f"holds a tokenizer of {len(tok)} tokens, more than model.tokenizer_vocab = 300" in one_line(e)


def test_a_pretrained_folder_whose_tokenizer_outgrows_its_embedding_is_a_mismatch(tmp_path, corpus):
    model, _ = build_model(ModelConfig(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=2,
                                       intermediate_size=32))
    big = train_bpe((f"def f{i}(): return {i * 7}" for i in range(300)), 400)
    assert len(big) > model.config.vocab_size
    save_checkpoint(model, big, tmp_path / "ckpt")  # a folder someone assembled from two sources
    with pytest.raises(TokenizerMismatch) as e:
        check_data(text([corpus], column="content"), ModelConfig(pretrained=str(tmp_path / "ckpt")))
    assert f"its tokenizer has {len(big)} tokens but its model's vocab_size is {model.config.vocab_size}" in one_line(e)
