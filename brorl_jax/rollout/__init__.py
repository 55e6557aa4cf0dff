"""brorl_jax.rollout: large-N generation that prefills each prompt once and shares its KV cache
among its N continuations (docs/INTERFACES.md, "rollout"; design in docs/rollout.md)."""
from brorl_jax.rollout.engine import (
    RolloutResult,
    bucket_num_prompts,
    bucket_prompt_length,
    decode_bytes_per_sample,
    decode_chunk_fn,
    prefill_prompts_fn,
    validate_inputs,
    generate,
    kv_bytes,
    plan_chunks,
)
from brorl_jax.rollout.naive import generate_naive

__all__ = [
    "RolloutResult",
    "generate",
    "generate_naive",
    "plan_chunks",
    "kv_bytes",
    "decode_bytes_per_sample",
    "bucket_prompt_length",
    "bucket_num_prompts",
    "prefill_prompts_fn",
    "decode_chunk_fn",
    "validate_inputs",
]
