"""Mass-balance theory of BroRL (arXiv 2510.01180, §2, §4.1, App. C).

mass_balance: Theorem 1 quantities (P_pos, P_neg, Q_pos, A_2, B_2, U_pos,2, U_neg,2, S_R, the three
  terms of ΔQ_pos) and Lemma 2's expectation Σ_i p_i^2 (1 - p_i)^N.
diagnostics:  the per-step training diagnostics built on them.
simulate:     the §4.1 / Fig. 3 simulation (``python -m brorl_jax.theory.simulate``).

Depends only on jax, numpy, optax and matplotlib (never on the rest of brorl_jax).
"""

from brorl_jax.theory.diagnostics import (
    expected_unsampled_second_moment,
    first_occurrence,
    group_reward_balance,
    reward_balance_metrics,
    unsampled_second_moment_from_logits,
    unsampled_second_moment_from_probs,
)
from brorl_jax.theory.mass_balance import (
    DeltaQPos,
    MassBalance,
    delta_q_pos,
    lemma2_expected_unsampled,
    linear_surrogate_loss,
    logit_step,
    partial_masses,
    sampled_set_mask,
    token_rewards,
    unsampled_second_moment_terms,
)

__all__ = [
    "DeltaQPos", "MassBalance", "delta_q_pos", "lemma2_expected_unsampled",
    "linear_surrogate_loss", "logit_step", "partial_masses", "sampled_set_mask", "token_rewards",
    "unsampled_second_moment_terms", "expected_unsampled_second_moment", "first_occurrence",
    "group_reward_balance", "reward_balance_metrics", "unsampled_second_moment_from_logits",
    "unsampled_second_moment_from_probs",
]
