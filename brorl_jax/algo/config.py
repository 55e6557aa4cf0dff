"""AlgoConfig: every knob of the BroRL/ProRLv2 update, with the paper's defaults.

A frozen dataclass (hashable) so it can be a static argument of jitted functions. Defaults follow
/work/shared/paper_notes.md §1.2-1.5: REINFORCE++-baseline advantages, dynamic sampling, PPO
clip-higher 0.2/0.28, token-level loss, ICE-POP truncated IS in [0.5, 5], k2 KL with beta 1e-4 and
log-ratio clamp 10, no entropy bonus. Values the papers do not state are marked "(not in paper)".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

ADVANTAGE_NAMES = ("reinforce_pp_baseline", "grpo", "rloo")
KL_NAMES = ("k1", "k2", "k3")
AGG_NAMES = ("token_mean", "seq_mean_token_mean")
TIS_MODES = ("ice_pop", "truncate", "off")
CAP_POLICIES = ("error", "pad")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """RL-update hyper-parameters (one RL step = generation, filtering, then the update).

    Batch shape: the update always sees prompts_per_step * rollouts_per_prompt rows.
    """
    # -- rollouts / dynamic sampling (BroRL §3.1, Table 1; veRL DAPO recipe) --
    rollouts_per_prompt: int = 16                # N (BroRL: 512; ProRL baseline: 16)
    prompts_per_step: int = 512                  # post-filter prompts per step (BroRL: 128)
    dynamic_sampling: bool = True                # keep groups with 0 < #correct < N
    correct_threshold: float = 1.0               # reward >= this counts as correct (raw verifier score)
    generation_batch_multiplier: float = 1.0     # prompts generated per round = ceil(mult * prompts_per_step)
    max_generation_rounds: int = 8               # veRL: filter_groups.max_num_gen_batches
    dynamic_sampling_cap_policy: str = "error"   # "error" (veRL) | "pad" (mask unfilled rows)
    # -- advantages (BroRL §3.1) --
    advantage_estimator: str = "reinforce_pp_baseline"
    advantage_eps: float = 1e-6
    # -- policy loss (ProRLv2: clip-higher) --
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    loss_agg: str = "token_mean"                 # NeMo-RL token_level_loss (not in paper)
    ppo_mini_batches: int = 4                    # ProRL v1 §3.2: 256 / 64 = 4 updates per step
    ppo_epochs: int = 1
    micro_batch_size: int = 8                    # rows per gradient-accumulation micro-batch
    micro_batch_tokens: int = 0                  # tokens per micro-batch (// row width = rows); 0 = use micro_batch_size rows
    temperature: float = 1.0                     # rollout temperature; log-probs of logits / T
    # -- off-policy correction (BroRL §3.1 "truncated IS"; ICE-POP bounds from NeMo-RL) --
    tis_mode: str = "ice_pop"                    # "ice_pop" (drop outside band) | "truncate" | "off"
    tis_low: float = 0.5
    tis_high: float = 5.0
    recompute_old_logprobs: bool = True          # trainer-side pi_old at step start (veRL old_log_prob)
    # -- KL to the reference (ProRLv2: k2, clamp 10; beta 1e-4 from NeMo-RL / OpenRLHF) --
    kl_coef: float = 1e-4
    kl_estimator: str = "k2"
    kl_clamp: float = 10.0
    ref_reset_interval: int = 0                  # reset pi_ref every K steps; 0 = never (ProRLv2: 200-500)
    reset_optimizer_on_ref_reset: bool = False   # ProRL v1: True, ProRLv2: False
    # -- entropy --
    entropy_coef: float = 0.0                    # bonus off by default (not used by ProRL/BroRL)
    # -- scheduled cosine length penalty (ProRLv2; constants not in paper) --
    length_penalty: bool = False
    length_penalty_coef: float = 0.1             # lambda_len (not in paper)
    length_penalty_eta_min: float = -1.0         # eta at t = T_max (not in paper)
    length_penalty_eta_max: float = 0.0          # eta at t = 0 (not in paper)
    length_penalty_on_steps: int = 100           # ProRLv2 example: 100 on, 500 off
    length_penalty_off_steps: int = 500
    # -- fused log-prob implementation ("auto": chunked on CPU, Pallas on GPU/TPU) --
    logprob_impl: str = "auto"
    remat: bool = True                           # recompute transformer layers in the backward pass

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"AlgoConfig: {msg}")

        need(self.rollouts_per_prompt >= 2, f"rollouts_per_prompt must be >= 2 (group baselines need "
             f"several responses per prompt); got {self.rollouts_per_prompt}")
        need(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1; got {self.prompts_per_step}")
        need(self.advantage_estimator in ADVANTAGE_NAMES,
             f"advantage_estimator must be one of {ADVANTAGE_NAMES}; got {self.advantage_estimator!r}")
        need(self.kl_estimator in KL_NAMES, f"kl_estimator must be one of {KL_NAMES}; got {self.kl_estimator!r}")
        need(self.loss_agg in AGG_NAMES, f"loss_agg must be one of {AGG_NAMES}; got {self.loss_agg!r}")
        need(self.tis_mode in TIS_MODES, f"tis_mode must be one of {TIS_MODES}; got {self.tis_mode!r}")
        need(self.dynamic_sampling_cap_policy in CAP_POLICIES,
             f"dynamic_sampling_cap_policy must be one of {CAP_POLICIES}; got "
             f"{self.dynamic_sampling_cap_policy!r}")
        need(0 <= self.clip_eps_low < 1, f"clip_eps_low must be in [0, 1); got {self.clip_eps_low}")
        need(self.clip_eps_high >= 0, f"clip_eps_high must be >= 0; got {self.clip_eps_high}")
        need(0 <= self.tis_low < self.tis_high,
             f"need 0 <= tis_low < tis_high; got tis_low={self.tis_low}, tis_high={self.tis_high}")
        need(self.kl_coef >= 0, f"kl_coef must be >= 0; got {self.kl_coef}")
        need(self.kl_clamp > 0, f"kl_clamp must be > 0; got {self.kl_clamp}")
        need(self.ppo_mini_batches >= 1 and self.ppo_epochs >= 1 and self.micro_batch_size >= 1,
             "ppo_mini_batches, ppo_epochs and micro_batch_size must be >= 1")
        need(self.micro_batch_tokens >= 0,
             f"micro_batch_tokens must be >= 0 (0 = micro_batch_size rows); got {self.micro_batch_tokens}")
        need(self.temperature > 0, f"temperature must be > 0; got {self.temperature}")
        need(self.generation_batch_multiplier > 0,
             f"generation_batch_multiplier must be > 0; got {self.generation_batch_multiplier}")
        need(self.max_generation_rounds >= 1,
             f"max_generation_rounds must be >= 1; got {self.max_generation_rounds}")
        need(self.ref_reset_interval >= 0, f"ref_reset_interval must be >= 0; got {self.ref_reset_interval}")
        need(self.logprob_impl in ("auto", "pallas", "chunked", "naive"),
             f"logprob_impl must be auto|pallas|chunked|naive; got {self.logprob_impl!r}")

    @property
    def batch_rows(self) -> int:
        """Rows of the update batch: prompts_per_step * rollouts_per_prompt."""
        return self.prompts_per_step * self.rollouts_per_prompt

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "AlgoConfig":
        """Build from a dict / ml_collections.ConfigDict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        items = dict(mapping.items()) if hasattr(mapping, "items") else dict(mapping)
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"AlgoConfig: unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**items)
