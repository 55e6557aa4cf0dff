"""The jnp slot decode attention that the kernels are tested against (and what impl="auto" runs
on CPU): one lax.fori_loop over the prompt tiles in use, a matmul each; then the slots sorted by
own length in tiles of 16, each looping over its pages up to its longest slot (the work follows
the tokens generated, not the slots' capacity)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention.common import (
    _NEG,
    _check_scales,
    _check_slot_shapes,
    _merge,
    _widen,
    as_fp8,
    default_tile,
    plan_tiles,
)


def _kv_block(x, dtype):
    """A gathered KV block as floats: a uint16 store holds bfloat16 bit patterns (how a decode
    loop keeps a 16-bit KV store on CPU, whose XLA backend would otherwise compute every scatter
    into it in float32, converting the whole store), a uint8 one e4m3 bit patterns; an e4m3
    block is converted (exactly) to ``dtype``, q's, after the gather: the block, not the store."""
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return _widen(as_fp8(x), dtype)


def _stats_out(m, l, acc):
    """(o, lse) of an online-softmax state; rows without any valid key: o = 0, lse = -inf."""
    valid = l > 0
    o = jnp.where(valid[..., None], acc / jnp.where(valid, l, 1.0)[..., None], 0.0)
    lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
    return o, lse


def slot_decode_attention_reference(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, tile=None, own_tile=16, kv_scales=None,
) -> jax.Array:
    """jnp slot decode attention (shapes and layouts: the package docstring, __init__.py):
    ``out[B, H, Dh]`` in q's dtype, float32 accumulation.

    Prompt part: a loop over the prompt tiles in use, one matmul each. Own part: the slots sorted
    by own length (longest first), in tiles of ``own_tile``, each tile looping over its slots'
    pages up to its longest slot, so the work follows the tokens generated (not the slots'
    capacity). The parts merge by log-sum-exp. ``kv_scales`` (a KVScales): the four KV arrays
    hold e4m3 (or uint8 bit patterns of it), scores are ``(q . k8) * k_scale`` and the PV matmul
    takes ``p * v_scale`` (common.quantize_kv).
    """
    _check_slot_shapes(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                       page_table, suffix_len, layer)
    _check_scales(kv_scales, prefix_k, prefix_v, pages_k, pages_v)
    lead = 0 if layer is None else 1
    b, h, dh = q.shape
    k_pool, hkv, p_len = prefix_k.shape[lead], prefix_k.shape[lead + 1], prefix_k.shape[lead + 2]
    n_pages, bs = pages_k.shape[lead], pages_k.shape[lead + 2]
    max_pages = page_table.shape[1]
    s_len = max_pages * bs
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    tile = default_tile(b, k_pool) if tile is None else int(tile)
    if layer is None:
        layer = 0
        prefix_k, prefix_v = prefix_k[None], prefix_v[None]
        pages_k, pages_v = pages_k[None], pages_v[None]
        if kv_scales is not None:
            kv_scales = type(kv_scales)(*(x[None] for x in kv_scales))
    # no kv_scales: no scale rows, no multiply (the unscaled program, op for op)
    sc = kv_scales if kv_scales is not None else (None,) * 4
    if kv_scales is not None:   # e4m3 stores read as their bits, converted a block at a time:
        # XLA:CPU has no e4m3 arithmetic and would otherwise widen each whole store to f16
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
        prefix_k, prefix_v, pages_k, pages_v = map(bits, (prefix_k, prefix_v, pages_k, pages_v))
    scaled = lambda s, x: s if x is None else s * x
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, n_pages - 1)
    plan = plan_tiles(prefix_index, suffix_len, num_prefixes=k_pool, tile=tile, max_suffix=s_len)
    slen = jnp.where(prefix_index >= 0, suffix_len, 0).astype(jnp.int32)
    qf = (q.astype(jnp.float32) * scale).reshape(b, hkv, g, dh)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def prompt_tile(i, carry):
        o_acc, lse_acc = carry
        rows = jax.lax.dynamic_slice_in_dim(plan["row_slot"], i * tile, tile)
        ok = rows >= 0
        kp = plan["tile_prefix"][i]
        prompt = lambda x: _kv_block(jax.lax.dynamic_slice(x, (layer, kp, 0, 0, 0),
                                                           (1, 1, hkv, p_len, dh))[0, 0], q.dtype)
        row = lambda x: None if x is None else jax.lax.dynamic_slice(
            x, (layer, kp, 0, 0), (1, 1, hkv, p_len))[0, 0][:, None, :]      # [Hkv, 1, P]
        pk, pv = prompt(prefix_k), prompt(prefix_v)
        ks, vs = row(sc[0]), row(sc[1])
        # one [tile*g, Dh] x [Dh, P] matmul per KV head, in the KV's dtype with f32 accumulation
        # (an explicit f32 copy of a slice of a loop-invariant store gets hoisted by XLA into a
        # whole-store conversion per call)
        qm = qf[jnp.maximum(rows, 0)].transpose(1, 0, 2, 3).reshape(hkv, tile * g, dh)
        s = scaled(f32("kmd,kpd->kmp", qm.astype(pk.dtype), pk), ks)
        mask = jnp.arange(p_len) < prefix_len[kp]
        s = jnp.where(mask, s, _NEG)
        m = jnp.max(s, axis=-1)
        p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
        pw = p if vs is None else jnp.where(mask, p * vs, 0.0)
        o, lse = _stats_out(m, jnp.sum(p, axis=-1), f32("kmp,kpd->kmd", pw.astype(pv.dtype), pv))
        dest = jnp.where(ok, rows, b)
        o = o.reshape(hkv, tile, g, dh).transpose(1, 0, 2, 3)
        lse = lse.reshape(hkv, tile, g).transpose(1, 0, 2)
        return (o_acc.at[dest].set(o, mode="drop"), lse_acc.at[dest].set(lse, mode="drop"))

    o_p, lse_p = jax.lax.fori_loop(
        0, plan["num_tiles"], prompt_tile,
        (jnp.zeros((b, hkv, g, dh), jnp.float32), jnp.full((b, hkv, g), -jnp.inf, jnp.float32)))

    # own part: slots by own length, longest first
    ts = min(own_tile, b)
    n_own = -(-b // ts)
    order = jnp.argsort(-slen, stable=True).astype(jnp.int32)
    order = jnp.pad(order, (0, n_own * ts - b), constant_values=-1)
    used_tiles = (jnp.sum(slen > 0) + ts - 1) // ts

    def own_tile_body(i, carry):
        o_acc, lse_acc = carry
        rows = jax.lax.dynamic_slice_in_dim(order, i * ts, ts)
        ok = rows >= 0
        r = jnp.maximum(rows, 0)
        qt = qf[r]                                               # [ts, Hkv, g, Dh]
        tl = jnp.where(ok, slen[r], 0)
        table = page_table[r]                                    # [ts, MP]

        def block(j, st):
            m, l, acc = st
            start = j * bs
            take = lambda x: _kv_block(jax.vmap(lambda page: jax.lax.dynamic_slice(
                x, (layer, page, 0, 0, 0), (1, 1, hkv, bs, dh))[0, 0])(table[:, j]), q.dtype)
            row = lambda x: None if x is None else jax.vmap(lambda page: jax.lax.dynamic_slice(
                x, (layer, page, 0, 0), (1, 1, hkv, bs))[0, 0])(table[:, j])[:, :, None, :]
            kb, vb = take(pages_k), take(pages_v)                # [ts, Hkv, page, Dh]
            ks, vs = row(sc[2]), row(sc[3])                      # [ts, Hkv, 1, page]
            s = scaled(f32("tkgd,tksd->tkgs", qt.astype(kb.dtype), kb), ks)
            msk = ((start + jnp.arange(bs))[None, :] < tl[:, None])[:, None, None, :]
            s = jnp.where(msk, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            pb = jnp.where(msk, jnp.exp(s - m_new[..., None]), 0.0)
            pw = pb if vs is None else jnp.where(msk, pb * vs, 0.0)
            alpha = jnp.exp(m - m_new)
            return (m_new, alpha * l + jnp.sum(pb, axis=-1),
                    alpha[..., None] * acc + f32("tkgs,tksd->tkgd", pw.astype(vb.dtype), vb))

        init = (jnp.full((ts, hkv, g), _NEG, jnp.float32), jnp.zeros((ts, hkv, g), jnp.float32),
                jnp.zeros((ts, hkv, g, dh), jnp.float32))
        o, lse = _stats_out(*jax.lax.fori_loop(0, (jnp.max(tl) + bs - 1) // bs, block, init))
        dest = jnp.where(ok, rows, b)
        return (o_acc.at[dest].set(o, mode="drop"), lse_acc.at[dest].set(lse, mode="drop"))

    o_s, lse_s = jax.lax.fori_loop(
        0, used_tiles, own_tile_body,
        (jnp.zeros((b, hkv, g, dh), jnp.float32), jnp.full((b, hkv, g), -jnp.inf, jnp.float32)))
    out = _merge(o_p, lse_p, o_s, lse_s)
    out = jnp.where((prefix_index >= 0)[:, None, None, None], out, 0.0)
    return out.reshape(b, h, dh).astype(q.dtype)
