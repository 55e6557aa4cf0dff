"""ModelConfig <-> HF config.json conversion."""

from __future__ import annotations

import pytest
from models_testutil import hf_config, transformers

from brorl_jax.models import ModelConfig


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_from_hf_config_reads_transformers_config_and_round_trips(kind):
    hf = hf_config(kind, heads=8, kv_heads=2, tie=(kind == "qwen3")).to_dict()
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.model_type == kind
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 2)
    assert cfg.head_dim == (16 if kind == "qwen3" else 8)
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.tie_word_embeddings == (kind == "qwen3")
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert hash(cfg) == hash(ModelConfig.from_hf_config(hf))  # usable as a static jit argument
    if kind == "llama":
        scaling = dict(cfg.rope_scaling)
        assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
        assert scaling["original_max_position_embeddings"] == 64
        assert cfg.rope_theta == 500_000.0
    else:
        assert cfg.rope_scaling is None
    # to_hf_config is read back by transformers and by us as the same architecture.
    back = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(back) == cfg
    reloaded = transformers.AutoConfig.for_model(**back)
    assert reloaded.rope_parameters["rope_theta"] == cfg.rope_theta
    assert ModelConfig.from_hf_config(reloaded.to_dict()) == cfg


def test_from_hf_config_reads_legacy_rope_layout():
    # Llama-3.1-style config.json written by transformers 4.x: rope_theta + rope_scaling.
    hf = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "eos_token_id": [128001, 128008, 128009],
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.rope_theta == 500000.0
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 8192
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings


def test_unsupported_model_type_names_the_file_and_supported_types():
    with pytest.raises(ValueError, match=r"my/config.json.*'gpt2'.*qwen2.*qwen3.*llama"):
        ModelConfig.from_hf_config({"model_type": "gpt2"}, source="my/config.json")


def test_unsupported_rope_type_and_bad_fields_are_rejected():
    hf = hf_config("qwen2").to_dict()
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        ModelConfig.from_hf_config({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config({**hf, "num_attention_heads": 4, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="param_dtype"):
        ModelConfig.from_hf_config(hf, param_dtype="float16")
