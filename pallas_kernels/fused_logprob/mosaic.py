"""The TPU ("mosaic") family of the `fused_logprob` kernels (interpreted on CPU too).

Token and vocabulary tiles are both grid axes: each step DMAs one [block_t, D] x [D, block_v]
pair into VMEM (the whole hidden dimension is one block: one MXU contraction per tile, block_v
planned against the VMEM budget), running statistics in VMEM scratch / the resident output block.
The backward is two kernels, d hidden and d lm_head, each recomputing its logits tiles. Inputs are
padded so every tile is full: tokens to block_t, vocab to block_v (masked columns). Mosaic TPU
compiler parameters with grid dimension semantics and a scoped-VMEM limit (see _backend).
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
    _online_update,
    _Opts,
    _pad_to,
    _pallas_pad,
    _round_up,
)

# Mosaic tiles: tokens in multiples of 16 (bf16 sublane packing), vocab in multiples of 128 lanes;
# the whole hidden dimension is one block (one MXU contraction per tile).
_MOSAIC_BLOCK_T = 256
_MOSAIC_BLOCK_V = (512, 256, 128)


def mosaic_vmem_bytes(block_t: int, block_v: int, hidden: int, itemsize: int) -> int:
    """Scoped VMEM the largest of the three Mosaic kernels needs (double-buffered input blocks,
    the f32 accumulator block, ~8 live [block_t, block_v] f32 temporaries)."""
    inputs = 2 * (block_t * hidden + hidden * block_v) * itemsize
    temps = 8 * block_t * block_v * 4
    acc = 2 * max(block_t * hidden, hidden * block_v) * 4
    return inputs + temps + acc


def _mosaic_tiles(t_len: int, hidden: int, itemsize: int) -> dict[str, int] | str:
    """The largest (block_t, block_v) whose blocks fit the VMEM budget (tokens first: they set
    how often the lm_head is re-read), or why none does."""
    budget = _backend.tpu_vmem_budget_bytes()
    for bt_max in (_MOSAIC_BLOCK_T, 128, 64, 16):
        bt = min(bt_max, _round_up(max(t_len, 1), 16))
        for bv in _MOSAIC_BLOCK_V:
            need = mosaic_vmem_bytes(bt, bv, hidden, itemsize)
            if need <= budget:
                return {"block_t": bt, "block_v": bv, "block_d": hidden}
    return (f"hidden size {hidden} needs {need} bytes of VMEM even at block_t={bt}, "
            f"block_v=128 (budget {budget})")


def _mo_logits(h_ref, w_ref, inv_temp):
    return jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32) * inv_temp


def _mo_fwd_kernel(h_ref, w_ref, tg_ref, lse_ref, tl_ref, ent_ref, p2_ref, *scratch,
                   bv, vocab, inv_temp):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        for ref, val in zip(scratch, _init_carry(lse_ref.shape[0])):
            ref[...] = val

    col, valid = _cols(bv, j, vocab)
    z = jnp.where(valid, _mo_logits(h_ref, w_ref, inv_temp), _NEG)
    carry = _online_update(tuple(r[...] for r in scratch), z, valid, col, tg_ref[...])
    for ref, val in zip(scratch, carry):
        ref[...] = val

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse, tl, ent, p2 = _finish(tuple(r[...] for r in scratch))
        lse_ref[...], tl_ref[...], ent_ref[...], p2_ref[...] = lse, tl, ent, p2


def _mo_dh_kernel(h_ref, w_ref, tg_ref, lse_ref, ent_ref, gl_ref, ge_ref, dh_ref, *,
                  bv, vocab, inv_temp):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        dh_ref[...] = jnp.zeros(dh_ref.shape, dh_ref.dtype)

    col, valid = _cols(bv, j, vocab)
    z = jnp.where(valid, _mo_logits(h_ref, w_ref, inv_temp), _NEG)
    dz = _dlogits(z, valid, col, tg_ref[...], lse_ref[...], ent_ref[...], gl_ref[...], ge_ref[...])
    dz = (dz * inv_temp).astype(w_ref.dtype)
    dh_ref[...] += lax.dot_general(dz, w_ref[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)


def _mo_dw_kernel(h_ref, w_ref, tg_ref, lse_ref, ent_ref, gl_ref, ge_ref, dw_ref, *,
                  bv, vocab, inv_temp):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    col, valid = _cols(bv, j, vocab)
    z = jnp.where(valid, _mo_logits(h_ref, w_ref, inv_temp), _NEG)
    dz = _dlogits(z, valid, col, tg_ref[...], lse_ref[...], ent_ref[...], gl_ref[...], ge_ref[...])
    dz = (dz * inv_temp).astype(h_ref.dtype)
    dw_ref[...] += lax.dot_general(h_ref[...], dz, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)



def forward(hidden, lm_head, targets, opts: _Opts):
    """-> (lse, target logit, entropy, sum_p2), each [T] float32."""
    from jax.experimental.pallas import tpu as pltpu
    t_len = hidden.shape[0]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    (t_pad, d_pad), v_pad = h.shape, w.shape[1]
    bt, bv = opts.block_t, opts.block_v
    n_t, n_v = t_pad // bt, v_pad // bv
    vec = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    outs = pl.pallas_call(
        functools.partial(_mo_fwd_kernel, **dims),
        out_shape=[_column(t_pad)] * 4,
        grid=(n_t, n_v),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
                  pl.BlockSpec((d_pad, bv), lambda i, j: (0, j)), vec],
        out_specs=[vec] * 4,
        scratch_shapes=[pltpu.VMEM((bt, 1), jnp.float32) for _ in range(5)],
        interpret=interpret_mode(),
        compiler_params=_backend.mosaic_params(("parallel", "arbitrary")),
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
    n_t, n_v = t_pad // bt, v_pad // bv
    vec_i = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    dh = pl.pallas_call(
        functools.partial(_mo_dh_kernel, **dims),
        out_shape=jax.ShapeDtypeStruct((t_pad, d_pad), jnp.float32),
        grid=(n_t, n_v),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
                  pl.BlockSpec((d_pad, bv), lambda i, j: (0, j))] + [vec_i] * 5,
        out_specs=pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
        interpret=interpret_mode(),
        compiler_params=_backend.mosaic_params(("parallel", "arbitrary")),
        name="fused_logprob_bwd_hidden",
    )(h, w, tg, *rows)
    vec_j = pl.BlockSpec((bt, 1), lambda j, i: (i, 0))
    dw = pl.pallas_call(
        functools.partial(_mo_dw_kernel, **dims),
        out_shape=jax.ShapeDtypeStruct((d_pad, v_pad), jnp.float32),
        grid=(n_v, n_t),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda j, i: (i, 0)),
                  pl.BlockSpec((d_pad, bv), lambda j, i: (0, j))] + [vec_j] * 5,
        out_specs=pl.BlockSpec((d_pad, bv), lambda j, i: (0, j)),
        interpret=interpret_mode(),
        compiler_params=_backend.mosaic_params(("parallel", "arbitrary")),
        name="fused_logprob_bwd_lm_head",
    )(h, w, tg, *rows)
    return dh[:t_len, :d].astype(hidden.dtype), dw[:d, :vocab].astype(lm_head.dtype)
