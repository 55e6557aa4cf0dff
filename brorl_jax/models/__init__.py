"""brorl_jax.models: Flax decoder-only transformer (Qwen2/Qwen3/Llama, Qwen3-MoE), HF load/save,
demo model.

See docs/INTERFACES.md ("models") for the contract; the pure functions live in ``transformer``.
"""

from . import lora, peft_io
from .config import ModelConfig
from .demo_model import ensure_demo_model, ensure_demo_moe_model
from .gguf import convert_gguf
from .hf import Model, load_directory, save_pretrained
from .pretrained import (
    builtin_model_names,
    from_pretrained,
    model_path_problem,
    read_config,
    resolve_model_path,
)
from .transformer import (
    attention,
    embed,
    final_norm,
    forward,
    init_params,
    layer_finish,
    layer_finish_routed,
    layer_qkv,
    lm_head_matrix,
    lm_logits,
)

_LAZY = {"SMOLLM2_NAME", "ensure_smollm2", "smollm2_gguf_file"}


def __getattr__(name: str):
    # brorl_jax.models.smollm2 is also a command (python -m): importing it here eagerly would
    # make runpy warn that the module was imported before it ran.
    if name in _LAZY:
        from . import smollm2

        return getattr(smollm2, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ModelConfig",
    "lora",
    "peft_io",
    "Model",
    "from_pretrained",
    "load_directory",
    "save_pretrained",
    "ensure_demo_model",
    "ensure_demo_moe_model",
    "convert_gguf",
    "model_path_problem",
    "resolve_model_path",
    "read_config",
    "builtin_model_names",
    "SMOLLM2_NAME",
    "ensure_smollm2",
    "smollm2_gguf_file",
    "init_params",
    "forward",
    "embed",
    "layer_qkv",
    "layer_finish",
    "layer_finish_routed",
    "final_norm",
    "lm_head_matrix",
    "lm_logits",
    "attention",
]
