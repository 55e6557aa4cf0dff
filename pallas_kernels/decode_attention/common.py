"""What the reference and both kernel families of the slot decode attention share: the
argument checks, the prompt-tile plan (jnp, on device), the log-sum-exp merge of the two parts,
and the online softmax the kernels run over KV blocks."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend

_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
_NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free on fully masked rows

# ----------------------------------------------------------------------------------------------
# FP8 (e4m3) KV: one float32 scale per (position, KV head), fixed when the token is written
# ----------------------------------------------------------------------------------------------

FP8_KV_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0        # the largest finite e4m3fn value
# amax floor: an all-zero row gets a finite, normal scale (2.2e-33) and quantizes to zeros
_AMAX_FLOOR = 1e-30


class KVScales(NamedTuple):
    """The float32 dequantization scales of an e4m3 KV store, each the shape of its KV array
    without the last (Dh) axis: ``prefix_k/v [K, Hkv, P]`` (``[L, K, Hkv, P]`` with a layer
    axis), ``pages_k/v [NP, Hkv, page]`` (``[L, NP, Hkv, page]``). KV = e4m3 value x scale."""
    prefix_k: jax.Array
    prefix_v: jax.Array
    pages_k: jax.Array
    pages_v: jax.Array


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x[..., Dh]`` -> (``x8`` float8_e4m3fn ``[..., Dh]``, ``scale`` float32 ``[...]``):
    ``scale = max(amax_Dh |x|, floor) / FP8_MAX``, ``x8 = x / scale`` rounded to e4m3 (the clip
    only catches a last-ulp overshoot of amax / scale past 448, which e4m3fn would make NaN)."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), _AMAX_FLOOR) / FP8_MAX
    x8 = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_KV_DTYPE)
    return x8, scale


def as_fp8(x: jax.Array) -> jax.Array:
    """An e4m3 KV block: a uint8 store holds e4m3 bit patterns (the CPU reference's form)."""
    return jax.lax.bitcast_convert_type(x, FP8_KV_DTYPE) if x.dtype == jnp.uint8 else x


def dequantize_kv(x8: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``x8 * scale[..., None]`` (x8: e4m3, or uint8 holding its bit patterns)."""
    return as_fp8(x8).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def is_fp8_store(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(FP8_KV_DTYPE), jnp.dtype(jnp.uint8))


def _store_dtype(prefix_k, pages_k):
    """The KV dtype the kernels are asked to read: a CPU reference's bit-pattern store (uint16,
    uint8) in either pool wins (the kernels refuse it), else the page pool's."""
    for x in (prefix_k, pages_k):
        if x.dtype in (jnp.uint16, jnp.uint8):
            return x.dtype
    return pages_k.dtype


def _scale_rows(kv_scales, layered: bool):
    """The four scale arrays with a layer axis and a unit axis before positions:
    ``[L, K, Hkv, 1, P]`` / ``[L, NP, Hkv, 1, page]`` (free reshapes), so a kernel's block of
    them is a ``[1, positions]`` row, lanes along positions like its scores."""
    return tuple((x if layered else x[None])[..., None, :] for x in kv_scales)


def _check_scales(kv_scales, prefix_k, prefix_v, pages_k, pages_v) -> None:
    """With ``kv_scales`` the four KV arrays hold e4m3 (or uint8 bit patterns) and each scale has
    its array's shape less Dh; without, no array may be e4m3 (it would be read unscaled)."""
    kvs = dict(prefix_k=prefix_k, prefix_v=prefix_v, pages_k=pages_k, pages_v=pages_v)
    if kv_scales is None:
        fp8 = [n for n, x in kvs.items() if is_fp8_store(x.dtype)]
        if fp8:
            raise ValueError(f"{', '.join(fp8)} hold e4m3 (or uint8) values but kv_scales is None:"
                             " pass the KVScales written with them")
        return
    if not isinstance(kv_scales, KVScales):
        raise ValueError(f"kv_scales must be a KVScales, got {type(kv_scales).__name__}")
    for name, x in kvs.items():
        sc = getattr(kv_scales, name)
        if not is_fp8_store(x.dtype):
            raise ValueError(f"kv_scales given but {name} is {jnp.dtype(x.dtype).name}: "
                             "an fp8 store is float8_e4m3fn (or uint8 bit patterns)")
        if sc.shape != x.shape[:-1] or sc.dtype != jnp.float32:
            raise ValueError(f"kv_scales.{name} must be float32{list(x.shape[:-1])} (its KV's "
                             f"shape less Dh), got {jnp.dtype(sc.dtype).name}{list(sc.shape)}")


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
                "of bfloat16 bit patterns and a uint8 one of e4m3 are the CPU reference's)")
    if dtype is not None and jnp.dtype(dtype) == jnp.dtype(FP8_KV_DTYPE):
        cc = _gpu_compute_capability()
        if cc is not None and cc < (8, 9):
            return (f"an e4m3 KV store on sm_{cc[0]}{cc[1]}: Triton converts e4m3 from sm_89 "
                    "(Ada, Hopper) on")
    if not in_shard_map and _backend.under_auto_partitioned_mesh():
        return "traced under a mesh outside shard_map (GSPMD cannot partition a Pallas call)"
    if page_size is not None:
        fam = _backend.kernel_family(family)
        if page_size % 8 or (fam == "triton" and (page_size < 16 or page_size & (page_size - 1))):
            return (f"page size {page_size}: the kernels read whole pages, a multiple of 8 "
                    "(TPU sublanes), a power of two >= 16 on GPU (Triton dot)")
    return None


def _gpu_compute_capability() -> tuple[int, int] | None:
    """The attached GPU's compute capability when kernels are traced for it; None otherwise
    (CPU, TPU, or a GPU compile target without a device: H100 is what bench/ compiles for)."""
    if _backend.backend() != "gpu" or jax.default_backend() != "gpu":
        return None
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # a device without the attribute: let the compiler say
        return None


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


def _widen(x, dtype):
    """An e4m3 KV block as ``dtype`` (q's: exact, e4m3 fits bfloat16), converted where it was
    loaded (registers / VMEM); any other block as it is."""
    return x.astype(dtype) if x.dtype == jnp.dtype(FP8_KV_DTYPE) else x


def _attend_blocks(q, length, block, load):
    """Online softmax of q [R, Dh] over the first ``length`` positions, ``block`` at a time:
    ``load(j, start)`` -> (k, v) [block, Dh] of block j, or (k, v, k_scale, v_scale) with e4m3
    k, v and float32 scale rows [1, block]: s = (q . k) * k_scale, the PV matmul takes
    p * v_scale (the normaliser the unscaled p). Returns (out [R, Dh] f32, lse [R])."""
    rows, dh = q.shape
    state = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, dh), jnp.float32))

    def body(j, st):
        start = pl.multiple_of(j * block, block)
        k, v, *scales = load(j, start)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
        if not scales:
            return _online_step(st, _qk(q, k), pos < length, lambda p: _pv(p, v))
        k_scale, v_scale = scales
        s = _qk(q, _widen(k, q.dtype)) * k_scale
        v = _widen(v, q.dtype)
        mask = pos < length
        return _online_step(st, s, mask, lambda p: _pv(jnp.where(mask, p * v_scale, 0.0), v))

    return _finish(jax.lax.fori_loop(0, (length + block - 1) // block, body, state))
