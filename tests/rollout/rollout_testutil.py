"""Tiny models for tests/rollout (a uniquely named module: the tests/* folders are not packages)."""
from __future__ import annotations

import jax
import numpy as np

from brorl_jax.models import Model, ModelConfig, init_params

EOS = 3


def tiny_config(**changes) -> ModelConfig:
    """2 layers, hidden 32, 4 query heads over 2 KV heads (GQA), vocab 128."""
    base = dict(
        model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=True,
        qk_norm=False, tie_word_embeddings=False, max_position_embeddings=96,
        bos_token_id=None, eos_token_ids=(EOS,),
    )
    base.update(changes)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, weight_scale: float = 8.0, **changes) -> Model:
    """Random tiny model; weights scaled up so its next-token distributions are far from uniform
    (peaked enough that stop tokens and top-k/top-p boundaries actually matter)."""
    cfg = tiny_config(**changes)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    params = jax.tree.map(lambda x: x * weight_scale if x.ndim >= 2 else x, params)
    return Model(cfg, params, None, (EOS,))


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 31)), [30], [40, 41, 42]]


def prompt_rng(seed: int, lengths: list[int], vocab: int = 128) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, n)] for n in lengths]
