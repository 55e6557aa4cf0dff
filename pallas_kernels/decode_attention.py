"""Decode attention of slots against a pool of shared prompt KVs plus each slot's own, paged KV.

A decode *slot* holds one sample: its query ``q[b]``, its own generated KV (valid up to
``suffix_len[b]``), kept in fixed-size *pages* of a page pool (position s of slot b lives in
page ``page_table[b, s // page]`` at offset ``s % page``), and the index ``prefix_index[b]`` of
its prompt in a pool of prompt KVs ``prefix_k[k]`` (valid up to ``prefix_len[k]``), each stored
once and shared by every slot of that prompt. Softmax attention over ``prompt ++ own`` splits
exactly into the two parts merged by their log-sum-exp (the online-softmax / flash-attention
identity)::

    o_p, lse_p = attend(q, prompt)          o_s, lse_s = attend(q, own)
    lse = logaddexp(lse_p, lse_s)
    out = exp(lse_p - lse) * o_p + exp(lse_s - lse) * o_s

GQA: query head ``h`` uses KV head ``h // (H // Hkv)`` (Hugging Face ``repeat_kv`` order).
Slots with ``prefix_index < 0`` are empty: their output is zeros. A row with no valid key at all
returns zeros.

**Tiles.** The prompt part is computed per *tile*: the slots are ordered by (prompt, own length
descending) and each prompt's run of slots is cut into tiles of ``tile`` slots (the last one
padded), so one tile holds slots of a single prompt and its ``[tile * H / Hkv, Dh] x [Dh, P]``
matmul reads the prompt's KV once for all of them. At most ``B // tile + K`` tiles exist; only
the ones in use are computed. ``plan_tiles`` builds this plan (jnp, on device).

**Layouts** (head-major, so a TPU block's last two dims are (positions, Dh)):
``q[B, H, Dh]``, ``prefix_k/v[K, Hkv, P, Dh]``, ``prefix_len[K]``, ``prefix_index[B]``,
``pages_k/v[NP, Hkv, page, Dh]``, ``page_table[B, MP]``, ``suffix_len[B]``. With ``layer=l`` the
prompt pool and the page pool carry a leading layer axis (``[L, K, ...]``, ``[L, NP, ...]``) and
layer ``l`` is read in place (a decode loop's caches are never copied per layer).

Three implementations of :func:`slot_decode_attention`:

* ``reference`` (jnp): one ``lax.fori_loop`` over the prompt tiles in use, a matmul each; then the
  slots sorted by own length in tiles of 16, each looping over its pages up to its longest slot
  (the work follows the tokens generated, not the slots' capacity).
* ``pallas``, Triton form (GPU): kernel 1, grid (tile, KV head), streams the tile's prompt KV in
  blocks with an online softmax; kernel 2, grid (slot, KV head), streams the slot's pages up to
  its length, read through the page table. The two results merge by log-sum-exp in jnp.
* ``pallas``, Mosaic form (TPU): the same two kernels, with the tile plan and the page table as
  scalar-prefetch arguments so each grid step's block (layer, prompt, page) comes from them:
  pages past a slot's length are neither fetched again (their index map repeats the last one)
  nor computed.

:func:`shared_prefix_decode_attention` keeps the earlier grouped form
(``q[B, N, H, Dh]`` with ``prefix_k[B, P, Hkv, Dh]`` shared by the N samples of row b, or by
``prefix_index[b, n]`` into a pool; contiguous own KV ``[B, N, S, Hkv, Dh]``) on top of it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode

_IMPLS = ("auto", "reference", "pallas")
_DTYPES = ("float32", "bfloat16", "float16")
_NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free on fully masked rows
# Query rows per Triton prompt-tile program (tile x padded query heads per KV head): its q block,
# scores and accumulator stay within an H100's shared memory with 64-position prompt blocks.
TRITON_TILE_ROWS = 128


def decode_attention_unsupported_reason(dtype=None, page_size: int | None = None,
                                       family: str | None = None, *,
                                       in_shard_map: bool = False) -> str | None:
    """None when the Pallas kernels compile for a KV store of ``dtype`` in pages of
    ``page_size`` positions on the current target (see ``_backend.compile_target``), else why
    not; ``impl="auto"`` then uses the jnp reference (logged once). ``in_shard_map``: the caller
    runs the kernels inside ``shard_map`` (the rollout engine), so a mesh being traced under does
    not matter."""
    if dtype is not None and jnp.dtype(dtype).name not in _DTYPES:
        return (f"KV dtype {jnp.dtype(dtype).name} (the kernels take {_DTYPES}; a uint16 store "
                "of bfloat16 bit patterns is the CPU reference's)")
    if not in_shard_map and _backend.under_auto_partitioned_mesh():
        return "traced under a mesh outside shard_map (GSPMD cannot partition a Pallas call)"
    if page_size is not None:
        fam = _backend.kernel_family(family)
        if page_size % 8 or (fam == "triton" and (page_size < 16 or page_size & (page_size - 1))):
            return (f"page size {page_size}: the kernels read whole pages, a multiple of 8 "
                    "(TPU sublanes), a power of two >= 16 on GPU (Triton dot)")
    return None


def resolve_impl(impl: str, dtype=None, page_size: int | None = None, *,
                 in_shard_map: bool = False) -> str:
    """"auto" -> the Pallas kernels on GPU/TPU, the jnp reference on CPU (interpreting is slow)
    or where the kernels do not compile for this KV store (decode_attention_unsupported_reason;
    logged once); an explicit "pallas" that cannot compile raises the reason."""
    check = lambda: decode_attention_unsupported_reason(dtype, page_size,
                                                        in_shard_map=in_shard_map)
    return _backend.resolve_impl(impl, _IMPLS, on_cpu="reference", kernel="decode_attention",
                                 check=check)


def default_page_size() -> int:
    """Positions per page of own KV the kernels are built for on the current target: 128 on TPU
    (a page is one (128, Dh) VMEM block of the scalar-prefetch grid), else 16 (>= 16 rows per
    Triton dot; the jnp reference's block)."""
    return 128 if _backend.backend() == "tpu" else 16


def default_tile(num_slots: int, num_prefixes: int) -> int:
    """Slots per prompt tile: about the slots one prompt holds (so a tile is rarely padded), a
    power of two in [8, 64]."""
    per_prompt = max(1, num_slots // max(num_prefixes, 1))
    return int(min(64, max(8, 1 << (per_prompt.bit_length() - 1))))


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def _check_slot_shapes(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                       page_table, suffix_len, layer) -> None:
    lead = 0 if layer is None else 1
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, Dh], got {q.shape}")
    b, h, dh = q.shape
    if prefix_k.ndim != 4 + lead or prefix_k.shape[-1] != dh:
        want = "[L, K, Hkv, P, Dh]" if lead else "[K, Hkv, P, Dh]"
        raise ValueError(f"prefix_k must be {want} with Dh={dh}, got {prefix_k.shape}")
    k_pool, hkv = prefix_k.shape[lead], prefix_k.shape[lead + 1]
    if h % hkv:
        raise ValueError(f"num heads H={h} must be a multiple of num kv heads Hkv={hkv}")
    if prefix_v.shape != prefix_k.shape:
        raise ValueError(f"prefix_v shape {prefix_v.shape} != prefix_k shape {prefix_k.shape}")
    if pages_k.ndim != 4 + lead or pages_k.shape[lead + 1] != hkv or pages_k.shape[-1] != dh:
        want = "[L, NP, Hkv, page, Dh]" if lead else "[NP, Hkv, page, Dh]"
        raise ValueError(f"pages_k must be {want} with Hkv={hkv}, Dh={dh}, got {pages_k.shape}")
    if pages_v.shape != pages_k.shape:
        raise ValueError(f"pages_v shape {pages_v.shape} != pages_k shape {pages_k.shape}")
    if lead and prefix_k.shape[0] != pages_k.shape[0]:
        raise ValueError(f"prefix_k and pages_k have different layer counts: "
                         f"{prefix_k.shape[0]} vs {pages_k.shape[0]}")
    if prefix_len.shape != (k_pool,):
        raise ValueError(f"prefix_len must be [K={k_pool}], got {prefix_len.shape}")
    if prefix_index.shape != (b,):
        raise ValueError(f"prefix_index must be [B={b}], got {prefix_index.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, pages per slot], got {page_table.shape}")
    if suffix_len.shape != (b,):
        raise ValueError(f"suffix_len must be [B={b}], got {suffix_len.shape}")


# ----------------------------------------------------------------------------------------------
# The tile plan (jnp; shared by the reference and the kernels)
# ----------------------------------------------------------------------------------------------


def plan_tiles(prefix_index: jax.Array, suffix_len: jax.Array, *, num_prefixes: int, tile: int,
               max_suffix: int) -> dict:
    """Order the slots into prompt tiles.

    Slots are sorted by (prompt, own length descending); prompt k's ``c_k`` slots fill
    ``ceil(c_k / tile)`` consecutive tiles. Returns ``row_slot int32[T_max * tile]`` (the slot in
    each tile row, -1 for padding), ``tile_prefix int32[T_max]`` (the prompt of each tile; tiles
    past ``num_tiles`` repeat the last one in use, so a pipeline does not fetch new blocks for
    them), ``num_tiles`` (int32 scalar), ``tile_len int32[T_max]`` (the longest own KV of the
    tile) and ``slot_pos int32[B]`` (each slot's row in the tiles, ``tile index * tile + rank``;
    ``T_max * tile`` for empty slots), with ``T_max = B // tile + K``.
    """
    b = prefix_index.shape[0]
    k = num_prefixes
    n_tiles = b // tile + k
    valid = prefix_index >= 0
    pidx = jnp.where(valid, prefix_index, k).astype(jnp.int32)
    slen = jnp.where(valid, suffix_len, 0).astype(jnp.int32)
    key = pidx * (max_suffix + 1) + (max_suffix - jnp.clip(slen, 0, max_suffix))
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_p = pidx[order]
    counts = jnp.zeros((k + 1,), jnp.int32).at[pidx].add(1)[:k]
    first = jnp.cumsum(counts) - counts                 # first sorted position of each prompt
    tiles = (counts + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    pc = jnp.minimum(sorted_p, k - 1)
    rank = jnp.arange(b, dtype=jnp.int32) - first[pc]
    pos = jnp.where(sorted_p < k, tile_start[pc] * tile + rank, n_tiles * tile)
    row_slot = jnp.full((n_tiles * tile,), -1, jnp.int32).at[pos].set(order, mode="drop")
    num_tiles = tile_end[-1]
    tid = jnp.minimum(jnp.arange(n_tiles, dtype=jnp.int32), jnp.maximum(num_tiles - 1, 0))
    tile_prefix = jnp.clip(jnp.searchsorted(tile_end, tid, side="right"), 0, k - 1)
    first_row = row_slot[tid * tile]
    tile_len = jnp.where(first_row >= 0, slen[jnp.maximum(first_row, 0)], 0)
    slot_pos = jnp.full((b,), n_tiles * tile, jnp.int32).at[order].set(pos.astype(jnp.int32))
    return dict(row_slot=row_slot, tile_prefix=tile_prefix.astype(jnp.int32),
                num_tiles=num_tiles.astype(jnp.int32), tile_len=tile_len.astype(jnp.int32),
                slot_pos=slot_pos)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp)
# ----------------------------------------------------------------------------------------------


def _merge(o_p, lse_p, o_s, lse_s):
    """Exact merge of two softmax parts by their log-sum-exp (either may be empty: lse -inf)."""
    lse = jnp.logaddexp(lse_p, lse_s)
    safe = jnp.isfinite(lse)
    lse = jnp.where(safe, lse, 0.0)
    w_p = jnp.where(safe & jnp.isfinite(lse_p), jnp.exp(lse_p - lse), 0.0)
    w_s = jnp.where(safe & jnp.isfinite(lse_s), jnp.exp(lse_s - lse), 0.0)
    return w_p[..., None] * o_p + w_s[..., None] * o_s


def _kv_block(x):
    """A gathered KV block as floats: a uint16 store holds bfloat16 bit patterns (how a decode
    loop keeps a 16-bit KV store on CPU, whose XLA backend would otherwise compute every scatter
    into it in float32, converting the whole store)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def _stats_out(m, l, acc):
    """(o, lse) of an online-softmax state; rows without any valid key: o = 0, lse = -inf."""
    valid = l > 0
    o = jnp.where(valid[..., None], acc / jnp.where(valid, l, 1.0)[..., None], 0.0)
    lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
    return o, lse


def slot_decode_attention_reference(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, tile=None, own_tile=16,
) -> jax.Array:
    """jnp slot decode attention (module docstring): ``out[B, H, Dh]`` in q's dtype, float32
    accumulation.

    Prompt part: a loop over the prompt tiles in use, one matmul each. Own part: the slots sorted
    by own length (longest first), in tiles of ``own_tile``, each tile looping over its slots'
    pages up to its longest slot, so the work follows the tokens generated (not the slots'
    capacity). The parts merge by log-sum-exp.
    """
    _check_slot_shapes(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                       page_table, suffix_len, layer)
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
                                                           (1, 1, hkv, p_len, dh))[0, 0])
        pk, pv = prompt(prefix_k), prompt(prefix_v)
        # one [tile*g, Dh] x [Dh, P] matmul per KV head, in the KV's dtype with f32 accumulation
        # (an explicit f32 copy of a slice of a loop-invariant store gets hoisted by XLA into a
        # whole-store conversion per call)
        qm = qf[jnp.maximum(rows, 0)].transpose(1, 0, 2, 3).reshape(hkv, tile * g, dh)
        s = f32("kmd,kpd->kmp", qm.astype(pk.dtype), pk)
        mask = jnp.arange(p_len) < prefix_len[kp]
        s = jnp.where(mask, s, _NEG)
        m = jnp.max(s, axis=-1)
        p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
        o, lse = _stats_out(m, jnp.sum(p, axis=-1), f32("kmp,kpd->kmd", p.astype(pv.dtype), pv))
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
                x, (layer, page, 0, 0, 0), (1, 1, hkv, bs, dh))[0, 0])(table[:, j]))
            kb, vb = take(pages_k), take(pages_v)                # [ts, Hkv, page, Dh]
            s = f32("tkgd,tksd->tkgs", qt.astype(kb.dtype), kb)
            msk = ((start + jnp.arange(bs))[None, :] < tl[:, None])[:, None, None, :]
            s = jnp.where(msk, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            pb = jnp.where(msk, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            return (m_new, alpha * l + jnp.sum(pb, axis=-1),
                    alpha[..., None] * acc + f32("tkgs,tksd->tkgd", pb.astype(vb.dtype), vb))

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


def slot_decode_attention_traffic(kernel: str, operands, *, group: int,
                                  slots_per_prompt, prompt_len: int, own_len: float,
                                  family: str = "triton") -> tuple[float, float]:
    """(HBM bytes, flops) of ONE call of a Pallas kernel of :func:`slot_decode_attention_pallas`
    (the traffic declaration bench/roofline.py adds to its walk of the compiled program, where
    the kernel is opaque), from its operands as compiled and the lengths it runs at.

    ``kernel``: "slot_decode_attention_prefix" or "slot_decode_attention_own"; ``operands``:
    [(dtype name, shape)] of the custom call in order; ``group``: query heads per KV head;
    ``slots_per_prompt``: live slots of each prompt in the pool; ``prompt_len``: valid prompt
    positions; ``own_len``: mean own KV positions of a live slot. What each program moves:

    * prefix (grid tile x KV head; tiles past the ones in use return at once): its q rows, the
      prompt's K and V up to ``prompt_len`` in whole blocks (Triton: blocks of <= 64 positions;
      Mosaic: the whole padded prompt is one VMEM block), its f32 outputs (o and lse);
    * own (grid slot x KV head): its q rows, its pages up to its length, K and V, its page-table
      entries; Triton: its rows of the prompt part (f32) in and the merged output (q's dtype)
      out; Mosaic: its f32 outputs.
    Flops: 2 x rows x positions x Dh for QK^T and again for PV, padded rows included.
    """
    itemsize = lambda d: jnp.dtype(d).itemsize
    if kernel == "slot_decode_attention_prefix":
        (q_dt, q_shape), (kv_dt, kv_shape) = operands[4], operands[5]
        n_tiles, hkv, rows, dh = q_shape
        p_pad = kv_shape[3]
        if family == "triton":    # packed rows (_slot_attention_triton)
            tile = triton_tile(sum(int(c) for c in slots_per_prompt), kv_shape[1], group)
        else:
            tile = rows // max(8, _pow2(group))
        in_use = min(n_tiles, sum(-(-int(c) // tile) for c in slots_per_prompt if c > 0))
        if family == "triton":
            block_p = min(64, max(16, _pow2(p_pad)))
            positions = min(p_pad, _round_up(int(prompt_len), block_p))
        else:
            positions = p_pad
        per = (rows * dh * itemsize(q_dt) + 2 * positions * dh * itemsize(kv_dt)
               + rows * (dh + 1) * 4)
        return float(in_use * hkv * per), float(in_use * hkv * 4 * rows * positions * dh)
    if kernel == "slot_decode_attention_own":
        merged = family == "triton"     # merges the prompt part in the kernel, writes q's dtype
        (q_dt, q_shape), (kv_dt, kv_shape) = operands[4 if merged else -3], \
            operands[5 if merged else -2]
        b, hkv, gp, dh = q_shape
        page = kv_shape[3]
        live = min(b, sum(int(c) for c in slots_per_prompt))
        positions = _round_up(int(math.ceil(own_len)), page) if own_len > 0 else 0
        if merged:   # q in, its prompt-part rows (f32 o and lse) in, the output out
            per_slot = gp * dh * itemsize(q_dt) + gp * (dh + 1) * 4 + gp * dh * itemsize(q_dt)
        else:        # q in, f32 o and lse out
            per_slot = gp * dh * itemsize(q_dt) + gp * (dh + 1) * 4
        kv = live * (2 * positions * dh * itemsize(kv_dt) + 4 * positions // page)
        return (float(hkv * (b * per_slot + kv)),
                float(hkv * live * 4 * gp * positions * dh))
    raise ValueError(f"unknown slot decode attention kernel {kernel!r}")


# ----------------------------------------------------------------------------------------------
# Pallas kernels. Kernel 1 (prompt part, per tile) and kernel 2 (own part, per slot block) each
# return (o, lse); they merge by log-sum-exp in jnp.
# ----------------------------------------------------------------------------------------------


def _online_step(state, s, mask, v_fn):
    """One online-softmax step (Milakov & Gimelshein 2018; FlashAttention) over s [rows, blk]."""
    m, l, acc = state
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + v_fn(p)


def _finish(state):
    m, l, acc = state
    valid = l > 0
    o = acc / jnp.where(valid, l, 1.0)[:, None]
    lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
    return o, lse


def _qk(q, k):
    """Scores q [M, D] x k [N, D]^T -> [M, N]: operands in the KV's dtype (bfloat16 tensor-core /
    MXU dots for a bfloat16 model, as the reference), accumulated in float32."""
    return jax.lax.dot_general(q.astype(k.dtype), k, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _pv(p, v):
    """p [M, N] (float32 softmax weights) x v [N, D] in v's dtype, accumulated in float32."""
    return jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _attend_blocks(q, length, block, load):
    """Online softmax of q [R, Dh] over the first ``length`` positions, ``block`` at a time:
    ``load(j, start)`` -> (k, v) [block, Dh] of block j. Returns (out [R, Dh] f32, lse [R])."""
    rows, dh = q.shape
    state = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, dh), jnp.float32))

    def body(j, st):
        start = pl.multiple_of(j * block, block)
        k, v = load(j, start)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
        return _online_step(st, _qk(q, k), pos < length, lambda p: _pv(p, v))

    return _finish(jax.lax.fori_loop(0, (length + block - 1) // block, body, state))


def _prefix_kernel_triton(layer_ref, tp_ref, nt_ref, plen_ref, q_ref, pk_ref, pv_ref, o_ref,
                          lse_ref, *, block_p):
    """Grid (tile, KV head). q_ref [R, Dh] (the tile's rows for this KV head); pk_ref/pv_ref
    [L, K, P_pad, Dh] (this KV head, read in place at the tile's (layer, prompt))."""
    i = pl.program_id(0)

    @pl.when(i < nt_ref[0])
    def _():
        layer, kp = layer_ref[0], tp_ref[i]
        o, lse = _attend_blocks(
            q_ref[...], plen_ref[kp], block_p,
            lambda j, start: (pk_ref[layer, kp, pl.ds(start, block_p), :],
                              pv_ref[layer, kp, pl.ds(start, block_p), :]))
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def _prefix_kernel_mosaic(layer_ref, tp_ref, nt_ref, plen_ref, q_ref, pk_ref, pv_ref, o_ref,
                          lse_ref, *, block_p):
    """Grid (tile, KV head); scalar prefetch (layer, tile_prefix, num_tiles, prefix_len) picks the
    prompt block: pk_ref/pv_ref [P_pad, Dh] are the tile's prompt for this KV head, in VMEM."""
    i = pl.program_id(0)

    @pl.when(i < nt_ref[0])
    def _():
        o, lse = _attend_blocks(
            q_ref[...], plen_ref[tp_ref[i]], block_p,
            lambda j, start: (pk_ref[pl.ds(start, block_p), :], pv_ref[pl.ds(start, block_p), :]))
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse[:, None]


def _own_kernel_triton(layer_ref, table_ref, slen_ref, q_ref, pk_ref, pv_ref, o_ref, lse_ref):
    """Grid (slot, KV head). q_ref [Gp, Dh] (the slot's query heads of this KV head, padded);
    pk_ref/pv_ref [L, NP, page, Dh] (this KV head), read in place at the layer and the slot's
    pages (table_ref [B, MP])."""
    b = pl.program_id(0)
    layer = layer_ref[0]
    page = pk_ref.shape[2]

    def load(j, start):
        idx = table_ref[b, j]
        return pk_ref[layer, idx, :, :], pv_ref[layer, idx, :, :]

    o, lse = _attend_blocks(q_ref[...], slen_ref[b], page, load)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse[:, None]


def _own_kernel_mosaic(layer_ref, table_ref, last_ref, slen_ref, q_ref, sk_ref, sv_ref, o_ref,
                       lse_ref, m_sc, l_sc, acc_sc, *, block_s):
    """Grid (slot, KV head, page j); scalar prefetch (layer, flattened page table, last page,
    lengths) picks each step's page: pages past the slot's length are neither fetched (their
    index map repeats the last one) nor computed. q_ref [Gp, Dh]; sk_ref/sv_ref [page, Dh];
    running softmax state in VMEM scratch."""
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j <= last_ref[b])
    def _():
        q = q_ref[...]
        k = sk_ref[...]
        v = sv_ref[...]
        pos = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], block_s), 1)
        m, l, acc = _online_step((m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...]), _qk(q, k),
                                 pos < slen_ref[b], lambda p: _pv(p, v))
        m_sc[...] = m[:, None]
        l_sc[...] = l[:, None]
        acc_sc[...] = acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o, lse = _finish((m_sc[...][:, 0], l_sc[...][:, 0], acc_sc[...]))
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
                             op_ref, lp_ref, o_ref, *, group, tile):
    """Grid (slot, KV head): the slot's own KV as :func:`_own_kernel_triton`, merged by
    log-sum-exp with the slot's rows of the prompt part (``op_ref [T, R, Dh]`` /
    ``lp_ref [T, R]`` of this KV head, packed ``group`` rows per slot), written once in q's
    dtype (zeros for an empty slot: ``pos_ref[b] < 0``)."""
    b = pl.program_id(0)
    layer = layer_ref[0]
    gp = q_ref.shape[0]

    def load(j, start):
        idx = table_ref[b, j]
        return pk_ref[layer, idx, :, :], pv_ref[layer, idx, :, :]

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


def _slot_attention_triton(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                           page_table, suffix_len, *, layer, scale, tile, block_p):
    """The GPU (Triton) form of :func:`slot_decode_attention_pallas`, with two differences
    from the Mosaic form that cut the traffic of a decode step (bench/roofline.py):

    * prompt tiles pack each slot's ``g = H / Hkv`` query rows (not padded to a power of two per
      slot), so a 128-row tile holds ``(128 - Gp) // g + 1`` slots (19 for Qwen2.5's g = 6, 8
      before): each prompt's KV is read by 2.5x fewer tiles. The tiles of one prompt run in the
      same launch and read the same prompt blocks (1 MiB per layer for a 1024-token Qwen2.5
      prompt), which an H100's 50 MiB L2 serves; bench/roofline.py still counts every tile's
      read as HBM traffic.
    * the own-KV kernel merges its result with the slot's rows of the prompt part and writes the
      attention output once, in q's dtype: no scatter of the prompt part into slot order, no f32
      merge pass, no zero buffers.
    """
    reason = decode_attention_unsupported_reason(
        jnp.uint16 if jnp.uint16 in (prefix_k.dtype, pages_k.dtype) else pages_k.dtype,
        pages_k.shape[-2], "triton", in_shard_map=True)
    if reason is not None:
        raise ValueError(f"slot_decode_attention_pallas: {reason}")
    interpret = interpret_mode()
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
    scalars = (layer_arr, plan["tile_prefix"], plan["num_tiles"].reshape(1),
               prefix_len.astype(jnp.int32))
    full = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
    kv_spec = pl.BlockSpec((n_layers, k_pool, None, p_pad, dh), lambda i, k: (0, 0, k, 0, 0))
    params = _backend.compiler_params("triton", dimension_semantics=("parallel", "parallel"))
    o_p, lse_p = pl.pallas_call(
        functools.partial(_prefix_kernel_triton, block_p=block_p),
        grid=(n_tiles, hkv),
        in_specs=[full(x) for x in scalars] + [
            pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)), kv_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)),
                   pl.BlockSpec((None, None, rows, 1), lambda i, k: (i, k, 0, 0))],
        out_shape=(jax.ShapeDtypeStruct((n_tiles, hkv, rows, dh), jnp.float32),
                   jax.ShapeDtypeStruct((n_tiles, hkv, rows, 1), jnp.float32)),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_prefix",
    )(*scalars, qt, prefix_k, prefix_v)
    # each slot's rows of the prompt part: tile slot_pos // tile, rows (slot_pos % tile) * g on
    pos = jnp.where(prefix_index >= 0, plan["slot_pos"], -1).astype(jnp.int32)
    qs = jnp.pad(qf, ((0, 0), (0, 0), (0, gp - g), (0, 0)))                 # [B, Hkv, Gp, Dh]
    kv_own = pl.BlockSpec((n_layers, n_pages, None, page, dh), lambda i, k: (0, 0, k, 0, 0))
    qo_spec = pl.BlockSpec((None, None, gp, dh), lambda i, k: (i, k, 0, 0))
    out = pl.pallas_call(
        functools.partial(_own_merge_kernel_triton, group=g, tile=tile),
        grid=(b, hkv),
        in_specs=[full(layer_arr), full(page_table), full(slen), full(pos), qo_spec, kv_own,
                  kv_own, pl.BlockSpec((n_tiles, None, rows, dh), lambda i, k: (0, k, 0, 0)),
                  pl.BlockSpec((n_tiles, None, rows), lambda i, k: (0, k, 0))],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, gp, dh), q.dtype),
        interpret=interpret, compiler_params=params, name="slot_decode_attention_own",
    )(layer_arr, page_table, slen, pos, qs, pages_k, pages_v, o_p, lse_p[..., 0])
    return out[:, :, :g].reshape(b, h, dh)


def slot_decode_attention_pallas(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, tile=None, family=None, block_p=None,
) -> jax.Array:
    """Pallas form of :func:`slot_decode_attention_reference` (same contract).

    The prompt pool and the page pool are passed whole (with their layer axis) and read in place;
    q, the plans and the two partial results are small. ``family``: "triton" or "mosaic"
    (default: by target). ``block_p``: prompt positions per step (default up to 128). The own KV
    is read a page at a time (pages of >= 16 positions on GPU, a multiple of 8 on TPU)."""
    _check_slot_shapes(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                       page_table, suffix_len, layer)
    family = _backend.kernel_family(family)
    if family == "triton":
        return _slot_attention_triton(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k,
                                      pages_v, page_table, suffix_len, layer=layer, scale=scale,
                                      tile=tile, block_p=block_p)
    reason = decode_attention_unsupported_reason(
        jnp.uint16 if jnp.uint16 in (prefix_k.dtype, pages_k.dtype) else pages_k.dtype,
        pages_k.shape[-2], family, in_shard_map=True)   # a mesh: the caller's choice to make
    if reason is not None:
        raise ValueError(f"slot_decode_attention_pallas: {reason}")
    interpret = interpret_mode()
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
    # query rows per (slot, KV head) padded to a power of two (Triton: >= 16 for its dot)
    gp = max(16 if family == "triton" else 8, _pow2(g))
    if tile is None:
        tile = default_tile(b, k_pool)
        if family == "triton":   # a tile's q rows, scores and accumulator fit shared memory
            tile = max(1, min(tile, TRITON_TILE_ROWS // gp))
    tile = int(tile)
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
    if not block_p:   # Triton: power-of-two blocks; Mosaic: whole sublane groups
        block_p = (min(64, max(16, _pow2(p_len))) if family == "triton"
                   else min(128, _round_up(p_len, 16)))
    p_pad = _round_up(p_len, block_p)
    if p_pad != p_len:   # only the compat path and odd prompt buckets get here (copies the pool)
        pad = ((0, 0), (0, 0), (0, 0), (0, p_pad - p_len), (0, 0))
        prefix_k, prefix_v = jnp.pad(prefix_k, pad), jnp.pad(prefix_v, pad)
    out_shapes = (jax.ShapeDtypeStruct((n_tiles, hkv, rows, dh), jnp.float32),
                  jax.ShapeDtypeStruct((n_tiles, hkv, rows, 1), jnp.float32))
    scalars = (layer_arr, plan["tile_prefix"], plan["num_tiles"].reshape(1),
               prefix_len.astype(jnp.int32))
    if family == "triton":
        full = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
        kv_spec = pl.BlockSpec((n_layers, k_pool, None, p_pad, dh), lambda i, k: (0, 0, k, 0, 0))
        o_p, lse_p = pl.pallas_call(
            functools.partial(_prefix_kernel_triton, block_p=block_p),
            grid=(n_tiles, hkv),
            in_specs=[full(x) for x in scalars] + [
                pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)), kv_spec, kv_spec],
            out_specs=[pl.BlockSpec((None, None, rows, dh), lambda i, k: (i, k, 0, 0)),
                       pl.BlockSpec((None, None, rows, 1), lambda i, k: (i, k, 0, 0))],
            out_shape=out_shapes, interpret=interpret,
            compiler_params=_backend.compiler_params(
                family, dimension_semantics=("parallel", "parallel")),
            name="slot_decode_attention_prefix",
        )(*scalars, qt, prefix_k, prefix_v)
    else:
        from jax.experimental.pallas import tpu as pltpu
        kv_spec = pl.BlockSpec((None, None, None, p_pad, dh),
                               lambda i, k, ly, tp, nt, pln: (ly[0], tp[i], k, 0, 0))
        qo_spec = pl.BlockSpec((None, None, rows, dh), lambda i, k, *_: (i, k, 0, 0))
        o_p, lse_p = pl.pallas_call(
            functools.partial(_prefix_kernel_mosaic, block_p=block_p),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4, grid=(n_tiles, hkv),
                in_specs=[qo_spec, kv_spec, kv_spec],
                out_specs=[qo_spec,
                           pl.BlockSpec((None, None, rows, 1), lambda i, k, *_: (i, k, 0, 0))]),
            out_shape=out_shapes, interpret=interpret,
            compiler_params=_backend.compiler_params(
                family, dimension_semantics=("parallel", "parallel")),
            name="slot_decode_attention_prefix",
        )(*scalars, qt, prefix_k, prefix_v)
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
    if family == "triton":
        full = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
        kv_spec = pl.BlockSpec((n_layers, n_pages, None, page, dh), lambda i, k: (0, 0, k, 0, 0))
        qo_spec = pl.BlockSpec((None, None, gp, dh), lambda i, k: (i, k, 0, 0))
        o_s, lse_s = pl.pallas_call(
            _own_kernel_triton,
            grid=(b, hkv),
            in_specs=[full(layer_arr), full(page_table), full(slen), qo_spec, kv_spec, kv_spec],
            out_specs=[qo_spec, pl.BlockSpec((None, None, gp, 1), lambda i, k: (i, k, 0, 0))],
            out_shape=own_shapes, interpret=interpret,
            compiler_params=_backend.compiler_params(
                family, dimension_semantics=("parallel", "parallel")),
            name="slot_decode_attention_own",
        )(layer_arr, page_table, slen, qs, pages_k, pages_v)
    else:
        from jax.experimental.pallas import tpu as pltpu
        last = jnp.maximum((slen + page - 1) // page - 1, 0).astype(jnp.int32)
        kv_spec = pl.BlockSpec(
            (None, None, None, page, dh),
            lambda i, k, j, ly, tb, la, sl: (ly[0], tb[i * max_pages + jnp.minimum(j, la[i])], k,
                                             0, 0))
        q_spec = pl.BlockSpec((None, None, gp, dh), lambda i, k, j, *_: (i, k, 0, 0))
        o_s, lse_s = pl.pallas_call(
            functools.partial(_own_kernel_mosaic, block_s=page),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4, grid=(b, hkv, max_pages),
                in_specs=[q_spec, kv_spec, kv_spec],
                out_specs=[q_spec,
                           pl.BlockSpec((None, None, gp, 1), lambda i, k, j, *_: (i, k, 0, 0))],
                scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32),
                                pltpu.VMEM((gp, 1), jnp.float32),
                                pltpu.VMEM((gp, dh), jnp.float32)]),
            out_shape=own_shapes, interpret=interpret,
            compiler_params=_backend.compiler_params(
                family, dimension_semantics=("parallel", "parallel", "arbitrary")),
            name="slot_decode_attention_own",
        )(layer_arr, page_table.reshape(-1), last, slen, qs, pages_k, pages_v)
    out = _merge(o_pref, lse_pref, o_s, lse_s[..., 0])          # [B, Hkv, Gp, Dh]
    out = jnp.where((prefix_index >= 0)[:, None, None, None], out, 0.0)
    return out[:, :, :g].reshape(b, h, dh).astype(q.dtype)


def slot_decode_attention(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, impl="auto",
) -> jax.Array:
    """Decode attention of B slots (module docstring for shapes and layouts).

    Args:
      q: ``[B, H, Dh]`` the current token's queries, one row per slot.
      prefix_k, prefix_v: ``[K, Hkv, P, Dh]`` a pool of prompt KVs (``[L, K, ...]`` with layer).
      prefix_len: ``[K]`` valid prompt positions. prefix_index: ``[B]`` each slot's prompt
        (< 0: empty slot, output zeros).
      pages_k, pages_v: ``[NP, Hkv, page, Dh]`` the page pool of the slots' own KV (``[L, NP,
        ...]`` with layer); a uint16 pool holds bfloat16 bit patterns (reference only).
      page_table: ``int32[B, MP]``: own position s of slot b is in page ``page_table[b, s //
        page]`` (entries past the slot's length are ignored).
      suffix_len: ``[B]`` valid own positions.
      layer: int or traced int32: read layer ``layer`` of the pools in place.
      impl: "auto" (kernels on GPU/TPU, reference on CPU), "reference" or "pallas".
    Returns ``out[B, H, Dh]`` = softmax attention over prompt ++ own KV, q's dtype.
    """
    pallas = resolve_impl(impl, pages_k.dtype, pages_k.shape[-2]) == "pallas"
    fn = slot_decode_attention_pallas if pallas else slot_decode_attention_reference
    return fn(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table,
              suffix_len, layer=layer, scale=scale)


# ----------------------------------------------------------------------------------------------
# The grouped form: N samples per row share row b's prompt (or a pool entry by prefix_index)
# ----------------------------------------------------------------------------------------------


def _check_grouped(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
                   prefix_index) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, N, H, Dh], got {q.shape}")
    b, n, h, dh = q.shape
    pool = prefix_k.shape[0] if prefix_index is not None else b
    if prefix_k.ndim != 4 or prefix_k.shape[0] != pool or prefix_k.shape[3] != dh:
        raise ValueError(f"prefix_k must be [{'K' if prefix_index is not None else 'B'}={pool}, "
                         f"P, Hkv, Dh={dh}], got {prefix_k.shape}")
    hkv = prefix_k.shape[2]
    if h % hkv:
        raise ValueError(f"num heads H={h} must be a multiple of num kv heads Hkv={hkv}")
    if prefix_v.shape != prefix_k.shape:
        raise ValueError(f"prefix_v shape {prefix_v.shape} != prefix_k shape {prefix_k.shape}")
    if suffix_k.ndim != 5 or suffix_k.shape[:2] != (b, n) or suffix_k.shape[3:] != (hkv, dh):
        raise ValueError(f"suffix_k must be [B={b}, N={n}, S, Hkv={hkv}, Dh={dh}], "
                         f"got {suffix_k.shape}")
    if suffix_v.shape != suffix_k.shape:
        raise ValueError(f"suffix_v shape {suffix_v.shape} != suffix_k shape {suffix_k.shape}")
    if prefix_len.shape != (pool,):
        raise ValueError(f"prefix_len must be [{pool}], got {prefix_len.shape}")
    if suffix_len.shape != (b, n):
        raise ValueError(f"suffix_len must be [B={b}, N={n}], got {suffix_len.shape}")
    if prefix_index is not None and prefix_index.shape != (b, n):
        raise ValueError(f"prefix_index must be [B={b}, N={n}], got {prefix_index.shape}")


def _grouped(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, prefix_index,
             scale, fn):
    _check_grouped(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
                   prefix_index)
    b, n, h, dh = q.shape
    s_len, hkv = suffix_k.shape[2], suffix_k.shape[3]
    if prefix_index is None:
        prefix_index = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, n))
    page = 16                      # contiguous own KV cut into pages; padding masked by length
    s_pad = _round_up(s_len, page)
    mp = s_pad // page

    def own(x):   # [B, N, S, Hkv, Dh] -> pages [B*N*MP, Hkv, page, Dh]
        x = jnp.pad(x.reshape(b * n, s_len, hkv, dh), ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0)))
        return x.reshape(b * n * mp, page, hkv, dh).transpose(0, 2, 1, 3)

    table = jnp.arange(b * n * mp, dtype=jnp.int32).reshape(b * n, mp)
    pre = lambda x: x.transpose(0, 2, 1, 3)
    out = fn(q.reshape(b * n, h, dh), pre(prefix_k), pre(prefix_v), prefix_len,
             prefix_index.reshape(b * n).astype(jnp.int32), own(suffix_k), own(suffix_v), table,
             suffix_len.reshape(b * n).astype(jnp.int32), scale=scale)
    return out.reshape(b, n, h, dh)


def shared_prefix_decode_attention_reference(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, prefix_index=None,
    scale=None,
) -> jax.Array:
    """Grouped form of the reference: ``q[B, N, H, Dh]``, ``prefix_k/v[B, P, Hkv, Dh]`` (or a pool
    ``[K, P, Hkv, Dh]`` with ``prefix_index[B, N]``), ``prefix_len[B or K]``,
    ``suffix_k/v[B, N, S, Hkv, Dh]``, ``suffix_len[B, N]`` -> ``out[B, N, H, Dh]``."""
    return _grouped(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
                    prefix_index, scale, slot_decode_attention_reference)


def shared_prefix_decode_attention_pallas(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, prefix_index=None,
    scale=None, **kernel_options,
) -> jax.Array:
    """Grouped form of the Pallas kernels (contract of the grouped reference);
    ``kernel_options`` (family, tile, block_p) go to :func:`slot_decode_attention_pallas`."""
    return _grouped(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
                    prefix_index, scale, functools.partial(slot_decode_attention_pallas,
                                                           **kernel_options))


def shared_prefix_decode_attention(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, prefix_index=None,
    scale=None, impl="auto",
) -> jax.Array:
    """Decode attention of ``q[B, N, H, Dh]`` (N samples per row) against a shared prompt KV and
    per-sample KV.

    Args:
      q: ``[B, N, H, Dh]`` queries of the current token of each of N samples per row.
      prefix_k, prefix_v: ``[B, P, Hkv, Dh]`` prompt KV, stored once per row; with
        ``prefix_index`` a pool ``[K, P, Hkv, Dh]`` of prompts.
      prefix_len: ``[B]`` (or ``[K]``) valid prompt positions (right padding).
      suffix_k, suffix_v: ``[B, N, S, Hkv, Dh]`` each sample's generated KV.
      suffix_len: ``[B, N]`` valid generated positions.
      prefix_index: optional ``int32[B, N]``: sample (b, n) reads pool prompt
        ``prefix_index[b, n]`` (< 0: empty, output zeros); default: prompt b.
      scale: score scale, default ``Dh ** -0.5``.
      impl: "auto" (kernel on GPU/TPU, reference on CPU), "reference" or "pallas".

    Returns ``out[B, N, H, Dh]``, exactly softmax attention over prefix ++ suffix. (This form
    copies the KV into the slot layout per call; a decode loop keeps its pools in that layout
    and calls :func:`slot_decode_attention`.)
    """
    if resolve_impl(impl, suffix_k.dtype) == "pallas":
        return shared_prefix_decode_attention_pallas(
            q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
            prefix_index=prefix_index, scale=scale)
    return shared_prefix_decode_attention_reference(
        q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len,
        prefix_index=prefix_index, scale=scale)
