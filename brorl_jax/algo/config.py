"""AlgoConfig: the algorithm's frozen view of the run config (a static argument of jitted steps).

It has no defaults and no validation of its own: names, types, defaults and checks live in the
run-config schema (`brorl_jax.config`). Its fields are exactly the keys of the schema's `algo`
section plus three keys the update needs from other sections (`CROSS_SECTION`), under the SAME
names, so `algo.X` in a config file is `AlgoConfig.X` in the code. Build one with
`AlgoConfig.from_run_config(cfg)` (after `brorl_jax.config.validate`) or, in tests and notebooks,
`brorl_jax.config.algo_config(**overrides)`.

Paper defaults and their sources are in the schema and in docs/algo.md's choices table.
"""
from __future__ import annotations

import dataclasses
from typing import Any

# AlgoConfig field -> the run-config section it is read from (every other field: "algo").
CROSS_SECTION = {"rollouts_per_prompt": "rollout", "temperature": "rollout", "remat": "model"}


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """RL-update hyper-parameters; field meanings, defaults and sources: brorl_jax/config.py.

    Batch shape: the update always sees prompts_per_step * rollouts_per_prompt sequences.
    """
    # -- from other sections (CROSS_SECTION) --
    rollouts_per_prompt: int          # rollout.rollouts_per_prompt (N)
    temperature: float                # rollout.temperature (> 0; greedy rollouts train at 1.0)
    remat: bool                       # model.remat
    # -- algo.* --
    prompts_per_step: int
    advantage: str
    advantage_eps: float
    whiten_eps: float
    advantage_normalizer: str
    advantage_ema_decay: float
    dynamic_sampling: bool
    dynamic_sampling_rule: str
    correct_threshold: float
    generation_batch_multiplier: float
    max_generation_rounds: int
    dynamic_sampling_cap_policy: str
    reward_clip_low: float
    reward_clip_high: float
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float
    loss_agg: str
    ppo_mini_batches: int
    ppo_epochs: int
    micro_batch_size: int
    micro_batch_tokens: int
    pack_sequences: bool
    tis_mode: str
    tis_low: float
    tis_high: float
    recompute_old_logprobs: bool
    kl_coef: float
    kl_estimator: str
    kl_clamp: float
    ref_reset_every: int
    reset_optimizer_on_ref_reset: bool
    entropy_coef: float
    length_penalty: bool
    length_penalty_coef: float
    length_penalty_eta_min: float
    length_penalty_eta_max: float
    length_penalty_on_steps: int
    length_penalty_off_steps: int
    logprob_impl: str

    @property
    def batch_rows(self) -> int:
        """Sequences in the update batch: prompts_per_step * rollouts_per_prompt."""
        return self.prompts_per_step * self.rollouts_per_prompt

    @staticmethod
    def section_of(name: str) -> str:
        """The run-config section field `name` is read from."""
        return CROSS_SECTION.get(name, "algo")

    @classmethod
    def from_run_config(cls, cfg: Any, **overrides: Any) -> "AlgoConfig":
        """The algorithm's view of a (validated) run config; `overrides` replace fields by name
        (e.g. the temperature of a scheduled phase)."""
        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = cfg[cls.section_of(f.name)][f.name]
        if values["temperature"] <= 0:        # greedy rollouts: log-probs of the plain softmax
            values["temperature"] = 1.0
        unknown = sorted(set(overrides) - set(values))
        if unknown:
            raise ValueError(f"AlgoConfig has no field(s) {unknown}")
        values.update(overrides)
        return cls(**values)
