"""The largest training rollout call of a run and the rollout stream paused across the update:
the facts the door (train/door.py: the memory plans) reads and hands to the runtime
(train/runtime.py, the remat policy's memory). Config only: nothing here imports the run context.
"""
from __future__ import annotations

import dataclasses

from brorl_jax.algo import host, policies
from brorl_jax.config import as_run_config
from brorl_jax.rollout import plan as rollout_plan


@dataclasses.dataclass(frozen=True)
class RolloutCall:
    """The largest rollout call of one kind in a run, per process, and the keys that size it."""
    what: str                   # "training" | "evaluation"
    num_prompts: int
    samples_per_prompt: int
    max_new_tokens: int
    n_keys: str                 # the keys that set samples_per_prompt
    length_key: str             # the key that sets max_new_tokens
    precision: tuple[str, str] = ("bf16", "bf16")   # the rollout copy's (weights, KV cache)

    def model_config(self, model_cfg):
        """The call's engine config: ``model_cfg`` at its precision (the memory plan's sizes)."""
        from brorl_jax.models.precision import with_precision
        return with_precision(model_cfg, *self.precision)


def rollout_precision(cfg) -> tuple[str, str]:
    """(rollout.weight_dtype, rollout.kv_dtype): the training rollouts' precision."""
    return cfg.rollout.weight_dtype, cfg.rollout.kv_dtype


def training_call(cfg, num_processes: int = 1) -> RolloutCall:
    """The largest training-round call of a run (per process): a generation batch of prompts,
    ceil(overgenerate_factor x the largest N) samples each."""
    cfg = as_run_config(cfg)
    r = cfg.rollout
    n_keys = "rollout.adaptive_n_buckets" if r.adaptive_n else policies.N_KEY
    if r.overgenerate_factor > 1.0:
        n_keys += " x rollout.overgenerate_factor"
    return RolloutCall("training", -(-cfg.round_prompts // num_processes),
                       host.num_candidates(cfg, host.max_group_rows(cfg)), r.max_new_tokens,
                       n_keys, "rollout.max_new_tokens", rollout_precision(cfg))


def records_routing(cfg, model_cfg) -> bool:
    """Whether the run's engines record each token's experts (algo.routing_replay="rollout" on
    a mixture-of-experts model, train/runtime.py): their pools hold the record (rollout.plan)."""
    return (model_cfg is not None and model_cfg.is_moe
            and as_run_config(cfg).algo.routing_replay == "rollout")


def rollout_device_count(cfg) -> int:
    """The devices this process's rollouts run on (train/runtime.py): its share of
    mesh.rollout_devices when disaggregated, else every local device."""
    import jax
    return int(cfg.mesh.rollout_devices) // jax.process_count() or jax.local_device_count()


def paused_engine_bytes(cfg, model_cfg, *, num_devices: int, num_processes: int = 1) -> int:
    """Device memory (per device) of the rollout stream an RL step leaves paused across the
    update: when samples are carried (RunConfig.carries_samples) the engine keeps its slots, KV
    pages and prompt pool for the groups still in flight (train/collect.py), so they sit beside
    the update's state and activations. 0 when nothing is carried (rounds, or k = 0: the stream
    is closed before the update), when the rollout has devices of its own (mesh.rollout_devices:
    the paused engine is not beside the update) or without a model config."""
    cfg = as_run_config(cfg)
    if model_cfg is None or not cfg.carries_samples or int(cfg.mesh.rollout_devices):
        return 0
    train = training_call(cfg, num_processes)
    model_cfg = train.model_config(model_cfg)
    prompt_len = rollout_plan.bucket_prompt_length(cfg.data.max_prompt_len)
    routing = records_routing(cfg, model_cfg)
    plan = rollout_plan.plan_slots(model_cfg, train.num_prompts, prompt_len,
                                   train.samples_per_prompt, train.max_new_tokens,
                                   cfg.memory_budget_bytes,
                                   num_devices=num_devices, record_routing=routing)
    return rollout_plan.stream_plan(model_cfg, plan, prompt_len, train.max_new_tokens,
                                    routing).bytes_per_device
