"""Decode attention against a shared prompt KV plus per-sample KV (one prompt, N continuations).

For prompt ``b`` with N samples, the key/value sequence of sample ``n`` is the concatenation of the
prompt's KV (stored once, ``prefix_k[b]``) and the sample's own generated KV (``suffix_k[b, n]``).
Softmax attention over a concatenation splits exactly into the two parts merged by their
log-sum-exp (the online-softmax / flash-attention identity)::

    o_p, lse_p = attend(q, prefix)          o_s, lse_s = attend(q, suffix)
    lse = logaddexp(lse_p, lse_s)
    out = exp(lse_p - lse) * o_p + exp(lse_s - lse) * o_s

The prefix part is a matmul with ``N * H / Hkv`` query rows per KV head: all N samples of a prompt
read its KV once, which turns the memory-bound decode attention over the prompt into a compute-bound
one. GQA: query head ``h`` uses KV head ``h // (H // Hkv)`` (Hugging Face ``repeat_kv`` order).

Masks: prefix positions ``p < prefix_len[b]`` and suffix positions ``s < suffix_len[b, n]`` are valid
(both right-padded). A row with no valid key at all returns zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode

_IMPLS = ("auto", "reference", "pallas")
_NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free on fully masked rows


def resolve_impl(impl: str) -> str:
    """"auto" -> the Pallas kernel on GPU/TPU, the jnp reference on CPU (interpreting is slow)."""
    return _backend.resolve_impl(impl, _IMPLS, on_cpu="reference")


def _check_shapes(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, N, H, Dh], got {q.shape}")
    b, n, h, dh = q.shape
    if prefix_k.ndim != 4 or prefix_k.shape[0] != b or prefix_k.shape[3] != dh:
        raise ValueError(f"prefix_k must be [B={b}, P, Hkv, Dh={dh}], got {prefix_k.shape}")
    hkv = prefix_k.shape[2]
    if h % hkv:
        raise ValueError(f"num heads H={h} must be a multiple of num kv heads Hkv={hkv}")
    if prefix_v.shape != prefix_k.shape:
        raise ValueError(f"prefix_v shape {prefix_v.shape} != prefix_k shape {prefix_k.shape}")
    if suffix_k.ndim != 5 or suffix_k.shape[:2] != (b, n) or suffix_k.shape[3:] != (hkv, dh):
        raise ValueError(f"suffix_k must be [B={b}, N={n}, S, Hkv={hkv}, Dh={dh}], got {suffix_k.shape}")
    if suffix_v.shape != suffix_k.shape:
        raise ValueError(f"suffix_v shape {suffix_v.shape} != suffix_k shape {suffix_k.shape}")
    if prefix_len.shape != (b,):
        raise ValueError(f"prefix_len must be [B={b}], got {prefix_len.shape}")
    if suffix_len.shape != (b, n):
        raise ValueError(f"suffix_len must be [B={b}, N={n}], got {suffix_len.shape}")


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp)
# ----------------------------------------------------------------------------------------------


def _masked_attend(scores: jax.Array, mask: jax.Array, pv_fn) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis of ``scores`` under ``mask``: (out, lse); a row without any
    valid key gives out = 0, lse = -inf (so it gets zero weight in the merge)."""
    scores = jnp.where(mask, scores, _NEG)
    m = jnp.max(scores, axis=-1)
    valid = m > _NEG / 2
    # masked entries are exp(_NEG - m) == 0 on valid rows; invalid rows are zeroed below, which
    # saves a second full pass over the [rows, keys] scores
    p = jnp.exp(scores - m[..., None])
    l = jnp.sum(p, axis=-1)
    out = jnp.where(valid[..., None], pv_fn(p) / l[..., None], 0.0)
    lse = jnp.where(valid, m + jnp.log(l), -jnp.inf)
    return out, lse


def shared_prefix_decode_attention_reference(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, scale=None
) -> jax.Array:
    """Plain-jnp shared-prefix decode attention (shapes in the module docstring).

    ``q[B, N, H, Dh]``, ``prefix_k/v[B, P, Hkv, Dh]``, ``prefix_len[B]``,
    ``suffix_k/v[B, N, S, Hkv, Dh]``, ``suffix_len[B, N]`` -> ``out[B, N, H, Dh]`` (q's dtype).
    Accumulates in float32. Queries are laid out [B, Hkv, N*g, Dh] so the prefix part is one
    batch-leading matmul per (prompt, KV head); XLA's CPU dot is ~2x slower on the 5-D einsum.
    """
    _check_shapes(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len)
    b, n, h, dh = q.shape
    p_len, hkv = prefix_k.shape[1], prefix_k.shape[2]
    s_len = suffix_k.shape[2]
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    qg = (q.astype(jnp.float32) * scale).reshape(b, n, hkv, g, dh).transpose(0, 2, 1, 3, 4)
    qm = qg.reshape(b, hkv, n * g, dh)  # [B, Hkv, M = N*g, Dh]
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    # prefix: one [N*g, Dh] x [Dh, P] matmul per (prompt, kv head)
    s_p = f32("bkmd,bpkd->bkmp", qm, prefix_k.astype(jnp.float32))
    mask_p = (jnp.arange(p_len)[None, :] < prefix_len[:, None])[:, None, None, :]
    o_p, lse_p = _masked_attend(
        s_p, mask_p, lambda p: f32("bkmp,bpkd->bkmd", p, prefix_v.astype(jnp.float32)))
    # suffix: each sample against its own generated KV
    s_s = f32("bkngd,bnskd->bkngs", qg, suffix_k.astype(jnp.float32))
    mask_s = (jnp.arange(s_len) < suffix_len[..., None])[:, None, :, None, :]  # [B,1,N,1,S]
    o_s, lse_s = _masked_attend(
        s_s, mask_s, lambda p: f32("bkngs,bnskd->bkngd", p, suffix_v.astype(jnp.float32)))
    o_s, lse_s = o_s.reshape(b, hkv, n * g, dh), lse_s.reshape(b, hkv, n * g)
    # exact merge of the two softmaxes by their log-sum-exp
    lse = jnp.logaddexp(lse_p, lse_s)
    safe = jnp.isfinite(lse)
    lse = jnp.where(safe, lse, 0.0)
    w_p = jnp.where(safe, jnp.exp(lse_p - lse), 0.0)
    w_s = jnp.where(safe, jnp.exp(lse_s - lse), 0.0)
    out = w_p[..., None] * o_p + w_s[..., None] * o_s  # [B, Hkv, N*g, Dh]
    out = out.reshape(b, hkv, n, g, dh).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, n, h, dh).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas kernel: one program per (prompt, kv head, block of samples); online softmax over the
# prompt KV in blocks of block_p, then over the samples' own KV in blocks of block_s.
# ----------------------------------------------------------------------------------------------


def _decode_attention_kernel(
    plen_ref, slen_ref, q_ref, pk_ref, pv_ref, sk_ref, sv_ref, o_ref, *, scale, block_p, block_s
):
    b = pl.program_id(0)
    q = q_ref[...].astype(jnp.float32) * scale  # [bn, g, Dh]
    bn, g, dh = q.shape
    q2 = q.reshape(bn * g, dh)
    plen = plen_ref[b]
    slen = slen_ref[...]  # [bn]
    m0 = jnp.full((bn * g,), _NEG, jnp.float32)
    l0 = jnp.zeros((bn * g,), jnp.float32)
    acc0 = jnp.zeros((bn * g, dh), jnp.float32)

    def update(state, s, mask, v_fn):
        # one online-softmax step (Milakov & Gimelshein 2018; FlashAttention): s [rows, blk]
        m, l, acc = state
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + v_fn(p)

    def prefix_body(i, state):
        start = pl.multiple_of(i * block_p, block_p)
        k = pk_ref[pl.ds(start, block_p), :].astype(jnp.float32)  # [bp, Dh]
        v = pv_ref[pl.ds(start, block_p), :].astype(jnp.float32)
        s = jax.lax.dot_general(q2, k, (((1,), (1,)), ((), ())))  # [bn*g, bp]
        pos = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        return update(state, s, pos < plen, lambda p: jnp.dot(p, v))

    num_p = (plen + block_p - 1) // block_p  # skip prompt blocks that are all padding
    state = jax.lax.fori_loop(0, num_p, prefix_body, (m0, l0, acc0))

    def suffix_body(i, state):
        start = pl.multiple_of(i * block_s, block_s)
        k = sk_ref[:, pl.ds(start, block_s), :].astype(jnp.float32)  # [bn, bs, Dh]
        v = sv_ref[:, pl.ds(start, block_s), :].astype(jnp.float32)
        # per-sample scores as broadcast-multiply-reduce (no batched dot needed): [bn, g, bs]
        s = jnp.sum(q[:, :, None, :] * k[:, None, :, :], axis=-1).reshape(bn * g, block_s)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (bn, g, block_s), 2)
        mask = (pos < slen[:, None, None]).reshape(bn * g, block_s)

        def pv(p):
            p3 = p.reshape(bn, g, block_s)
            return jnp.sum(p3[:, :, :, None] * v[:, None, :, :], axis=2).reshape(bn * g, dh)

        return update(state, s, mask, pv)

    num_s = (jnp.max(slen) + block_s - 1) // block_s  # skip suffix blocks not yet written
    m, l, acc = jax.lax.fori_loop(0, num_s, suffix_body, state)
    out = acc / jnp.maximum(l, 1e-30)[:, None]
    o_ref[...] = out.reshape(bn, g, dh).astype(o_ref.dtype)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.partial(jax.jit, static_argnames=("scale", "block_n", "block_p", "block_s"))
def shared_prefix_decode_attention_pallas(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, scale=None,
    block_n: int = 16, block_p: int = 64, block_s: int = 32,
) -> jax.Array:
    """Pallas kernel with the contract of :func:`shared_prefix_decode_attention_reference`.

    Grid ``(B, Hkv, ceil(N / block_n))``. Each program keeps ``block_n * g`` query rows and streams
    the prompt KV of its (prompt, kv head) once, then each sample's own KV, with one online softmax
    state, so the prefix/suffix LSE merge is exact and never materialises [N, P] scores.
    """
    _check_shapes(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len)
    b, n, h, dh = q.shape
    p_len, hkv = prefix_k.shape[1], prefix_k.shape[2]
    s_len = suffix_k.shape[2]
    g = h // hkv
    scale = dh**-0.5 if scale is None else scale
    block_n = min(block_n, n)
    block_p = min(block_p, _round_up(p_len, 8))
    block_s = min(block_s, _round_up(s_len, 8))
    n_pad, p_pad, s_pad = _round_up(n, block_n), _round_up(p_len, block_p), _round_up(s_len, block_s)
    qg = jnp.pad(q.reshape(b, n, hkv, g, dh), ((0, 0), (0, n_pad - n), (0, 0), (0, 0), (0, 0)))
    pad_p = ((0, 0), (0, p_pad - p_len), (0, 0), (0, 0))
    pk, pv = jnp.pad(prefix_k, pad_p), jnp.pad(prefix_v, pad_p)
    pad_s = ((0, 0), (0, n_pad - n), (0, s_pad - s_len), (0, 0), (0, 0))
    sk, sv = jnp.pad(suffix_k, pad_s), jnp.pad(suffix_v, pad_s)
    slen = jnp.pad(suffix_len.astype(jnp.int32), ((0, 0), (0, n_pad - n)))
    kernel = functools.partial(
        _decode_attention_kernel, scale=float(scale), block_p=block_p, block_s=block_s
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_pad // block_n),
        in_specs=[
            pl.BlockSpec((b,), lambda i, k, j: (0,)),
            pl.BlockSpec((None, block_n), lambda i, k, j: (i, j)),
            pl.BlockSpec((None, block_n, None, g, dh), lambda i, k, j: (i, j, k, 0, 0)),
            pl.BlockSpec((None, p_pad, None, dh), lambda i, k, j: (i, 0, k, 0)),
            pl.BlockSpec((None, p_pad, None, dh), lambda i, k, j: (i, 0, k, 0)),
            pl.BlockSpec((None, block_n, s_pad, None, dh), lambda i, k, j: (i, j, 0, k, 0)),
            pl.BlockSpec((None, block_n, s_pad, None, dh), lambda i, k, j: (i, j, 0, k, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_n, None, g, dh), lambda i, k, j: (i, j, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n_pad, hkv, g, dh), q.dtype),
        interpret=interpret_mode(),
        name="shared_prefix_decode_attention",
    )(prefix_len.astype(jnp.int32), slen, qg, pk, pv, sk, sv)
    return out[:, :n].reshape(b, n, h, dh)


def shared_prefix_decode_attention(
    q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, *, scale=None, impl="auto"
) -> jax.Array:
    """Decode attention of ``q[B, N, H, Dh]`` against a shared prompt KV and per-sample KV.

    Args:
      q: ``[B, N, H, Dh]`` queries of the current token of each of N samples per prompt.
      prefix_k, prefix_v: ``[B, P, Hkv, Dh]`` prompt KV, stored once per prompt.
      prefix_len: ``[B]`` int, valid prompt positions (right padding).
      suffix_k, suffix_v: ``[B, N, S, Hkv, Dh]`` each sample's generated KV.
      suffix_len: ``[B, N]`` int, valid generated positions.
      scale: score scale, default ``Dh ** -0.5``.
      impl: "auto" (kernel on GPU/TPU, reference on CPU), "reference" or "pallas".

    Returns:
      ``out[B, N, H, Dh]``, exactly softmax attention over prefix ++ suffix.
    """
    if resolve_impl(impl) == "pallas":
        return shared_prefix_decode_attention_pallas(
            q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, scale=scale
        )
    return shared_prefix_decode_attention_reference(
        q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_len, scale=scale
    )
