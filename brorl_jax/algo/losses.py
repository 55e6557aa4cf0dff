"""Policy loss pieces: PPO clip-higher surrogate with dual-clip, truncated IS, KL estimators,
entropy bonus and loss aggregation (BroRL §3.1, ProRLv2; veRL core_algos conventions, checked
against veRL's own outputs in tests/algo/test_verl_parity.py).

Per token t of response i (all arrays [B, T], advantages A [B] broadcast -> [B, T], or per token
[B, T] on packed rows):
    r       = exp(clamp(logp - old_logp, -20, 20))          PPO ratio (veRL clamps the log-ratio)
    pg      = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))        (= -min(r A, clip(r) A))
    dual    = min(pg, -c A) where A < 0, if dual_clip_c = c > 1   (veRL compute_policy_loss_vanilla;
              Ye et al. 2020); 0 = off
    w_tis   = stop_grad(IS weight pi_old_trainer / pi_rollout), TIS_MODES:
              truncate: min(k, tis_high)                        (Yao et al. 2025; veRL rollout_is)
              ice_pop:  k if tis_low <= k <= tis_high else 0   (tokens outside the band dropped)
              off:      1
    kl      = KL_ESTIMATORS on x = logp - ref_logp:
              k1 = x                                  (veRL "kl": unclamped)
              k2 = clamp(x, -c, c)^2 / 2              (ProRLv2: c = kl_clamp = 10; c = inf is
                                                        veRL's unclamped "mse")
              k3 = clamp(e^-x' - 1 + x', -10, 10), x' = clamp(x, -20, 20)   (veRL "low_var_kl")
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

# veRL's bounds (core_algos.kl_penalty "low_var_kl" and compute_policy_loss_vanilla).
K3_INPUT_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
PPO_LOG_RATIO_CLAMP = 20.0


def kl_k1(log_ratio: jax.Array, clamp: float = jnp.inf) -> jax.Array:
    """k1 = log pi/pi_ref (unbiased, high variance, can be negative); unclamped as in veRL."""
    del clamp
    return log_ratio


def kl_k2(log_ratio: jax.Array, clamp: float = jnp.inf) -> jax.Array:
    """k2 = clamp(log pi/pi_ref, -c, c)^2 / 2. ProRLv2 states the clamp c = 10 (its write-up:
    x = exp(clamp(log pi_ref/pi_old, -10, 10))); veRL's "mse" is the same without a clamp. Its
    gradient is the true reverse-KL gradient for on-policy samples."""
    return 0.5 * jnp.square(jnp.clip(log_ratio, -clamp, clamp))


def kl_k3(log_ratio: jax.Array, clamp: float = jnp.inf) -> jax.Array:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi) (Schulman's low-variance estimator, >= 0), as veRL's
    "low_var_kl": the log-ratio clamped to +-20 and the value to [-10, 10] (`clamp` unused)."""
    del clamp
    x = jnp.clip(log_ratio, -K3_INPUT_CLAMP, K3_INPUT_CLAMP)
    return jnp.clip(jnp.exp(-x) - 1.0 + x, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, float], jax.Array]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[jax.Array, float], jax.Array]:
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown kl_estimator {name!r}; allowed: {sorted(KL_ESTIMATORS)}") from None


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k2",
               clamp: float = 10.0) -> jax.Array:
    """Per-token KL estimate [B, T] from log pi and log pi_ref; `clamp` is k2's log-ratio clamp
    (module docstring: k1 and k3 follow veRL's own bounds)."""
    return get_kl_estimator(estimator)(logp - ref_logp, clamp)


# ------------------------------------------------------------------------- PPO and TIS

def ppo_clip_objective(logp, old_logp, advantages, clip_eps_low: float, clip_eps_high: float,
                       dual_clip_c: float = 0.0):
    """Per-token clipped surrogate loss (to minimise) and where clipping is active.

    Returns (pg [B, T], ratio [B, T], clipped_low bool, clipped_high bool, dual_clipped bool).
    clipped_low: A < 0 and r < 1 - eps_low; clipped_high: A > 0 and r > 1 + eps_high (so their sum
    is veRL's pg_clipfrac); dual_clipped: A < 0 and the dual-clip bound -c A is the loss (veRL's
    pg_clipfrac_lower)."""
    ratio = jnp.exp(jnp.clip(logp - old_logp, -PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP))
    adv = advantages if advantages.ndim == logp.ndim else advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = jnp.maximum(unclipped, clipped)
    clipped_low = (adv < 0) & (ratio < 1.0 - clip_eps_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + clip_eps_high)
    if dual_clip_c > 0:
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (pg > bound)
        pg = jnp.where(dual, bound, pg)
    else:
        dual = jnp.zeros(pg.shape, bool)
    return pg, ratio, clipped_low, clipped_high, dual


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
    log_k = jnp.clip(lax_stop(trainer_logp) - lax_stop(rollout_logp), -PPO_LOG_RATIO_CLAMP,
                     PPO_LOG_RATIO_CLAMP)           # veRL rollout_corr_helper clamps at +-20 too
    return TIS_MODES[mode](jnp.exp(log_k), low, high)


def behaviour_gap(trainer_logp, rollout_logp):
    """Per token, under stop_gradient: |log pi_old - log mu| (the trainer's step-start log-prob
    against the rollout engine's sampling log-prob: precision, kernels, staleness) and the k3
    estimate of KL(mu || pi_old) from the samples of mu, exp(d) - 1 - d with d = log pi_old -
    log mu (Schulman's k3: unbiased, >= 0), d clamped like the TIS ratio. Logged as
    rollout/logprob_gap_mean and rollout/behaviour_kl."""
    d = jnp.clip(lax_stop(trainer_logp) - lax_stop(rollout_logp), -PPO_LOG_RATIO_CLAMP,
                 PPO_LOG_RATIO_CLAMP)
    return jnp.abs(d), jnp.expm1(d) - d


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
    [B, T]; agg_weights [B, T] from LOSS_AGG applied to the whole mini-batch; cfg: UpdateConfig.
    Returns (loss, sums) where sums holds token-sums (over loss_mask) of the diagnostics plus the
    weighted pg/kl/entropy terms, so callers can add micro-batches and divide by n_tokens.
    """
    m = loss_mask.astype(jnp.float32)
    w = agg_weights * m
    pg, ratio, c_low, c_high, dual = ppo_clip_objective(logp, old_logp, advantages,
                                                        cfg.clip_eps_low, cfg.clip_eps_high,
                                                        cfg.dual_clip_c)
    tis_w, dropped = tis_weights(old_logp, rollout_logp, cfg.tis_mode, cfg.tis_low, cfg.tis_high)
    gap_abs, behaviour_kl = behaviour_gap(old_logp, rollout_logp)
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
        "dual_clip_sum": jnp.sum(m * dual),
        "ratio_sum": sg(jnp.sum(m * ratio)),
        "tis_dropped_sum": jnp.sum(m * dropped),
        "tis_weight_sum": jnp.sum(m * tis_w),
        "logprob_gap_sum": jnp.sum(m * gap_abs),
        "behaviour_kl_sum": jnp.sum(m * behaviour_kl),
    }
    return loss, sums


# The sums policy_loss returns (per mini-batch), and the step's metrics from them
METRIC_SUMS = ("n_tokens", "kl_sum", "entropy_sum", "clip_low_sum", "clip_high_sum",
               "dual_clip_sum", "ratio_sum", "tis_dropped_sum", "tis_weight_sum", "pg_loss",
               "kl_loss", "entropy_loss", "logprob_gap_sum", "behaviour_kl_sum")


def step_metrics(m: dict, cfg) -> dict:
    """The step's metrics from the per-mini-batch ones (stacked [ppo_epochs * M]); cfg: the
    UpdateConfig."""
    n_tok = jnp.maximum(m["n_tokens"], 1.0)
    frac = lambda k: jnp.mean(m[k] / n_tok)
    return {
        "loss": jnp.mean(m["loss"]),
        "pg_loss": jnp.mean(m["pg_loss"]),
        "kl": frac("kl_sum"),
        "entropy": frac("entropy_sum"),
        "clip_frac_low": frac("clip_low_sum"),
        "clip_frac_high": frac("clip_high_sum"),
        "clip_frac": jnp.mean((m["clip_low_sum"] + m["clip_high_sum"]) / n_tok),
        "dual_clip_frac": frac("dual_clip_sum"),
        "ratio_mean": frac("ratio_sum"),
        "tis_dropped_frac": frac("tis_dropped_sum"),
        "tis_weight_mean": frac("tis_weight_sum"),
        "logprob_gap_mean": frac("logprob_gap_sum"),
        "behaviour_kl": frac("behaviour_kl_sum"),
        "grad_norm": jnp.mean(m["grad_norm"]),
        "grad_var": jnp.mean(m["grad_var"]),
        "finite": jnp.min(m["finite"]),
        "skipped": jnp.sum(1.0 - m["finite"]),
        "n_tokens": jnp.sum(m["n_tokens"]) / cfg.ppo_epochs,
        "optimizer_steps": jnp.sum(m["finite"]),
    }
