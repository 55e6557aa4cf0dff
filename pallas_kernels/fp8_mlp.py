"""The rollout's FP8 SwiGLU MLP in two Triton kernels, the down projection's input handed over
in e4m3 (issue 41; docs/rollout.md "FP8 weights").

With FP8 weights the plain form (qwix's quantized Dense layers) runs the MLP as three XLA
programs around two FP8 GEMMs: the gate/up GEMM writes g and u in the compute dtype, a fusion
multiplies silu(g) * u, a reduction reads the product for each token's absmax and a convert
reads it a third time to write the e4m3 input of the down projection: at 256 decode slots on
Qwen2.5-1.5B about 0.84 GB of a 16.2 GB H100 decode step (bench/roofline.py). Here:

* ``fp8_swiglu_gate_up``, grid (token block, 128-wide intermediate block): accumulates the e4m3
  x Wg and x Wu over the hidden dimension in float32, applies the scales (x per token, W per
  output channel), rounds g and u to the compute dtype (as the plain GEMMs' outputs are), takes
  act = silu(g) * u in float32 and writes it in e4m3 with one float32 scale per (token, 128
  intermediate channels): the block's absmax / 448. A per-token scale would need the whole row
  of act, which no program holds; 1 x 128 blocks are the activation scaling of DeepSeek-V3's
  FP8 recipe (and of the "block FP8" checkpoints vLLM and SGLang serve), finer than per token.
* ``fp8_down``: accumulates act Wd over the intermediate dimension 128 channels at a time, each
  block's float32 partial product times its activation scales, then the weights' output-channel
  scales; writes the compute dtype.

The kernels run only in the rollout (no gradient). The embedding, norms and LM head are untouched.
``resolve_impl`` reads the model's ``mlp_impl``: "auto" (the kernels on GPU, where the weights
are e4m3), "pallas" (the kernels; interpreted on CPU for tests), "reference" (the caller's plain
qwix GEMMs; "auto" on CPU and TPU too). ``fp8_swiglu_mlp_reference`` is the kernels' own
arithmetic in jnp, their test reference.

``fp8_mlp_kernel_cost`` declares the kernels' flops and bytes from their tiling (a Pallas call is
opaque to XLA's cost model and to an HLO walk), beside the kernels it describes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels.swiglu_mlp import _divisor_tile, _nbytes, _silu32, accumulate_gate_up

IMPLS = ("auto", "pallas", "reference")
# The kernels' names in the compiled program (bench/roofline.py declares their traffic).
KERNEL_NAMES = ("fp8_swiglu_gate_up", "fp8_down")
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# Intermediate channels per activation scale: one block of the gate/up kernel's output, one
# inner step of the down kernel.
ACT_BLOCK = 128
# Tiles: 64-token blocks; gate/up: two float32 [64, 128] accumulators over 8 warps, shared memory
# per stage x (64 x 128) + Wg, Wu (128 x 128 each) in e4m3 = 40 KiB, 3 stages 120 KiB of the
# 227 KiB an H100 block may use; down: one accumulator, 4 warps, 24 KiB a stage.
BLOCK_T, BLOCK_N, BLOCK_K = 64, 128, 128
_WARPS_GATE_UP, _WARPS_DOWN, _STAGES = 8, 4, 3
# SMs of an H100 / H200: how many programs of a grid run at once (one per SM at these tiles).
GPU_CORES = 132
# The smallest K of a Triton FP8 dot (Hopper's FP8 MMA instruction shape).
_MIN_FP8_K = 32


def pallas_unsupported_reason(x_shape, wg_shape, weight_dtype) -> str | None:
    """None when the kernels compile for these shapes on the target traced for, else why not."""
    if _backend.under_auto_partitioned_mesh():
        return "traced under a mesh outside shard_map (GSPMD replicates a Triton kernel)"
    if _backend.backend() == "tpu":
        return "no TPU kernel: the rollout's int8 weights run as qwix's GEMMs on TPU"
    if jnp.dtype(weight_dtype) != jnp.dtype(E4M3):
        return f"weights in {jnp.dtype(weight_dtype).name}, the kernels take e4m3"
    d, i = wg_shape
    if len(x_shape) != 2 or x_shape[1] != d:
        return f"x must be [T, {d}], got {tuple(x_shape)}"
    if _divisor_tile(d, BLOCK_K, _MIN_FP8_K) is None:
        return f"hidden size {d} is not a multiple of {_MIN_FP8_K}"
    if i % ACT_BLOCK:
        return f"intermediate size {i} is not a multiple of {ACT_BLOCK}"
    return None


def resolve_impl(impl: str, x_shape=None, wg_shape=None, weight_dtype=None) -> str:
    """"auto" -> "pallas" on GPU (unless pallas_unsupported_reason; logged once), "reference"
    (the caller's qwix GEMMs) on CPU and TPU."""
    if impl == "auto" and _backend.backend() == "tpu":
        return "reference"
    check = None
    if x_shape is not None:
        check = lambda: pallas_unsupported_reason(x_shape, wg_shape, weight_dtype)
    return _backend.resolve_impl(impl, IMPLS, on_cpu="reference", kernel="fp8_swiglu_mlp",
                                 check=check)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (e4m3 [T, D], float32 scales [T, 1]): each row's absmax / 448 (1 for a zero
    row), the activation quantization of the plain FP8 GEMMs."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (xf / s).astype(E4M3), s


def _block_quantize(a):
    """a float32 [rows, ACT_BLOCK] -> (e4m3, scales [rows, 1]): the rows' absmax / 448."""
    amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
    s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (a / s).astype(E4M3), s


# ------------------------------------------------------------------------------------------------
# the arithmetic, in jnp (the reference) and in the kernels
# ------------------------------------------------------------------------------------------------

def fp8_swiglu_mlp_reference(xq, sx, wg, sg, wu, su, wd, sd, *, out_dtype):
    """The kernels' arithmetic in plain jnp: xq e4m3 [T, D] with row scales sx [T, 1]; wg, wu
    e4m3 [D, I], wd e4m3 [I, D] with output-channel scales sg, su [1, I], sd [1, D] -> y [T, D]
    in ``out_dtype`` (and the e4m3 activations with their [T, I / 128] scales, for tests)."""
    f = lambda a: a.astype(jnp.float32)
    g = (jnp.dot(f(xq), f(wg)) * sx * f(sg)).astype(out_dtype)
    u = (jnp.dot(f(xq), f(wu)) * sx * f(su)).astype(out_dtype)
    act = _silu32(f(g)) * f(u)
    t, i = act.shape
    aq, s = jax.vmap(_block_quantize, in_axes=1, out_axes=1)(act.reshape(t, i // ACT_BLOCK,
                                                                         ACT_BLOCK))
    s = s[..., 0]                                                     # [T, I / 128]
    parts = jnp.einsum("tkc,kcd->tkd", f(aq), f(wd).reshape(i // ACT_BLOCK, ACT_BLOCK, -1))
    y = jnp.sum(parts * s[..., None], axis=1) * f(sd)
    return y.astype(out_dtype), aq.reshape(t, i), s


def _gate_up_kernel(x_ref, sx_ref, wg_ref, wu_ref, sg_ref, su_ref, a_ref, as_ref, *, bk: int,
                    n_k: int, out_dtype):
    g, u = accumulate_gate_up(x_ref, wg_ref, wu_ref, bk, n_k)
    sx = sx_ref[...]
    g = (g * sx * sg_ref[...].astype(jnp.float32)).astype(out_dtype).astype(jnp.float32)
    u = (u * sx * su_ref[...].astype(jnp.float32)).astype(out_dtype).astype(jnp.float32)
    aq, s = _block_quantize(_silu32(g) * u)
    a_ref[...] = aq
    as_ref[...] = s


def _down_kernel(a_ref, as_ref, wd_ref, sd_ref, y_ref, *, n_k: int):
    bt, bn = a_ref.shape[0], wd_ref.shape[1]

    def body(k, acc):
        k0 = pl.multiple_of(k * ACT_BLOCK, ACT_BLOCK)
        part = jnp.dot(a_ref[:, pl.ds(k0, ACT_BLOCK)], wd_ref[pl.ds(k0, ACT_BLOCK), :],
                       preferred_element_type=jnp.float32)
        return acc + part * as_ref[:, pl.ds(k, 1)]

    acc = lax.fori_loop(0, n_k, body, jnp.zeros((bt, bn), jnp.float32))
    y_ref[...] = (acc * sd_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def _tiles(t: int, d: int) -> tuple[int, int, int]:
    """(block_t, block over D (gate/up's K, down's N), padded T)."""
    bt = _divisor_tile(t, BLOCK_T) or BLOCK_T
    return bt, _divisor_tile(d, BLOCK_K, _MIN_FP8_K), -(-t // bt) * bt


def _gate_up(xq, sx, wg, sg, wu, su, *, out_dtype):
    """-> (e4m3 act [T_pad, I], float32 scales [T_pad, I / 128])."""
    t_pad, d = xq.shape
    i = wg.shape[1]
    bt, bk, _ = _tiles(t_pad, d)
    col = pl.BlockSpec((d, ACT_BLOCK), lambda r, c: (0, c))
    chan = pl.BlockSpec((1, ACT_BLOCK), lambda r, c: (0, c))
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, bk=bk, n_k=d // bk, out_dtype=out_dtype),
        out_shape=(jax.ShapeDtypeStruct((t_pad, i), E4M3),
                   jax.ShapeDtypeStruct((t_pad, i // ACT_BLOCK), jnp.float32)),
        # token blocks fastest: the programs that read a weight column run in the same wave
        grid=(t_pad // bt, i // ACT_BLOCK),
        in_specs=[pl.BlockSpec((bt, d), lambda r, c: (r, 0)),
                  pl.BlockSpec((bt, 1), lambda r, c: (r, 0)), col, col, chan, chan],
        out_specs=(pl.BlockSpec((bt, ACT_BLOCK), lambda r, c: (r, c)),
                   pl.BlockSpec((bt, 1), lambda r, c: (r, c))),
        interpret=_backend.interpret_mode(),
        compiler_params=_backend.triton_params(_WARPS_GATE_UP, _STAGES),
        name="fp8_swiglu_gate_up",
    )(xq, sx, wg, wu, sg, su)


def _down(aq, sa, wd, sd, *, out_dtype):
    """-> y [T_pad, D] in out_dtype."""
    t_pad, i = aq.shape
    d = wd.shape[1]
    bt, bn, _ = _tiles(t_pad, d)
    return pl.pallas_call(
        functools.partial(_down_kernel, n_k=i // ACT_BLOCK),
        out_shape=jax.ShapeDtypeStruct((t_pad, d), out_dtype),
        grid=(t_pad // bt, d // bn),
        in_specs=[pl.BlockSpec((bt, i), lambda r, c: (r, 0)),
                  pl.BlockSpec((bt, i // ACT_BLOCK), lambda r, c: (r, 0)),
                  pl.BlockSpec((i, bn), lambda r, c: (0, c)),
                  pl.BlockSpec((1, bn), lambda r, c: (0, c))],
        out_specs=pl.BlockSpec((bt, bn), lambda r, c: (r, c)),
        interpret=_backend.interpret_mode(),
        compiler_params=_backend.triton_params(_WARPS_DOWN, _STAGES),
        name="fp8_down",
    )(aq, sa, wd, sd)


def fp8_swiglu_mlp(x: jax.Array, wg, sg, wu, su, wd, sd) -> jax.Array:
    """y = (silu(x Wg) * (x Wu)) Wd with e4m3 weights, in the two kernels: x [T, D] in the
    compute dtype (quantized here per token), wg/wu e4m3 [D, I], wd e4m3 [I, D], their
    output-channel scales sg/su [1, I], sd [1, D] (any float dtype) -> [T, D] in x's dtype."""
    reason = pallas_unsupported_reason(x.shape, wg.shape, wg.dtype)
    if reason is not None:
        raise ValueError(f"fp8_swiglu_mlp: {reason}")
    xq, sx = quantize_rows(x)
    t, d = x.shape
    _, _, t_pad = _tiles(t, d)
    if t_pad != t:
        xq = jnp.pad(xq, ((0, t_pad - t), (0, 0)))
        sx = jnp.pad(sx, ((0, t_pad - t), (0, 0)), constant_values=1.0)
    aq, sa = _gate_up(xq, sx, wg, sg, wu, su, out_dtype=x.dtype)
    return _down(aq, sa, wd, sd, out_dtype=x.dtype)[:t]


# ------------------------------------------------------------------------------------------------
# Declared cost of the Triton kernels (opaque to XLA's cost model and to an HLO walk)
# ------------------------------------------------------------------------------------------------

def fp8_mlp_kernel_cost(kernel: str, operands, outputs, *,
                        cores: int = GPU_CORES) -> tuple[float, float]:
    """(bytes, flops) of one launch of a kernel of this module, named as in the compiled program
    (KERNEL_NAMES), from its operand and output shapes [(dtype, dims), ...].

    fp8_swiglu_gate_up: operands x [T, D], its scales [T, 1], Wg, Wu [D, I], their scales;
    outputs act [T, I] and its scales [T, I / 128]. fp8_down: operands act, its scales, Wd
    [I, D], its scales; output y [T, D]. Flops: the GEMMs, 2 T D I per weight matrix. Bytes: the
    outputs once; the weights and their scales once (token blocks are the fastest grid axis, so
    the programs that read a weight column run in the same wave); the token-row operands once
    per wave of ``cores`` programs (an upper bound: they are the smaller operands and may stay
    in L2 across waves)."""
    (_, (t, k)) = operands[0]
    if kernel == "fp8_swiglu_gate_up":
        n = operands[2][1][1]
        weights, n_mats, blocks = sum(_nbytes(o) for o in operands[2:6]), 2, n // ACT_BLOCK
    elif kernel == "fp8_down":
        n = operands[2][1][1]
        weights, n_mats = _nbytes(operands[2]) + _nbytes(operands[3]), 1
        blocks = n // _tiles(t, n)[1]
    else:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNEL_NAMES}")
    bt, _, t_pad = _tiles(t, k if kernel == "fp8_swiglu_gate_up" else n)
    waves = -(-(t_pad // bt) * blocks // cores)
    rows = _nbytes(operands[0]) + _nbytes(operands[1])
    written = sum(_nbytes(o) for o in outputs)
    return float(written + weights + waves * rows), float(2 * n_mats * t * k * n)
