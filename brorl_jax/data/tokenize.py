"""Prompt records -> token ids with the model's tokenizer and chat template.

Prompts are never truncated: a prompt longer than `max_prompt_len` tokens is left out of the
dataset and counted (make_prompt_loader does this in a pre-pass), because a truncated question is
a different question whose ground truth may no longer follow from it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class PromptTokenizer:
    """Turns a normalized record into prompt token ids (a callable: record -> list[int]).

    With a chat template (the usual case for instruct models) the record's messages, with
    `system_prompt` first when the record has no system message, go through
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``; a record with
    plain `prompt` text becomes one user message. Without a chat template (or with
    use_chat_template=False) the text is encoded as is, with the tokenizer's special tokens
    (e.g. BOS); message contents are joined by blank lines. When a chat template is wanted
    but the tokenizer has none, a warning is logged once and plain encoding is used.

    Args:
      tokenizer: a transformers tokenizer (PreTrainedTokenizerBase).
      max_prompt_len: longest prompt kept, in tokens; longer ones are skipped by the loader.
      system_prompt: optional system message added to every prompt.
      use_chat_template: False for base models fed raw text.
      chat_template_kwargs: extra template variables, e.g. {"enable_thinking": False} (Qwen3).
    """

    def __init__(self, tokenizer: Any, max_prompt_len: int, system_prompt: str | None = None,
                 use_chat_template: bool = True,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}.")
        self.tokenizer = tokenizer
        self.max_prompt_len = int(max_prompt_len)
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if use_chat_template and not has_template:
            logger.warning("tokenizer %s has no chat template; prompts are encoded as plain text "
                           "(pass use_chat_template=False to silence this).",
                           getattr(tokenizer, "name_or_path", type(tokenizer).__name__))
        self.use_chat_template = use_chat_template and has_template

    def messages(self, record: Mapping) -> list[dict]:
        """The chat messages for a record, system prompt included."""
        messages = record.get("prompt_messages")
        if messages is None:
            text = record.get("prompt")
            if not isinstance(text, str):
                raise ValueError(f"record from {record.get('source')!r} row {record.get('row')} "
                                 "has neither 'prompt_messages' nor 'prompt' text.")
            messages = [{"role": "user", "content": text}]
        messages = [dict(m) for m in messages]
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, record: Mapping) -> str:
        """The exact string that is tokenized (useful for logging what the model sees)."""
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                self.messages(record), add_generation_prompt=True, tokenize=False,
                **self.chat_template_kwargs)
        if record.get("prompt_messages") is None and self.system_prompt is None:
            return record["prompt"]
        return "\n\n".join(m["content"] for m in self.messages(record))

    def __call__(self, record: Mapping) -> list[int]:
        return self.encode_batch([record])[0]

    def encode_batch(self, records: Sequence[Mapping]) -> list[list[int]]:
        """Token ids for many records at once (one batched tokenizer call)."""
        if not records:
            return []
        if self.use_chat_template:
            # The template's text already holds BOS etc., so no special tokens are added
            # (apply_chat_template(tokenize=True) does the same).
            texts = [self.text(r) for r in records]
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer([self.text(r) for r in records],
                                 add_special_tokens=True)["input_ids"]
        return [list(map(int, x)) for x in ids]
