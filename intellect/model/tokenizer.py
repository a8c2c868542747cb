"""The tokenizer of a model: the built-in character tokenizer of the synthetic tasks, or a local HF folder.

One token per character of ``CHARS`` plus four specials, built with the
``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast`` so a
checkpoint folder loads with ``AutoTokenizer.from_pretrained`` (and vLLM)::

    >>> tok = build_tokenizer()
    >>> tok("12+3=15")["input_ids"]        # BOS, then one id per character
    [1, 5, 6, 14, 7, 18, 5, 9]
    >>> tok.decode([5, 6, 14, 7, 2], skip_special_tokens=True)
    '12+3'

Any other tokenizer (a BPE trained on a corpus, a checkpoint's) is an HF folder loaded by
:func:`load_tokenizer`; :func:`tokenizer_for` picks between the two as a model config says.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from intellect.config import ModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# Order fixes the ids: changing it invalidates every saved checkpoint.
CHARS = "0123456789+-*/=()., :abcdefghijklmnopqrstuvwxyz"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The fixed character vocabulary: specials 0-3, then ``CHARS`` in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=1 << 20,
    )


def load_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The HF tokenizer saved in a local ``folder`` (``tokenizer.json`` and its config); never downloads."""
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_for(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer a new model of ``cfg`` is built for: ``cfg.tokenizer``'s folder, else the
    built-in character tokenizer."""
    return build_tokenizer() if cfg.tokenizer is None else load_tokenizer(cfg.tokenizer)
