"""The shapes the kernels are claimed to compile at (issue 19), in one place.

Used by tests/kernels/test_lowering.py (lowering for cuda and tpu) and bench/compile_check.py
(full deviceless compiles). Widths are the published configs of each family's model; the
lowering tests build 2-layer models of these widths.
"""
from __future__ import annotations

from typing import NamedTuple


class ModelShape(NamedTuple):
    model_type: str          # brorl_jax.models.ModelConfig.model_type
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tie_word_embeddings: bool
    layers: int               # num_hidden_layers of the model's config.json


MODEL_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-1.5b": ModelShape("qwen2", 1536, 12, 2, 128, 151_936, 8960, True, 28),
    "qwen2.5-7b": ModelShape("qwen2", 3584, 28, 4, 128, 152_064, 18944, False, 28),
    "qwen3-8b": ModelShape("qwen3", 4096, 32, 8, 128, 151_936, 12288, False, 36),
    "llama-3.1-8b": ModelShape("llama", 4096, 32, 8, 128, 128_256, 14336, False, 32),
}

DTYPES = ("bfloat16", "float32")
# Decode sampling: one row per sample of a decode step, up to N = 512 rollouts of a prompt.
SAMPLING_ROWS = 512
# Log-prob tokens per kernel call: one update micro-batch (e.g. 2 rows x 2048 positions).
LOGPROB_TOKENS = 4096
# Sampling settings exercised: plain (BroRL's T = 1), greedy, and both filters.
SAMPLING_VARIANTS: dict[str, dict] = {
    "plain": dict(temperature=1.0),
    "greedy": dict(temperature=0.0),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
}
# Decode attention at a small decode batch (B prompts x N samples, P prompt, S generated).
DECODE_ATTENTION = dict(batch=2, samples=16, prefix=512, suffix=256)
# The rollout's slot decode attention (slot_decode_attention, as its decode step calls it): decode
# slots per device, prompts in the pool, prompt positions, own positions per slot (BroRL's 16k
# context), a page pool for a quarter of the slots' capacity, a 2-layer KV store read in place.
SLOT_DECODE_ATTENTION = dict(slots=64, pool=4, prompt=1024, own=16384, page_fraction=0.25,
                             layers=2)
