"""Shared fixtures for the data tests: a tiny character-level tokenizer with a chat template."""
from __future__ import annotations

import string

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """One token per printable ASCII character, plus <unk>, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    # BPE without merges = one token per character.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    return make_char_tokenizer(chat_template=None)
