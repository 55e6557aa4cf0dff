"""The TPU ("mosaic") family of the sampling kernel (interpreted on CPU too): grid (row block,
pass, tile), each vocabulary tile DMA'd into VMEM, the per-row state of passes.py in VMEM
scratch. Mosaic TPU compiler parameters (see _backend)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
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


def _mosaic_sampling_kernel(x_ref, u_ref, tok_ref, logp_ref, *scratch, passes, names, cfg):
    p, j = pl.program_id(1), pl.program_id(2)
    n_v = pl.num_programs(2)
    refs = dict(zip(names, scratch))
    rows, bv = x_ref.shape

    @pl.when((p == 0) & (j == 0))
    def _():
        for k, v in _all_state(rows).items():
            refs[k][...] = v

    def load():
        return {k: r[...] for k, r in refs.items()}

    def store(st):
        for k, v in st.items():
            refs[k][...] = v

    x = x_ref[...].astype(jnp.float32)
    col0 = j * bv
    for kind, first, count in _pass_groups(passes):
        @pl.when((p >= first) & (p < first + count))
        def _(kind=kind, first=first):
            shift = jnp.int32(32 - _RADIX_BITS) - (p - first) * _RADIX_BITS
            st = _tile_step(kind, load(), x, col0, u_ref[...], shift, **cfg)

            @pl.when(j == n_v - 1)
            def _():
                if kind in ("topk", "topp"):
                    store(_search_finish(kind, st, shift, top_k=cfg["top_k"], top_p=cfg["top_p"]))
                else:
                    store(_pass_finish(kind, st, vocab=cfg["vocab"], top_k=cfg["top_k"]))

            @pl.when(j < n_v - 1)
            def _():
                store(st)

    @pl.when((p == len(passes) - 1) & (j == n_v - 1))
    def _():
        tok, logp = _outputs(load(), cfg["temperature"])
        tok_ref[...] = tok
        logp_ref[...] = logp


def call(x, u, *, passes, cfg, rows, bv, n_v, out_shape):
    """x [S_pad, V_pad] logits (padded to whole tiles), u [S_pad, 1] -> (tokens, logp) [S_pad, 1]."""
    from jax.experimental.pallas import tpu as pltpu
    spad = x.shape[0]
    st = _all_state(rows)
    names = tuple(st)
    scratch = [pltpu.VMEM((rows, 1), st[k].dtype) for k in names]
    return pl.pallas_call(
        functools.partial(_mosaic_sampling_kernel, passes=passes, names=names, cfg=cfg),
        grid=(spad // rows, len(passes), n_v),
        in_specs=[pl.BlockSpec((rows, bv), lambda i, p, j: (i, j)),
                  pl.BlockSpec((rows, 1), lambda i, p, j: (i, 0))],
        out_specs=[pl.BlockSpec((rows, 1), lambda i, p, j: (i, 0))] * 2,
        out_shape=out_shape,
        scratch_shapes=scratch,
        interpret=interpret_mode(),
        compiler_params=_backend.mosaic_params(("parallel", "arbitrary", "arbitrary")),
        name="sample_tokens",
    )(x, u)
