"""The locally built demo checkpoint (tiny Qwen2-style model + character tokenizer)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from brorl_jax.models import ensure_demo_model, from_pretrained, read_config
from brorl_jax.models.builtin_store import default_cache_dir
from brorl_jax.models.demo_model import DEMO_MODEL_NAME


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRORL_JAX_CACHE", str(cache))
        assert default_cache_dir() == cache
        path = ensure_demo_model()
    assert path == str(cache / DEMO_MODEL_NAME)
    return path


def test_demo_model_builds_idempotently_deterministically_and_atomically(demo_dir, tmp_path):
    from pathlib import Path

    weights = Path(demo_dir) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_demo_model(demo_dir) == demo_dir
    assert weights.stat().st_mtime_ns == stamp  # not rebuilt
    # No temporary directories left beside it.
    assert [p.name for p in Path(demo_dir).parent.iterdir()] == [DEMO_MODEL_NAME]
    # A second build elsewhere is byte-identical (fixed seed).
    other = ensure_demo_model(tmp_path / "again")
    assert (Path(other) / "model.safetensors").read_bytes() == weights.read_bytes()
    # A directory holding something else is not silently overwritten.
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a complete demo model"):
        ensure_demo_model(tmp_path / "junk")


def test_demo_model_loads_through_from_pretrained_with_tokenizer(demo_dir):
    model = from_pretrained(demo_dir)
    cfg, tok = model.config, model.tokenizer
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (128, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tok) < 128
    assert model.generation_eos_ids == (tok.eos_token_id,) == cfg.eos_token_ids
    assert tok.pad_token_id == 0 and tok.bos_token_id is not None
    # the door's memory plan reads the same config from config.json alone (no weights)
    assert read_config(demo_dir) == cfg
    assert read_config(demo_dir, "bfloat16") == cfg.replace(dtype="bfloat16",
                                                            param_dtype="bfloat16")
    assert read_config(os.path.join(demo_dir, "missing")) is None    # from_pretrained says why

    text = "What is 23 + 45?\nAnswer: 68."
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok.encode("0123456789")] == list("0123456789")
    assert tok.decode(tok.encode("é")) == "<unk>"

    messages = [{"role": "user", "content": "What is 23 + 45?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>What is 23 + 45?</s>\n<|assistant|>"
    prompt_ids = tok.encode(prompt)
    assert tok.eos_token_id in prompt_ids
    assert tok.convert_ids_to_tokens(prompt_ids[-1]) == "<|assistant|>"
    assert tok.decode(prompt_ids, skip_special_tokens=True) == "What is 23 + 45?\n"

    logits = np.asarray(model(np.asarray([prompt_ids], np.int32)))
    assert logits.shape == (1, len(prompt_ids), cfg.vocab_size) and np.isfinite(logits).all()


def test_demo_tokenizer_loads_the_users_way_with_transformers_autotokenizer(demo_dir):
    """transformers 5 loads a model_type "qwen2" directory as Qwen2Tokenizer whatever it
    declares; the demo's tokenizer.json is shaped so that this gives the project's own ids."""
    from transformers import AutoTokenizer

    ours = from_pretrained(demo_dir).tokenizer
    theirs = AutoTokenizer.from_pretrained(demo_dir)
    text = "What is 23 + 45?\nGive the answer.  <answer>68</answer></s>\n~`{}"
    assert theirs.encode(text) == ours.encode(text)
    assert theirs.decode(theirs.encode(text)) == text
    messages = [{"role": "user", "content": "What is 23 + 45?"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|user|>What is 23 + 45?</s>\n<|assistant|>"
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)



def test_the_moe_demo_model_loads_as_qwen3_moe_and_its_preset_passes_the_door(demo_dir, tmp_path,
                                                                            monkeypatch):
    """configs/demo.py:moe=1 names builtin:demo_moe: the dense demo's tokenizer and shapes as a
    Qwen3-MoE, built into the cache, read by the door and loaded as a real checkpoint is."""
    from transformers import AutoTokenizer

    from brorl_jax.models.demo_model import (
        DEMO_MOE_EXPERTS,
        DEMO_MOE_MODEL_NAME,
        DEMO_MOE_TOP_K,
        DEMO_MOE_WIDTH,
    )
    from brorl_jax.train import door
    from configs import demo

    monkeypatch.setenv("BRORL_JAX_CACHE", str(tmp_path))
    assert demo.get_config().model.path == ""                       # the default is the dense
    cfg = demo.get_config("moe=1")
    cfg.algo.routing_replay = "rollout"                              # refused for a dense model
    model_cfg = door.check_training(cfg).model_cfg                  # builds it into the cache
    moe_dir = str(tmp_path / DEMO_MOE_MODEL_NAME)
    model = from_pretrained(moe_dir)
    dense = from_pretrained(demo_dir)
    assert model.config == model_cfg.replace(attention_impl=model.config.attention_impl,
                                             mlp_impl=model.config.mlp_impl)
    c = model.config
    assert c.model_type == "qwen3_moe" and c.is_moe and c.norm_topk_prob and c.qk_norm
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
        DEMO_MOE_EXPERTS, DEMO_MOE_TOP_K, DEMO_MOE_WIDTH) == (8, 2, 64)
    shared = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "eos_token_ids")
    assert [getattr(c, k) for k in shared] == [getattr(dense.config, k) for k in shared]
    assert model.params["layers"]["moe"]["gate_proj"].shape == (4, 8, 128, 64)

    text = "What is 23 + 45?\nGive the answer.  <answer>68</answer></s>\n~`{}"
    theirs = AutoTokenizer.from_pretrained(moe_dir)       # a qwen3_moe directory, the user's way
    assert theirs.encode(text) == model.tokenizer.encode(text) == dense.tokenizer.encode(text)
    assert model.tokenizer.chat_template == dense.tokenizer.chat_template
    ids = model.tokenizer.encode("<|user|>What is 2 + 3?</s>\n<|assistant|>")
    logits = np.asarray(model(np.asarray([ids], np.int32)))
    assert logits.shape == (1, len(ids), c.vocab_size) and np.isfinite(logits).all()
