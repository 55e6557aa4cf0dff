"""brorl_jax.rollout: large-N generation with continuous batching over decode slots; each prompt is
prefilled once and its KV shared by its N continuations (docs/INTERFACES.md, "rollout"; design
in docs/rollout.md). Host side by role: types (results), scheduler (one call), stream (the
consumer's iterator and an open stream's handle), engine (compiled programs, generate)."""
from brorl_jax.rollout.engine import Engine, generate
from brorl_jax.rollout.naive import generate_naive
from brorl_jax.rollout.plan import (
    SlotPlan,
    bucket_num_prompts,
    bucket_prompt_length,
    kv_bytes,
    plan_slots,
    rollout_bytes,
    slot_bytes,
)
from brorl_jax.rollout.programs import prefill_prompts_fn
from brorl_jax.rollout.scheduler import Progress, Scheduler
from brorl_jax.rollout.stream import OpenStream, RolloutStream
from brorl_jax.rollout.types import GroupResult, RolloutResult, assemble, validate_inputs

__all__ = [
    "Engine",
    "GroupResult",
    "OpenStream",
    "Progress",
    "RolloutResult",
    "RolloutStream",
    "Scheduler",
    "SlotPlan",
    "assemble",
    "generate",
    "generate_naive",
    "plan_slots",
    "rollout_bytes",
    "kv_bytes",
    "slot_bytes",
    "bucket_prompt_length",
    "bucket_num_prompts",
    "prefill_prompts_fn",
    "validate_inputs",
]
