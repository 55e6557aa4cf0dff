"""The GPU ("triton") family of the sampling kernel (interpreted on CPU too): one program per
row block, each pass of passes.py a loop over the row's vocabulary tiles read from global memory
(the logits are not padded: the last tile is read ending at the row's end). Explicit Triton
compiler parameters (see _backend)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode
from pallas_kernels.sampling.passes import (
    _RADIX_BITS,
    _all_state,
    _outputs,
    _pass_finish,
    _pass_groups,
    _search_finish,
    _tile_step,
)


def _triton_sampling_kernel(x_ref, u_ref, tok_ref, logp_ref, *, passes, bv, n_v, cfg):
    """One row block; each pass sweeps the row's ``n_v`` whole tiles of ``bv`` columns, then (a
    row whose width is not a multiple of bv, read unpadded) one more tile ending at the row's
    end, counting only its columns past the whole tiles."""
    rows = tok_ref.shape[0]
    width = x_ref.shape[1]
    u = u_ref[...]
    st = _all_state(rows)

    def sweep(kind, st, shift):
        def body(j, st):
            col0 = pl.multiple_of(j * bv, bv)
            x = x_ref[:, pl.ds(col0, bv)].astype(jnp.float32)
            return _tile_step(kind, st, x, col0, u, shift, **cfg)
        st = lax.fori_loop(0, n_v, body, st)
        if n_v * bv < width:
            x = x_ref[:, pl.ds(width - bv, bv)].astype(jnp.float32)
            st = _tile_step(kind, st, x, width - bv, u, shift, lo=n_v * bv, **cfg)
        return st

    for kind, _, count in _pass_groups(passes):
        if kind in ("topk", "topp"):
            def search(i, st, kind=kind):
                shift = jnp.int32(32 - _RADIX_BITS) - i * _RADIX_BITS
                st = sweep(kind, st, shift)
                return _search_finish(kind, st, shift, top_k=cfg["top_k"], top_p=cfg["top_p"])
            st = lax.fori_loop(0, count, search, st)
        else:
            st = _pass_finish(kind, sweep(kind, st, jnp.int32(0)), vocab=cfg["vocab"],
                              top_k=cfg["top_k"])
    tok, logp = _outputs(st, cfg["temperature"])
    tok_ref[...] = tok
    logp_ref[...] = logp


def call(x, u, *, passes, cfg, rows, bv, n_v, out_shape):
    """x [S_pad, V'] logits (rows padded to ``rows``), u [S_pad, 1] -> (tokens, logp) [S_pad, 1]."""
    spad, vpad = x.shape
    return pl.pallas_call(
        functools.partial(_triton_sampling_kernel, passes=passes, bv=bv, n_v=n_v, cfg=cfg),
        grid=(spad // rows,),
        in_specs=[pl.BlockSpec((rows, vpad), lambda i: (i, 0)),
                  pl.BlockSpec((rows, 1), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((rows, 1), lambda i: (i, 0))] * 2,
        out_shape=out_shape,
        interpret=interpret_mode(),
        compiler_params=_backend.triton_params(num_warps=4, num_stages=2),
        name="sample_tokens",
    )(x, u)
