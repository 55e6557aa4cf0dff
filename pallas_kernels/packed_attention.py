"""Causal flash attention over packed rows (segment ids), for the update's forward and backward.

A packed row holds several sequences one after another (segment ids 1, 2, ... ; 0 = padding):
query i reads key j when j <= i and both carry the same segment id. The plain reference forms
the [B, H, T, T] score tensor; the kernels never do. They are the flash-attention kernels that
ship with the installed JAX, which take segment ids and a causal flag and have their own
backward passes (custom_vjp):

* GPU ("triton" family): ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton). Forward:
  one program per (query block, row, head) looping over key blocks up to the diagonal only;
  backward: one program per (key block, row, head) computes dK/dV over the query blocks from the
  diagonal down and dQ over the key blocks up to it. So the blocks above the diagonal are never
  visited (causal half, plus the diagonal blocks). Segment boundaries are masked inside a block.
* TPU ("mosaic" family): ``jax.experimental.pallas.ops.tpu.flash_attention.flash_attention``
  with ``SegmentIds`` and ``causal=True``; blocks above the diagonal skip their compute.

Both kernels want equal query and key/value head counts: grouped-query K/V ([B, T, Hkv, Dh])
are repeated to H heads before the call (query head h reads K/V head h // (H / Hkv), as
transformers' ``repeat_kv``); the repeat's gradient sums back over the group. Rows are padded
to a whole number of blocks with segment id -1 (a segment of its own, cut off again).

Padding tokens (segment 0) read the earlier padding tokens of their row in the kernels and
nothing in the reference (uniform average): either way their outputs are meaningless and every
caller masks them; real tokens never read a padding key in either.

``impl``: "auto" (the kernel on GPU/TPU, the reference where Pallas only interprets), "pallas"
(the kernel; interpreted on CPU, both families, for tests), "reference".

``packed_attention_cost`` declares the kernels' flops and bytes from their tiling (a Pallas call
is opaque to XLA's cost model and to an HLO walk), beside the kernels it describes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend

IMPLS = ("auto", "pallas", "reference")
# GPU tiles: forward (query x key) and backward (both loops); Dh = 128 bf16 tiles of 128 rows are
# 32 KiB each, two pipeline stages of K and V fit H100 shared memory.
GPU_BLOCK = 128
GPU_BLOCK_BWD = 64
# TPU tiles (the library's defaults; 128 lanes).
TPU_BLOCK = 128
# The kernels' names in the lowered/optimized program (the roofline matches them).
KERNEL_NAMES = {"triton": ("mha_forward", "mha_preprocess_backward", "mha_backward"),
                "mosaic": ("flash_attention",)}
_MASK_VALUE = float(np.finfo(np.float32).min)


def packed_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                               segment_ids: jax.Array) -> jax.Array:
    """Plain jnp: q [B,T,H,Dh], k/v [B,T,Hkv,Dh], segment_ids int [B,T] -> out [B,T,H,Dh] in v's
    dtype. Scores and softmax in float32 over the full [T, T] (causal & same segment & key not
    padding); a query with no key (padding) gets a uniform average."""
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    seg = segment_ids.astype(jnp.int32)
    allowed = (jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
               & (seg[:, None, :] > 0))
    qg = q.reshape(b, t, hkv, h // hkv, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None], scores * np.float32(dh ** -0.5), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(v.dtype)


def pallas_unsupported_reason(q_shape, k_shape, dtype, *, family: str | None = None) -> str | None:
    """None when the kernel compiles for these shapes on the target traced for, else why not."""
    _, _, h, dh = q_shape
    hkv = k_shape[2]
    if h % hkv:
        return f"{h} query heads is not a multiple of {hkv} key/value heads"
    if _backend.under_auto_partitioned_mesh():
        return ("traced under a mesh outside shard_map (GSPMD cannot partition a Mosaic kernel "
                "and replicates a Triton one); call it inside shard_map over the batch axes")
    fam = _backend.kernel_family(family)
    if fam == "mosaic" and dh % 128:
        return f"TPU flash attention needs head_dim % 128 == 0, got {dh}"
    if fam == "triton" and dh < 16:
        return f"Triton attention needs head_dim >= 16, got {dh}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype)} is not a float type the kernels take"
    return None


def resolve_impl(impl: str, q_shape=None, k_shape=None, dtype=None, *,
                 family: str | None = None) -> str:
    """"auto" -> "pallas" on GPU/TPU (unless pallas_unsupported_reason; logged once),
    "reference" where Pallas only interprets."""
    check = None
    if q_shape is not None:
        check = lambda: pallas_unsupported_reason(q_shape, k_shape, dtype, family=family)
    return _backend.resolve_impl(impl, IMPLS, on_cpu="reference", kernel="packed_attention",
                                 check=check)


def _block(seq: int, cap: int) -> int:
    """A power-of-two tile <= cap covering short rows without much padding."""
    return min(cap, max(16, 1 << max(0, math.ceil(math.log2(max(seq, 1))))))


def padded_seq(seq: int, family: str, block: int | None = None) -> int:
    """The row width the kernels run at: a whole number of tiles."""
    blk = (block or TPU_BLOCK) if family == "mosaic" else _block(seq, block or GPU_BLOCK)
    return -(-seq // blk) * blk


def _triton_call(q, k, v, seg, interpret: bool, block: int | None = None):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention
    blk = _block(q.shape[1], block or GPU_BLOCK)
    bwd = min(block or GPU_BLOCK_BWD, blk)
    sizes = gpu_attention.BlockSizes(block_q=blk, block_k=blk, block_q_dkv=bwd, block_kv_dkv=bwd,
                                     block_q_dq=bwd, block_kv_dq=bwd)
    return gpu_attention.mha(q, k, v, seg, sm_scale=float(q.shape[-1] ** -0.5), causal=True,
                             block_sizes=sizes, interpret=interpret)


def _mosaic_library_call(q, k, v, seg, blk: int):
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention
    tr = lambda x: jnp.swapaxes(x, 1, 2)          # [B, T, H, Dh] <-> [B, H, T, Dh]
    sizes = tpu_attention.BlockSizes(
        block_q=blk, block_k_major=blk, block_k=blk, block_b=1, block_q_major_dkv=blk,
        block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk, block_k_major_dq=blk,
        block_k_dq=blk, block_q_dq=blk)
    out = tpu_attention.flash_attention(
        tr(q), tr(k), tr(v), segment_ids=tpu_attention.SegmentIds(seg, seg), causal=True,
        sm_scale=float(q.shape[-1] ** -0.5), block_sizes=sizes)
    return tr(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mosaic_interpreted(q, k, v, seg, blk):
    return _mosaic_interpreted_fwd(q, k, v, seg, blk)[0]


def _mosaic_interpreted_fwd(q, k, v, seg, blk):
    # Mosaic kernels interpret on CPU under pltpu.force_tpu_interpret_mode, which acts at trace
    # time: the library's backward kernels are traced when the gradient is, so both halves are
    # traced here, inside the mode (the forward's vjp closure carries the residuals).
    from jax.experimental.pallas import tpu as pltpu
    with pltpu.force_tpu_interpret_mode():
        out, vjp = jax.vjp(lambda a, b, c: _mosaic_library_call(a, b, c, seg, blk), q, k, v)
    return out, vjp


def _mosaic_interpreted_bwd(blk, vjp, do):
    from jax.experimental.pallas import tpu as pltpu
    with pltpu.force_tpu_interpret_mode():
        dq, dk, dv = vjp(do)
    return dq, dk, dv, None


_mosaic_interpreted.defvjp(_mosaic_interpreted_fwd, _mosaic_interpreted_bwd)


def _mosaic_call(q, k, v, seg, interpret: bool, block: int | None = None):
    blk = min(block or TPU_BLOCK, q.shape[1])
    if interpret:
        return _mosaic_interpreted(q, k, v, seg, blk)
    return _mosaic_library_call(q, k, v, seg, blk)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     impl: str = "auto", family: str | None = None,
                     block: int | None = None) -> jax.Array:
    """Causal attention within the segments of packed rows.

    q [B,T,H,Dh], k/v [B,T,Hkv,Dh] (H a multiple of Hkv), segment_ids int [B,T] (0 = padding)
    -> out [B,T,H,Dh] in q's dtype, differentiable in q, k, v. See the module docstring for
    impl and family; outputs at padding positions are unspecified. block: the tile size (None:
    GPU_BLOCK / GPU_BLOCK_BWD on GPU, TPU_BLOCK on TPU; tests use small tiles to have several).
    """
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"packed_attention: q {q.shape} must be [B,T,H,Dh] and k/v "
                         f"{k.shape}/{v.shape} [B,T,Hkv,Dh] of the same B, T, Dh")
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"packed_attention: segment_ids {segment_ids.shape} != [B,T] "
                         f"{q.shape[:2]}")
    impl = resolve_impl(impl, q.shape, k.shape, q.dtype, family=family)
    if impl == "reference":
        return packed_attention_reference(q, k, v, segment_ids).astype(q.dtype)
    fam = _backend.kernel_family(family)
    t, h = q.shape[1], q.shape[2]
    group = h // k.shape[2]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    v = v.astype(q.dtype)
    k = k.astype(q.dtype)
    seg = segment_ids.astype(jnp.int32)
    tp = padded_seq(t, fam, block)
    if tp != t:
        pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        seg = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=-1)
    call = _mosaic_call if fam == "mosaic" else _triton_call
    out = call(q, k, v, seg, _backend.interpret_mode(), block)
    return out[:, :t]


# ----------------------------------------------------------------------------------------------
# Declared cost (what each program of the GPU kernels reads, writes and computes)
# ----------------------------------------------------------------------------------------------

def _causal_block_pairs(n_rows: int, row_blk: int, n_cols: int, col_blk: int) -> int:
    """(row block, column block) pairs the kernels visit: column blocks up to the diagonal."""
    return sum(min(n_cols, -(-((i + 1) * row_blk) // col_blk)) for i in range(n_rows))


def packed_attention_cost(batch: int, seq: int, heads: int, head_dim: int, itemsize: int,
                          *, family: str = "triton") -> dict:
    """Flops and bytes of one forward and one backward call at [batch, seq, heads, head_dim]
    (heads after the K/V repeat), from the kernels' tiling. Flops count the tile pairs the
    kernels visit (the causal half plus the diagonal tiles), 2 * blk_q * blk_k * Dh per tile
    matmul. Bytes: every operand read and every output written once per kernel: the tiles a
    program re-reads (K/V by each query tile, Q/dO by each key tile) belong to one (row, head),
    1 MiB at T = 2048, Dh = 128, and the programs running at once share them in L2 (grid order
    puts one head's tiles side by side). ``tile_loads`` gives the bytes if every tile load came
    from memory, an upper bound.

    -> {"forward": {"flops", "bytes"}, "backward": {"flops", "bytes"}} (the backward includes
    its preprocessing kernel, delta = rowsum(dO * O)), per kernel name (bytes, flops), and
    "tile_loads". `seq` is the width the kernels run at (padded_seq of the row width)."""
    tp = padded_seq(seq, family)
    if family == "mosaic":
        blk_f = blk_b = min(TPU_BLOCK, tp)
    else:
        blk_f = _block(tp, GPU_BLOCK)
        blk_b = min(GPU_BLOCK_BWD, blk_f)
    bh = batch * heads
    tile = lambda rows: rows * head_dim * itemsize
    nf = tp // blk_f
    pairs_f = _causal_block_pairs(nf, blk_f, nf, blk_f)
    mm = 2 * blk_f * blk_f * head_dim
    fwd_flops = bh * pairs_f * 2 * mm
    row = tile(tp)                      # one [T, Dh] operand of one (row, head)
    fwd_bytes = bh * (4 * row + tp * 4) + batch * tp * 4          # q, k, v, out, lse; seg
    fwd_loads = bh * (nf * (2 * tile(blk_f) + blk_f * 4) + pairs_f * 2 * tile(blk_f))
    nb = tp // blk_b
    pairs_b = _causal_block_pairs(nb, blk_b, nb, blk_b)
    mmb = 2 * blk_b * blk_b * head_dim
    # dK/dV loop: QK^T, dO V^T, P^T dO, dS^T Q (4 matmuls); dQ loop: QK^T, dO V^T, dS K (3)
    bwd_flops = bh * pairs_b * 7 * mmb
    # reads q, k, v, out, dO, lse, delta; writes dq, dk, dv
    bwd_bytes = bh * (8 * row + 2 * tp * 4) + batch * tp * 4
    bwd_loads = bh * (pairs_b * (4 * tile(blk_b) + 2 * blk_b * 4) + nb * 7 * tile(blk_b))
    pre_bytes = bh * tp * (2 * head_dim * itemsize + 4)        # reads O and dO, writes delta
    pre_flops = bh * tp * 2 * head_dim
    return {"forward": {"flops": float(fwd_flops), "bytes": float(fwd_bytes)},
            "backward": {"flops": float(bwd_flops + pre_flops), "bytes": float(bwd_bytes + pre_bytes)},
            "mha_forward": (float(fwd_bytes), float(fwd_flops)),
            "mha_preprocess_backward": (float(pre_bytes), float(pre_flops)),
            "mha_backward": (float(bwd_bytes), float(bwd_flops)),
            "tile_loads": {"forward": float(fwd_loads), "backward": float(bwd_loads + pre_bytes)}}


_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4}


def packed_attention_kernel_cost(kernel: str, operands, outputs=None) -> tuple[float, float]:
    """(bytes, flops) of one launch of a GPU kernel of this module, named as in the compiled
    program ("mha_forward", "mha_preprocess_backward", "mha_backward"), from its operand shapes
    [(dtype, dims), ...] as the program passes them (q [B, T, H, Dh] first for the forward and
    the backward, O [B, T, H, Dh] first for the preprocessing)."""
    dtype, (b, t, h, dh) = operands[0]
    return packed_attention_cost(b, t, h, dh, _ITEMSIZE.get(dtype, 4))[kernel]


def causal_attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """The flops attention needs for one forward over causal [seq] rows: the two matmuls over
    the causal half, 2 * 2 * seq^2 / 2 * Dh per row and head (the issue's "needed" figure)."""
    return float(batch * heads * 2 * seq * seq * head_dim)
