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

**An e4m3 KV store** (``kv_scales=KVScales(...)``): the four KV arrays hold float8_e4m3fn values
(``quantize_kv``: one float32 scale per position and KV head, ``amax / 448``, fixed when the token
is written), the scales the arrays' shapes less Dh. Every form reads the 1-byte blocks and the
block's scale rows and dequantizes there: scores ``(q . k8) * k_scale``, the PV matmul on
``p * v_scale`` (the softmax normaliser on p). The e4m3 values widen exactly to q's dtype for the
dots (registers on GPU; VMEM on TPU, where v5e has no fp8 arithmetic: a conversion, no fp8 math);
no dequantized copy of a store exists. On CPU the reference also reads a uint8 store of the bits.

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

Layout of this package (as jax.experimental.pallas.ops keeps a kernel's GPU and TPU forms apart):
this module holds the public functions, the impl choice, the traffic declaration and the grouped
form; reference.py the jnp reference; common.py the checks, the tile plan and the online softmax
both families share; triton.py and mosaic.py the two kernel families (see _backend).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.decode_attention import common, mosaic, triton
from pallas_kernels.decode_attention.common import (
    FP8_KV_DTYPE,
    FP8_MAX,
    KVScales,
    _check_scales,
    _check_slot_shapes,
    _pow2,
    _round_up,
    decode_attention_unsupported_reason,
    default_tile,
    dequantize_kv,
    plan_tiles,
    quantize_kv,
)
from pallas_kernels.decode_attention.reference import slot_decode_attention_reference
from pallas_kernels.decode_attention.triton import TRITON_TILE_ROWS, triton_tile

__all__ = ["FP8_KV_DTYPE", "FP8_MAX", "KVScales", "TRITON_TILE_ROWS",
           "decode_attention_unsupported_reason", "default_page_size", "default_tile",
           "dequantize_kv", "plan_tiles", "quantize_kv", "resolve_impl", "shared_prefix_decode_attention",
           "shared_prefix_decode_attention_pallas", "shared_prefix_decode_attention_reference",
           "slot_decode_attention", "slot_decode_attention_pallas",
           "slot_decode_attention_reference", "slot_decode_attention_traffic", "triton_tile"]

_IMPLS = ("auto", "reference", "pallas")


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
      Mosaic: the whole padded prompt is one VMEM block), its f32 outputs (o and lse). Triton:
      the tile's n = ``tile x group`` packed rows: their int32 row indices, the live slots' rows
      of q gathered from ``q [B*H, Dh]`` (masked loads), n rows of o and lse written, the
      register tile's padding masked off; Mosaic: every row of its blocks;
    * own (grid slot x KV head): its q rows, its pages up to its length, K and V, its page-table
      entries; Triton: its ``group`` rows of q (masked loads from ``q [B, H, Dh]``), a live
      slot's ``group`` rows of the prompt part (f32 o and lse) in and its ``group`` rows of the
      merged output (q's dtype) out; Mosaic: its Gp padded rows of q in, f32 outputs out.
    Flops: 2 x rows x positions x Dh for QK^T and again for PV, the register tiles' padded rows
    included (Triton: ``triton.register_rows``).

    An e4m3 store (``kv_scales``): the KV at 1 byte an element, plus its float32 scale rows (two
    more operands after the KV: prefix, after prefix_v, last; own, Triton: after the prompt part's o
    and lse, last; Mosaic: after pages_v, last), 4 bytes per position each for K and V.
    """
    itemsize = lambda d: 1 if str(d).startswith(("f8", "float8")) else jnp.dtype(d).itemsize
    # the calls' operand counts without scale rows (scalars[, Triton prefix: q rows], q, K,
    # V[, o, lse]); 2 more with
    scale_ops = lambda plain: 2 if len(operands) >= plain + 2 else 0
    if kernel == "slot_decode_attention_prefix" and family == "triton":
        return _triton_prefix_traffic(operands, group, slots_per_prompt, prompt_len, itemsize,
                                      4 * scale_ops(8))
    if kernel == "slot_decode_attention_prefix":
        (q_dt, q_shape), (kv_dt, kv_shape) = operands[4], operands[5]
        sc_bytes = 4 * scale_ops(7)
        n_tiles, hkv, rows, dh = q_shape
        p_pad = kv_shape[3]
        tile = rows // max(8, _pow2(group))
        in_use = min(n_tiles, sum(-(-int(c) // tile) for c in slots_per_prompt if c > 0))
        positions = p_pad
        per = (rows * dh * itemsize(q_dt) + 2 * positions * dh * itemsize(kv_dt)
               + rows * (dh + 1) * 4 + positions * sc_bytes)
        return float(in_use * hkv * per), float(in_use * hkv * 4 * rows * positions * dh)
    if kernel == "slot_decode_attention_own":
        merged = family == "triton"     # merges the prompt part in the kernel, writes q's dtype
        n_sc = scale_ops(9 if merged else 7)
        (q_dt, q_shape), (kv_dt, kv_shape) = operands[4 if merged else -3 - n_sc], \
            operands[5 if merged else -2 - n_sc]
        page, hkv = kv_shape[3], kv_shape[2]
        b, dh = q_shape[0], q_shape[-1]
        live = min(b, sum(int(c) for c in slots_per_prompt))
        positions = _round_up(int(math.ceil(own_len)), page) if own_len > 0 else 0
        if merged:   # its g rows: q in, a live slot's prompt part (f32 o and lse) in, out out
            gp = triton.register_rows(group)[0]
            per_slot = 2 * group * dh * itemsize(q_dt)
            prompt_part = live * group * (dh + 1) * 4
        else:        # Gp padded rows: q in, f32 o and lse out
            gp = q_shape[2]
            per_slot, prompt_part = gp * dh * itemsize(q_dt) + gp * (dh + 1) * 4, 0
        kv = live * (2 * positions * dh * itemsize(kv_dt) + 4 * positions // page
                     + 4 * n_sc * positions)
        return (float(hkv * (b * per_slot + prompt_part + kv)),
                float(hkv * live * 4 * gp * positions * dh))
    raise ValueError(f"unknown slot decode attention kernel {kernel!r}")


def _triton_prefix_traffic(operands, group, slots_per_prompt, prompt_len, itemsize, sc_bytes):
    """The Triton prompt kernel's part of :func:`slot_decode_attention_traffic`: operands
    (scalars, qrow [T, n], q [B*H, Dh], K, V[, scale rows]); a tile in use reads its n row
    indices and the live slots' ``group`` q rows each (gathered, masked), the prompt's K and V
    in whole blocks up to ``prompt_len``, writes its n rows of f32 o and lse; it computes on
    ``triton.register_rows`` rows."""
    (_, (n_tiles, n)), (q_dt, (_, dh)), (kv_dt, kv_shape) = operands[4], operands[5], operands[6]
    hkv, p_pad = kv_shape[2], kv_shape[3]
    tile = n // group
    in_use = min(n_tiles, sum(-(-int(c) // tile) for c in slots_per_prompt if c > 0))
    block_p = min(64, max(16, _pow2(p_pad)))
    positions = min(p_pad, _round_up(int(prompt_len), block_p))
    per = (n * 4 + 2 * positions * dh * itemsize(kv_dt) + n * (dh + 1) * 4
           + positions * sc_bytes)
    q_rows = sum(int(c) for c in slots_per_prompt) * group
    computed = triton.register_rows(group)[1]
    return (float(hkv * (in_use * per + q_rows * dh * itemsize(q_dt))),
            float(in_use * hkv * 4 * computed * positions * dh))


def slot_decode_attention_pallas(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, tile=None, family=None, block_p=None, kv_scales=None,
) -> jax.Array:
    """Pallas form of :func:`slot_decode_attention_reference` (same contract).

    The prompt pool and the page pool are passed whole (with their layer axis) and read in place;
    q, the plans and the two partial results are small. ``family``: "triton" or "mosaic"
    (default: by target). ``block_p``: prompt positions per step (default up to 128). The own KV
    is read a page at a time (pages of >= 16 positions on GPU, a multiple of 8 on TPU).
    ``kv_scales``: e4m3 KV arrays, dequantized block by block inside the kernels."""
    _check_slot_shapes(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v,
                       page_table, suffix_len, layer)
    _check_scales(kv_scales, prefix_k, prefix_v, pages_k, pages_v)
    family_module = triton if _backend.kernel_family(family) == "triton" else mosaic
    return family_module.slot_attention(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k,
                                        pages_v, page_table, suffix_len, layer=layer, scale=scale,
                                        tile=tile, block_p=block_p, kv_scales=kv_scales)


def slot_decode_attention(
    q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table, suffix_len, *,
    layer=None, scale=None, impl="auto", kv_scales=None,
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
      kv_scales: a :class:`KVScales` when the four KV arrays hold e4m3 (``quantize_kv``; a
        uint8 store of its bit patterns: reference only): ``KV = x8 * scale``, one float32 scale
        per (position, KV head), applied inside the kernels to the scores (k) and to the
        softmax weights before the PV matmul (v). None: unscaled float KV, as before.
    Returns ``out[B, H, Dh]`` = softmax attention over prompt ++ own KV, q's dtype.
    """
    pallas = resolve_impl(impl, common._store_dtype(prefix_k, pages_k),
                          pages_k.shape[-2]) == "pallas"
    fn = slot_decode_attention_pallas if pallas else slot_decode_attention_reference
    return fn(q, prefix_k, prefix_v, prefix_len, prefix_index, pages_k, pages_v, page_table,
              suffix_len, layer=layer, scale=scale, kv_scales=kv_scales)


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
