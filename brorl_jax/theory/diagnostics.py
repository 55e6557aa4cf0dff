"""Live mass-balance diagnostics for training (BroRL §2, arXiv 2510.01180).

Pure ``jnp`` functions the trainer calls once per step; none of them makes a pass over the
vocabulary on its own in training: the per-position vocabulary sum is produced by the fused
log-prob kernel (``pallas_kernels.fused_logprob_stats``), these functions only reduce it.

1. Expected unsampled second moment (Lemma 2 / Corollary 3, token level).
   At a response position t the policy has a next-token distribution p_t[V]. If N tokens were
   drawn i.i.d. from p_t, token v would be missed with probability (1 - p_v)^N, so the expected
   unsampled second moment is  u_t = Σ_v p_{t,v}^2 (1 - p_{t,v})^N  (the quantity that drives the
   sign-indefinite term of Theorem 1 and shrinks monotonically with N). The trainer logs the mean
   of u_t over response positions at the run's current N (rollouts per prompt). This is a proxy:
   only the first response position really has N i.i.d. draws from one distribution (later
   positions condition on different prefixes in each rollout).

2. Per prompt group reward balance ("batch mood" S_R of §2.1 with R_c = +1, R_w = -1, a "token"
   being a whole response, sampled from the policy N times):

   * ``frac_correct``  = (1/N) Σ_j 1[r_j >= correct_threshold].
   * ``s_r_sample``    = (1/N) Σ_j R_j with R_j = ±1, i.e. 2 frac_correct - 1. It is an unbiased
     estimate of Q_pos - Q_neg, which is what S_R becomes when the sampled set covers all the
     mass (U empty, N -> ∞). Its sign says whether the group is reward-positive.
   * With sequence log-probs (log π(y_j | x) under the current policy), over *distinct* responses
     (duplicates identified by ``response_ids`` when given, else every sample is distinct):
       ``log_p_pos`` = log P_pos = log Σ_{distinct correct} π(y),  ``log_p_neg`` likewise;
       ``s_r``       = P_pos - P_neg: exactly the paper's S_R (set based). For LLM responses the
                       sampled mass is tiny, so |S_R| is tiny too (implication (ii) of Theorem 1);
       ``s_r_mass_weighted`` = (P_pos - P_neg) / (P_pos + P_neg) ∈ [-1, 1]: S_R normalized by the
                       sampled mass; same sign as S_R, comparable across groups;
       ``s_r_centered`` = s_r_mass_weighted - s_r_sample: the normalized S_R after the group-mean
                       baseline b = s_r_sample is subtracted from the rewards (R_c' = 1 - b,
                       R_w' = -1 - b, so S_R' = S_R - b (P_pos + P_neg)); this is the sign of the
                       unsampled-coupling term for baseline-centred advantages, as in the trainer
                       and the §4.1 simulation.
   Summaries over (valid) groups: means, fraction of groups with S_R > 0 / < 0, fraction of
   all-correct and all-wrong groups (those have zero centred advantage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from brorl_jax.theory.mass_balance import lemma2_expected_unsampled

Array = jax.Array


def unsampled_second_moment_from_probs(probs: Array, n: int | Array) -> Array:
    """Reference for the kernel statistic: Σ_v p_v^2 (1 - p_v)^N, ``probs[..., V]`` -> ``[...]``."""
    return lemma2_expected_unsampled(probs, n, axis=-1)


def unsampled_second_moment_from_logits(
    logits: Array, n: int | Array, temperature: float = 1.0
) -> Array:
    """Same from ``logits[..., V]`` with p = softmax(logits / temperature) -> ``[...]``."""
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1)
    return unsampled_second_moment_from_probs(probs, n)


def expected_unsampled_second_moment(unsampled_stat: Array, mask: Array) -> Array:
    """Mean of the per-position Σ_v p_v^2 (1 - p_v)^N over response positions.

    ``unsampled_stat`` [T] (or any shape, e.g. [B, T]) is the per-position sum computed by the
    fused log-prob pass at the current N; ``mask`` (same shape) is True on response positions.
    Returns a scalar, 0 when the mask is empty. A trailing axis of K values of N (the kernel's
    ``sum_p2_unsampled`` [T, K]) is kept: ``unsampled_stat`` [..., K] with ``mask`` [...] -> [K].
    """
    unsampled_stat = jnp.asarray(unsampled_stat)
    mask = jnp.asarray(mask, bool)
    if unsampled_stat.shape == mask.shape + unsampled_stat.shape[-1:] and \
            unsampled_stat.ndim == mask.ndim + 1:
        mask = mask[..., None]
        axes = tuple(range(mask.ndim - 1))
    elif unsampled_stat.shape == mask.shape:
        axes = None
    else:
        raise ValueError(f"unsampled_stat shape {unsampled_stat.shape} must equal mask shape "
                         f"{mask.shape} (optionally with one trailing axis over N values)")
    total = jnp.sum(jnp.where(mask, unsampled_stat, 0.0), axis=axes)
    count = jnp.sum(jnp.broadcast_to(mask, unsampled_stat.shape), axis=axes)
    return total / jnp.maximum(count, 1).astype(total.dtype)


def first_occurrence(response_ids: Array) -> Array:
    """bool[G, N]: True on the first sample of each distinct ``response_ids[G, N]`` in its group."""
    ids = jnp.asarray(response_ids)
    n = ids.shape[-1]
    same = ids[..., :, None] == ids[..., None, :]                      # [G, N, N]
    earlier = jnp.tril(jnp.ones((n, n), bool), k=-1)                   # k < j
    return ~jnp.any(same & earlier, axis=-1)


def _masked_mean(x: Array, mask: Array) -> Array:
    x = x.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def _checked_groups(rewards, seq_logprobs, response_ids, group_mask) -> tuple[Array, Array]:
    """group_reward_balance's inputs checked: (rewards [G, N], group_mask bool[G])."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [G, N] (groups x samples per group), got shape "
                         f"{rewards.shape}")
    g = rewards.shape[0]
    for name, arr in (("seq_logprobs", seq_logprobs), ("response_ids", response_ids)):
        if arr is not None and jnp.shape(arr) != rewards.shape:
            raise ValueError(f"{name} must have the shape of rewards {rewards.shape}, got "
                             f"{jnp.shape(arr)}")
    group_mask = jnp.ones((g,), bool) if group_mask is None else jnp.asarray(group_mask, bool)
    if group_mask.shape != (g,):
        raise ValueError(f"group_mask must be [G] = ({g},), got {group_mask.shape}")
    return rewards, group_mask


def group_reward_balance(
    rewards: Array,
    seq_logprobs: Array | None = None,
    *,
    correct_threshold: float = 0.5,
    response_ids: Array | None = None,
    group_mask: Array | None = None,
) -> dict[str, Array]:
    """Sample-based S_R-style statistics per prompt group (see the module docstring).

    Args:
      rewards: f32[G, N] verifier rewards of the N rollouts of each of G prompts.
      seq_logprobs: optional f32[G, N], log π(y_j | x) of each whole response under the current
        policy (sum of its token log-probs). Enables the mass-weighted (paper S_R) statistics.
      correct_threshold: a rollout is correct when reward >= this (0.5 suits {0, 1} and {-1, 1}).
      response_ids: optional int[G, N]; equal ids mark identical responses, which count once in
        the set-based masses (paper App. C.1). Without it every sample counts as distinct.
      group_mask: optional bool[G]; False marks padded groups, left out of the summaries.

    Returns a dict. Per group ([G]): frac_correct, s_r_sample and, with ``seq_logprobs``,
    num_distinct, log_p_pos, log_p_neg, s_r, s_r_mass_weighted, s_r_centered. Summaries (scalars):
    mean_frac_correct, mean_s_r_sample, frac_groups_s_r_sample_pos, frac_groups_s_r_sample_neg,
    frac_groups_all_correct, frac_groups_all_wrong and, with ``seq_logprobs``,
    mean_s_r_mass_weighted, frac_groups_s_r_pos, mean_s_r_centered, frac_groups_s_r_centered_pos.
    """
    rewards, group_mask = _checked_groups(rewards, seq_logprobs, response_ids, group_mask)
    correct = rewards >= correct_threshold                              # [G, N]
    frac_correct = jnp.mean(correct.astype(jnp.float32), axis=-1)
    s_r_sample = 2.0 * frac_correct - 1.0                              # mean of ±1 rewards
    out = {
        "frac_correct": frac_correct,
        "s_r_sample": s_r_sample,
        "mean_frac_correct": _masked_mean(frac_correct, group_mask),
        "mean_s_r_sample": _masked_mean(s_r_sample, group_mask),
        "frac_groups_s_r_sample_pos": _masked_mean(s_r_sample > 0, group_mask),
        "frac_groups_s_r_sample_neg": _masked_mean(s_r_sample < 0, group_mask),
        "frac_groups_all_correct": _masked_mean(frac_correct == 1.0, group_mask),
        "frac_groups_all_wrong": _masked_mean(frac_correct == 0.0, group_mask),
    }
    if seq_logprobs is None:
        return out

    logp = jnp.asarray(seq_logprobs, jnp.float32)
    distinct = (jnp.ones(rewards.shape, bool) if response_ids is None
                else first_occurrence(response_ids))
    neg_inf = jnp.float32(-jnp.inf)
    # Log-space sums: sequence probabilities underflow float32 for any realistic length. The
    # group max is taken out first so that ratios keep float32 precision at log-probs ~ -1e3.
    shift = jax.lax.stop_gradient(jnp.max(logp, axis=-1))                # [G]
    rel = logp - shift[:, None]
    rel_pos = jax.nn.logsumexp(jnp.where(distinct & correct, rel, neg_inf), axis=-1)
    rel_neg = jax.nn.logsumexp(jnp.where(distinct & ~correct, rel, neg_inf), axis=-1)
    rel_total = jnp.logaddexp(rel_pos, rel_neg)
    s_r_mass_weighted = jnp.exp(rel_pos - rel_total) - jnp.exp(rel_neg - rel_total)
    log_p_pos, log_p_neg = rel_pos + shift, rel_neg + shift
    s_r_centered = s_r_mass_weighted - s_r_sample
    out.update({
        "num_distinct": jnp.sum(distinct, axis=-1),
        "log_p_pos": log_p_pos,
        "log_p_neg": log_p_neg,
        "s_r": jnp.exp(log_p_pos) - jnp.exp(log_p_neg),
        "s_r_mass_weighted": s_r_mass_weighted,
        "s_r_centered": s_r_centered,
        "mean_s_r_mass_weighted": _masked_mean(s_r_mass_weighted, group_mask),
        # sign(S_R) = sign(s_r_mass_weighted); the latter does not underflow.
        "frac_groups_s_r_pos": _masked_mean(s_r_mass_weighted > 0, group_mask),
        "mean_s_r_centered": _masked_mean(s_r_centered, group_mask),
        "frac_groups_s_r_centered_pos": _masked_mean(s_r_centered > 0, group_mask),
    })
    return out


def reward_balance_metrics(balance: dict[str, Array], prefix: str = "theory/") -> dict[str, Array]:
    """The scalar summaries of :func:`group_reward_balance`, keyed ``prefix + name`` for logging."""
    return {prefix + k: v for k, v in balance.items() if jnp.ndim(v) == 0}
