"""A byte-level BPE tokenizer trained on the run's own corpus, saved as an HF tokenizer folder.

Llama-3 style: GPT-4's pre-tokenizer split (words, 1-3 digit groups, punctuation runs, whitespace) over
byte-level pieces, so any text encodes without an unknown token; ``BOS_TOKEN`` opens an encoding made with
special tokens, ``EOS_TOKEN`` ends documents, and there is **no pad token** (packed training never pads;
whoever needs padding brings their own). The folder loads with
``AutoTokenizer.from_pretrained(path, local_files_only=True)``::

    >>> tok = train_bpe(["def add(a, b):\\n    return a + b\\n"] * 50, vocab_size=300)
    >>> tok.pad_token is None, tok.eos_token, tok.decode(tok("return a + b")["input_ids"])
    (True, '<|endoftext|>', '<|begin_of_text|>return a + b')

``intellect tokenizer train --config RUN.toml`` (:func:`main`) trains one from a run config's ``[data]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from intellect.config import ConfigError, DataConfig, SmokeConfig, load_config
from intellect.data.arithmetic import document_pairs
from intellect.data.corpus import Corpus
from intellect.data.text import iter_documents
from intellect.model.checkpoint import make_tokenizer_portable
from intellect.model.tokenizer import load_tokenizer
from intellect.progress import Progress, to_stderr

BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|endoftext|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, then the specials
# ChatML turns (as Qwen2.5's instruct models): a chat tokenizer ends each turn, and so each completion,
# with TURN_END, which is its EOS; the template writes BOS itself, since rendered chats are tokenized
# without special tokens.
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (TURN_START, TURN_END)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}" + TURN_START + "{{ m['role'] }}\n{{ m['content'] }}" + TURN_END
    + "\n{% endfor %}{% if add_generation_prompt %}" + TURN_START + "assistant\n{% endif %}"
)
# GPT-4's split (as in Llama 3): contractions, letters with one leading non-letter, 1-3 digits,
# punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,DIGITS}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Characters of corpus text a tokenizer is trained on at most. BPE merges follow the most frequent pairs,
# which a few million characters of one corpus already rank stably, while training time grows with the
# text: on the standard library's source, 8M characters (about a third of it) give held-out text within
# 2% of the compression of training on all of it, in a fifth of the time.
TRAIN_CHARS = 8_000_000
ARITHMETIC_DOCUMENTS = 20_000


def train_bpe(texts: Iterable[str], vocab_size: int, chat: bool = False, digits: int = 3) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of (at most) ``vocab_size`` tokens learned from ``texts``, numbers cut
    into groups of at most ``digits`` digits before merging (3 as Llama 3; 1 as Qwen2.5, which keeps
    arithmetic digit by digit). With ``chat``, it also has the ChatML turn tokens,
    :data:`CHAT_TEMPLATE`, ``TURN_END`` as its EOS and ``EOS_TOKEN`` as its pad."""
    if not 1 <= digits <= 3:
        raise ValueError(f"digits must be 1, 2 or 3, got {digits}")
    specials = SPECIAL_TOKENS + (CHAT_TOKENS if chat else ())
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be >= {256 + len(specials)} (256 bytes + {len(specials)} specials), "
                         f"got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN.replace("DIGITS", str(digits))), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(texts, trainer=trainer)
    bos = core.token_to_id(BOS_TOKEN)
    core.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
                                                        special_tokens=[(BOS_TOKEN, bos)])
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                       model_max_length=1 << 30)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS_TOKEN, eos_token=TURN_END,
                                  pad_token=EOS_TOKEN, model_max_length=1 << 30)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def chat_texts(pairs: Iterable[tuple[str, str]]) -> Iterator[str]:
    """Each ``(prompt, answer)`` as the one-turn chat :data:`CHAT_TEMPLATE` writes (what a chat
    tokenizer's corpus holds, rendered before the tokenizer exists).

    >>> next(chat_texts([("1+2=", "3")]))
    '<|begin_of_text|><|im_start|>user\\n1+2=<|im_end|>\\n<|im_start|>assistant\\n3<|im_end|>\\n'
    """
    for prompt, answer in pairs:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        yield render_jinja_template([chat], chat_template=CHAT_TEMPLATE, bos_token=BOS_TOKEN)[0][0]


def save_tokenizer(tok: PreTrainedTokenizerFast, folder: str | os.PathLike) -> Path:
    """Write ``tok`` as an HF folder: assembled in a sibling temp folder, then renamed into place, so a
    reader sees no folder or a whole one. An existing non-empty ``folder`` is left as it is
    (``FileExistsError``)."""
    path = Path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        tok.save_pretrained(tmp)
        make_tokenizer_portable(tmp)
        try:
            os.rename(tmp, path)  # replaces an empty folder, never a full one
        except OSError as e:
            raise FileExistsError(f"tokenizer folder {str(path)!r} already exists") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def corpus_texts(data: DataConfig, max_documents: int | None = None, max_chars: int = TRAIN_CHARS,
                 counts: dict[str, int] | None = None) -> Iterator[str]:
    """Train-split documents in a fixed order until ``max_chars`` characters (the last one cut there):
    the text corpus's, or the first ``max_documents`` (default :data:`ARITHMETIC_DOCUMENTS`) arithmetic
    documents; ``counts`` gets ``documents`` and ``chars``."""
    counts = {} if counts is None else counts
    counts.update(documents=0, chars=0)
    if data.kind == "text":
        texts = iter_documents(data, split="train", max_documents=max_documents)
    else:  # the arithmetic stream is endless: a sample of it ranks its few merges stably
        pairs = itertools.islice(document_pairs(data), max_documents or ARITHMETIC_DOCUMENTS)
        texts = chat_texts(pairs) if data.chat else (prompt + answer for prompt, answer in pairs)
    for text in texts:
        text = text[: max_chars - counts["chars"]]
        counts["documents"] += 1
        counts["chars"] += len(text)
        yield text
        if counts["chars"] >= max_chars:
            return


def _reported(texts: Iterator[str], counts: dict[str, int], bar: Progress) -> Iterator[str]:
    """``texts`` as they are, each counted on ``bar``; once they are all read, the merges are computed."""
    for text in texts:
        yield text
        bar.update(advance=1, characters=counts["chars"])
    bar.waiting("computing the merges")


def _is_tokenizer_folder(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def ensure_tokenizer(path: str | os.PathLike, data: DataConfig, vocab_size: int,
                     max_documents: int | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer saved at ``path``; if there is none yet, one trained on the train split of ``data``'s
    corpus or arithmetic documents (at most ``max_documents`` documents and :data:`TRAIN_CHARS`
    characters), a chat tokenizer with ``data.chat``, saved there first.
    Processes racing to create it each train one; the first to rename wins and all load that one."""
    folder = Path(path)
    if not _is_tokenizer_folder(folder):
        counts: dict[str, int] = {}
        start = time.perf_counter()
        source = (f"{len(Corpus(data.text).files):,} files of data.text.files" if data.kind == "text"
                  else f"{max_documents or ARITHMETIC_DOCUMENTS:,} arithmetic documents")
        bar = Progress("BPE tokenizer", unit="document", heartbeat=True)
        bar.begin(f"training a {vocab_size}-token BPE tokenizer on {source} (at most {TRAIN_CHARS:,} "
                  f"characters) for {folder}")
        with bar:
            tok = train_bpe(_reported(corpus_texts(data, max_documents, counts=counts), counts, bar), vocab_size,
                            chat=data.chat, digits=1 if data.kind == "arithmetic" else 3)
            bar.close(f"{len(tok)} tokens learned from {counts['documents']:,} documents "
                      f"({counts['chars']:,} characters) in {time.perf_counter() - start:.1f}s")
        try:
            save_tokenizer(tok, folder)
        except FileExistsError:
            if not _is_tokenizer_folder(folder):
                raise
    loaded = load_tokenizer(folder)
    if not isinstance(loaded, PreTrainedTokenizerFast):
        raise TypeError(f"{folder} holds a {type(loaded).__name__}, not a fast (tokenizers) tokenizer")
    return loaded


# --------------------------------------------------------------------- command line


def _config_class(path: str | None, classes: Sequence[type]) -> type:
    """The first run config class whose fields cover the TOML file's top-level keys (data and model)."""
    if path is None:
        return classes[0]
    try:
        keys = set(tomllib.loads(Path(path).read_text()))
    except (OSError, tomllib.TOMLDecodeError):
        return classes[0]  # load_config reports it
    for cls in classes:
        if keys <= set(cls.model_fields):
            return cls
    return classes[0]


def main(argv: Sequence[str] | None = None, prog: str = "intellect tokenizer",
         run_configs: Sequence[type] = (SmokeConfig,)) -> int:
    """``train --config RUN.toml [--vocab-size N] [--out DIR] [--force] [KEY=VALUE ...]``: a BPE tokenizer
    from the run config's ``[data]`` corpus into ``--out`` (default ``model.tokenizer``). ``run_configs``:
    the run config classes a file may be (each with ``data`` and ``model`` sections), tried in order."""
    p = argparse.ArgumentParser(prog=prog, description="BPE tokenizers trained on a run's text corpus")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE tokenizer on the corpus of a run config's [data]")
    t.add_argument("--config", help="TOML run file whose [data.text] names the corpus (e.g. configs/diloco-text.toml)")
    t.add_argument("--vocab-size", type=int, help="tokens in the vocabulary (default: model.tokenizer_vocab)")
    t.add_argument("--out", help="tokenizer folder to write (default: model.tokenizer)")
    t.add_argument("--max-documents", type=int, help="train on at most this many documents")
    t.add_argument("--force", action="store_true", help="replace an existing tokenizer folder")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. data.text.files='[\"corpus/\"]'")
    args = p.parse_args(argv)
    try:
        cfg = load_config(_config_class(args.config, run_configs), args.config, args.overrides)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    data, model = getattr(cfg, "data"), getattr(cfg, "model")
    out, vocab = args.out or model.tokenizer, args.vocab_size or model.tokenizer_vocab
    if not out:
        print(f"{prog}: no output folder: pass --out or set model.tokenizer", file=sys.stderr)
        return 2
    if not data.text.files:
        print(f"{prog}: the config names no corpus: set data.text.files", file=sys.stderr)
        return 2
    if _is_tokenizer_folder(Path(out)):
        if not args.force:
            print(f"{prog}: {out} already exists (pass --force to replace it)", file=sys.stderr)
            return 1
        shutil.rmtree(out)
    start = time.perf_counter()
    to_stderr()
    try:
        tok = ensure_tokenizer(out, data, vocab, args.max_documents)
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"tokenizer: {len(tok)} tokens (asked {vocab}) in {time.perf_counter() - start:.1f}s -> {out}")
    return 0


__all__ = ["BOS_TOKEN", "CHAT_TEMPLATE", "CHAT_TOKENS", "EOS_TOKEN", "MIN_VOCAB", "TURN_END", "TURN_START", "SPECIAL_TOKENS", "TRAIN_CHARS", "corpus_texts",
           "ensure_tokenizer", "main", "save_tokenizer", "train_bpe"]
