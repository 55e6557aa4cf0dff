"""SwiGLU MLP with its elementwise work inside the GEMMs: y = (silu(x Wg) * (x Wu)) Wd.

XLA runs the product silu(g) * u as a kernel of its own (gate and up read, the product written,
then read back by the down projection), and its backward likewise (d act, g and u read, d gate
and d up written): about 28 ms of memory-bound kernels per update step at 8 x 2048 tokens on
Qwen2.5-1.5B on an H100 (docs/algo.md). XLA fuses no such producer into a GEMM, so two Triton
kernels do it (GPU; "triton" family):

* ``swiglu_gate_up``: one program per (token block, intermediate block) accumulates x Wg and
  x Wu over the hidden dimension and writes act = silu(g) * u; for the backward it also writes
  g and u (rounded to the compute dtype like an XLA GEMM's output, and act is computed from the
  rounded values, so forward and backward see the same g and u).
* ``swiglu_bwd``: one program per (token block, intermediate block) accumulates d act = dy Wd^T
  over the hidden dimension (float32, never written) and writes d gate and d up from it and the
  saved g and u, and act again (from g and u: the forward keeps g and u only, the activations
  XLA's own MLP keeps too).

The down projection and the backward's weight and input gradients are plain XLA GEMMs
(act Wd, act^T dy, x^T dg, x^T du, dg Wg^T + du Wu^T). Under ``jax.checkpoint`` the saved g and
u carry the names in SAVED_NAMES so a remat policy can keep them (models.transformer's "dots"
does: the backward then reruns no GEMM).

``impl``: "auto" (the kernels on GPU; the plain XLA expression on CPU and TPU, where XLA's own
fusions are what runs), "pallas" (the kernels; interpreted on CPU for tests), "reference".

``swiglu_mlp_kernel_cost`` declares the kernels' flops and bytes from their tiling (a Pallas call
is opaque to XLA's cost model and to an HLO walk), beside the kernels it describes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels import _backend

IMPLS = ("auto", "pallas", "reference")
# The kernels' names in the lowered/optimized program (the roofline matches them).
KERNEL_NAMES = ("swiglu_gate_up", "swiglu_bwd")
# checkpoint_name of what the forward saves for the backward (a remat policy keeps them by name).
SAVED_NAMES = ("swiglu_gate", "swiglu_up")
# Tiles: [block_t, block_i] outputs (two float32 accumulators in the forward: 2 x 64 KiB over 8
# warps), block_k of the hidden dimension per inner step. Shared memory per pipeline stage:
# x (128 x 64) + Wg, Wu (64 x 128 each) in bf16 = 48 KiB, 3 stages = 144 KiB of the 227 KiB an
# H100/H200 block may use.
BLOCK_T, BLOCK_I, BLOCK_K = 128, 128, 64
# The backward kernel has one accumulator: 256-token blocks (dy 256 x 64 + Wd 128 x 64 per stage,
# 3 stages = 144 KiB), half the programs, so half the waves that re-read dy.
BLOCK_T_BWD = 256
_WARPS, _STAGES = 8, 3
# SMs of an H100 / H200: how many programs of a grid run at once (one per SM at these tiles).
GPU_CORES = 132


def swiglu_mlp_reference(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    """Plain XLA: x [T, D], wg/wu [D, I], wd [I, D] -> y [T, D] in x's dtype (each GEMM's
    output in the compute dtype, as flax's Dense layers compute it)."""
    return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)


def _divisor_tile(n: int, cap: int, low: int = 16) -> int | None:
    """The largest power-of-two tile in [low, cap] dividing n (None: none does)."""
    blk = cap
    while blk >= low:
        if n % blk == 0:
            return blk
        blk //= 2
    return None


def pallas_unsupported_reason(x_shape, wg_shape, dtype) -> str | None:
    """None when the kernels compile for these shapes on the target traced for, else why not."""
    if _backend.under_auto_partitioned_mesh():
        return ("traced under a mesh outside shard_map (GSPMD replicates a Triton kernel); the "
                "plain XLA MLP is partitioned instead")
    if _backend.backend() == "tpu":
        return "no TPU kernel: XLA's own fusions run the MLP on TPU"
    d, i = wg_shape
    if len(x_shape) != 2 or x_shape[1] != d:
        return f"x must be [T, {d}], got {tuple(x_shape)}"
    if _divisor_tile(d, BLOCK_K) is None:
        return f"hidden size {d} is not a multiple of 16"
    if _divisor_tile(i, BLOCK_I) is None:
        return f"intermediate size {i} is not a multiple of 16"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype)} is not a float type the kernels take"
    return None


def resolve_impl(impl: str, x_shape=None, wg_shape=None, dtype=None) -> str:
    """"auto" -> "pallas" on GPU (unless pallas_unsupported_reason; logged once), "reference"
    on CPU and TPU (by design there: XLA's own fusions run the MLP, nothing is logged)."""
    if impl == "auto" and _backend.backend() == "tpu":
        return "reference"
    check = None
    if x_shape is not None:
        check = lambda: pallas_unsupported_reason(x_shape, wg_shape, dtype)
    return _backend.resolve_impl(impl, IMPLS, on_cpu="reference", kernel="swiglu_mlp",
                                 check=check)


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

def _silu32(g):
    return g / (1.0 + jnp.exp(-g))


def _gate_up_kernel(x_ref, wg_ref, wu_ref, *out_refs, bk: int, n_k: int, save: bool):
    bt, bi = x_ref.shape[0], wg_ref.shape[1]

    def body(k, acc):
        ag, au = acc
        k0 = pl.multiple_of(k * bk, bk)
        x = x_ref[:, pl.ds(k0, bk)]
        ag = ag + jnp.dot(x, wg_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32)
        au = au + jnp.dot(x, wu_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32)
        return ag, au

    zero = jnp.zeros((bt, bi), jnp.float32)
    g, u = lax.fori_loop(0, n_k, body, (zero, zero))
    a_ref = out_refs[0]
    g = g.astype(a_ref.dtype)
    u = u.astype(a_ref.dtype)
    if save:
        out_refs[1][...] = g
        out_refs[2][...] = u
    g32 = g.astype(jnp.float32)
    a_ref[...] = (_silu32(g32) * u.astype(jnp.float32)).astype(a_ref.dtype)


def _bwd_kernel(dy_ref, wd_ref, g_ref, u_ref, dg_ref, du_ref, a_ref, *, bk: int, n_k: int):
    bt, bi = dy_ref.shape[0], wd_ref.shape[0]

    def body(k, acc):
        k0 = pl.multiple_of(k * bk, bk)
        w = wd_ref[:, pl.ds(k0, bk)]
        return acc + jnp.dot(dy_ref[:, pl.ds(k0, bk)], w.T, preferred_element_type=jnp.float32)

    da = lax.fori_loop(0, n_k, body, jnp.zeros((bt, bi), jnp.float32))
    g = g_ref[...].astype(jnp.float32)
    u = u_ref[...].astype(jnp.float32)
    s = 1.0 / (1.0 + jnp.exp(-g))
    du_ref[...] = (da * g * s).astype(du_ref.dtype)
    dg_ref[...] = (da * u * s * (1.0 + g * (1.0 - s))).astype(dg_ref.dtype)
    a_ref[...] = (g * s * u).astype(a_ref.dtype)


def _tiles(t: int, d: int, i: int, block_t: int = BLOCK_T) -> tuple[int, int, int, int]:
    """(block_t, block_i, block_k, padded T): tiles dividing D and I; T padded to block_t."""
    bk, bi = _divisor_tile(d, BLOCK_K), _divisor_tile(i, BLOCK_I)
    bt = _divisor_tile(t, block_t) or block_t
    return bt, bi, bk, -(-t // bt) * bt


def _pad_rows(x, t_pad):
    return x if x.shape[0] == t_pad else jnp.pad(x, ((0, t_pad - x.shape[0]), (0, 0)))


def _gate_up(x, wg, wu, *, save: bool):
    """-> act [T, I] (and g, u with save=True), in x's dtype."""
    t, d = x.shape
    i = wg.shape[1]
    bt, bi, bk, t_pad = _tiles(t, d, i)
    out = jax.ShapeDtypeStruct((t_pad, i), x.dtype)
    blk = pl.BlockSpec((bt, bi), lambda r, c: (r, c))
    outs = pl.pallas_call(
        functools.partial(_gate_up_kernel, bk=bk, n_k=d // bk, save=save),
        out_shape=(out,) * (3 if save else 1),
        # token blocks fastest: a wave of programs shares few weight columns (read once) and
        # re-reads x, which is the smaller operand and stays in L2
        grid=(t_pad // bt, i // bi),
        in_specs=[pl.BlockSpec((bt, d), lambda r, c: (r, 0)),
                  pl.BlockSpec((d, bi), lambda r, c: (0, c)),
                  pl.BlockSpec((d, bi), lambda r, c: (0, c))],
        out_specs=(blk,) * (3 if save else 1),
        interpret=_backend.interpret_mode(),
        compiler_params=_backend.triton_params(_WARPS, _STAGES),
        name="swiglu_gate_up",
    )(_pad_rows(x, t_pad), wg.astype(x.dtype), wu.astype(x.dtype))
    return tuple(o[:t] for o in outs) if t_pad != t else tuple(outs)


def _swiglu_bwd(dy, wd, g, u):
    """-> (d gate, d up, act) [T, I] in g's dtype."""
    t, d = dy.shape
    i = wd.shape[0]
    bt, bi, bk, t_pad = _tiles(t, d, i, BLOCK_T_BWD)
    blk = pl.BlockSpec((bt, bi), lambda r, c: (r, c))
    out = jax.ShapeDtypeStruct((t_pad, i), g.dtype)
    outs = pl.pallas_call(
        functools.partial(_bwd_kernel, bk=bk, n_k=d // bk),
        out_shape=(out, out, out),
        grid=(t_pad // bt, i // bi),
        in_specs=[pl.BlockSpec((bt, d), lambda r, c: (r, 0)),
                  pl.BlockSpec((bi, d), lambda r, c: (c, 0)), blk, blk],
        out_specs=(blk, blk, blk),
        interpret=_backend.interpret_mode(),
        compiler_params=_backend.triton_params(_WARPS, _STAGES),
        name="swiglu_bwd",
    )(_pad_rows(dy.astype(g.dtype), t_pad), wd.astype(g.dtype), _pad_rows(g, t_pad),
      _pad_rows(u, t_pad))
    return tuple(o[:t] for o in outs) if t_pad != t else tuple(outs)


@jax.custom_vjp
def _mlp_pallas(x, wg, wu, wd):
    (act,) = _gate_up(x, wg, wu, save=False)
    return jnp.dot(act, wd.astype(x.dtype))


def _mlp_fwd(x, wg, wu, wd):
    act, g, u = _gate_up(x, wg, wu, save=True)
    g = checkpoint_name(g, SAVED_NAMES[0])
    u = checkpoint_name(u, SAVED_NAMES[1])
    return jnp.dot(act, wd.astype(x.dtype)), (x, wg, wu, wd, g, u)


def _mlp_bwd(res, dy):
    x, wg, wu, wd, g, u = res
    dg, du, act = _swiglu_bwd(dy, wd, g, u)
    cd = x.dtype
    dx = jnp.dot(dg, wg.astype(cd).T) + jnp.dot(du, wu.astype(cd).T)
    return (dx.astype(x.dtype), jnp.dot(x.T, dg).astype(wg.dtype),
            jnp.dot(x.T, du).astype(wu.dtype), jnp.dot(act.T, dy.astype(cd)).astype(wd.dtype))


_mlp_pallas.defvjp(_mlp_fwd, _mlp_bwd)


def swiglu_mlp(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, *,
               impl: str = "auto") -> jax.Array:
    """y = (silu(x Wg) * (x Wu)) Wd: x [T, D] in the compute dtype, wg/wu [D, I], wd [I, D]
    (cast to x's dtype) -> [T, D] in x's dtype, differentiable in all four."""
    impl = resolve_impl(impl, x.shape, wg.shape, x.dtype)
    if impl == "reference":
        cd = x.dtype
        return swiglu_mlp_reference(x, wg.astype(cd), wu.astype(cd), wd.astype(cd))
    return _mlp_pallas(x, wg, wu, wd)


# ------------------------------------------------------------------------------------------------
# Declared cost of the Triton kernels (opaque to XLA's cost model and to an HLO walk)
# ------------------------------------------------------------------------------------------------

# HLO and numpy dtype names (the walkers give either)
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "bfloat16": 2, "float16": 2, "float32": 4,
             "f8e4m3fn": 1, "float8_e4m3fn": 1}


def _nbytes(shape) -> int:
    dtype, dims = shape
    return _ITEMSIZE[dtype] * math.prod(dims)


def swiglu_mlp_kernel_cost(kernel: str, operands, outputs, *,
                           cores: int = GPU_CORES) -> tuple[float, float]:
    """(bytes, flops) of one launch of a kernel of this module, named as in the compiled program
    (KERNEL_NAMES), from its operand and output shapes [(dtype, dims), ...].

    swiglu_gate_up: operands x [T, D], Wg, Wu [D, I]; outputs act (and g, u) [T, I].
    swiglu_bwd: operands dy [T, D], Wd [I, D], g, u [T, I]; outputs d gate, d up, act [T, I].
    Flops: the GEMMs, 2 T D I per weight matrix. Bytes: the outputs and g, u once; the weights
    once (token blocks are the fastest grid axis, so the programs that read a weight column run
    in the same wave); the [T, D] operand once per wave of `cores` programs (an upper bound: it
    is the smaller operand and may stay in L2 across waves)."""
    (_, (t, d)) = operands[0]
    if kernel == "swiglu_gate_up":
        i = operands[1][1][1]
        weights, n_mats, elementwise = _nbytes(operands[1]) + _nbytes(operands[2]), 2, 0
    elif kernel == "swiglu_bwd":
        i = operands[1][1][0]
        weights, n_mats = _nbytes(operands[1]), 1
        elementwise = _nbytes(operands[2]) + _nbytes(operands[3])
    else:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNEL_NAMES}")
    bt, bi, _, t_pad = _tiles(t, d, i, BLOCK_T if kernel == "swiglu_gate_up" else BLOCK_T_BWD)
    programs = (t_pad // bt) * (i // bi)
    waves = -(-programs // cores)
    written = sum(_nbytes(o) for o in outputs)
    nbytes = written + elementwise + weights + waves * _nbytes(operands[0])
    return float(nbytes), float(2 * n_mats * t * d * i)
