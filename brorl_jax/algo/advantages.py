"""Outcome-reward advantage estimators, selectable by name (BroRL §3.1; ProRL Eq. 2).

Every estimator takes rewards [G, N] (G prompt groups x up to N responses) and returns advantages
[G, N] float32. Optional masks say which entries exist: group_mask bool [G] (False = a padded
group) and sample_mask bool [G, N] (False = a padded response slot of a smaller group, as adaptive
N makes); masked entries enter no statistic and get advantage 0. Works on numpy or jax arrays,
inside or outside jit. `ADVANTAGES` is the list of choices (`algo.advantage` reads it):

  reinforce_pp_baseline (BroRL / ProRLv2 default, veRL "reinforce_plus_plus_baseline"):
      A = R - mean_group(R);  A_norm = (A - mean_batch(A)) / sqrt(var_batch(A) + whiten_eps)
      where the batch statistics run over every response token of every kept group (veRL's
      masked_whiten, unbiased variance; the loop passes the response lengths).
  grpo:     A = (R - mean_group(R)) / (std_group(R) + eps)   (std with ddof=1, as veRL/torch.std)
  rloo:     A_i = R_i - mean_{j != i} R_j = N/(N-1) (R_i - mean_group(R))
  dr_grpo:  A = R - mean_group(R)   (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
            Training": GRPO without the std division, which over-weights easy/hard prompts)

Adding an estimator: write `fn(rewards, group_mask=None, *, sample_mask=None, eps, whiten_eps,
lengths=None)`
here, add it to ADVANTAGES, test it in tests/algo/test_advantages.py; config validation and
`--help` read the registry.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _prep(rewards, group_mask, sample_mask):
    """-> (rewards f32 [G, N], mask bool [G, N]: which entries exist)."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be [G, N] with N >= 2 responses per prompt; got shape {r.shape}")
    if group_mask is None:
        gm = jnp.ones((r.shape[0],), bool)
    else:
        gm = jnp.asarray(group_mask, bool)
        if gm.shape != (r.shape[0],):
            raise ValueError(f"group_mask must be [G={r.shape[0]}]; got shape {gm.shape}")
    mask = jnp.broadcast_to(gm[:, None], r.shape)
    if sample_mask is not None:
        sm = jnp.asarray(sample_mask, bool)
        if sm.shape != r.shape:
            raise ValueError(f"sample_mask must be [G, N]={r.shape}; got shape {sm.shape}")
        mask = mask & sm
    return r, mask


def _group_centered(r, mask):
    """R - mean over the group's existing responses (0 where masked), and the group sizes [G, 1]."""
    m = mask.astype(jnp.float32)
    n_g = jnp.sum(m, axis=1, keepdims=True)
    mean = jnp.sum(r * m, axis=1, keepdims=True) / jnp.maximum(n_g, 1.0)
    return jnp.where(mask, r - mean, 0.0), n_g


def reinforce_pp_baseline(rewards, group_mask=None, *, sample_mask=None, eps: float = 1e-6,
                          whiten_eps: float = 1e-8, lengths=None):
    """Group-mean baseline, then whitening over the whole (post-filter) batch. [G, N] -> [G, N].

    With `lengths` [G, N] (response tokens; what the training loop passes) the whitening runs
    over tokens exactly as veRL's masked_whiten does for REINFORCE++-baseline: with a = R -
    mean_group(R) on each of the M response tokens,
        mu = sum(a) / (M + 1e-8),  var = sum((a - mu)^2) / (M + 1e-8) * M / (M - 1),
        A = (a - mu) / sqrt(var + whiten_eps)          (whiten_eps = 1e-8 in veRL)
    Without `lengths` every response counts once (M = number of responses). `eps` is unused
    (the group-std epsilon of GRPO)."""
    del eps
    r, mask = _prep(rewards, group_mask, sample_mask)
    a, _ = _group_centered(r, mask)
    w = mask.astype(jnp.float32)
    if lengths is not None:
        w = w * jnp.asarray(lengths, jnp.float32)
    m = jnp.sum(w)
    mean = jnp.sum(w * a) / (m + 1e-8)
    var = jnp.sum(w * (a - mean) ** 2) / (m + 1e-8)
    var = var * jnp.where(m > 1.0, m / jnp.maximum(m - 1.0, 1.0), 1.0)   # unbiased (Bessel)
    out = (a - mean) * jax.lax.rsqrt(var + whiten_eps)
    return jnp.where(mask, out, 0.0)


def grpo(rewards, group_mask=None, *, sample_mask=None, eps: float = 1e-6,
         whiten_eps: float = 1e-8, lengths=None):
    """(R - mean_group) / (std_group + eps), std with ddof=1. All-equal groups get 0."""
    del lengths, whiten_eps
    r, mask = _prep(rewards, group_mask, sample_mask)
    a, n_g = _group_centered(r, mask)
    std = jnp.sqrt(jnp.sum(a * a, axis=1, keepdims=True) / jnp.maximum(n_g - 1.0, 1.0))
    return jnp.where(mask, a / (std + eps), 0.0)


def rloo(rewards, group_mask=None, *, sample_mask=None, eps: float = 1e-6,
         whiten_eps: float = 1e-8, lengths=None):
    """Leave-one-out baseline: R_i - mean of the other N_g - 1 responses of the group."""
    del eps, whiten_eps, lengths
    r, mask = _prep(rewards, group_mask, sample_mask)
    a, n_g = _group_centered(r, mask)
    return jnp.where(mask, a * (n_g / jnp.maximum(n_g - 1.0, 1.0)), 0.0)


def dr_grpo(rewards, group_mask=None, *, sample_mask=None, eps: float = 1e-6,
            whiten_eps: float = 1e-8, lengths=None):
    """Dr. GRPO: the group-mean baseline alone, R - mean_group(R) (no std normalisation)."""
    del eps, whiten_eps, lengths
    r, mask = _prep(rewards, group_mask, sample_mask)
    a, _ = _group_centered(r, mask)
    return a


ADVANTAGES: dict[str, Callable[..., jnp.ndarray]] = {
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo": grpo,
    "rloo": rloo,
    "dr_grpo": dr_grpo,
}


def get_advantage_fn(name: str) -> Callable[..., jnp.ndarray]:
    """Look up an advantage estimator by name; the error lists the allowed names."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADVANTAGES)}") from None


def compute_advantages(name: str, rewards, group_mask=None, *, sample_mask=None, eps: float = 1e-6,
                       whiten_eps: float = 1e-8, lengths=None):
    """get_advantage_fn(name)(rewards [G, N], group_mask [G], sample_mask [G, N], lengths [G, N])
    -> [G, N] float32."""
    return get_advantage_fn(name)(rewards, group_mask, sample_mask=sample_mask, eps=eps,
                                  whiten_eps=whiten_eps, lengths=lengths)
