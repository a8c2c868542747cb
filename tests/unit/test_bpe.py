"""The byte-level BPE tokenizer: training, the HF folder round trip, no pad token, ensure_tokenizer and
the ``intellect tokenizer train`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flows.cli import main as cli_main
from intellect.config import DataConfig
from intellect.data.text import PackedStream, is_heldout_text
from intellect.model.bpe import (BOS_TOKEN, EOS_TOKEN, MIN_VOCAB, corpus_texts, ensure_tokenizer, save_tokenizer,
                                 train_bpe)

CODE = [f"def f{i}(x, y):\n    return x * {i} + y  # number {i}\n" for i in range(300)]
ODD = ["naïve café — 東京 🙂 \x00\t\r\n", "   leading spaces", "1234567890", ""]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(CODE, vocab_size=400)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i, text in enumerate(CODE[:120]):
        (root / f"m{i:03d}.py").write_text(text)
    return root


def test_specials_and_no_pad_token(tok) -> None:
    assert tok.pad_token is None and tok.pad_token_id is None
    assert (tok.bos_token, tok.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert len(tok) == 400 and tok.bos_token_id != tok.eos_token_id
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # BOS with special tokens, nothing without
    assert tok.bos_token_id not in tok("x", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", CODE[:3] + ODD)
def test_any_text_round_trips_through_bytes(tok, text: str) -> None:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) <= len(text.encode())


def test_merges_compress_the_training_text(tok) -> None:
    text = CODE[7]
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < len(text.encode()) / 2


def test_saved_folder_loads_with_auto_tokenizer(tok, tmp_path: Path) -> None:
    folder = save_tokenizer(tok, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert loaded.pad_token is None and len(loaded) == len(tok)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    for text in CODE[:5] + ODD:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(FileExistsError):
        save_tokenizer(tok, folder)


def test_vocab_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match=str(MIN_VOCAB)):
        train_bpe(CODE, vocab_size=MIN_VOCAB - 1)


def test_corpus_texts_are_train_documents_capped(corpus: Path) -> None:
    data = DataConfig(kind="text", heldout_percent=20, text={"files": [str(corpus)]})
    counts: dict[str, int] = {}
    texts = list(corpus_texts(data, counts=counts))
    assert texts and not any(is_heldout_text(t, 20) for t in texts)
    assert counts == {"documents": len(texts), "chars": sum(map(len, texts))}
    capped = list(corpus_texts(data, max_chars=100))
    assert sum(map(len, capped)) == 100 and capped[:-1] == texts[:len(capped) - 1]
    assert len(list(corpus_texts(data, max_documents=5))) == 5


def test_ensure_tokenizer_trains_once_then_loads(corpus: Path, tmp_path: Path) -> None:
    data = DataConfig(kind="text", text={"files": [str(corpus)], "seq_len": 32})
    folder = tmp_path / "tokenizers" / "t"
    tok = ensure_tokenizer(folder, data, vocab_size=350)
    assert (folder / "tokenizer.json").is_file() and tok.pad_token is None and len(tok) == 350
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    again = ensure_tokenizer(folder, data, vocab_size=999)  # the folder wins over the asked size
    assert len(again) == 350 and (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    batch = PackedStream(data, again).next_batch(4)  # a tokenizer without a pad token packs
    assert batch["input_ids"].shape == (4, 32)


def _write_config(tmp_path: Path, corpus: Path, diloco: bool = False) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(
        f'run_name = "t"\n[model]\ntokenizer = "{tmp_path / "from-config"}"\ntokenizer_vocab = 320\n'
        f'[data]\nkind = "text"\n[data.text]\nfiles = ["{corpus}"]\n' + ("[diloco]\nworkers = 2\n" if diloco else ""))
    return config


def test_cli_trains_into_the_config_folder_or_out(corpus: Path, tmp_path: Path, capsys) -> None:
    config = _write_config(tmp_path, corpus)
    assert cli_main(["tokenizer", "train", "--config", str(config)]) == 0
    assert "320 tokens" in capsys.readouterr().out
    assert len(AutoTokenizer.from_pretrained(tmp_path / "from-config", local_files_only=True)) == 320
    assert cli_main(["tokenizer", "train", "--config", str(config)]) == 1  # exists: not replaced silently
    assert "--force" in capsys.readouterr().err
    out = tmp_path / "out"
    diloco = _write_config(tmp_path, corpus, diloco=True)  # a DiLoCo run config works as well
    assert cli_main(["tokenizer", "train", "--config", str(diloco), "--out", str(out), "--vocab-size", "300",
                     "data.heldout_percent=10"]) == 0
    assert "300 tokens" in capsys.readouterr().out and (out / "tokenizer.json").is_file()
    assert cli_main(["tokenizer", "train", "--config", str(diloco), "--out", str(out), "--force",
                     "--vocab-size", "290"]) == 0
    assert len(AutoTokenizer.from_pretrained(out, local_files_only=True)) == 290


def test_cli_reports_bad_configs(corpus: Path, tmp_path: Path, capsys) -> None:
    config = _write_config(tmp_path, corpus)
    assert cli_main(["tokenizer", "train", "--config", str(config), "data.heldout_percent=99"]) == 2
    assert "heldout_percent" in capsys.readouterr().err
    assert cli_main(["tokenizer", "train", "--out", str(tmp_path / "x")]) == 2
    assert "data.text.files" in capsys.readouterr().err
    assert cli_main(["tokenizer", "train", "--config", str(config), "--vocab-size", "10"]) == 2
    assert str(MIN_VOCAB) in capsys.readouterr().err
    assert cli_main(["tokenizer", "train", "--config", str(config), f"data.text.files=['{tmp_path}/none']"]) == 2
