"""The TPU ("mosaic") family of the slot decode attention kernels (interpreted on CPU too).

The same two kernels as triton.py, with the tile plan and the page table as scalar-prefetch
arguments so each grid step's block (layer, prompt, page) comes from them: pages past a slot's
length are neither fetched again (their index map repeats the last one) nor computed. Each
kernel returns (o, lse); the two parts merge by log-sum-exp in jnp. Mosaic TPU compiler
parameters (see _backend).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode
from pallas_kernels.decode_attention.common import (
    _NEG,
    _attend_blocks,
    _finish,
    _merge,
    _online_step,
    _pow2,
    _pv,
    _qk,
    _round_up,
    _scale_rows,
    _store_dtype,
    _widen,
    decode_attention_unsupported_reason,
    default_tile,
    plan_tiles,
)


def _prefix_kernel_mosaic(layer_ref, tp_ref, nt_ref, plen_ref, q_ref, pk_ref, pv_ref, *refs,
                          block_p):
    """Grid (tile, KV head); scalar prefetch (layer, tile_prefix, num_tiles, prefix_len) picks the
    prompt block: pk_ref/pv_ref [P_pad, Dh] are the tile's prompt for this KV head, in VMEM;
    with an e4m3 store, its scale rows ks_ref/vs_ref [1, P_pad] before the outputs."""
    *scale_refs, o_ref, lse_ref = refs
    i = pl.program_id(0)

    @pl.when(i < nt_ref[0])
    def _():
        def load(j, start):
            blk = pl.ds(start, block_p)
            return ((pk_ref[blk, :], pv_ref[blk, :]) + tuple(r[:, blk] for r in scale_refs))

        o, lse = _attend_blocks(q_ref[...], plen_ref[tp_ref[i]], block_p, load)
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def _own_kernel_mosaic(layer_ref, table_ref, last_ref, slen_ref, q_ref, sk_ref, sv_ref, *refs,
                       block_s, scaled):
    """Grid (slot, KV head, page j); scalar prefetch (layer, flattened page table, last page,
    lengths) picks each step's page: pages past the slot's length are neither fetched (their
    index map repeats the last one) nor computed. q_ref [Gp, Dh]; sk_ref/sv_ref [page, Dh];
    running softmax state in VMEM scratch. ``scaled``: an e4m3 page and its scale rows
    ks_ref/vs_ref [1, page] (before the outputs)."""
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[2:] if scaled else refs
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j <= last_ref[b])
    def _():
        q = q_ref[...]
        k = _widen(sk_ref[...], q.dtype)
        v = _widen(sv_ref[...], q.dtype)
        pos = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], block_s), 1)
        state = (m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...])
        if scaled:
            s = _qk(q, k) * ks_ref[...]
            mask = pos < slen_ref[b]
            pv = lambda p: _pv(jnp.where(mask, p * vs_ref[...], 0.0), v)
            m, l, acc = _online_step(state, s, mask, pv)
        else:
            m, l, acc = _online_step(state, _qk(q, k), pos < slen_ref[b], lambda p: _pv(p, v))
        m_sc[...] = m[:, None]
        l_sc[...] = l[:, None]
        acc_sc[...] = acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o, lse = _finish((m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...]))
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def slot_attention(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table,
                   suffix_len, *, layer, scale, tile, block_p, kv_scales=None):
    """The TPU (Mosaic) form of :func:`slot_decode_attention_pallas` (same contract).
    ``kv_scales``: an e4m3 store's scale rows go to each kernel as two more inputs right after
    its KV, blocked like it ([1, positions] rows of the prompt / the page)."""
    from jax.experimental.pallas import tpu as pltpu
    reason = decode_attention_unsupported_reason(   # a mesh: the caller's choice to make
        _store_dtype(prefix_k, pages_k), pages_k.shape[-2], "mosaic", in_shard_map=True)
    if reason is not None:
        raise ValueError(f"slot_decode_attention_pallas: {reason}")
    interpret = interpret_mode()
    rows_sc = () if kv_scales is None else _scale_rows(kv_scales, layer is not None)
    if layer is None:
        layer = 0
        prefix_k, prefix_v = prefix_k[None], prefix_v[None]
        pages_k, pages_v = pages_k[None], pages_v[None]
    n_layers, k_pool, hkv, p_len, dh = prefix_k.shape
    b, h, _ = q.shape
    n_pages, page = pages_k.shape[1], pages_k.shape[3]
    max_pages = page_table.shape[1]
    s_len = max_pages * page
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, n_pages - 1)
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    gp = max(8, _pow2(g))   # query rows per (slot, KV head), padded to a power of two
    tile = int(default_tile(b, k_pool) if tile is None else tile)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    plan = plan_tiles(prefix_index, suffix_len, num_prefixes=k_pool, tile=tile, max_suffix=s_len)
    slen = jnp.where(prefix_index >= 0, suffix_len, 0).astype(jnp.int32)
    qs = (q.astype(jnp.float32) * scale).reshape(b, hkv, g, dh)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, gp - g), (0, 0))).astype(q.dtype)   # [B, Hkv, Gp, Dh]
    n_tiles = plan["tile_prefix"].shape[0]
    rows = tile * gp
    rs = plan["row_slot"]
    qt = jnp.where((rs >= 0)[:, None, None, None], qs[jnp.maximum(rs, 0)], 0)
    qt = qt.reshape(n_tiles, tile, hkv, gp, dh).transpose(0, 2, 1, 3, 4).reshape(
        n_tiles, hkv, rows, dh)
    if not block_p:   # whole sublane groups
        block_p = min(128, _round_up(p_len, 16))
    p_pad = _round_up(p_len, block_p)
    if p_pad != p_len:   # only the compat path and odd prompt buckets get here (copies the pool)
        pad = ((0, 0), (0, 0), (0, 0), (0, p_pad - p_len), (0, 0))
        prefix_k, prefix_v = jnp.pad(prefix_k, pad), jnp.pad(prefix_v, pad)
        rows_sc = (*(jnp.pad(x, pad[:3] + pad[4:] + pad[3:4]) for x in rows_sc[:2]),
                   *rows_sc[2:])
    out_shapes = (jax.ShapeDtypeStruct((n_tiles, hkv, rows, dh), jnp.float32),
                  jax.ShapeDtypeStruct((n_tiles, hkv, rows, 1), jnp.float32))
    scalars = (layer_arr, plan["tile_prefix"], plan["num_tiles"].reshape(1),
               prefix_len.astype(jnp.int32))
    kv_spec = pl.BlockSpec((None, None, None, p_pad, dh),
                           lambda i, k, ly, tp, nt, pln: (ly[0], tp[i], k, 0, 0))
    sc_spec = pl.BlockSpec((None, None, None, 1, p_pad),
                           lambda i, k, ly, tp, nt, pln: (ly[0], tp[i], k, 0, 0))
    qo_spec = pl.BlockSpec((None, None, rows, dh), lambda i, k, *_: (i, k, 0, 0))
    o_p, lse_p = pl.pallas_call(
        functools.partial(_prefix_kernel_mosaic, block_p=block_p),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(n_tiles, hkv),
            in_specs=[qo_spec, kv_spec, kv_spec] + [sc_spec] * len(rows_sc[:2]),
            out_specs=[qo_spec,
                       pl.BlockSpec((None, None, rows, 1), lambda i, k, *_: (i, k, 0, 0))]),
        out_shape=out_shapes, interpret=interpret,
        compiler_params=_backend.mosaic_params(("parallel", "parallel")),
        name="slot_decode_attention_prefix",
    )(*scalars, qt, prefix_k, prefix_v, *rows_sc[:2])
    # back from tile rows to slots (tiles past num_tiles hold garbage: masked out)
    in_use = (jnp.arange(n_tiles) < plan["num_tiles"])[:, None]
    o_p = o_p.reshape(n_tiles, hkv, tile, gp, dh).transpose(0, 2, 1, 3, 4).reshape(-1, hkv, gp, dh)
    lse_p = lse_p.reshape(n_tiles, hkv, tile, gp).transpose(0, 2, 1, 3).reshape(-1, hkv, gp)
    ok = (rs >= 0) & jnp.repeat(in_use[:, 0], tile)
    dest = jnp.where(ok, rs, b)
    o_pref = jnp.zeros((b, hkv, gp, dh), jnp.float32).at[dest].set(o_p, mode="drop")
    lse_pref = jnp.full((b, hkv, gp), -jnp.inf, jnp.float32).at[dest].set(lse_p, mode="drop")

    # kernel 2: the slots' own KV, page by page
    own_shapes = (jax.ShapeDtypeStruct((b, hkv, gp, dh), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, gp, 1), jnp.float32))
    last = jnp.maximum((slen + page - 1) // page - 1, 0).astype(jnp.int32)
    page_index = lambda i, k, j, ly, tb, la, sl: (
        ly[0], tb[i * max_pages + jnp.minimum(j, la[i])], k, 0, 0)
    kv_spec = pl.BlockSpec((None, None, None, page, dh), page_index)
    sc_spec = pl.BlockSpec((None, None, None, 1, page), page_index)
    q_spec = pl.BlockSpec((None, None, gp, dh), lambda i, k, j, *_: (i, k, 0, 0))
    o_s, lse_s = pl.pallas_call(
        functools.partial(_own_kernel_mosaic, block_s=page, scaled=bool(rows_sc)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, hkv, max_pages),
            in_specs=[q_spec, kv_spec, kv_spec] + [sc_spec] * len(rows_sc[2:]),
            out_specs=[q_spec,
                       pl.BlockSpec((None, None, gp, 1), lambda i, k, j, *_: (i, k, 0, 0))],
            scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32),
                            pltpu.VMEM((gp, 1), jnp.float32),
                            pltpu.VMEM((gp, dh), jnp.float32)]),
        out_shape=own_shapes, interpret=interpret,
        compiler_params=_backend.mosaic_params(("parallel", "parallel", "arbitrary")),
        name="slot_decode_attention_own",
    )(layer_arr, page_table.reshape(-1), last, slen, qs, pages_k, pages_v, *rows_sc[2:])
    out = _merge(o_pref, lse_pref, o_s, lse_s[..., 0])          # [B, Hkv, Gp, Dh]
    out = jnp.where((prefix_index >= 0)[:, None, None, None], out, 0.0)
    return out[:, :, :g].reshape(b, h, dh).astype(q.dtype)
