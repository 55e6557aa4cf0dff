"""The algorithm's frozen views of the run config: AlgoConfig (the update's: a static argument of
the jitted steps, so the key of their compile cache) and CollectConfig (the host-side collect's:
selection, shaping, dynamic sampling, advantages, the update batch's layout).

Neither has defaults or validation of its own: names, types, defaults and checks live in the
run-config schema (`brorl_jax.config`). Every field is a schema key under the SAME name, read
from the `algo` section unless `CROSS_SECTION` / `COLLECT_CROSS_SECTION` names another, so
`algo.X` in a config file is `AlgoConfig.X` or `CollectConfig.X` in the code. Every key of the
`algo` section is a field of exactly one of the two (a test checks it): a setting only the
collect reads is not in AlgoConfig, so changing it compiles no update step again. Build them with
`AlgoConfig.from_run_config(cfg)` / `CollectConfig.from_run_config(cfg)` (after
`brorl_jax.config.validate`) or, in tests and notebooks, `brorl_jax.config.algo_config(**overrides)`
/ `brorl_jax.config.collect_config(**overrides)`.

Paper defaults and their sources are in the schema and in docs/algo.md's choices table.
"""
from __future__ import annotations

import dataclasses
from typing import Any

# AlgoConfig field -> the run-config section it is read from (every other field: "algo").
CROSS_SECTION = {"rollouts_per_prompt": "rollout", "temperature": "rollout", "remat": "model"}
# CollectConfig field -> its section (every other field: "algo").
COLLECT_CROSS_SECTION = {
    "rollouts_per_prompt": "rollout", "max_new_tokens": "rollout", "adaptive_n": "rollout",
    "adaptive_n_buckets": "rollout", "adaptive_n_thresholds": "rollout",
    "adaptive_n_ema_decay": "rollout", "overgenerate_factor": "rollout", "select_rule": "rollout",
    "seed": "train", "groups_in_flight": "rewards"}


def _from_run_config(cls, cfg: Any, overrides: dict) -> dict:
    values = {f.name: cfg[cls.section_of(f.name)][f.name] for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    values.update(overrides)
    return values


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """RL-update hyper-parameters; field meanings, defaults and sources: brorl_jax/config.py.

    Batch shape: the update always sees prompts_per_step * rollouts_per_prompt sequences (the two
    fields define the batch the compiled step is built for, so they stay here although the
    collect reads them too; CollectConfig has its own copies).
    """
    # -- from other sections (CROSS_SECTION) --
    rollouts_per_prompt: int          # rollout.rollouts_per_prompt (N)
    temperature: float                # rollout.temperature (> 0; greedy rollouts train at 1.0)
    remat: bool                       # model.remat
    # -- algo.* --
    prompts_per_step: int
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float
    loss_agg: str
    ppo_mini_batches: int
    ppo_epochs: int
    micro_batch_size: int
    micro_batch_tokens: int
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
        values = {f.name: cfg[cls.section_of(f.name)][f.name] for f in dataclasses.fields(cls)}
        if values["temperature"] <= 0:        # greedy rollouts: log-probs of the plain softmax
            values["temperature"] = 1.0
        unknown = sorted(set(overrides) - set(values))
        if unknown:
            raise ValueError(f"AlgoConfig has no field(s) {unknown}")
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class CollectConfig:
    """The host-side collect's settings (brorl_jax/algo/host.py): which candidates are kept,
    how rewards are shaped, which groups enter the batch, how advantages are normalised and how
    the batch is laid out. Host numpy only: no compiled program reads it."""
    # -- from other sections (COLLECT_CROSS_SECTION) --
    rollouts_per_prompt: int          # rollout.rollouts_per_prompt (N)
    max_new_tokens: int               # rollout.max_new_tokens (the length penalty's T_max)
    adaptive_n: bool                  # rollout.adaptive_n ... (policies.samples_per_prompt_policy)
    adaptive_n_buckets: str
    adaptive_n_thresholds: str
    adaptive_n_ema_decay: float
    overgenerate_factor: float        # rollout.overgenerate_factor
    select_rule: str                  # rollout.select_rule
    seed: int                         # train.seed (the selection's random order)
    groups_in_flight: int             # rewards.groups_in_flight (groups scored at once)
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
    stream_rounds: bool
    max_staleness: int
    decode_during_update: int
    reward_clip_low: float
    reward_clip_high: float
    pack_sequences: bool
    length_penalty: bool
    length_penalty_coef: float
    length_penalty_eta_min: float
    length_penalty_eta_max: float
    length_penalty_on_steps: int
    length_penalty_off_steps: int

    @property
    def batch_rows(self) -> int:
        """Sequences in the update batch: prompts_per_step * rollouts_per_prompt."""
        return self.prompts_per_step * self.rollouts_per_prompt

    @staticmethod
    def section_of(name: str) -> str:
        """The run-config section field `name` is read from."""
        return COLLECT_CROSS_SECTION.get(name, "algo")

    @classmethod
    def from_run_config(cls, cfg: Any, **overrides: Any) -> "CollectConfig":
        """The collect's view of a (validated) run config; `overrides` replace fields by name."""
        return cls(**_from_run_config(cls, cfg, overrides))
