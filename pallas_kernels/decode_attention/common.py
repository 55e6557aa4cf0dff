"""What the reference and both kernel families of the slot decode attention share: the
argument checks, the prompt-tile plan (jnp, on device), the log-sum-exp merge of the two parts,
and the online softmax the kernels run over KV blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend

_DTYPES = ("float32", "bfloat16", "float16")
_NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free on fully masked rows


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
