"""Preflight: fail fast on pretraining data that cannot work, before any process starts, in one line.

:func:`check_data` is what ``intellect smoke`` and ``intellect diloco`` run right after the config
parses: for a text corpus it resolves every ``data.text.files`` entry and reads the first training
document (so a missing file, a wrong ``data.text.column``, an empty or unreadable corpus are named
now, not as a traceback from a worker an hour in), and it checks the tokenizer the run will use
against the model. Every failure is a :data:`DATA_ERRORS` exception whose message is one line
naming the field or the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from intellect.config import DataConfig, ModelConfig
from intellect.data.corpus import Corpus, CorpusError, CorpusReader, Cursor, new_stats
from intellect.model.tokenizer import load_tokenizer


class TokenizerMismatch(ValueError):
    """A tokenizer that does not fit the model or the configuration it is used with."""


DATA_ERRORS = (CorpusError, TokenizerMismatch)


def check_corpus(data: DataConfig) -> dict[str, int]:
    """Resolve the corpus and read its first training document; the reader's counts so far.

    Raises :class:`~intellect.data.corpus.CorpusNotFound` for an entry that names nothing, and
    :class:`~intellect.data.corpus.CorpusError` when a whole pass finds no document (the message
    says why: rows without the text column, lines that are not JSON, unreadable files, ...)."""
    corpus = Corpus(data.text)
    stats = new_stats()
    reader = CorpusReader(corpus, lambda epoch: f"check:{epoch}")
    next(iter(reader.stream(Cursor(), lambda _ref, _at: True, None, epochs=1, stats=stats)), None)
    return stats


def _vocab_size(folder: Path) -> int | None:
    try:
        value = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_tokenizer(model: ModelConfig, text: bool) -> None:
    """The tokenizer a run would use fits: a ``model.pretrained`` folder's has no more tokens than its
    ``vocab_size`` (token ids past the embedding would index out of range), an existing
    ``model.tokenizer`` folder has no more than ``model.tokenizer_vocab`` (it was trained with other
    settings), and a text run's has an EOS token (packing puts one between documents)."""
    if model.pretrained:
        folder, field = Path(model.pretrained), "model.pretrained"
    elif model.tokenizer and Path(model.tokenizer).is_dir() and any(Path(model.tokenizer).iterdir()):
        folder, field = Path(model.tokenizer), "model.tokenizer"
    else:
        return  # the built-in tokenizer, or one the run trains on its corpus first
    try:
        tok = load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise TokenizerMismatch(f"{field} {str(folder)!r}: no loadable tokenizer ({str(e).splitlines()[0]})") from None
    if model.pretrained:
        vocab = _vocab_size(folder)
        if vocab is not None and len(tok) > vocab:
            raise TokenizerMismatch(f"{field} {str(folder)!r}: its tokenizer has {len(tok)} tokens but its model's "
                                    f"vocab_size is {vocab}")
    elif len(tok) > model.tokenizer_vocab:
        raise TokenizerMismatch(f"{field} {str(folder)!r} holds a tokenizer of {len(tok)} tokens, more than "
                                f"model.tokenizer_vocab = {model.tokenizer_vocab}: point model.tokenizer at a new "
                                "folder to train one, or set tokenizer_vocab")
    if text and not isinstance(getattr(tok, "eos_token_id", None), int):
        raise TokenizerMismatch(f"{field} {str(folder)!r}: the tokenizer has no EOS token, which packing a text "
                                "corpus needs between documents")


def check_data(data: DataConfig, model: ModelConfig) -> None:
    """:func:`check_corpus` for a text run, then :func:`check_tokenizer`."""
    if data.kind == "text":
        check_corpus(data)
    check_tokenizer(model, data.kind == "text")


__all__ = ["DATA_ERRORS", "TokenizerMismatch", "check_corpus", "check_data", "check_tokenizer"]
