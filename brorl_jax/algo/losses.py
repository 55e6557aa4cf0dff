"""Policy loss pieces: PPO clip-higher surrogate, truncated IS (ICE-POP), KL estimators, entropy
bonus and loss aggregation (BroRL §3.1, ProRLv2; conventions of veRL core_algos).

Per token t of response i (all arrays [B, T], advantages A [B] broadcast -> [B, T], or per token
[B, T] on packed rows):
    r       = exp(logp - old_logp)                      PPO ratio against the step-start policy
    pg      = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))        (= -min(r A, clip(r) A))
    w_tis   = stop_grad(IS weight pi_old_trainer / pi_rollout):
              ice_pop:  k if tis_low <= k <= tis_high else 0   (tokens outside the band dropped)
              truncate: min(k, tis_high)                        (Yao et al. 2025)
              off:      1
    kl      = estimator(clamp(logp - ref_logp, -c, c)):  k1 = x, k2 = x^2 / 2, k3 = e^-x - 1 + x
    loss_t  = w_tis pg + beta kl - entropy_coef H
    loss    = sum_t agg_weight_t loss_t
with aggregation weights (computed on the whole PPO mini-batch so that micro-batch sums add up):
    token_mean:           mask / sum(mask)
    seq_mean_token_mean:  mask / (len_i * #non-empty sequences)   (segment sums on packed rows)
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


# ------------------------------------------------------------------------- aggregation weights
# A "sequence" is a row of the padded layout, or a run of equal segment ids in a packed row
# (docs/INTERFACES.md "algo"); a packed sequence never straddles rows, so per-sequence sums are
# row-local.

def token_mean_weights(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """mask [B, T] -> weights [B, T] summing to 1 over all valid tokens (token-level loss).
    segment_ids is accepted for a uniform signature (packing does not change a token mean)."""
    del segment_ids
    m = mask.astype(jnp.float32)
    return m / jnp.maximum(jnp.sum(m), 1.0)


def segment_token_counts(mask: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-sequence sums on packed rows: mask [B, T], segment_ids int [B, T] (each sequence one
    contiguous run of equal ids within its row) -> (count [B, T]: the number of mask tokens of the
    token's sequence, first bool [B, T]: the token opens its run). Row-local prefix sums (exact
    for counts below 2^24), so rows stay independent under a row-sharded mesh."""
    m = mask.astype(jnp.float32)
    seg = segment_ids.astype(jnp.int32)
    t = seg.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)
    first = seg != jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    last = seg != jnp.pad(seg[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
    end = jax.lax.cummin(jnp.where(last, idx, t - 1), axis=1, reverse=True)
    c = jnp.cumsum(m, axis=1)
    at = lambda x, i: jnp.take_along_axis(x, i, axis=1)
    return at(c, end) - at(c, start) + at(m, start), first


def seq_mean_token_mean_weights(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """mask [B, T] -> weights: mean over tokens within each sequence, then over non-empty
    sequences (sequences without any loss token, e.g. dynamic-sampling padding, are not counted).
    segment_ids [B, T]: packed rows (sequences are segments); None: each row is one sequence."""
    m = mask.astype(jnp.float32)
    if segment_ids is None:
        lens = jnp.sum(m, axis=1, keepdims=True)
        n_seq = jnp.maximum(jnp.sum(lens > 0), 1)
    else:
        lens, first = segment_token_counts(mask, segment_ids)
        n_seq = jnp.maximum(jnp.sum(first & (segment_ids > 0) & (lens > 0)), 1)
    return m / jnp.maximum(lens, 1.0) / n_seq


LOSS_AGG: dict[str, Callable[..., jax.Array]] = {
    "token_mean": token_mean_weights,
    "seq_mean_token_mean": seq_mean_token_mean_weights,
}


def get_loss_agg(name: str) -> Callable[..., jax.Array]:
    """LOSS_AGG[name]: (loss_mask [B, T], segment_ids [B, T] or None) -> weights [B, T]."""
    try:
        return LOSS_AGG[name]
    except KeyError:
        raise ValueError(f"unknown loss_agg {name!r}; allowed: {sorted(LOSS_AGG)}") from None


# ------------------------------------------------------------------------- KL estimators

def kl_k1(log_ratio: jax.Array) -> jax.Array:
    """k1 = log pi/pi_ref (unbiased, high variance, can be negative)."""
    return log_ratio


def kl_k2(log_ratio: jax.Array) -> jax.Array:
    """k2 = (log pi/pi_ref)^2 / 2 (ProRLv2 default; its gradient is the true reverse-KL gradient
    for on-policy samples)."""
    return 0.5 * jnp.square(log_ratio)


def kl_k3(log_ratio: jax.Array) -> jax.Array:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi) (Schulman's low-variance estimator, >= 0)."""
    return jnp.exp(-log_ratio) - 1.0 + log_ratio


KL_ESTIMATORS: dict[str, Callable[[jax.Array], jax.Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[jax.Array], jax.Array]:
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown kl_estimator {name!r}; allowed: {sorted(KL_ESTIMATORS)}") from None


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k2", clamp: float = 10.0) -> jax.Array:
    """Per-token KL estimate [B, T] from log pi and log pi_ref, log-ratio clamped to [-clamp, clamp]
    (ProRLv2: clamp 10 before exponentiating)."""
    log_ratio = jnp.clip(logp - ref_logp, -clamp, clamp)
    return get_kl_estimator(estimator)(log_ratio)


# ------------------------------------------------------------------------- PPO and TIS

def ppo_clip_objective(logp, old_logp, advantages, clip_eps_low: float, clip_eps_high: float):
    """Per-token clipped surrogate loss (to minimise) and where clipping is active.

    Returns (pg [B, T], ratio [B, T], clipped_low bool, clipped_high bool). clipped_low: A < 0 and
    r < 1 - eps_low (the clipped branch is the max); clipped_high: A > 0 and r > 1 + eps_high."""
    ratio = jnp.exp(logp - old_logp)
    adv = advantages if advantages.ndim == logp.ndim else advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = jnp.maximum(unclipped, clipped)
    clipped_low = (adv < 0) & (ratio < 1.0 - clip_eps_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + clip_eps_high)
    return pg, ratio, clipped_low, clipped_high


def _tis_ice_pop(k, low, high):
    keep = (k >= low) & (k <= high)
    return jnp.where(keep, k, 0.0), ~keep


def _tis_truncate(k, low, high):
    del low
    return jnp.minimum(k, high), k > high


def _tis_off(k, low, high):
    del low, high
    return jnp.ones_like(k), jnp.zeros(k.shape, bool)


# algo.tis_mode: weight(k, low, high) -> (weight, dropped-or-truncated mask)
TIS_MODES: dict[str, Callable] = {"ice_pop": _tis_ice_pop, "truncate": _tis_truncate,
                                  "off": _tis_off}


def tis_weights(trainer_logp, rollout_logp, mode: str = "ice_pop", low: float = 0.5, high: float = 5.0):
    """Importance weight of the trainer's pi_old over the rollout engine's pi, [B, T], under
    stop_gradient. Returns (weight, dropped bool). See module docstring for the modes."""
    if mode not in TIS_MODES:
        raise ValueError(f"unknown tis_mode {mode!r}; allowed: {sorted(TIS_MODES)}")
    k = jnp.exp(lax_stop(trainer_logp) - lax_stop(rollout_logp))
    return TIS_MODES[mode](k, low, high)


def lax_stop(x):
    return jax.lax.stop_gradient(x)


# ------------------------------------------------------------------------- the full loss

def policy_loss(
    logp: jax.Array,
    entropy: jax.Array,
    *,
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    ref_logp: jax.Array | None,
    advantages: jax.Array,
    loss_mask: jax.Array,
    agg_weights: jax.Array,
    cfg,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss sum_t agg_weight_t (w_tis pg + beta kl - entropy_coef H) for a (micro-)batch.

    logp, entropy: current policy [B, T]; old_logp: step-start trainer log-probs; rollout_logp:
    sampling-time log-probs (the TIS denominator); ref_logp: reference log-probs or None when
    kl_coef == 0; advantages [B] (per row) or [B, T] (per token, packed rows); loss_mask bool
    [B, T]; agg_weights [B, T] from LOSS_AGG applied to the whole mini-batch; cfg: AlgoConfig.
    Returns (loss, sums) where sums holds token-sums (over loss_mask) of the diagnostics plus the
    weighted pg/kl/entropy terms, so callers can add micro-batches and divide by n_tokens.
    """
    m = loss_mask.astype(jnp.float32)
    w = agg_weights * m
    pg, ratio, c_low, c_high = ppo_clip_objective(logp, old_logp, advantages,
                                                  cfg.clip_eps_low, cfg.clip_eps_high)
    tis_w, dropped = tis_weights(old_logp, rollout_logp, cfg.tis_mode, cfg.tis_low, cfg.tis_high)
    pg_term = jnp.sum(w * tis_w * pg)
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator, cfg.kl_clamp)
    else:
        kl = jnp.zeros_like(logp)
    kl_term = jnp.sum(w * kl)
    ent_term = jnp.sum(w * entropy)
    loss = pg_term + cfg.kl_coef * kl_term - cfg.entropy_coef * ent_term
    sg = jax.lax.stop_gradient
    sums = {
        "pg_loss": sg(pg_term),
        "kl_loss": sg(kl_term),
        "entropy_loss": sg(ent_term),
        "n_tokens": jnp.sum(m),
        "kl_sum": sg(jnp.sum(m * kl)),
        "entropy_sum": sg(jnp.sum(m * entropy)),
        "clip_low_sum": jnp.sum(m * c_low),
        "clip_high_sum": jnp.sum(m * c_high),
        "ratio_sum": sg(jnp.sum(m * ratio)),
        "tis_dropped_sum": jnp.sum(m * dropped),
        "tis_weight_sum": jnp.sum(m * tis_w),
    }
    return loss, sums
