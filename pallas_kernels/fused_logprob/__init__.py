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
  "naive"   - the reference (full logits, autodiff); see reference.py.
  "auto"    - "chunked" on CPU (interpreted Pallas is far slower than XLA there), "pallas" on
              GPU/TPU unless pallas_unsupported_reason() names a reason (a dtype, a VMEM budget,
              a mesh outside shard_map): then "chunked", logged once per reason.
fused_logprob_vocab_shard: the same with the vocabulary split over a mesh axis (inside
shard_map), used by brorl_jax.parallel.vocab_parallel.

Layout of this package (as jax.experimental.pallas.ops keeps a kernel's GPU and TPU forms apart):
this module holds the public functions, the argument checks, the impl / tile choice and the
custom VJP; reference.py the naive ground truth; common.py the tile math every path shares;
chunked.py the jnp path; triton.py and mosaic.py the two kernel families (see _backend).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend
from pallas_kernels._backend import backend, interpret_mode
from pallas_kernels.fused_logprob import chunked, mosaic, triton
from pallas_kernels.fused_logprob.common import _next_pow2, _Opts
from pallas_kernels.fused_logprob.mosaic import _MOSAIC_BLOCK_T, _mosaic_tiles, mosaic_vmem_bytes
from pallas_kernels.fused_logprob.reference import (
    fused_logprob_reference,
    fused_logprob_stats_reference,
)
from pallas_kernels.fused_logprob.triton import _TRITON_TILES, GPU_CORES, fused_logprob_kernel_cost

__all__ = ["IMPLS", "GPU_CORES", "default_block_sizes", "fused_logprob", "fused_logprob_kernel_cost",
           "fused_logprob_reference", "fused_logprob_stats", "fused_logprob_stats_reference",
           "fused_logprob_vocab_shard", "mosaic_vmem_bytes", "pallas_unsupported_reason",
           "resolve_impl"]

IMPLS = ("auto", "pallas", "chunked", "naive")


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
# custom VJP core and public API
# ----------------------------------------------------------------------------------------------

def _forward(hidden, lm_head, targets, opts):
    """-> (lse, target logit, entropy, sum_p2), each [T] float32, by the path opts names."""
    if opts.impl == "chunked":
        return chunked.forward(hidden, lm_head, targets, opts)
    family = triton if opts.family == "triton" else mosaic
    return family.forward(hidden, lm_head, targets, opts)


def _backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts):
    """-> (d hidden, d lm_head) for the cotangents of logp and entropy."""
    if opts.impl == "chunked":
        fn = chunked.backward
    else:
        fn = (triton if opts.family == "triton" else mosaic).backward
    return fn(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts)


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
    dh, dw = _backward(hidden, lm_head, targets, lse, ent, g_logp, g_ent, opts)
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
    # dL/dz_v on this shard's columns with the global softmax (global lse and entropy); the
    # hidden gradient is this shard's part (shard_map sums it over `axis`, see the caller).
    dh, dw = _backward(hidden, lm_head, targets_local, lse, ent, g_logp, g_ent, opts)
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
        result["sum_p2_unsampled"] = lax.stop_gradient(chunked.unsampled_second_moment(
            lax.stop_gradient(hidden), lax.stop_gradient(lm_head), lse, ns, chunk_opts))
    return result
