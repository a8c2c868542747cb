"""How a task's prompt becomes the token ids a model is asked with: the tokenizer's chat template,
or the raw text; and the one-turn chats a chat model is pretrained on (:func:`chat_document`).

Workers, the validator, the filter and the held-out evaluation all render through
:func:`render_prompt` with the run's :class:`PromptConfig` (it travels in the submission config the
service hands to workers), and the validator compares each rollout's prompt tokens with its own
rendering, so a worker cannot choose the text it answers.

``template = "auto"`` uses the chat template when the tokenizer has one: the prompt becomes the
user turn (after an optional system turn) and ``add_generation_prompt`` opens the assistant turn.
The rendered text is tokenized without special tokens, since a chat template writes its own
(BOS included). Without a template, the prompt is tokenized as it is, special tokens added (BOS)::

    >>> from intellect.model.bpe import train_bpe
    >>> plain = train_bpe(["12+34=46"] * 20, vocab_size=300)
    >>> plain.decode(render_prompt(plain, "12+34=", PromptConfig()))
    '<|begin_of_text|>12+34='
    >>> chat = train_bpe(["12+34=46"] * 20, vocab_size=300, chat=True)
    >>> chat.decode(render_prompt(chat, "12+34=", PromptConfig(system="Be brief.")))
    '<|begin_of_text|><|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\n12+34=<|im_end|>\\n<|im_start|>assistant\\n'
    >>> chat.decode(render_prompt(chat, "12+34=", PromptConfig(template="raw")))
    '<|begin_of_text|>12+34='
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

from pydantic import Field

from intellect.config import StrictModel


class PromptError(ValueError):
    """A prompt that cannot be rendered (no chat template where one is required, a template error, no tokens)."""


class PromptConfig(StrictModel):
    """How prompts are rendered (workers, validator, filter and evaluation must agree)."""

    template: Literal["auto", "chat", "raw"] = Field(
        default="auto",
        description="auto: the tokenizer's chat template when it has one, else raw; chat: the chat template "
        "(an error without one); raw: the prompt text as it is, with the tokenizer's special tokens (BOS).",
    )
    system: str | None = Field(
        default=None, min_length=1, max_length=16384,
        description="A system turn before each prompt (chat templates only); None: none.",
    )


def uses_chat(tokenizer, cfg: PromptConfig) -> bool:
    """Whether prompts are rendered with ``tokenizer``'s chat template under ``cfg``."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if cfg.template == "chat" and not has:
        raise PromptError("prompt.template = 'chat' but the tokenizer has no chat template")
    return cfg.template == "chat" or (cfg.template == "auto" and has)


def render_prompt(tokenizer, prompt: str, cfg: PromptConfig) -> list[int]:
    """The token ids ``prompt`` is asked with under ``cfg`` (module docstring); :class:`PromptError`
    when it cannot be rendered."""
    if not uses_chat(tokenizer, cfg):
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
            {"role": "user", "content": prompt}]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a user's Jinja template can raise anything
            raise PromptError(f"the chat template cannot render it: {' '.join(str(e).split()) or type(e).__name__}") \
                from None
        if not isinstance(text, str):
            raise PromptError(f"the chat template rendered {type(text).__name__}, not text")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise PromptError("it renders to no tokens")
    return ids


def chat_document(tokenizer, prompt: str, answer: str, system: str | None = None) -> tuple[str, str]:
    """``(prompt text, document)`` of a one-turn chat, as pretraining encodes them (BOS, the text, then
    EOS): the document is the prompt text followed by ``answer``, and both leave out what the encoding
    adds, the template's BOS in front and its end of turn (the tokenizer's EOS) after the answer. So
    the document's tokens are :func:`render_prompt`'s, then the answer, then the EOS a completion ends
    with. :class:`PromptError` when the template does not end the answer's turn with the EOS.

        >>> from intellect.model.bpe import train_bpe
        >>> tok = train_bpe(["12+34=46"] * 20, vocab_size=300, chat=True)
        >>> chat_document(tok, "12+34=", "46")[1]
        '<|im_start|>user\\n12+34=<|im_end|>\\n<|im_start|>assistant\\n46'
    """
    cfg = PromptConfig(template="chat", system=system)
    uses_chat(tokenizer, cfg)  # PromptError without a template
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    try:
        head = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
    except Exception as e:  # noqa: BLE001 - a user's Jinja template can raise anything
        raise PromptError(f"the chat template cannot render it: {' '.join(str(e).split()) or type(e).__name__}") \
            from None
    eos = tokenizer.eos_token or ""
    if not (isinstance(head, str) and isinstance(full, str) and eos and full.startswith(head + answer + eos)):
        raise PromptError("the chat template does not end the assistant's turn with the tokenizer's EOS")
    bos = tokenizer.bos_token or ""
    if bos and head.startswith(bos):
        head = head[len(bos):]
    return head, head + answer


class _Problem(Protocol):
    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


@dataclass(frozen=True)
class ChatTask:
    """A problem as a one-turn chat (:func:`chat_document`): what pretraining's evaluation reads."""

    prompt: str
    answer: str
    text: str


def chat_tasks(tokenizer, problems: Sequence[_Problem], system: str | None = None) -> list[ChatTask]:
    """Each problem's prompt and full text as a one-turn chat; the answer as it is."""
    out = []
    for p in problems:
        head, doc = chat_document(tokenizer, p.prompt, p.answer, system)
        out.append(ChatTask(prompt=head, answer=p.answer, text=doc))
    return out
