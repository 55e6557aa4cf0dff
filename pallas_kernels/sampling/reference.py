"""The plain-jnp sampling reference (sort-based filtering) that the kernels are tested against,
and the argument checks every form shares. Same contract as `sample_tokens` (see __init__.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _check_args(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [samples, vocab], got shape {logits.shape}")
    if not temperature >= 0.0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no top-k filtering), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")


def sample_tokens_reference(
    logits: jax.Array,
    uniforms: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp sampling: ``logits[S, V]``, ``uniforms[S]`` -> ``(tokens[S] int32, logp[S] f32)``.

    Top-k uses ``lax.top_k``, top-p a full descending sort + cumulative sum (the textbook way); the
    draw is the inverse CDF in vocabulary order described in the package docstring (__init__.py).
    """
    _check_args(logits, temperature, top_k, top_p)
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    if temperature == 0.0:
        tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, None], axis=-1)[:, 0]
        return tokens, logp
    z = x / temperature
    zmax = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - zmax)
    lse = zmax[:, 0] + jnp.log(jnp.sum(e, axis=-1))
    kept = jnp.ones_like(x, dtype=bool)
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        kept = x >= kth
    if top_p < 1.0:
        ek = jnp.where(kept, e, 0.0)
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        csum = jnp.cumsum(jnp.take_along_axis(ek, order, axis=-1), axis=-1)
        target = top_p * jnp.sum(ek, axis=-1, keepdims=True)
        # first sorted index whose cumulative mass reaches top_p; keep every logit >= its value
        cut = jnp.minimum(jnp.sum(csum < target, axis=-1, keepdims=True), vocab - 1)
        kept = kept & (x >= jnp.take_along_axis(sorted_x, cut, axis=-1))
    ek = jnp.where(kept, e, 0.0) if (0 < top_k < vocab or top_p < 1.0) else e
    tokens = _inverse_cdf(ek, uniforms.astype(jnp.float32))
    logp = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logp


def _inverse_cdf(weights: jax.Array, uniforms: jax.Array, block: int = 128) -> jax.Array:
    """``min{j : sum_{i<=j} w_i > u * sum_i w_i}`` per row of ``weights[S, V] >= 0``, always an
    index with ``w_j > 0``.

    Two-level prefix sums (block totals, then one block's entries) instead of a full-row cumsum:
    XLA's CPU cumsum over a [S, 32k] row costs as much as the LM-head matmul that produced it.
    """
    rows, vocab = weights.shape
    nb = -(-vocab // block)
    w = jnp.pad(weights, ((0, 0), (0, nb * block - vocab))).reshape(rows, nb, block)
    block_csum = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [S, nb]
    target = uniforms * block_csum[:, -1]
    iota_b = jnp.arange(nb)
    last_block = jnp.max(jnp.where(block_csum > jnp.concatenate(
        [jnp.zeros((rows, 1)), block_csum[:, :-1]], axis=-1), iota_b, 0), axis=-1)
    blk = jnp.minimum(jnp.sum(block_csum <= target[:, None], axis=-1), last_block)
    base = jnp.where(blk > 0, jnp.take_along_axis(block_csum, jnp.maximum(blk - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [S, block]
    iota = jnp.arange(block)
    last_nz = jnp.max(jnp.where(inner > 0, iota, 0), axis=-1)
    j = jnp.minimum(jnp.sum(base[:, None] + jnp.cumsum(inner, axis=-1) <= target[:, None], axis=-1),
                    last_nz)
    return (blk * block + j).astype(jnp.int32)
