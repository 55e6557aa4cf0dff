"""What the chunked path and both kernel families of `fused_logprob` share: the static options
of a call, the online log-sum-exp over logits tiles and its gradient (plain jnp on column vectors
[n, 1], so it lowers through XLA, Triton and Mosaic alike), and the padding to whole tiles.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Masked (padded) vocabulary columns get this logit: exp(_NEG - m) == 0 without inf/nan arithmetic.
_NEG = -1e30


class _Opts(NamedTuple):
    """Static options of one fused call (hashable: a nondiff argument of the custom VJP)."""
    impl: str          # "pallas" | "chunked"
    block_t: int
    block_v: int
    block_d: int       # triton kernels only: contraction tile over the hidden dimension
    inv_temp: float
    family: str = "triton"   # pallas only: "triton" (GPU, CPU interpret) | "mosaic" (TPU)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _online_update(carry, z, valid, col, targets):
    """Fold one logits tile z [bt, bv] (f32; invalid columns hold _NEG) into the running stats.

    carry = (m, s, a, q, t), each [bt, 1]: running max, sum e^{z-m}, sum e^{z-m}(z-m),
    sum e^{2(z-m)}, target logit; targets [bt, 1]. Rescaling by e^{m_old - m_new} keeps everything
    relative to the current max."""
    m, s, a, q, t = carry
    m_new = jnp.maximum(m, jnp.max(z, axis=-1, keepdims=True))
    delta = m - m_new                                         # <= 0
    alpha = jnp.exp(delta)
    zc = jnp.where(valid, z - m_new, 0.0)
    e = jnp.where(valid, jnp.exp(zc), 0.0)
    s_new = alpha * s + jnp.sum(e, axis=-1, keepdims=True)
    a_new = alpha * (a + delta * s) + jnp.sum(e * zc, axis=-1, keepdims=True)
    q_new = alpha * alpha * q + jnp.sum(e * e, axis=-1, keepdims=True)
    hit = (col == targets) & valid
    t_new = t + jnp.sum(jnp.where(hit, z, 0.0), axis=-1, keepdims=True)
    return m_new, s_new, a_new, q_new, t_new


def _init_carry(n: int):
    zero = jnp.zeros((n, 1), jnp.float32)
    return (jnp.full((n, 1), _NEG, jnp.float32), zero, zero, zero, zero)


def _finish(carry):
    """-> (lse, target_logit, entropy, sum_p2), each [bt, 1] f32."""
    m, s, a, q, t = carry
    log_s = jnp.log(s)
    return m + log_s, t, log_s - a / s, q / (s * s)


def _dlogits(z, valid, col, targets, lse, ent, g_logp, g_ent):
    """dL/dz for one tile: g_logp (onehot - p) - g_ent p (log p + H); 0 on invalid columns.
    z [bt, bv]; targets, lse, ent, g_logp, g_ent [bt, 1]."""
    logp = z - lse
    p = jnp.where(valid, jnp.exp(logp), 0.0)
    onehot = jnp.where((col == targets) & valid, 1.0, 0.0)
    return g_logp * (onehot - p) - g_ent * (p * jnp.where(valid, logp + ent, 0.0))


def _pad_to(x, axis: int, multiple: int, value=0):
    size = x.shape[axis]
    pad = (-size) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _cols(bv, j, vocab):
    col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    return col, col < vocab


def _pallas_pad(hidden, lm_head, targets, opts: _Opts):
    bt, bv, bd = opts.block_t, opts.block_v, opts.block_d
    if opts.family == "mosaic":
        bd = hidden.shape[1]          # one block over the whole hidden dim
    h = _pad_to(_pad_to(hidden, 0, bt), 1, bd)
    w = _pad_to(_pad_to(lm_head, 0, bd), 1, bv)
    tg = _pad_to(targets.astype(jnp.int32), 0, bt)[:, None]
    dims = dict(bv=bv, vocab=lm_head.shape[1], inv_temp=opts.inv_temp)
    if opts.family == "triton":
        dims.update(bt=bt, bd=bd, n_d=h.shape[1] // bd)
    return h, w, tg, dims


def _column(n: int):
    return jax.ShapeDtypeStruct((n, 1), jnp.float32)
