"""The GPU ("triton") family of the `fused_logprob` kernels (interpreted on CPU too).

One program per token block (resp. vocab tile), an inner loop over the other axis and over
block_d-wide pieces of the hidden dimension, tiles read straight from global memory, so only one
dot's operands sit in shared memory. Inputs are padded so every tile is full: tokens to block_t,
vocab to block_v (masked columns), the hidden dim to block_d (zeros: no effect on logits).
Per-token vectors travel as [T, 1] columns. The backward recomputes each logits tile once: the
d hidden kernel also writes dz for a chunk of tokens, and one XLA GEMM forms its d lm_head.
Explicit Triton compiler parameters (see _backend).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode
from pallas_kernels.fused_logprob.common import (
    _NEG,
    _cols,
    _column,
    _dlogits,
    _finish,
    _init_carry,
    _next_pow2,
    _online_update,
    _Opts,
    _pad_to,
    _pallas_pad,
    _round_up,
)

# Triton tiles (powers of two, >= 16 for tl.dot). Per inner step the operands of one dot live in
# shared memory, num_stages-fold: (64*64 + 64*128) * 4 B * 2 stages = 96 KiB in float32, well
# under the 227 KiB an H100/H200 block may use; the [64, 128] f32 logits tile lives in registers.
_TRITON_TILES = {"block_t": 64, "block_v": 128, "block_d": 64}
_TRITON_WARPS, _TRITON_STAGES = 4, 2
# Tokens per chunk of the Triton backward: its dz [chunk, V] (lm_head's dtype) is held between
# the d hidden kernel and the d lm_head GEMM (8192 x 151,936 bf16 = 2.5 GB).
_DZ_CHUNK_TOKENS = 8192


def _tr_logits(h_ref, w_ref, row0, col0, bt, bv, bd, n_d, inv_temp):
    """z = h[row0:row0+bt] @ w[:, col0:col0+bv] * inv_temp, contracting D in bd-wide pieces (a
    loop, not unrolled: only one piece's operands are in shared memory at a time)."""
    def body(k, acc):
        k0 = pl.multiple_of(k * bd, bd)
        h = h_ref[pl.ds(row0, bt), pl.ds(k0, bd)]
        w = w_ref[pl.ds(k0, bd), pl.ds(col0, bv)]
        return acc + jnp.dot(h, w, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, n_d, body, jnp.zeros((bt, bv), jnp.float32)) * inv_temp


def _tr_fwd_kernel(h_ref, w_ref, tg_ref, lse_ref, tl_ref, ent_ref, p2_ref, *,
                   bt, bv, bd, n_d, n_v, vocab, inv_temp):
    targets = tg_ref[...]

    def body(j, carry):
        col, valid = _cols(bv, j, vocab)
        col0 = pl.multiple_of(j * bv, bv)
        z = jnp.where(valid, _tr_logits(h_ref, w_ref, 0, col0, bt, bv, bd, n_d, inv_temp), _NEG)
        return _online_update(carry, z, valid, col, targets)

    lse, tl, ent, p2 = _finish(lax.fori_loop(0, n_v, body, _init_carry(bt)))
    lse_ref[...], tl_ref[...], ent_ref[...], p2_ref[...] = lse, tl, ent, p2


def _tr_dh_kernel(h_ref, w_ref, tg_ref, lse_ref, ent_ref, gl_ref, ge_ref, dh_ref, dz_ref, *,
                  bt, bv, bd, n_d, n_v, vocab, inv_temp):
    """d hidden for one token block, and the block's dL/dz tiles written out (dz_ref
    [block_t, V_pad] in lm_head's dtype) for d lm_head = hidden^T dz as one GEMM: the logits are
    recomputed once in the backward, not once per gradient."""
    targets, lse, ent = tg_ref[...], lse_ref[...], ent_ref[...]
    g_logp, g_ent = gl_ref[...], ge_ref[...]

    def zero(k, _):
        dh_ref[:, pl.ds(pl.multiple_of(k * bd, bd), bd)] = jnp.zeros((bt, bd), dh_ref.dtype)
        return 0

    lax.fori_loop(0, n_d, zero, 0)

    def body(j, _):
        col, valid = _cols(bv, j, vocab)
        col0 = pl.multiple_of(j * bv, bv)
        z = jnp.where(valid, _tr_logits(h_ref, w_ref, 0, col0, bt, bv, bd, n_d, inv_temp), _NEG)
        dz = (_dlogits(z, valid, col, targets, lse, ent, g_logp, g_ent) * inv_temp).astype(w_ref.dtype)
        dz_ref[:, pl.ds(col0, bv)] = dz.astype(dz_ref.dtype)

        def acc(k, _):
            k0 = pl.multiple_of(k * bd, bd)
            w = w_ref[pl.ds(k0, bd), pl.ds(col0, bv)]
            dh_ref[:, pl.ds(k0, bd)] += jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
            return 0

        lax.fori_loop(0, n_d, acc, 0)
        return 0

    lax.fori_loop(0, n_v, body, 0)


def forward(hidden, lm_head, targets, opts: _Opts):
    """-> (lse, target logit, entropy, sum_p2), each [T] float32."""
    t_len = hidden.shape[0]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    (t_pad, d_pad), v_pad = h.shape, w.shape[1]
    bt, bv = opts.block_t, opts.block_v
    n_t, n_v = t_pad // bt, v_pad // bv
    vec = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    outs = pl.pallas_call(
        functools.partial(_tr_fwd_kernel, n_v=n_v, **dims),
        out_shape=[_column(t_pad)] * 4,
        grid=(n_t,),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
                  pl.BlockSpec((d_pad, v_pad), lambda i: (0, 0)), vec],
        out_specs=[vec] * 4,
        scratch_shapes=(),
        interpret=interpret_mode(),
        compiler_params=_backend.triton_params(_TRITON_WARPS, _TRITON_STAGES),
        name="fused_logprob_fwd",
    )(h, w, tg)
    return tuple(o[:t_len, 0] for o in outs)


def backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts: _Opts):
    """-> (d hidden [T, D], d lm_head [D, V]) in the inputs' dtypes."""
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    bt, bv = opts.block_t, opts.block_v
    pad_t = lambda x: _pad_to(x.astype(jnp.float32), 0, bt)[:, None]
    rows = (pad_t(lse), pad_t(ent), pad_t(g_logp), pad_t(g_ent))  # padded rows: zero cotangent
    (t_pad, d_pad), v_pad = h.shape, w.shape[1]
    n_v = v_pad // bv
    # Token chunks of at most _DZ_CHUNK_TOKENS: the d hidden kernel writes the chunk's dz
    # [chunk, V_pad] and one XLA GEMM adds hidden^T dz to d lm_head (float32), so the
    # logits are recomputed once per backward and dz never exceeds one chunk.
    chunk = min(t_pad, _round_up(_DZ_CHUNK_TOKENS, bt))
    n_chunks = -(-t_pad // chunk)
    chunk = _round_up(-(-t_pad // n_chunks), bt)
    pad_c = lambda x: _pad_to(x, 0, chunk * n_chunks).reshape((n_chunks, chunk) + x.shape[1:])
    vec_blk = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    dh_call = pl.pallas_call(
        functools.partial(_tr_dh_kernel, n_v=n_v, **dims),
        out_shape=(jax.ShapeDtypeStruct((chunk, d_pad), jnp.float32),
                   jax.ShapeDtypeStruct((chunk, v_pad), w.dtype)),
        grid=(chunk // bt,),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
                  pl.BlockSpec((d_pad, v_pad), lambda i: (0, 0))] + [vec_blk] * 5,
        out_specs=(pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
                   pl.BlockSpec((bt, v_pad), lambda i: (i, 0))),
        interpret=interpret_mode(),
        compiler_params=_backend.triton_params(_TRITON_WARPS, _TRITON_STAGES),
        name="fused_logprob_bwd_hidden",
    )

    def one_chunk(dw, xs):
        h_c, tg_c, *rows_c = xs
        dh_c, dz_c = dh_call(h_c, w, tg_c, *rows_c)
        dw = dw + jnp.dot(h_c.T, dz_c, preferred_element_type=jnp.float32)
        return dw, dh_c

    xs = (pad_c(h), pad_c(tg)) + tuple(pad_c(r) for r in rows)
    if n_chunks == 1:
        dw, dh = one_chunk(jnp.zeros((d_pad, v_pad), jnp.float32), tuple(x[0] for x in xs))
    else:
        dw, dh = lax.scan(one_chunk, jnp.zeros((d_pad, v_pad), jnp.float32), xs)
        dh = dh.reshape(-1, d_pad)
    return dh[:t_len, :d].astype(hidden.dtype), dw[:d, :vocab].astype(lm_head.dtype)


# ----------------------------------------------------------------------------------------------
# Declared cost of the Triton kernels (opaque to XLA's cost model and to an HLO walk)
# ----------------------------------------------------------------------------------------------

_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4}
# SMs of an H100 / H200: how many programs of a grid run at once (one per SM at these tiles).
GPU_CORES = 132


def fused_logprob_kernel_cost(kernel: str, operands, outputs=None, *,
                              cores: int = GPU_CORES) -> tuple[float, float]:
    """(bytes, flops) of one launch of a Triton kernel of this module, named as in the compiled
    program ("fused_logprob_fwd", "fused_logprob_bwd_hidden", "fused_logprob_bwd_lm_head"), from
    its operand shapes [(dtype, dims), ...]: hidden [T, D] and lm_head [D, V], padded to tiles.

    Flops: every logits tile, 2 T D V, once in the forward and once in the d hidden kernel, plus
    its product dz W^T (2 T D V); d lm_head = h^T dz is an XLA GEMM the walk counts itself.
    Bytes, with L2 reuse among the programs running at once (`cores`
    of them): the forward and d hidden programs each walk all of lm_head, which streams once per
    wave of `cores` token blocks; their hidden block and running [block_t, D] float32
    accumulator stay on chip / in L2; the d lm_head programs each walk all of hidden (T x D
    fits L2), once per wave of `cores` vocab tiles, and write their [D, block_v] float32 tile.
    The d hidden kernel also writes dz [T, V] in lm_head's dtype. Per-token vectors are [T, 1]
    float32. ("fused_logprob_bwd_lm_head" is the TPU family's kernel: the same model.)"""
    (hd, (t, d)), (wd, (_, v)) = operands[0], operands[1]
    hi, wi = _ITEMSIZE.get(hd, 4), _ITEMSIZE.get(wd, 4)
    tiles = _TRITON_TILES
    bt = min(tiles["block_t"], _next_pow2(max(t, 16)))
    n_t, n_v = -(-t // bt), -(-v // tiles["block_v"])
    logits = 2.0 * t * d * v
    h_bytes, w_bytes = t * d * hi, d * v * wi
    if kernel == "fused_logprob_fwd":
        return h_bytes + w_bytes * -(-n_t // cores) + 5 * t * 4, logits
    if kernel == "fused_logprob_bwd_hidden":
        return (h_bytes + w_bytes * -(-n_t // cores) + t * d * 4 + t * v * wi + 5 * t * 4,
                2 * logits)
    if kernel == "fused_logprob_bwd_lm_head":
        return h_bytes * -(-n_v // cores) + w_bytes + d * v * 4 + 5 * t * 4, 2 * logits
    raise ValueError(f"fused_logprob_kernel_cost: unknown kernel {kernel!r}")
