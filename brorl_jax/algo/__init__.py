"""brorl_jax.algo: advantages, dynamic sampling, policy loss, KL, optimizer and the update step.

The host-side half of a step (selection, shaping, filtering, advantages, the update batch) is
algo/host.py: the step's host-side decisions, pure functions over an explicit CollectState. See
docs/algo.md for the design and the choices made where the papers are silent. The registries
(ADVANTAGES, GROUP_FILTERS, KL_ESTIMATORS, LOSS_AGG, TIS_MODES, policies.ADVANTAGE_NORMALIZERS)
are the lists of choices that config validation and --help read.
"""
from brorl_jax.algo import adapters, host  # noqa: E402 - after the modules it builds on
from brorl_jax.algo.advantages import ADVANTAGES, compute_advantages, get_advantage_fn
from brorl_jax.algo.batch import (
                                  TokenRows,
                                  UpdateBatch,
                                  assemble_groups,
                                  assemble_update_batch,
                                  bucket_rows,
                                  is_packed,
                                  pad_packed_rows,
                                  unpack_to_padded,
)
from brorl_jax.algo.dynamic_sampling import (
                                  CAP_POLICIES,
                                  GROUP_FILTERS,
                                  DynamicSamplingError,
                                  Group,
                                  GroupSampler,
                                  generation_batch_size,
                                  get_group_filter,
                                  select_groups,
)
from brorl_jax.algo.host import CollectState  # noqa: E402
from brorl_jax.algo.length_penalty import (
                                  apply_length_penalty,
                                  cosine_length_reward,
                                  length_penalty_active,
)
from brorl_jax.algo.losses import (
                                  KL_ESTIMATORS,
                                  LOSS_AGG,
                                  TIS_MODES,
                                  get_kl_estimator,
                                  get_loss_agg,
                                  kl_penalty,
                                  policy_loss,
                                  ppo_clip_objective,
                                  tis_weights,
)
from brorl_jax.algo.optimizer import (
                                  OPTIMIZERS,
                                  SCHEDULES,
                                  OptimizerConfig,
                                  learning_rate_schedule,
                                  make_optimizer,
                                  scaled_learning_rate,
)
from brorl_jax.algo.update import (
                                  PolicyFns,
                                  TrainState,
                                  create_train_state,
                                  make_logprob_fn,
                                  make_update_step,
                                  maybe_reset_reference,
                                  micro_batch_rows,
                                  model_policy_fns,
                                  reset_reference,
)

__all__ = [
    "ADVANTAGES", "compute_advantages", "get_advantage_fn", "assemble_groups",
    "assemble_update_batch", "bucket_rows", "is_packed", "pad_packed_rows", "unpack_to_padded",
    "TokenRows", "UpdateBatch",
    "CAP_POLICIES", "GROUP_FILTERS", "DynamicSamplingError",
    "Group", "GroupSampler", "generation_batch_size", "get_group_filter", "select_groups",
    "apply_length_penalty", "cosine_length_reward", "length_penalty_active", "KL_ESTIMATORS",
    "LOSS_AGG", "TIS_MODES", "get_kl_estimator", "get_loss_agg", "kl_penalty", "policy_loss",
    "ppo_clip_objective", "tis_weights", "OPTIMIZERS", "SCHEDULES", "OptimizerConfig",
    "learning_rate_schedule", "make_optimizer", "scaled_learning_rate", "PolicyFns", "TrainState",
    "create_train_state", "make_logprob_fn", "make_update_step", "maybe_reset_reference",
    "micro_batch_rows",
    "model_policy_fns", "reset_reference", "host", "CollectState", "adapters",
]
