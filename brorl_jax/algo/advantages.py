"""Outcome-reward advantage estimators, selectable by name (BroRL §3.1; ProRL Eq. 2).

All take rewards [G, N] (G prompt groups x N responses) and an optional group_mask bool [G]
(False = a padded group that must not enter any statistic) and return advantages [G, N] float32,
zero on masked groups. Works on numpy or jax arrays, inside or outside jit.

  reinforce_pp_baseline (BroRL / ProRLv2 default, veRL "reinforce_plus_plus_baseline"):
      A = R - mean_group(R);  A_norm = (A - mean_batch(A)) / (std_batch(A) + eps)
      where the batch statistics run over every response of every kept group.
  grpo:  A = (R - mean_group(R)) / (std_group(R) + eps)   (std with ddof=1, as veRL/torch.std)
  rloo:  A_i = R_i - mean_{j != i} R_j = N/(N-1) (R_i - mean_group(R))
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _prep(rewards, group_mask):
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be [G, N] with N >= 2 responses per prompt; got shape {r.shape}")
    if group_mask is None:
        gm = jnp.ones((r.shape[0],), bool)
    else:
        gm = jnp.asarray(group_mask, bool)
        if gm.shape != (r.shape[0],):
            raise ValueError(f"group_mask must be [G={r.shape[0]}]; got shape {gm.shape}")
    return r, gm


def reinforce_pp_baseline(rewards, group_mask=None, *, eps: float = 1e-6, lengths=None) -> jax.Array:
    """Group-mean baseline, then whitening over the whole (post-filter) batch. [G, N] -> [G, N].

    `lengths` [G, N] (optional) weights the batch mean/std by response length, i.e. whitening over
    tokens as veRL's masked_whiten does; the default weights every response once (the paper's
    "normalised over the global batch" does not say which)."""
    r, gm = _prep(rewards, group_mask)
    a = r - jnp.mean(r, axis=1, keepdims=True)
    w = jnp.broadcast_to(gm[:, None], r.shape).astype(jnp.float32)
    if lengths is not None:
        w = w * jnp.asarray(lengths, jnp.float32)
    total = jnp.maximum(jnp.sum(w), 1.0)
    mean = jnp.sum(w * a) / total
    var = jnp.sum(w * (a - mean) ** 2) / total
    out = (a - mean) / (jnp.sqrt(var) + eps)
    return jnp.where(gm[:, None], out, 0.0)


def grpo(rewards, group_mask=None, *, eps: float = 1e-6, lengths=None) -> jax.Array:
    """(R - mean_group) / (std_group + eps), std with ddof=1. All-equal groups get 0. [G,N] -> [G,N]."""
    del lengths
    r, gm = _prep(rewards, group_mask)
    a = r - jnp.mean(r, axis=1, keepdims=True)
    std = jnp.std(r, axis=1, ddof=1, keepdims=True)
    return jnp.where(gm[:, None], a / (std + eps), 0.0)


def rloo(rewards, group_mask=None, *, eps: float = 1e-6, lengths=None) -> jax.Array:
    """Leave-one-out baseline: R_i - mean of the other N-1 responses. [G, N] -> [G, N]."""
    del eps, lengths
    r, gm = _prep(rewards, group_mask)
    n = r.shape[1]
    a = (r - jnp.mean(r, axis=1, keepdims=True)) * (n / (n - 1))
    return jnp.where(gm[:, None], a, 0.0)


ADVANTAGES: dict[str, Callable[..., jax.Array]] = {
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo": grpo,
    "rloo": rloo,
}


def get_advantage_fn(name: str) -> Callable[..., jax.Array]:
    """Look up an advantage estimator by name; the error lists the allowed names."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADVANTAGES)}") from None


def compute_advantages(name: str, rewards, group_mask=None, *, eps: float = 1e-6, lengths=None):
    """get_advantage_fn(name)(rewards [G, N], group_mask [G]) -> advantages [G, N] float32."""
    return get_advantage_fn(name)(rewards, group_mask, eps=eps, lengths=lengths)
