"""Naive reference for `fused_logprob`: materialises the full [T, V] logits.

This is the ground truth the chunked path and the Pallas kernel are tested against, and the
"naive" arm of bench/logprob.py. Gradients come from plain autodiff through `log_softmax`.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def reference_logits(hidden: jax.Array, lm_head: jax.Array, temperature: float = 1.0) -> jax.Array:
    """z = (hidden @ lm_head) / temperature in float32.  hidden [T, D], lm_head [D, V] -> [T, V]."""
    z = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    return z / jnp.float32(temperature)


def fused_logprob_reference(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log softmax(z)[target] and entropy -sum p log p, both [T] float32 (z as in reference_logits)."""
    logp_all = jax.nn.log_softmax(reference_logits(hidden, lm_head, temperature), axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def fused_logprob_stats_reference(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    unsampled_n: int | Sequence[int] | None = None,
) -> dict[str, jax.Array]:
    """Reference for `fused_logprob_stats`: logp, entropy, sum_p2 = sum_v p_v^2 [T], and with
    `unsampled_n` the BroRL Lemma 2 statistic sum_v p_v^2 (1 - p_v)^n as [T, len(n)]."""
    logp_all = jax.nn.log_softmax(reference_logits(hidden, lm_head, temperature), axis=-1)
    p = jnp.exp(logp_all)
    out = {
        "logp": jnp.take_along_axis(logp_all, targets[:, None].astype(jnp.int32), axis=-1)[:, 0],
        "entropy": -jnp.sum(p * logp_all, axis=-1),
        "sum_p2": jnp.sum(p * p, axis=-1),
    }
    if unsampled_n is not None:
        ns = jnp.asarray([unsampled_n] if isinstance(unsampled_n, int) else list(unsampled_n),
                         jnp.float32)
        out["sum_p2_unsampled"] = jnp.stack(
            [jnp.sum(p * p * (1.0 - p) ** n, axis=-1) for n in ns], axis=-1)
    return out
