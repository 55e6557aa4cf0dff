"""The GPU ("triton") family of the slot decode attention kernels (interpreted on CPU too).

Kernel 1, grid (tile, KV head), streams the tile's prompt KV in blocks with an online softmax;
its tiles pack each slot's g = H / Hkv query rows, gathered from q in the kernel. Kernel 2, grid
(slot, KV head), streams the slot's pages up to its length, read through the page table, and
merges its result with the slot's rows of the prompt part by log-sum-exp, writing the output once
in q's dtype. Both read and write only the real rows (masked loads and stores); the register
tiles' padding rows (a Triton dot's M >= 16, a power of two) never touch HBM. Explicit Triton
compiler parameters (see _backend).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

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

# Query rows per Triton prompt-tile program (a register tile holding tile x g packed query rows):
# its q block, scores and accumulator stay within an H100's shared memory with 64-position blocks.
TRITON_TILE_ROWS = 128


def _scaled(q, scale):
    """q's rows times the score scale, rounded back to q's dtype (as an XLA multiply would)."""
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def _prefix_kernel_triton(layer_ref, tp_ref, nt_ref, plen_ref, qrow_ref, q_ref, pk_ref, pv_ref,
                          *refs, block_p, rows, group, scale):
    """Grid (tile, KV head). The tile's n = tile x g packed query rows are gathered from q_ref
    [B*H, Dh] (unscaled, flat) by qrow_ref [n] (row of each slot's first head in q, -1: no slot)
    plus this KV head's offset, into a ``rows``-row register tile (masked: rows past n are
    neither loaded nor stored, rows of no slot are not loaded: zeros); pk_ref/pv_ref [L, K,
    P_pad, Dh] (this KV head, read in place at the tile's (layer, prompt)); with an e4m3 store,
    its scale rows ks_ref/vs_ref [L, K, 1, P_pad] before the outputs o_ref [n, Dh] / lse_ref
    [n, 1]."""
    *scale_refs, o_ref, lse_ref = refs
    i, head = pl.program_id(0), pl.program_id(1)

    @pl.when(i < nt_ref[0])
    def _():
        layer, kp = layer_ref[0], tp_ref[i]
        real = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < qrow_ref.shape[0]
        window = pl.ds(0, rows)

        def load(j, start):
            blk = pl.ds(start, block_p)
            return ((pk_ref[layer, kp, blk, :], pv_ref[layer, kp, blk, :])
                    + tuple(r[layer, kp, :, blk] for r in scale_refs))

        first = pltriton.load(qrow_ref.at[window], mask=real[:, 0], other=-1)
        row = jnp.where(first >= 0, first + head * group, 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, q_ref.shape[1]), 1)
        q = pltriton.load(q_ref.at[row[:, None], col], mask=(first >= 0)[:, None], other=0)
        o, lse = _attend_blocks(_scaled(q, scale), plen_ref[kp], block_p, load)
        pltriton.store(o_ref.at[window, :], o.astype(o_ref.dtype), mask=real)
        pltriton.store(lse_ref.at[window, :], lse[:, None], mask=real)


def register_rows(group: int) -> tuple[int, int]:
    """(Gp, rows): the register tiles' rows of the own kernel (a slot's ``group`` query rows of
    one KV head, padded to a power of two >= 16: a Triton dot's M) and of the prompt kernel
    (``TRITON_TILE_ROWS``, or Gp if larger). The padded rows are computed on, never loaded or
    stored (masked)."""
    gp = max(16, _pow2(group))
    return gp, max(TRITON_TILE_ROWS, gp)


def triton_tile(num_slots: int, num_prefixes: int, group: int) -> int:
    """Slots per prompt tile of the Triton form: about the slots one prompt holds, at most as many
    as fit a ``TRITON_TILE_ROWS``-row tile with ``group`` packed rows each."""
    fit = register_rows(group)[1] // group
    per_prompt = max(default_tile(num_slots, num_prefixes), -(-num_slots // max(num_prefixes, 1)))
    return max(1, min(fit, per_prompt))


def _own_merge_kernel_triton(layer_ref, table_ref, slen_ref, pos_ref, q_ref, pk_ref, pv_ref,
                             op_ref, lp_ref, *refs, group, tile, scale):
    """Grid (slot, KV head). q_ref [H, Dh] (the slot's query heads, unscaled): the program reads
    its ``group`` rows of this KV head into a Gp-row register tile (masked loads: rows past
    ``group`` are never read) and scales them; pk_ref/pv_ref [L, NP, page, Dh] (this KV head),
    read in place at the layer and the slot's pages (table_ref [B, MP]) up to its length. The
    result is merged by log-sum-exp with the slot's ``group`` rows of the prompt part
    (``op_ref [T, n, Dh]`` / ``lp_ref [T, n]`` of this KV head, packed ``group`` rows per slot;
    none read for an empty slot: ``pos_ref[b] < 0``) and its ``group`` rows are written once in
    q's dtype to o_ref [H, Dh] (zeros for an empty slot). With an e4m3 store its scale rows
    ks_ref/vs_ref [L, NP, 1, page] come before o_ref."""
    *scale_refs, o_ref = refs
    b, head = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    gp = register_rows(group)[0]
    real = jax.lax.broadcasted_iota(jnp.int32, (gp,), 0) < group
    heads = pl.ds(head * group, gp)

    def load(j, start):
        idx = jnp.clip(table_ref[b, j], 0, pk_ref.shape[1] - 1)   # a scalar, not an XLA pass
        return ((pk_ref[layer, idx, :, :], pv_ref[layer, idx, :, :])
                + tuple(r[layer, idx, :, :] for r in scale_refs))

    q = pltriton.load(q_ref.at[heads, :], mask=real[:, None], other=0)
    o_s, lse_s = _attend_blocks(_scaled(q, scale), slen_ref[b], pk_ref.shape[2], load)
    pos = pos_ref[b]
    has = pos >= 0
    pos = jnp.maximum(pos, 0)
    t, off = pos // tile, (pos % tile) * group
    mine = real & has
    o_p = pltriton.load(op_ref.at[t, pl.ds(off, gp), :], mask=mine[:, None], other=0.0)
    lse_p = pltriton.load(lp_ref.at[t, pl.ds(off, gp)], mask=mine, other=-jnp.inf)
    m = jnp.maximum(lse_p, lse_s)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w_p = jnp.where(lse_p == -jnp.inf, 0.0, jnp.exp(lse_p - m))
    w_s = jnp.where(lse_s == -jnp.inf, 0.0, jnp.exp(lse_s - m))
    den = w_p + w_s
    o = (w_p[:, None] * o_p + w_s[:, None] * o_s) / jnp.where(den > 0, den, 1.0)[:, None]
    o = jnp.where(has & (den > 0)[:, None], o, 0.0).astype(o_ref.dtype)
    pltriton.store(o_ref.at[heads, :], o, mask=real[:, None])


def slot_attention(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                   page_table, suffix_len, *, layer, scale, tile, block_p, kv_scales=None):
    """The GPU (Triton) form of :func:`slot_decode_attention_pallas`, with two differences
    from the Mosaic form (mosaic.py) that cut the traffic of a decode step (bench/roofline.py):

    * prompt tiles pack each slot's ``g = H / Hkv`` query rows (not padded to a power of two per
      slot), so a 128-row tile holds ``128 // g`` slots (21 for Qwen2.5's g = 6, 8 padded):
      each prompt's KV is read by 2.6x fewer tiles. The tiles of one prompt run in the
      same launch and read the same prompt blocks (1 MiB per layer for a 1024-token Qwen2.5
      prompt), which an H100's 50 MiB L2 serves; bench/roofline.py still counts every tile's
      read as HBM traffic.
    * the own-KV kernel merges its result with the slot's rows of the prompt part and writes the
      attention output once, in q's dtype: no scatter of the prompt part into slot order, no f32
      merge pass, no zero buffers.

    Neither kernel moves a padding row: the prompt kernel gathers its tile's rows from q (row
    indices from the tile plan) and stores its ``tile * g`` rows; the own kernel reads its slot's
    g rows of q and of the prompt part and writes g rows of ``out [B, H, Dh]`` directly (masked
    loads and stores of Gp-row register tiles). No XLA pad, gather or slice of q or out; q is
    scaled in the kernels, as XLA would (f32 multiply, rounded to q's dtype).

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
    page_table = page_table.astype(jnp.int32)     # entries clipped to the pool in the kernel
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    rows = register_rows(g)[1]
    tile = int(tile) if tile is not None else triton_tile(b, k_pool, g)
    if tile * g > rows:
        raise ValueError(f"tile={tile} slots of {g} rows do not fit a {rows}-row prompt tile")
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    plan = plan_tiles(prefix_index, suffix_len, num_prefixes=k_pool, tile=tile, max_suffix=s_len)
    slen = jnp.where(prefix_index >= 0, suffix_len, 0).astype(jnp.int32)
    n_tiles, n = plan["tile_prefix"].shape[0], tile * g     # n real rows of a rows-row tile
    rs = plan["row_slot"]       # tile rows -> q's row of the slot's first head of KV head 0
    qrow = jnp.where((rs >= 0)[:, None], rs[:, None] * h + jnp.arange(g, dtype=jnp.int32), -1)
    if not block_p:
        block_p = min(64, max(16, _pow2(p_len)))
    p_pad = _round_up(p_len, block_p)
    if p_pad != p_len:   # only odd prompt buckets get here (copies the pool)
        pad = ((0, 0), (0, 0), (0, 0), (0, p_pad - p_len), (0, 0))
        prefix_k, prefix_v = jnp.pad(prefix_k, pad), jnp.pad(prefix_v, pad)
        rows_sc = (*(jnp.pad(x, pad[:3] + pad[4:] + pad[3:4]) for x in rows_sc[:2]),
                   *rows_sc[2:])
    scalars = (layer_arr, plan["tile_prefix"], plan["num_tiles"].reshape(1),
               prefix_len.astype(jnp.int32), qrow.reshape(n_tiles, n).astype(jnp.int32))
    full = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
    kv_spec = pl.BlockSpec((n_layers, k_pool, None, p_pad, dh), lambda i, k: (0, 0, k, 0, 0))
    sc_spec = pl.BlockSpec((n_layers, k_pool, None, 1, p_pad), lambda i, k: (0, 0, k, 0, 0))
    params = _backend.compiler_params("triton", dimension_semantics=("parallel", "parallel"))
    o_p, lse_p = pl.pallas_call(
        functools.partial(_prefix_kernel_triton, block_p=block_p, rows=rows, group=g,
                          scale=scale),
        grid=(n_tiles, hkv),
        in_specs=[full(x) for x in scalars[:4]] + [
            pl.BlockSpec((None, n), lambda i, k: (i, 0)), full(q.reshape(b * h, dh)), kv_spec,
            kv_spec] + [sc_spec] * len(rows_sc[:2]),
        out_specs=[pl.BlockSpec((None, None, n, dh), lambda i, k: (i, k, 0, 0)),
                   pl.BlockSpec((None, None, n, 1), lambda i, k: (i, k, 0, 0))],
        out_shape=(jax.ShapeDtypeStruct((n_tiles, hkv, n, dh), jnp.float32),
                   jax.ShapeDtypeStruct((n_tiles, hkv, n, 1), jnp.float32)),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_prefix",
    )(*scalars, q.reshape(b * h, dh), prefix_k, prefix_v, *rows_sc[:2])
    # each slot's rows of the prompt part: tile slot_pos // tile, rows (slot_pos % tile) * g on
    pos = jnp.where(prefix_index >= 0, plan["slot_pos"], -1).astype(jnp.int32)
    kv_own = pl.BlockSpec((n_layers, n_pages, None, page, dh), lambda i, k: (0, 0, k, 0, 0))
    sc_own = pl.BlockSpec((n_layers, n_pages, None, 1, page), lambda i, k: (0, 0, k, 0, 0))
    qo_spec = pl.BlockSpec((None, h, dh), lambda i, k: (i, 0, 0))   # the slot's heads: both
    return pl.pallas_call(                                           # programs' rows, masked
        functools.partial(_own_merge_kernel_triton, group=g, tile=tile, scale=scale),
        grid=(b, hkv),
        in_specs=[full(layer_arr), full(page_table), full(slen), full(pos), qo_spec, kv_own,
                  kv_own, pl.BlockSpec((n_tiles, None, n, dh), lambda i, k: (0, k, 0, 0)),
                  pl.BlockSpec((n_tiles, None, n), lambda i, k: (0, k, 0))]
        + [sc_own] * len(rows_sc[2:]),
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct((b, h, dh), q.dtype),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_own",
    )(layer_arr, page_table, slen, pos, q, pages_k, pages_v, o_p, lse_p[..., 0], *rows_sc[2:])
