"""The chunked jnp path of `fused_logprob` ("chunked"; impl="auto" on CPU): lax.scan over token
blocks (outer) and vocabulary chunks (inner), the tile math of common.py in XLA. The vocabulary is
never padded (a tail chunk is handled separately) so lm_head [D, V] is never copied. Also the
second vocabulary sweep of `fused_logprob_stats(unsampled_n=...)`.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.fused_logprob.common import (
    _dlogits,
    _finish,
    _init_carry,
    _online_update,
    _Opts,
    _pad_to,
)


def _vocab_chunks(vocab: int, block_v: int):
    """(chunk size, number of full chunks, tail size) of the vocabulary."""
    block_v = min(block_v, vocab)
    return block_v, vocab // block_v, vocab % block_v


def forward(hidden, lm_head, targets, opts: _Opts):
    t_len, _ = hidden.shape
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    h = _pad_to(hidden, 0, bt).reshape(-1, bt, hidden.shape[1])
    tg = _pad_to(targets.astype(jnp.int32), 0, bt).reshape(-1, bt, 1)

    def tile(h_blk, w, start):
        z = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp
        col = start + jnp.arange(w.shape[1], dtype=jnp.int32)[None, :]
        return z, col

    def block_stats(args):
        h_blk, t_blk = args

        def body(carry, j):
            start = j * bv
            z, col = tile(h_blk, lax.dynamic_slice_in_dim(lm_head, start, bv, axis=1), start)
            return _online_update(carry, z, True, col, t_blk), None

        carry, _ = lax.scan(body, _init_carry(h_blk.shape[0]), jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            z, col = tile(h_blk, lm_head[:, n_full * bv:], n_full * bv)
            carry = _online_update(carry, z, True, col, t_blk)
        return _finish(carry)

    outs = lax.map(block_stats, (h, tg))
    return tuple(o.reshape(-1)[:t_len] for o in outs)


def backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts: _Opts):
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    pad = lambda x: _pad_to(x, 0, bt).reshape((-1, bt) + x.shape[1:])
    col_pad = lambda x: pad(x.astype(jnp.float32))[..., None]
    h, tg = pad(hidden), pad(targets.astype(jnp.int32))[..., None]
    lse_b, ent_b = col_pad(lse), col_pad(ent)
    # Padded token rows get zero cotangents, so they contribute nothing.
    gl_b, ge_b = col_pad(g_logp), col_pad(g_ent)

    def chunk_grads(h_blk, w, start, t_blk, l_blk, e_blk, gl, ge):
        z = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp
        col = start + jnp.arange(w.shape[1], dtype=jnp.int32)[None, :]
        dz = (_dlogits(z, True, col, t_blk, l_blk, e_blk, gl, ge) * opts.inv_temp).astype(w.dtype)
        dh = jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
        dw = jnp.dot(h_blk.T, dz, preferred_element_type=jnp.float32)
        return dh, dw

    def token_block(dw_acc, args):
        h_blk, t_blk, l_blk, e_blk, gl, ge = args

        def body(carry, j):
            dh, dw_acc = carry
            start = j * bv
            w = lax.dynamic_slice_in_dim(lm_head, start, bv, axis=1)
            dh_j, dw_j = chunk_grads(h_blk, w, start, t_blk, l_blk, e_blk, gl, ge)
            old = lax.dynamic_slice_in_dim(dw_acc, start, bv, axis=1)
            dw_acc = lax.dynamic_update_slice_in_dim(dw_acc, old + dw_j, start, axis=1)
            return (dh + dh_j, dw_acc), None

        dh0 = jnp.zeros((h_blk.shape[0], d), jnp.float32)
        (dh, dw_acc), _ = lax.scan(body, (dh0, dw_acc), jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            start = n_full * bv
            dh_j, dw_j = chunk_grads(h_blk, lm_head[:, start:], start, t_blk, l_blk, e_blk, gl, ge)
            dh = dh + dh_j
            dw_acc = dw_acc.at[:, start:].add(dw_j)
        return dw_acc, dh

    dw, dh = lax.scan(token_block, jnp.zeros((d, vocab), jnp.float32),
                      (h, tg, lse_b, ent_b, gl_b, ge_b))
    dh = dh.reshape(-1, d)[:t_len]
    return dh.astype(hidden.dtype), dw.astype(lm_head.dtype)


def unsampled_second_moment(hidden, lm_head, lse, ns, opts: _Opts):
    """sum_v p_v^2 (1 - p_v)^n for each n in ns -> [T, K] (BroRL Lemma 2 / Corollary 3).

    Needs the final lse, hence a second sweep over the vocabulary (chunked jnp; diagnostics only)."""
    t_len = hidden.shape[0]
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    h = _pad_to(hidden, 0, bt).reshape(-1, bt, hidden.shape[1])
    lse_b = _pad_to(lse, 0, bt).reshape(-1, bt)
    ns = jnp.asarray(ns, jnp.float32)

    def chunk(h_blk, l_blk, w):
        logp = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp - l_blk[:, None]
        p = jnp.exp(logp)
        # p^2 (1-p)^n = exp(2 log p + n log1p(-p)); log1p keeps small-p terms accurate.
        log_terms = 2.0 * logp[:, :, None] + ns * jnp.log1p(-jnp.minimum(p, 1.0 - 1e-7))[:, :, None]
        return jnp.sum(jnp.exp(log_terms), axis=1)

    def block(args):
        h_blk, l_blk = args

        def body(acc, j):
            w = lax.dynamic_slice_in_dim(lm_head, j * bv, bv, axis=1)
            return acc + chunk(h_blk, l_blk, w), None

        acc, _ = lax.scan(body, jnp.zeros((h_blk.shape[0], ns.shape[0]), jnp.float32),
                          jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            acc = acc + chunk(h_blk, l_blk, lm_head[:, n_full * bv:])
        return acc

    return lax.map(block, (h, lse_b)).reshape(-1, ns.shape[0])[:t_len]
