"""A real word-level tokenizer of any vocabulary size, built without a download; shared by
tests/unit/test_arch.py and tests/unit/test_metrics.py."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def word_tokenizer(vocab_size: int, *, pad: bool) -> PreTrainedTokenizerFast:
    """A real word-level tokenizer of ``vocab_size`` ids: ``<s>``, ``</s>`` (and ``<pad>``), then words."""
    specials = ["<s>", "</s>"] + (["<pad>"] if pad else [])
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"pad_token": "<pad>"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", **extra)
