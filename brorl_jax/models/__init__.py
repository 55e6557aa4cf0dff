"""brorl_jax.models: Flax decoder-only transformer (Qwen2/Qwen3/Llama), HF load/save, demo model.

See docs/INTERFACES.md ("models") for the contract; the pure functions live in ``transformer``.
"""

from .config import ModelConfig
from .demo_model import ensure_demo_model
from .hf import Model, from_pretrained, save_pretrained
from .transformer import (
    attention,
    decode_step,
    embed,
    final_norm,
    forward,
    init_cache,
    init_params,
    layer_finish,
    layer_qkv,
    lm_head_matrix,
    lm_logits,
    prefill,
)

__all__ = [
    "ModelConfig",
    "Model",
    "from_pretrained",
    "save_pretrained",
    "ensure_demo_model",
    "init_params",
    "forward",
    "embed",
    "layer_qkv",
    "layer_finish",
    "final_norm",
    "lm_head_matrix",
    "lm_logits",
    "attention",
    "init_cache",
    "prefill",
    "decode_step",
]
