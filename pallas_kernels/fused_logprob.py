"""Fused per-token log-prob and entropy from final hidden states, never holding [T, V] logits.

The RL update needs log pi(y_t | y_<t) (and the entropy) for every response token. At BroRL's
N = 512 that is millions of tokens against a 151,936-entry vocabulary: the logits alone would be
terabytes. This module computes, for z = (hidden @ lm_head) / temperature,

    logp[t]    = z[t, y_t] - logsumexp_v z[t, v]
    entropy[t] = -sum_v p[t, v] log p[t, v]              (p = softmax z[t])
    sum_p2[t]  = sum_v p[t, v]^2                         (concentration, BroRL §2 / App. C)

with an online (flash-style) log-sum-exp over vocabulary tiles. Per tile with running max m,
s = sum e^{z-m}, a = sum e^{z-m} (z-m), q = sum e^{2(z-m)} are rescaled when m grows; at the end
lse = m + log s, entropy = log s - a / s, sum_p2 = q / s^2.

The backward pass (custom VJP) recomputes each logits tile and forms
    dL/dz_v = g_logp (1[v = y] - p_v) - g_ent p_v (log p_v + H)
then dL/dhidden = dz @ lm_head^T / temperature and dL/dlm_head = hidden^T @ dz / temperature,
accumulated tile by tile, so memory stays O(T*D + D*V) for any T.

Implementations (`impl=`):
  "pallas"  - pl.pallas_call kernels (forward; backward for hidden; backward for lm_head), grid
              over token blocks (resp. vocab blocks), inner loop over the other axis. Compiled on
              GPU/TPU, interpreted on CPU (slow: tiny shapes only).
  "chunked" - the same math in plain jnp: lax.scan over token blocks and vocab chunks.
  "naive"   - the reference (full logits, autodiff); see fused_logprob_reference.py.
  "auto"    - "chunked" on CPU (interpreted Pallas is far slower than XLA there), "pallas" on
              GPU/TPU.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import backend, interpret_mode
from pallas_kernels.fused_logprob_reference import fused_logprob_reference

IMPLS = ("auto", "pallas", "chunked", "naive")
# Masked (padded) vocabulary columns get this logit: exp(_NEG - m) == 0 without inf/nan arithmetic.
_NEG = -1e30


class _Opts(NamedTuple):
    """Static options of one fused call (hashable: a nondiff argument of the custom VJP)."""
    impl: str          # "pallas" | "chunked"
    block_t: int
    block_v: int
    block_d: int       # pallas only: contraction tile over the hidden dimension
    inv_temp: float


def default_block_sizes(impl: str, hidden_size: int, vocab_size: int) -> dict[str, int]:
    """Per-backend tile sizes. GPU (Triton) needs power-of-two tiles >= 16; TPU (Mosaic) wants
    multiples of (8, 128); on CPU interpreted Pallas only runs tiny shapes, and the chunked path
    wants large tiles so each matmul amortises XLA's per-op overhead."""
    be = backend()
    if impl == "chunked":
        if be == "cpu":
            return {"block_t": 1024, "block_v": 8192, "block_d": hidden_size}
        return {"block_t": 4096, "block_v": 16384, "block_d": hidden_size}
    if be == "gpu":
        block_d = next((b for b in (128, 64, 32, 16) if hidden_size % b == 0), 64)
        return {"block_t": 64, "block_v": 128, "block_d": block_d}
    if be == "tpu":
        return {"block_t": 256, "block_v": 512, "block_d": hidden_size}
    return {"block_t": 16, "block_v": 128, "block_d": hidden_size}


def _check_inputs(hidden, lm_head, targets, temperature, impl):
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [T, D]; got shape {hidden.shape} (flatten batch/time first)")
    if lm_head.ndim != 2:
        raise ValueError(f"lm_head must be [D, V]; got shape {lm_head.shape}")
    if hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"hidden [T, D={hidden.shape[1]}] and lm_head [D={lm_head.shape[0]}, V] "
                         "disagree on D; pass the [D, V] output embedding (transpose a tied [V, D] one)")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [T={hidden.shape[0]}]; got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")


# ----------------------------------------------------------------------------------------------
# Tile math shared by the chunked path and the Pallas kernel bodies (plain jnp, so it lowers both
# through XLA and inside pallas_call).
# ----------------------------------------------------------------------------------------------

def _online_update(carry, z, valid, col, targets):
    """Fold one logits tile z [bt, bv] (f32; invalid columns hold _NEG) into the running stats.

    carry = (m, s, a, q, t): running max, sum e^{z-m}, sum e^{z-m}(z-m), sum e^{2(z-m)}, target
    logit. Rescaling by e^{m_old - m_new} keeps everything relative to the current max."""
    m, s, a, q, t = carry
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    delta = m - m_new                                         # <= 0
    alpha = jnp.exp(delta)
    zc = jnp.where(valid, z - m_new[:, None], 0.0)
    e = jnp.where(valid, jnp.exp(zc), 0.0)
    s_new = alpha * s + jnp.sum(e, axis=-1)
    a_new = alpha * (a + delta * s) + jnp.sum(e * zc, axis=-1)
    q_new = alpha * alpha * q + jnp.sum(e * e, axis=-1)
    hit = (col == targets[:, None]) & valid
    t_new = t + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    return m_new, s_new, a_new, q_new, t_new


def _init_carry(n: int):
    zero = jnp.zeros((n,), jnp.float32)
    return (jnp.full((n,), _NEG, jnp.float32), zero, zero, zero, zero)


def _finish(carry):
    """-> (lse, target_logit, entropy, sum_p2), each [bt] f32."""
    m, s, a, q, t = carry
    log_s = jnp.log(s)
    return m + log_s, t, log_s - a / s, q / (s * s)


def _dlogits(z, valid, col, targets, lse, ent, g_logp, g_ent):
    """dL/dz for one tile: g_logp (onehot - p) - g_ent p (log p + H); 0 on invalid columns."""
    logp = z - lse[:, None]
    p = jnp.where(valid, jnp.exp(logp), 0.0)
    onehot = ((col == targets[:, None]) & valid).astype(jnp.float32)
    dz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * jnp.where(valid, p * (logp + ent[:, None]), 0.0)
    return dz


def _pad_to(x, axis: int, multiple: int, value=0):
    size = x.shape[axis]
    pad = (-size) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# ----------------------------------------------------------------------------------------------
# Chunked jnp path: scan over token blocks (outer) and vocab chunks (inner). The vocabulary is
# never padded (a tail chunk is handled separately) so lm_head [D, V] is never copied.
# ----------------------------------------------------------------------------------------------

def _vocab_chunks(vocab: int, block_v: int):
    """(number of full chunks, tail size) of the vocabulary."""
    block_v = min(block_v, vocab)
    return block_v, vocab // block_v, vocab % block_v


def _chunked_forward(hidden, lm_head, targets, opts: _Opts):
    t_len, _ = hidden.shape
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    h = _pad_to(hidden, 0, bt).reshape(-1, bt, hidden.shape[1])
    tg = _pad_to(targets.astype(jnp.int32), 0, bt).reshape(-1, bt)

    def tile(h_blk, w, start):
        z = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp
        col = start + jnp.arange(w.shape[1], dtype=jnp.int32)[None, :]
        return z, col

    def block_stats(args):
        h_blk, t_blk = args

        def body(carry, j):
            start = j * bv
            z, col = tile(h_blk, lax.dynamic_slice_in_dim(lm_head, start, bv, axis=1), start)
            return _online_update(carry, z, True, col, t_blk), None

        carry, _ = lax.scan(body, _init_carry(h_blk.shape[0]), jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            z, col = tile(h_blk, lm_head[:, n_full * bv:], n_full * bv)
            carry = _online_update(carry, z, True, col, t_blk)
        return _finish(carry)

    outs = lax.map(block_stats, (h, tg))
    return tuple(o.reshape(-1)[:t_len] for o in outs)


def _chunked_backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts: _Opts):
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    pad = lambda x: _pad_to(x, 0, bt).reshape((-1, bt) + x.shape[1:])
    h, tg = pad(hidden), pad(targets.astype(jnp.int32))
    lse_b, ent_b = pad(lse), pad(ent)
    # Padded token rows get zero cotangents, so they contribute nothing.
    gl_b, ge_b = pad(g_logp.astype(jnp.float32)), pad(g_ent.astype(jnp.float32))

    def chunk_grads(h_blk, w, start, t_blk, l_blk, e_blk, gl, ge):
        z = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp
        col = start + jnp.arange(w.shape[1], dtype=jnp.int32)[None, :]
        dz = (_dlogits(z, True, col, t_blk, l_blk, e_blk, gl, ge) * opts.inv_temp).astype(w.dtype)
        dh = jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
        dw = jnp.dot(h_blk.T, dz, preferred_element_type=jnp.float32)
        return dh, dw

    def token_block(dw_acc, args):
        h_blk, t_blk, l_blk, e_blk, gl, ge = args

        def body(carry, j):
            dh, dw_acc = carry
            start = j * bv
            w = lax.dynamic_slice_in_dim(lm_head, start, bv, axis=1)
            dh_j, dw_j = chunk_grads(h_blk, w, start, t_blk, l_blk, e_blk, gl, ge)
            old = lax.dynamic_slice_in_dim(dw_acc, start, bv, axis=1)
            dw_acc = lax.dynamic_update_slice_in_dim(dw_acc, old + dw_j, start, axis=1)
            return (dh + dh_j, dw_acc), None

        dh0 = jnp.zeros((h_blk.shape[0], d), jnp.float32)
        (dh, dw_acc), _ = lax.scan(body, (dh0, dw_acc), jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            start = n_full * bv
            dh_j, dw_j = chunk_grads(h_blk, lm_head[:, start:], start, t_blk, l_blk, e_blk, gl, ge)
            dh = dh + dh_j
            dw_acc = dw_acc.at[:, start:].add(dw_j)
        return dw_acc, dh

    dw, dh = lax.scan(token_block, jnp.zeros((d, vocab), jnp.float32),
                      (h, tg, lse_b, ent_b, gl_b, ge_b))
    dh = dh.reshape(-1, d)[:t_len]
    return dh.astype(hidden.dtype), dw.astype(lm_head.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas kernels. Inputs are padded so every tile is full: tokens to block_t, hidden dim to
# block_d (zeros: no effect on logits), vocab to block_v (masked columns).
# ----------------------------------------------------------------------------------------------

def _compiler_params(num_warps: int = 4, num_stages: int = 2):
    if backend() == "gpu" and not interpret_mode():
        from jax.experimental.pallas import triton as plgpu  # GPU-only import
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return None


def _logits_tile(h_ref, w_ref, row0, col0, bt, bv, bd, n_d, inv_temp):
    """z = h[row0:row0+bt] @ w[:, col0:col0+bv] * inv_temp, contracting D in bd-wide pieces."""
    acc = jnp.zeros((bt, bv), jnp.float32)
    for k in range(n_d):   # static: n_d = D_pad / block_d is small
        h = h_ref[pl.ds(row0, bt), pl.ds(k * bd, bd)]
        w = w_ref[pl.ds(k * bd, bd), pl.ds(col0, bv)]
        acc += jnp.dot(h, w, preferred_element_type=jnp.float32)
    return acc * inv_temp


def _fwd_kernel(h_ref, w_ref, tg_ref, lse_ref, tl_ref, ent_ref, p2_ref, *,
                bt, bv, bd, n_d, n_v, vocab, inv_temp):
    targets = tg_ref[...]

    def body(j, carry):
        col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
        valid = col < vocab
        z = jnp.where(valid, _logits_tile(h_ref, w_ref, 0, j * bv, bt, bv, bd, n_d, inv_temp), _NEG)
        return _online_update(carry, z, valid, col, targets)

    lse, tl, ent, p2 = _finish(lax.fori_loop(0, n_v, body, _init_carry(bt)))
    lse_ref[...] = lse
    tl_ref[...] = tl
    ent_ref[...] = ent
    p2_ref[...] = p2


def _dh_kernel(h_ref, w_ref, tg_ref, lse_ref, ent_ref, gl_ref, ge_ref, dh_ref, *,
               bt, bv, bd, n_d, n_v, vocab, inv_temp):
    targets, lse, ent = tg_ref[...], lse_ref[...], ent_ref[...]
    g_logp, g_ent = gl_ref[...], ge_ref[...]
    dh_ref[...] = jnp.zeros(dh_ref.shape, dh_ref.dtype)

    def body(j, _):
        col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
        valid = col < vocab
        z = jnp.where(valid, _logits_tile(h_ref, w_ref, 0, j * bv, bt, bv, bd, n_d, inv_temp), _NEG)
        dz = _dlogits(z, valid, col, targets, lse, ent, g_logp, g_ent) * inv_temp
        dz = dz.astype(w_ref.dtype)
        for k in range(n_d):
            w = w_ref[pl.ds(k * bd, bd), pl.ds(j * bv, bv)]
            dh_ref[:, pl.ds(k * bd, bd)] += jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
        return 0

    lax.fori_loop(0, n_v, body, 0)


def _dw_kernel(h_ref, w_ref, tg_ref, lse_ref, ent_ref, gl_ref, ge_ref, dw_ref, *,
               bt, bv, bd, n_d, n_t, vocab, inv_temp):
    j = pl.program_id(0)
    col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    valid = col < vocab
    dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    def body(i, _):
        rows = pl.ds(i * bt, bt)
        targets, lse, ent = tg_ref[rows], lse_ref[rows], ent_ref[rows]
        g_logp, g_ent = gl_ref[rows], ge_ref[rows]
        z = jnp.where(valid, _logits_tile(h_ref, w_ref, i * bt, 0, bt, bv, bd, n_d, inv_temp), _NEG)
        dz = _dlogits(z, valid, col, targets, lse, ent, g_logp, g_ent) * inv_temp
        dz = dz.astype(h_ref.dtype)
        for k in range(n_d):
            h = h_ref[rows, pl.ds(k * bd, bd)]
            dw_ref[pl.ds(k * bd, bd), :] += jnp.dot(h.T, dz, preferred_element_type=jnp.float32)
        return 0

    lax.fori_loop(0, n_t, body, 0)


def _pallas_pad(hidden, lm_head, targets, opts: _Opts):
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    bt, bv, bd = opts.block_t, opts.block_v, opts.block_d
    h = _pad_to(_pad_to(hidden, 0, bt), 1, bd)
    w = _pad_to(_pad_to(lm_head, 0, bd), 1, bv)
    tg = _pad_to(targets.astype(jnp.int32), 0, bt)
    dims = dict(bt=bt, bv=bv, bd=bd, n_d=h.shape[1] // bd, vocab=vocab, inv_temp=opts.inv_temp)
    return h, w, tg, dims


def _pallas_forward(hidden, lm_head, targets, opts: _Opts):
    t_len = hidden.shape[0]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    t_pad, bt = h.shape[0], opts.block_t
    vec = pl.BlockSpec((bt,), lambda i: (i,))
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, n_v=w.shape[1] // opts.block_v, **dims),
        out_shape=[jax.ShapeDtypeStruct((t_pad,), jnp.float32)] * 4,
        grid=(t_pad // bt,),
        in_specs=[pl.BlockSpec((bt, h.shape[1]), lambda i: (i, 0)),
                  pl.BlockSpec(w.shape, lambda i: (0, 0)),
                  vec],
        out_specs=[vec] * 4,
        interpret=interpret_mode(),
        compiler_params=_compiler_params(),
        name="fused_logprob_fwd",
    )(h, w, tg)
    return tuple(o[:t_len] for o in outs)


def _pallas_backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts: _Opts):
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    bt, bv = opts.block_t, opts.block_v
    pad_t = lambda x: _pad_to(x.astype(jnp.float32), 0, bt)
    rows = (pad_t(lse), pad_t(ent), pad_t(g_logp), pad_t(g_ent))  # padded rows: zero cotangent
    t_pad, d_pad, v_pad = h.shape[0], h.shape[1], w.shape[1]

    vec_blk = pl.BlockSpec((bt,), lambda i: (i,))
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, n_v=v_pad // bv, **dims),
        out_shape=jax.ShapeDtypeStruct((t_pad, d_pad), jnp.float32),
        grid=(t_pad // bt,),
        in_specs=[pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
                  pl.BlockSpec(w.shape, lambda i: (0, 0))] + [vec_blk] * 5,
        out_specs=pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
        interpret=interpret_mode(),
        compiler_params=_compiler_params(),
        name="fused_logprob_bwd_hidden",
    )(h, w, tg, *rows)

    vec_all = pl.BlockSpec((t_pad,), lambda j: (0,))
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, n_t=t_pad // bt, **dims),
        out_shape=jax.ShapeDtypeStruct((d_pad, v_pad), jnp.float32),
        grid=(v_pad // bv,),
        in_specs=[pl.BlockSpec(h.shape, lambda j: (0, 0)),
                  pl.BlockSpec((d_pad, bv), lambda j: (0, j))] + [vec_all] * 5,
        out_specs=pl.BlockSpec((d_pad, bv), lambda j: (0, j)),
        interpret=interpret_mode(),
        compiler_params=_compiler_params(),
        name="fused_logprob_bwd_lm_head",
    )(h, w, tg, *rows)
    return dh[:t_len, :d].astype(hidden.dtype), dw[:d, :vocab].astype(lm_head.dtype)


# ----------------------------------------------------------------------------------------------
# custom VJP core and public API
# ----------------------------------------------------------------------------------------------

def _forward(hidden, lm_head, targets, opts):
    fn = _pallas_forward if opts.impl == "pallas" else _chunked_forward
    return fn(hidden, lm_head, targets, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_core(hidden, lm_head, targets, opts: _Opts):
    lse, tl, ent, p2 = _forward(hidden, lm_head, targets, opts)
    return tl - lse, ent, p2


def _fused_core_fwd(hidden, lm_head, targets, opts):
    lse, tl, ent, p2 = _forward(hidden, lm_head, targets, opts)
    return (tl - lse, ent, p2), (hidden, lm_head, targets, lse, ent)


def _fused_core_bwd(opts, res, cotangents):
    hidden, lm_head, targets, lse, ent = res
    g_logp, g_ent, _ = cotangents   # sum_p2 is returned under stop_gradient by every caller
    fn = _pallas_backward if opts.impl == "pallas" else _chunked_backward
    dh, dw = fn(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts)
    return dh, dw, None


_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)


def resolve_impl(impl: str) -> str:
    """"auto" -> "chunked" on CPU (where Pallas only interprets), "pallas" on GPU/TPU."""
    return _backend.resolve_impl(impl, IMPLS, on_cpu="chunked")


def _opts(impl, hidden, lm_head, temperature, block_t, block_v, block_d) -> _Opts:
    defaults = default_block_sizes(impl, hidden.shape[1], lm_head.shape[1])
    bt = block_t or defaults["block_t"]
    bv = block_v or defaults["block_v"]
    bd = block_d or defaults["block_d"]
    for name, val in (("block_t", bt), ("block_v", bv), ("block_d", bd)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be a positive int; got {val}")
    return _Opts(impl, int(bt), int(bv), int(bd), float(1.0 / temperature))


def _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d):
    _check_inputs(hidden, lm_head, targets, temperature, impl)
    impl = resolve_impl(impl)
    if impl == "naive":
        return None
    opts = _opts(impl, hidden, lm_head, temperature, block_t, block_v, block_d)
    logp, ent, p2 = _fused_core(hidden, lm_head, targets, opts)
    return logp, ent, lax.stop_gradient(p2), opts


def fused_logprob(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-prob of `targets` and entropy under softmax(hidden @ lm_head / temperature).

    Args:
      hidden: [T, D] final (normed) hidden states, any float dtype.
      lm_head: [D, V] output embedding.
      targets: [T] int token ids.
      temperature: the sampling temperature (rollouts sampled at T need log-probs of z / T).
      impl: "auto" | "pallas" | "chunked" | "naive" (see module docstring).
      block_t, block_v, block_d: tile sizes; None = per-backend defaults (default_block_sizes).
    Returns:
      (logp [T] float32, entropy [T] float32), differentiable wrt hidden and lm_head.
    """
    out = _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d)
    if out is None:
        return fused_logprob_reference(hidden, lm_head, targets, temperature=temperature)
    return out[0], out[1]


def _unsampled_second_moment(hidden, lm_head, lse, ns, opts: _Opts):
    """sum_v p_v^2 (1 - p_v)^n for each n in ns -> [T, K] (BroRL Lemma 2 / Corollary 3).

    Needs the final lse, hence a second sweep over the vocabulary (chunked jnp; diagnostics only)."""
    t_len = hidden.shape[0]
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    h = _pad_to(hidden, 0, bt).reshape(-1, bt, hidden.shape[1])
    lse_b = _pad_to(lse, 0, bt).reshape(-1, bt)
    ns = jnp.asarray(ns, jnp.float32)

    def chunk(h_blk, l_blk, w):
        logp = jnp.dot(h_blk, w, preferred_element_type=jnp.float32) * opts.inv_temp - l_blk[:, None]
        p = jnp.exp(logp)
        # p^2 (1-p)^n = exp(2 log p + n log1p(-p)); log1p keeps small-p terms accurate.
        log_terms = 2.0 * logp[:, :, None] + ns * jnp.log1p(-jnp.minimum(p, 1.0 - 1e-7))[:, :, None]
        return jnp.sum(jnp.exp(log_terms), axis=1)

    def block(args):
        h_blk, l_blk = args

        def body(acc, j):
            w = lax.dynamic_slice_in_dim(lm_head, j * bv, bv, axis=1)
            return acc + chunk(h_blk, l_blk, w), None

        acc, _ = lax.scan(body, jnp.zeros((h_blk.shape[0], ns.shape[0]), jnp.float32),
                          jnp.arange(n_full, dtype=jnp.int32))
        if tail:
            acc = acc + chunk(h_blk, l_blk, lm_head[:, n_full * bv:])
        return acc

    return lax.map(block, (h, lse_b)).reshape(-1, ns.shape[0])[:t_len]


def fused_logprob_stats(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    unsampled_n: int | Sequence[int] | None = None,
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
) -> dict[str, jax.Array]:
    """`fused_logprob` plus the mass-balance statistics (BroRL §2, App. C).

    Returns dict(logp [T], entropy [T], sum_p2 [T]) and, when `unsampled_n` (an int or a list of
    ints) is given, sum_p2_unsampled [T, K] = sum_v p_v^2 (1 - p_v)^n, the expected unsampled
    second moment of Lemma 2 for each n. logp and entropy are differentiable; the statistics are
    returned under stop_gradient.
    """
    out = _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d)
    if out is None:
        from pallas_kernels.fused_logprob_reference import fused_logprob_stats_reference
        ref = fused_logprob_stats_reference(hidden, lm_head, targets, temperature=temperature,
                                            unsampled_n=unsampled_n)
        return {k: (v if k in ("logp", "entropy") else lax.stop_gradient(v)) for k, v in ref.items()}
    logp, ent, p2, opts = out
    result = {"logp": logp, "entropy": ent, "sum_p2": p2}
    if unsampled_n is not None:
        ns = [unsampled_n] if isinstance(unsampled_n, int) else list(unsampled_n)
        lse, _, _, _ = _forward(lax.stop_gradient(hidden), lax.stop_gradient(lm_head), targets,
                                opts)
        chunk_opts = opts if opts.impl == "chunked" else opts._replace(
            **{k: v for k, v in default_block_sizes("chunked", hidden.shape[1], lm_head.shape[1]).items()
               if k in ("block_t", "block_v")})
        result["sum_p2_unsampled"] = lax.stop_gradient(_unsampled_second_moment(
            lax.stop_gradient(hidden), lax.stop_gradient(lm_head), lse, ns, chunk_opts))
    return result
