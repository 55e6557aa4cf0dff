"""Query-chunked attention and a transformer forward that uses it (pure jnp, for long contexts).

The model's reference attention (brorl_jax.models.transformer.attention) forms the full
[B, H, T, T] float32 score tensor. At BroRL's 16k context that is 16384^2 x 12 heads x 4 bytes
= 12.9 GB per sequence and layer, before the softmax copy and the backward pass. Here the queries
are split into chunks of `q_chunk` (memory-efficient attention, Rabe & Staats 2021, arXiv
2112.05682): each chunk attends to all keys with the same reference `attention` function, under
jax.checkpoint, so the forward holds [B, H, q_chunk, T] scores at a time and the backward pass
recomputes one chunk's scores instead of storing them. Results equal the reference exactly up to
float rounding (same masking, same float32 softmax).

On GPU the better choice is cuDNN flash attention (jax.nn.dot_product_attention with
implementation="cudnn"), which never materialises the scores: the model's
model.attention_impl="cudnn". This module exists so the plan (bench/plan_memory.py) can show what
bounded attention memory does to the update's footprint, on any backend.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from brorl_jax.models.config import ModelConfig
from brorl_jax.models.transformer import (
    attention,
    default_positions,
    embed,
    final_norm,
    layer_finish,
    layer_qkv,
    remat_layer,
    segment_positions,
)


def chunked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array,
                             q_chunk: int = 512, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention over query chunks.

    q [B,T,H,Dh], k/v [B,T,Hkv,Dh], key_mask bool[B,T] (True = real token) -> out [B,T,H,Dh].
    Query i may read key j when j <= i (array index) and key_mask[b, j], as in forward().
    segment_ids int[B,T] (packed rows): additionally only keys of the query's own segment.
    """
    b, t, h, dh = q.shape
    qc = min(q_chunk, t)
    pad = (-t) % qc
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    n = qp.shape[1] // qc
    q_blocks = jnp.moveaxis(qp.reshape(b, n, qc, h, dh), 1, 0)        # [n, B, qc, H, Dh]
    key_idx = jnp.arange(t)
    if segment_ids is None:
        seg_blocks = jnp.zeros((n, b, qc), jnp.int32)                  # unused
    else:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
        seg_blocks = jnp.moveaxis(seg.reshape(b, n, qc), 1, 0)         # [n, B, qc]

    @jax.checkpoint
    def one(args):
        qb, sb, i = args
        q_idx = i * qc + jnp.arange(qc)
        allowed = (key_idx[None, :] <= q_idx[:, None])[None] & key_mask[:, None, :]
        if segment_ids is not None:
            allowed = allowed & (sb[:, :, None] == segment_ids[:, None, :])
        return attention(qb, k, v, allowed)

    out = lax.map(one, (q_blocks, seg_blocks, jnp.arange(n)))         # [n, B, qc, H, Dh]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * qc, h, dh)[:, :t]


def forward_hidden(params: dict, cfg: ModelConfig, tokens: jax.Array, *,
                   positions: jax.Array | None = None, attention_mask: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, remat: bool | str = False,
                   q_chunk: int = 512,
                   constrain: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """transformer.forward(..., return_hidden=True) with chunked_causal_attention.

    tokens int32[B,T] -> final normed hidden h[B,T,D]. segment_ids: packed rows, as in
    forward() (give it instead of attention_mask). `constrain` (e.g. a sharding constraint) is
    applied to the residual stream after every layer."""
    b, t = tokens.shape
    if segment_ids is not None:
        if attention_mask is not None:
            raise ValueError("forward_hidden: give attention_mask or segment_ids, not both")
        mask = segment_ids > 0
        if positions is None:
            positions = segment_positions(segment_ids)
    else:
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
    if positions is None:
        positions = default_positions(mask)
    fix = constrain or (lambda x: x)

    def layer(x, layer_params):
        q, k, v = layer_qkv(layer_params, cfg, x, positions)
        attn = chunked_causal_attention(q, k, v, mask, q_chunk, segment_ids)
        x = layer_finish(layer_params, cfg, x, attn)
        return fix(x), None

    x, _ = lax.scan(remat_layer(layer, remat), fix(embed(params, cfg, tokens)), params["layers"])
    return final_norm(params, cfg, x)
