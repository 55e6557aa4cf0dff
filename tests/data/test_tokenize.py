"""PromptTokenizer: chat template with generation prompt, system prompt, plain-text fallback."""
from __future__ import annotations

import logging

import pytest

from brorl_jax.data import PromptTokenizer


def record(messages=None, prompt=None):
    r = {"data_source": "math", "ground_truth": "2", "extra_info": {}, "row": 0, "source": "t"}
    if messages is not None:
        r["prompt_messages"] = messages
    if prompt is not None:
        r["prompt"] = prompt
    return r


def test_chat_template_matches_apply_chat_template(char_tokenizer):
    messages = [{"role": "user", "content": "What is 1+1?"}]
    pt = PromptTokenizer(char_tokenizer, max_prompt_len=512)
    expected = char_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert pt(record(messages)) == list(expected)
    # Plain prompt text is the same as one user message.
    assert pt(record(prompt="What is 1+1?")) == list(expected)
    assert pt.text(record(messages)).endswith("<|im_start|>assistant\n")


def test_system_prompt_added_only_when_absent(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, max_prompt_len=512, system_prompt="Be brief.")
    assert pt.text(record(prompt="Hi")).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    own = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]
    assert pt.messages(record(own)) == own


def test_encode_batch_equals_one_by_one(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, max_prompt_len=512)
    recs = [record(prompt="a"), record(prompt="bb bb"),
            record([{"role": "user", "content": "ccc"}])]
    assert pt.encode_batch(recs) == [pt(r) for r in recs]


def test_no_chat_template_falls_back_to_plain_text_with_one_warning(plain_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="brorl_jax.data.tokenize"):
        pt = PromptTokenizer(plain_tokenizer, max_prompt_len=512)
        ids = [pt(record(prompt="abc")) for _ in range(3)]
    assert len([r for r in caplog.records if "no chat template" in r.message]) == 1
    assert ids[0] == plain_tokenizer("abc")["input_ids"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert pt.text(record(msgs)) == "S\n\nQ"


def test_use_chat_template_false_is_silent(char_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="brorl_jax.data.tokenize"):
        pt = PromptTokenizer(char_tokenizer, max_prompt_len=512, use_chat_template=False)
    assert not caplog.records
    assert pt(record(prompt="xy")) == char_tokenizer("xy")["input_ids"]


def test_bad_arguments_raise(char_tokenizer):
    with pytest.raises(ValueError, match="max_prompt_len"):
        PromptTokenizer(char_tokenizer, max_prompt_len=0)
    with pytest.raises(ValueError, match="neither"):
        PromptTokenizer(char_tokenizer, max_prompt_len=8)(record())
