"""Prompt text -> prompt ids, one way for every command.

Contract: ``chat_prompt_ids`` and ``text_prompt_ids`` give the token ids a
model is asked to continue. ``generate`` (through its JSONL reader),
``train-mtp`` and the benchmarks all call them, so a drafting head is trained
on exactly the ids ``generate`` serves and the benchmarks time those same ids.
Nothing here knows JSONL, flags or a terminal; a chat template that raises
(it is jinja, it may raise anything) raises to the caller, who reports it.

- **messages**: the tokenizer's chat template is rendered to *text*, with the
  generation prompt (the opening of the assistant's turn) appended, and that
  text is encoded without special tokens. The template writes every special
  token the model expects; encoding must not add a BOS a second time. Taking
  the text and encoding it ourselves, rather than asking the template call to
  tokenize, keeps one behaviour whatever the transformers version (whose
  tokenizing call has returned a list in some versions and a
  ``BatchEncoding`` in others).
- A message is its ``role`` and its ``content`` and nothing else; a content
  given as OpenAI content parts is the concatenation of its text parts
  (``content_text``), whichever command reads it.
- **a raw prompt**: encoded with the tokenizer's own special tokens (a BOS,
  where the tokenizer adds one), as a completion endpoint takes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = Mapping[str, Any]  # {"role": str, "content": str | [{"type": "text", "text": str}]}


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer prompts need."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def content_text(content: Any) -> str:
    """A message's content as text: a string as it is, OpenAI content parts
    joined. Raises ``ValueError`` for a part that is not text, or a content
    that is neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("must be a string")
    texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
    strings = [t for t in texts if isinstance(t, str)]
    if len(strings) != len(content):
        kinds = sorted({str(p.get("type")) for p in content if isinstance(p, Mapping)} - {"text"})
        if kinds:
            raise ValueError(
                f"has {', '.join(kinds)} parts: metrale runs models on text only (a "
                "vision-language checkpoint such as Qwen3.5 is loaded without its vision "
                "tower), so only text parts are supported"
            )
        raise ValueError("only text parts are supported")
    return "".join(strings)


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[int, ...]:
    """The ids of ``messages`` rendered by the chat template, ready for the
    assistant's reply (see the module doc)."""
    plain = [{"role": m["role"], "content": content_text(m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return tuple(int(i) for i in tokenizer.encode(str(text), add_special_tokens=False))


def user_prompt_ids(tokenizer: Tokenizer, content: str) -> tuple[int, ...]:
    """``chat_prompt_ids`` of one user message."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": content}])


def text_prompt_ids(tokenizer: Tokenizer, prompt: str) -> tuple[int, ...]:
    """The ids of a raw prompt, with the tokenizer's special tokens."""
    return tuple(int(i) for i in tokenizer.encode(prompt))


def record_prompt_ids(record: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[int, ...] | None:
    """The ids ``generate`` serves for a JSONL record's ``messages`` or
    ``prompt`` (chat-templated or plain); None when it has neither."""
    if "messages" in record:
        return chat_prompt_ids(tokenizer, record["messages"])
    if "prompt" in record:
        return text_prompt_ids(tokenizer, record["prompt"])
    return None
