"""The GPU ("triton") family of the slot decode attention kernels (interpreted on CPU too).

Kernel 1, grid (tile, KV head), streams the tile's prompt KV in blocks with an online softmax;
its tiles pack each slot's g = H / Hkv query rows. Kernel 2, grid (slot, KV head), streams the
slot's pages up to its length, read through the page table, and merges its result with the
slot's rows of the prompt part by log-sum-exp, writing the output once in q's dtype. Explicit
Triton compiler parameters (see _backend).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode
from pallas_kernels.decode_attention.common import (
    _attend_blocks,
    _pow2,
    _round_up,
    _scale_rows,
    _store_dtype,
    decode_attention_unsupported_reason,
    default_tile,
    plan_tiles,
)

# Query rows per Triton prompt-tile program (tile x padded query heads per KV head): its q block,
# scores and accumulator stay within an H100's shared memory with 64-position prompt blocks.
TRITON_TILE_ROWS = 128


def _prefix_kernel_triton(layer_ref, tp_ref, nt_ref, plen_ref, q_ref, pk_ref, pv_ref, *refs,
                          block_p):
    """Grid (tile, KV head). q_ref [R, Dh] (the tile's rows for this KV head); pk_ref/pv_ref
    [L, K, P_pad, Dh] (this KV head, read in place at the tile's (layer, prompt)); with an e4m3
    store, its scale rows ks_ref/vs_ref [L, K, 1, P_pad] before the outputs."""
    *scale_refs, o_ref, lse_ref = refs
    i = pl.program_id(0)

    @pl.when(i < nt_ref[0])
    def _():
        layer, kp = layer_ref[0], tp_ref[i]

        def load(j, start):
            blk = pl.ds(start, block_p)
            return ((pk_ref[layer, kp, blk, :], pv_ref[layer, kp, blk, :])
                    + tuple(r[layer, kp, :, blk] for r in scale_refs))

        o, lse = _attend_blocks(q_ref[...], plen_ref[kp], block_p, load)
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def triton_tile(num_slots: int, num_prefixes: int, group: int) -> int:
    """Slots per prompt tile of the Triton form: about the slots one prompt holds, at most as many
    as fit a ``TRITON_TILE_ROWS``-row tile with ``group`` packed rows each (a slot's padded
    ``Gp``-row window must stay inside its tile: the own kernel reads it there)."""
    gp = max(16, _pow2(group))
    fit = (max(TRITON_TILE_ROWS, gp) - gp) // group + 1
    per_prompt = max(default_tile(num_slots, num_prefixes), -(-num_slots // max(num_prefixes, 1)))
    return max(1, min(fit, per_prompt))


def _own_merge_kernel_triton(layer_ref, table_ref, slen_ref, pos_ref, q_ref, pk_ref, pv_ref,
                             op_ref, lp_ref, *refs, group, tile):
    """Grid (slot, KV head). q_ref [Gp, Dh] (the slot's query heads of this KV head, padded);
    pk_ref/pv_ref [L, NP, page, Dh] (this KV head), read in place at the layer and the slot's
    pages (table_ref [B, MP]) up to its length. The result is merged by log-sum-exp with the
    slot's rows of the prompt part (``op_ref [T, R, Dh]`` / ``lp_ref [T, R]`` of this KV head,
    packed ``group`` rows per slot), written once in q's dtype (zeros for an empty slot:
    ``pos_ref[b] < 0``). With an e4m3 store its scale rows ks_ref/vs_ref [L, NP, 1, page] come
    before o_ref."""
    *scale_refs, o_ref = refs
    b = pl.program_id(0)
    layer = layer_ref[0]
    gp = q_ref.shape[0]

    def load(j, start):
        idx = table_ref[b, j]
        return ((pk_ref[layer, idx, :, :], pv_ref[layer, idx, :, :])
                + tuple(r[layer, idx, :, :] for r in scale_refs))

    o_s, lse_s = _attend_blocks(q_ref[...], slen_ref[b], pk_ref.shape[2], load)
    pos = pos_ref[b]
    has = pos >= 0
    pos = jnp.maximum(pos, 0)
    t, off = pos // tile, (pos % tile) * group
    o_p = op_ref[t, pl.ds(off, gp), :]
    lse_p = lp_ref[t, pl.ds(off, gp)]
    mine = (jax.lax.broadcasted_iota(jnp.int32, (gp,), 0) < group) & has
    lse_p = jnp.where(mine, lse_p, -jnp.inf)
    m = jnp.maximum(lse_p, lse_s)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w_p = jnp.where(lse_p == -jnp.inf, 0.0, jnp.exp(lse_p - m))
    w_s = jnp.where(lse_s == -jnp.inf, 0.0, jnp.exp(lse_s - m))
    den = w_p + w_s
    o = (w_p[:, None] * jnp.where(mine[:, None], o_p, 0.0) + w_s[:, None] * o_s) / jnp.where(
        den > 0, den, 1.0)[:, None]
    o_ref[...] = jnp.where(has & (den > 0)[:, None], o, 0.0).astype(o_ref.dtype)


def slot_attention(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                   page_table, suffix_len, *, layer, scale, tile, block_p, kv_scales=None):
    """The GPU (Triton) form of :func:`slot_decode_attention_pallas`, with two differences
    from the Mosaic form (mosaic.py) that cut the traffic of a decode step (bench/roofline.py):

    * prompt tiles pack each slot's ``g = H / Hkv`` query rows (not padded to a power of two per
      slot), so a 128-row tile holds ``(128 - Gp) // g + 1`` slots (19 for Qwen2.5's g = 6, 8
      before): each prompt's KV is read by 2.5x fewer tiles. The tiles of one prompt run in the
      same launch and read the same prompt blocks (1 MiB per layer for a 1024-token Qwen2.5
      prompt), which an H100's 50 MiB L2 serves; bench/roofline.py still counts every tile's
      read as HBM traffic.
    * the own-KV kernel merges its result with the slot's rows of the prompt part and writes the
      attention output once, in q's dtype: no scatter of the prompt part into slot order, no f32
      merge pass, no zero buffers.

    ``kv_scales``: an e4m3 store's scale rows go to each kernel as two more inputs after its KV
    (prefix: after prefix_v; own: after the prompt part's o and lse), blocked like the KV.
    """
    reason = decode_attention_unsupported_reason(_store_dtype(prefix_k, pages_k),
                                                 pages_k.shape[-2], "triton", in_shard_map=True)
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
    s_len = page_table.shape[1] * page
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, n_pages - 1)
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    gp, rows = max(16, _pow2(g)), max(TRITON_TILE_ROWS, max(16, _pow2(g)))
    tile = int(tile) if tile is not None else triton_tile(b, k_pool, g)
    if (tile - 1) * g + gp > rows:
        raise ValueError(f"tile={tile} slots of {g} rows do not fit a {rows}-row prompt tile")
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    plan = plan_tiles(prefix_index, suffix_len, num_prefixes=k_pool, tile=tile, max_suffix=s_len)
    slen = jnp.where(prefix_index >= 0, suffix_len, 0).astype(jnp.int32)
    qf = (q.astype(jnp.float32) * scale).reshape(b, hkv, g, dh).astype(q.dtype)
    n_tiles = plan["tile_prefix"].shape[0]
    rs = plan["row_slot"]
    qt = jnp.where((rs >= 0)[:, None, None, None], qf[jnp.maximum(rs, 0)], 0)
    qt = qt.reshape(n_tiles, tile, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(
        n_tiles, hkv, tile * g, dh)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, rows - tile * g), (0, 0)))
    if not block_p:
        block_p = min(64, max(16, _pow2(p_len)))
    p_pad = _round_up(p_len, block_p)
    if p_pad != p_len:   # only odd prompt buckets get here (copies the pool)
        pad = ((0, 0), (0, 0), (0, 0), (0, p_pad - p_len), (0, 0))
        prefix_k, prefix_v = jnp.pad(prefix_k, pad), jnp.pad(prefix_v, pad)
        rows_sc = (*(jnp.pad(x, pad[:3] + pad[4:] + pad[3:4]) for x in rows_sc[:2]),
                   *rows_sc[2:])
    scalars = (layer_arr, plan["tile_prefix"], plan["num_tiles"].reshape(1),
               prefix_len.astype(jnp.int32))
    full = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
    kv_spec = pl.BlockSpec((n_layers, k_pool, None, p_pad, dh), lambda i, k: (0, 0, k, 0, 0))
    sc_spec = pl.BlockSpec((n_layers, k_pool, None, 1, p_pad), lambda i, k: (0, 0, k, 0, 0))
    params = _backend.compiler_params("triton", dimension_semantics=("parallel", "parallel"))
    o_p, lse_p = pl.pallas_call(
        functools.partial(_prefix_kernel_triton, block_p=block_p),
        grid=(n_tiles, hkv),
        in_specs=[full(x) for x in scalars] + [
            pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)), kv_spec, kv_spec]
        + [sc_spec] * len(rows_sc[:2]),
        out_specs=[pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)),
                   pl.BlockSpec((None, None, rows, 1), lambda i, k: (i, k, 0, 0))],
        out_shape=(jax.ShapeDtypeStruct((n_tiles, hkv, rows, dh), jnp.float32),
                   jax.ShapeDtypeStruct((n_tiles, hkv, rows, 1), jnp.float32)),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_prefix",
    )(*scalars, qt, prefix_k, prefix_v, *rows_sc[:2])
    # each slot's rows of the prompt part: tile slot_pos // tile, rows (slot_pos % tile) * g on
    pos = jnp.where(prefix_index >= 0, plan["slot_pos"], -1).astype(jnp.int32)
    qs = jnp.pad(qf, ((0, 0), (0, 0), (0, gp - g), (0, 0)))                 # [B, Hkv, Gp, Dh]
    kv_own = pl.BlockSpec((n_layers, n_pages, None, page, dh), lambda i, k: (0, 0, k, 0, 0))
    sc_own = pl.BlockSpec((n_layers, n_pages, None, 1, page), lambda i, k: (0, 0, k, 0, 0))
    qo_spec = pl.BlockSpec((None, None, gp, dh), lambda i, k: (i, k, 0, 0))
    out = pl.pallas_call(
        functools.partial(_own_merge_kernel_triton, group=g, tile=tile),
        grid=(b, hkv),
        in_specs=[full(layer_arr), full(page_table), full(slen), full(pos), qo_spec, kv_own,
                  kv_own, pl.BlockSpec((n_tiles, None, rows, dh), lambda i, k: (0, k, 0, 0)),
                  pl.BlockSpec((n_tiles, None, rows), lambda i, k: (0, k, 0))]
        + [sc_own] * len(rows_sc[2:]),
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, gp, dh), q.dtype),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_own",
    )(layer_arr, page_table, slen, pos, qs, pages_k, pages_v, o_p, lse_p[..., 0], *rows_sc[2:])
    return out[:, :, :g].reshape(b, h, dh)
