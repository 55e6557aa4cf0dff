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
accumulated tile by tile, so memory stays O(T*D + D*V) for any T. On GPU the logits are
recomputed once: the d hidden kernel writes dz (lm_head's dtype, the dtype both products take)
for a chunk of tokens and one GEMM forms the chunk's d lm_head; on TPU and in the chunked path
the two products sit in separate kernels / loops, each recomputing its tiles.

Implementations (`impl=`):
  "pallas"  - pl.pallas_call kernels (forward; backward for hidden [+ dz on GPU]; backward for
              lm_head [TPU; a GEMM over dz on GPU]) in two
              families (see _backend): "triton" on GPU - explicit Triton compiler params, grid
              over token blocks (resp. vocab tiles), inner loops over the other axis and over
              64-wide pieces of the hidden dim, so only one dot's operands sit in shared memory;
              "mosaic" on TPU - token and vocab tiles are both grid axes, each step DMAs one
              [block_t, D] x [D, block_v] pair into VMEM (block_v planned against the VMEM
              budget), running statistics in VMEM scratch. Neither ever holds the whole lm_head
              or a whole vocabulary row. Interpreted on CPU (slow: tiny shapes only).
  "chunked" - the same math in plain jnp: lax.scan over token blocks and vocab chunks.
  "naive"   - the reference (full logits, autodiff); see fused_logprob_reference.py.
  "auto"    - "chunked" on CPU (interpreted Pallas is far slower than XLA there), "pallas" on
              GPU/TPU unless pallas_unsupported_reason() names a reason (a dtype, a VMEM budget,
              a mesh outside shard_map): then "chunked", logged once per reason.
fused_logprob_vocab_shard: the same with the vocabulary split over a mesh axis (inside
shard_map), used by brorl_jax.parallel.vocab_parallel.
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
    block_d: int       # triton kernels only: contraction tile over the hidden dimension
    inv_temp: float
    family: str = "triton"   # pallas only: "triton" (GPU, CPU interpret) | "mosaic" (TPU)


# Triton tiles (powers of two, >= 16 for tl.dot). Per inner step the operands of one dot live in
# shared memory, num_stages-fold: (64*64 + 64*128) * 4 B * 2 stages = 96 KiB in float32, well
# under the 227 KiB an H100/H200 block may use; the [64, 128] f32 logits tile lives in registers.
_TRITON_TILES = {"block_t": 64, "block_v": 128, "block_d": 64}
_TRITON_WARPS, _TRITON_STAGES = 4, 2
# Tokens per chunk of the Triton backward: its dz [chunk, V] (lm_head's dtype) is held between
# the d hidden kernel and the d lm_head GEMM (8192 x 151,936 bf16 = 2.5 GB).
_DZ_CHUNK_TOKENS = 8192
# Mosaic tiles: tokens in multiples of 16 (bf16 sublane packing), vocab in multiples of 128 lanes;
# the whole hidden dimension is one block (one MXU contraction per tile).
_MOSAIC_BLOCK_T = 256
_MOSAIC_BLOCK_V = (512, 256, 128)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


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


def default_block_sizes(impl: str, hidden_size: int, vocab_size: int, *, tokens: int | None = None,
                        itemsize: int = 4, family: str | None = None) -> dict[str, int]:
    """Per-backend tile sizes. Triton (GPU) needs power-of-two tiles >= 16 whose dot operands fit
    shared memory; Mosaic (TPU) wants multiples of (16, 128) whose blocks fit the VMEM budget; the
    chunked path wants large tiles so each matmul amortises XLA's per-op overhead."""
    be = backend()
    if impl == "chunked":
        if be == "cpu":
            return {"block_t": 1024, "block_v": 8192, "block_d": hidden_size}
        return {"block_t": 4096, "block_v": 16384, "block_d": hidden_size}
    family = _backend.kernel_family(family)
    if family == "mosaic":
        tiles = _mosaic_tiles(tokens or _MOSAIC_BLOCK_T, hidden_size, itemsize)
        if isinstance(tiles, str):
            raise ValueError(f"fused_logprob: {tiles}")
        return tiles
    if be == "cpu":   # interpreted: tiny shapes only
        return {"block_t": 16, "block_v": 128, "block_d": min(64, _next_pow2(max(hidden_size, 16)))}
    tiles = dict(_TRITON_TILES)
    tiles["block_d"] = min(tiles["block_d"], _next_pow2(max(hidden_size, 16)))
    if tokens is not None:
        tiles["block_t"] = min(tiles["block_t"], _next_pow2(max(tokens, 16)))
    return tiles


_DTYPES = ("float32", "bfloat16", "float16")


def pallas_unsupported_reason(hidden_shape, lm_head_shape, dtype, *, family: str | None = None
                              ) -> str | None:
    """None when the Pallas kernels compile for these shapes on the current target (see
    _backend.compile_target), else why not. impl="auto" falls back to "chunked" on a reason."""
    t_len, d = hidden_shape
    if jnp.dtype(dtype).name not in _DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (kernels take {_DTYPES})"
    if _backend.under_auto_partitioned_mesh():
        return ("traced under a mesh outside shard_map (GSPMD cannot partition a Pallas call); "
                "use brorl_jax.parallel.vocab_parallel.sharded_fused_logprob(mesh)")
    if _backend.kernel_family(family) == "mosaic":
        tiles = _mosaic_tiles(t_len, d, jnp.dtype(dtype).itemsize)
        return tiles if isinstance(tiles, str) else None
    return None


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
# Tile math shared by the chunked path and the Pallas kernel bodies (plain jnp on column vectors
# [n, 1], so it lowers through XLA, Triton and Mosaic alike).
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Chunked jnp path: scan over token blocks (outer) and vocab chunks (inner). The vocabulary is
# never padded (a tail chunk is handled separately) so lm_head [D, V] is never copied.
# ----------------------------------------------------------------------------------------------

def _vocab_chunks(vocab: int, block_v: int):
    """(chunk size, number of full chunks, tail size) of the vocabulary."""
    block_v = min(block_v, vocab)
    return block_v, vocab // block_v, vocab % block_v


def _chunked_forward(hidden, lm_head, targets, opts: _Opts):
    t_len, _ = hidden.shape
    vocab = lm_head.shape[1]
    bt = min(opts.block_t, t_len)
    bv, n_full, tail = _vocab_chunks(vocab, opts.block_v)
    h = _pad_to(hidden, 0, bt).reshape(-1, bt, hidden.shape[1])
    tg = _pad_to(targets.astype(jnp.int32), 0, bt).reshape(-1, bt, 1)

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
    col_pad = lambda x: pad(x.astype(jnp.float32))[..., None]
    h, tg = pad(hidden), pad(targets.astype(jnp.int32))[..., None]
    lse_b, ent_b = col_pad(lse), col_pad(ent)
    # Padded token rows get zero cotangents, so they contribute nothing.
    gl_b, ge_b = col_pad(g_logp), col_pad(g_ent)

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
# Pallas kernels, two families (see _backend): "triton" - one program per token block (resp.
# vocab tile for d lm_head), inner loops over the other axis and over hidden-dim pieces, reading
# tiles straight from global memory; "mosaic" - both axes are grid axes, each step DMAs one
# [block_t, D] x [D, block_v] pair into VMEM, running stats in VMEM scratch / the resident
# output block. Inputs are padded so every tile is full: tokens to block_t, vocab to block_v
# (masked columns), and for triton the hidden dim to block_d (zeros: no effect on logits).
# Per-token vectors travel as [T, 1] columns.
# ----------------------------------------------------------------------------------------------

def _cols(bv, j, vocab):
    col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    return col, col < vocab


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


def _pallas_forward(hidden, lm_head, targets, opts: _Opts):
    t_len = hidden.shape[0]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    (t_pad, d_pad), v_pad = h.shape, w.shape[1]
    bt, bv = opts.block_t, opts.block_v
    n_t, n_v = t_pad // bt, v_pad // bv
    if opts.family == "triton":
        vec = pl.BlockSpec((bt, 1), lambda i: (i, 0))
        kernel = functools.partial(_tr_fwd_kernel, n_v=n_v, **dims)
        grid = (n_t,)
        in_specs = [pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
                    pl.BlockSpec((d_pad, v_pad), lambda i: (0, 0)), vec]
        scratch = ()
    else:
        vec = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
        kernel = functools.partial(_mo_fwd_kernel, **dims)
        grid = (n_t, n_v)
        in_specs = [pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
                    pl.BlockSpec((d_pad, bv), lambda i, j: (0, j)), vec]
        from jax.experimental.pallas import tpu as pltpu
        scratch = [pltpu.VMEM((bt, 1), jnp.float32) for _ in range(5)]
    outs = pl.pallas_call(
        kernel,
        out_shape=[_column(t_pad)] * 4,
        grid=grid,
        in_specs=in_specs,
        out_specs=[vec] * 4,
        scratch_shapes=scratch,
        interpret=interpret_mode(),
        compiler_params=_backend.compiler_params(
            opts.family, num_warps=_TRITON_WARPS, num_stages=_TRITON_STAGES,
            dimension_semantics=("parallel", "arbitrary")),
        name="fused_logprob_fwd",
    )(h, w, tg)
    return tuple(o[:t_len, 0] for o in outs)


def _pallas_backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts: _Opts):
    t_len, d = hidden.shape
    vocab = lm_head.shape[1]
    h, w, tg, dims = _pallas_pad(hidden, lm_head, targets, opts)
    bt, bv = opts.block_t, opts.block_v
    pad_t = lambda x: _pad_to(x.astype(jnp.float32), 0, bt)[:, None]
    rows = (pad_t(lse), pad_t(ent), pad_t(g_logp), pad_t(g_ent))  # padded rows: zero cotangent
    (t_pad, d_pad), v_pad = h.shape, w.shape[1]
    n_t, n_v = t_pad // bt, v_pad // bv
    params = functools.partial(_backend.compiler_params, opts.family, num_warps=_TRITON_WARPS,
                               num_stages=_TRITON_STAGES)
    if opts.family == "triton":
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
            interpret=interpret_mode(), compiler_params=params(),
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
    else:
        vec_i = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
        dh = pl.pallas_call(
            functools.partial(_mo_dh_kernel, **dims),
            out_shape=jax.ShapeDtypeStruct((t_pad, d_pad), jnp.float32),
            grid=(n_t, n_v),
            in_specs=[pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
                      pl.BlockSpec((d_pad, bv), lambda i, j: (0, j))] + [vec_i] * 5,
            out_specs=pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
            interpret=interpret_mode(),
            compiler_params=params(dimension_semantics=("parallel", "arbitrary")),
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
            compiler_params=params(dimension_semantics=("parallel", "arbitrary")),
            name="fused_logprob_bwd_lm_head",
        )(h, w, tg, *rows)
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


# ----------------------------------------------------------------------------------------------
# vocabulary split over a mesh axis (call inside shard_map): the kernel per shard, statistics
# merged with collectives, the backward per shard with the merged lse and entropy.
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _shard_core(hidden, lm_head, targets_local, opts: _Opts, axis):
    return _shard_core_fwd(hidden, lm_head, targets_local, opts, axis)[0]


def _shard_core_fwd(hidden, lm_head, targets_local, opts, axis):
    lse_j, t_j, ent_j, _ = _forward(hidden, lm_head, targets_local, opts)
    m = lax.pmax(lse_j, axis)
    lse = m + jnp.log(lax.psum(jnp.exp(lse_j - m), axis))
    # entropy over the union of the shards: H = sum_j w_j (H_j - log w_j), w_j = e^{lse_j - lse}
    log_w = lse_j - lse
    ent = lax.psum(jnp.exp(log_w) * (ent_j - log_w), axis)
    logp = lax.psum(t_j, axis) - lse
    return (logp, ent), (hidden, lm_head, targets_local, lse, ent)


def _shard_core_bwd(opts, axis, res, cotangents):
    hidden, lm_head, targets_local, lse, ent = res
    # The outputs are replicated over `axis`; shard_map (check_vma=False) hands each shard
    # 1/k of their cotangent, so the whole cotangent is the sum over the shards.
    g_logp, g_ent = lax.psum(cotangents, axis)
    fn = _pallas_backward if opts.impl == "pallas" else _chunked_backward
    # dL/dz_v on this shard's columns with the global softmax (global lse and entropy); the
    # hidden gradient is this shard's part (shard_map sums it over `axis`, see the caller).
    dh, dw = fn(hidden, lm_head, targets_local, lse, ent, g_logp, g_ent, opts)
    return dh, dw, None


_shard_core.defvjp(_shard_core_fwd, _shard_core_bwd)


def fused_logprob_vocab_shard(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    axis_name: str,
    vocab_start: jax.Array | int,
    temperature: float = 1.0,
    impl: str = "auto",
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
    family: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`fused_logprob` with the vocabulary split over mesh axis `axis_name`; call it inside
    shard_map (check_vma=False) with `hidden` replicated over that axis.

    hidden [T, D]; lm_head [D, V_k] this shard's columns, the first being global column
    `vocab_start`; targets [T] global token ids. Returns (logp [T], entropy [T]) over the whole
    vocabulary, equal on every shard of the axis. Each shard runs the kernel (or the chunked path)
    on its columns; only [T]-vectors cross the axis (one pmax, three psums). The backward runs per
    shard with the merged lse and entropy: d lm_head stays on its shard, d hidden is this shard's
    part, which shard_map's transpose sums over `axis_name` (hidden enters replicated there).
    """
    _check_inputs(hidden, lm_head, targets, temperature, impl)
    impl = resolve_impl(impl, hidden, lm_head, family=family)
    if impl == "naive":
        raise ValueError("fused_logprob_vocab_shard: impl='naive' has no sharded form; use "
                         "'auto', 'pallas' or 'chunked'")
    opts = _opts(impl, hidden, lm_head, temperature, block_t, block_v, block_d, family)
    targets_local = targets.astype(jnp.int32) - vocab_start   # off-shard ids match no column
    return _shard_core(hidden, lm_head, targets_local, opts, axis_name)


def resolve_impl(impl: str, hidden=None, lm_head=None, *, family: str | None = None) -> str:
    """"auto" -> "chunked" on CPU (where Pallas only interprets), "pallas" on GPU/TPU unless the
    kernel cannot compile for these shapes there (pallas_unsupported_reason; logged once)."""
    check = None
    if hidden is not None:
        check = lambda: pallas_unsupported_reason(hidden.shape, lm_head.shape, hidden.dtype,
                                                  family=family)
    return _backend.resolve_impl(impl, IMPLS, on_cpu="chunked", kernel="fused_logprob", check=check)


def _opts(impl, hidden, lm_head, temperature, block_t, block_v, block_d, family) -> _Opts:
    family = _backend.kernel_family(family) if impl == "pallas" else "triton"
    defaults = default_block_sizes(impl, hidden.shape[1], lm_head.shape[1], tokens=hidden.shape[0],
                                   itemsize=jnp.dtype(hidden.dtype).itemsize, family=family)
    bt = block_t or defaults["block_t"]
    bv = block_v or defaults["block_v"]
    bd = block_d or defaults["block_d"]
    for name, val in (("block_t", bt), ("block_v", bv), ("block_d", bd)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be a positive int; got {val}")
    if impl == "pallas" and not interpret_mode():
        if family == "triton" and any(v < 16 or v & (v - 1) for v in (bt, bv, bd)):
            raise ValueError(f"Triton tiles must be powers of two >= 16; got block_t={bt}, "
                             f"block_v={bv}, block_d={bd}")
        if family == "mosaic" and (bt % 8 or bv % 128):
            raise ValueError(f"Mosaic tiles need block_t % 8 == 0 and block_v % 128 == 0; got "
                             f"block_t={bt}, block_v={bv}")
    return _Opts(impl, int(bt), int(bv), int(bd), float(1.0 / temperature), family)


def _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d, family):
    _check_inputs(hidden, lm_head, targets, temperature, impl)
    impl = resolve_impl(impl, hidden, lm_head, family=family)
    if impl == "naive":
        return None
    opts = _opts(impl, hidden, lm_head, temperature, block_t, block_v, block_d, family)
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
    family: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-prob of `targets` and entropy under softmax(hidden @ lm_head / temperature).

    Args:
      hidden: [T, D] final (normed) hidden states, any float dtype.
      lm_head: [D, V] output embedding.
      targets: [T] int token ids.
      temperature: the sampling temperature (rollouts sampled at T need log-probs of z / T).
      impl: "auto" | "pallas" | "chunked" | "naive" (see module docstring).
      block_t, block_v, block_d: tile sizes; None = per-backend defaults (default_block_sizes).
      family: the Pallas kernel structure, None = the target's ("triton" on GPU, "mosaic" on
        TPU); on CPU either can be interpreted (tests run both).
    Returns:
      (logp [T] float32, entropy [T] float32), differentiable wrt hidden and lm_head.
    """
    out = _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d, family)
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
    family: str | None = None,
) -> dict[str, jax.Array]:
    """`fused_logprob` plus the mass-balance statistics (BroRL §2, App. C).

    Returns dict(logp [T], entropy [T], sum_p2 [T]) and, when `unsampled_n` (an int or a list of
    ints) is given, sum_p2_unsampled [T, K] = sum_v p_v^2 (1 - p_v)^n, the expected unsampled
    second moment of Lemma 2 for each n. logp and entropy are differentiable; the statistics are
    returned under stop_gradient.
    """
    out = _fused_all(hidden, lm_head, targets, temperature, impl, block_t, block_v, block_d, family)
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
