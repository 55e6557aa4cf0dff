"""The rollout's FP8 GEMMs as Triton kernels: every projection of a decoder layer with e4m3
weights, its input quantized inside the kernel and its output written once in the compute dtype
(issue 41; docs/rollout.md "FP8 weights").

The plain form (qwix's quantized Dense layers, compiled by XLA) runs each projection as an XLA
reduction for its input's per-token absmax, a convert that writes the e4m3 input, the FP8 GEMM
writing float32 and a fusion that scales it (and adds the bias); the SwiGLU MLP besides writes g
and u, multiplies them in a fusion of its own and reads the product twice more to quantize the
down projection's input. At 256 decode slots on Qwen2.5-1.5B the projections moved 2.6 GB of a
16.2 GB H100 decode step against 1.3 GB of weights (bench/roofline.py). Here three kernels:

* ``fp8_linear`` (q, k, v, o), grid (token block, output block): x in the compute dtype, read a
  [block_t, 128] tile at a time, each tile quantized in registers with one float32 scale per
  (token, 128 input channels): the row's absmax over the tile / 448; the tile's e4m3 x e4m3 dot
  (float32) times the tile's scales is accumulated; then the weights' output-channel scales and
  the bias; the output is written in the compute dtype.
* ``fp8_swiglu_gate_up``, grid (token block, 128-wide intermediate block): the same for x Wg and
  x Wu at once, g and u rounded to the compute dtype (as the plain GEMMs' outputs are), then
  act = silu(g) * u in float32, written in e4m3 with one float32 scale per (token, 128
  intermediate channels).
* ``fp8_down``: act Wd from those e4m3 values and scales, 128 channels at a time.

Activation scales per (token, 128 channels) are DeepSeek-V3's FP8 recipe (and the "block FP8" of
the checkpoints vLLM and SGLang serve): a per-token scale would need a whole row, which no
program of an output block holds, and the blocks are finer than per token (the test shows the
error no larger). Each 128-deep dot is added in float32 outside the tensor cores, so a long
reduction keeps float32 precision (DeepSeek's "promotion"). Where the input width is not a
multiple of 128 the block is the largest power of two dividing it, at least 32.

The kernels run only in the rollout (no gradient). ``resolve_impl`` reads the model's
``mlp_impl``: "auto" (the kernels on GPU, where the weights are e4m3), "pallas" (the kernels;
interpreted on CPU for tests), "reference" (the caller's plain qwix GEMMs; what "auto" is on CPU
and TPU). ``*_reference`` are the kernels' own arithmetic in jnp, their test references.
``fp8_gemm_kernel_cost`` declares the kernels' flops and bytes from their tiling (a Pallas call
is opaque to XLA's cost model and to an HLO walk), beside the kernels it describes.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels.swiglu_mlp import _divisor_tile, _nbytes, _silu32

logger = logging.getLogger("pallas_kernels")

IMPLS = ("auto", "pallas", "reference")
# The kernels' names in the compiled program (bench/roofline.py declares their traffic).
KERNEL_NAMES = ("fp8_linear", "fp8_swiglu_gate_up", "fp8_down")
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# Input channels per activation scale (and the K step of every kernel); smaller only where the
# width is not a multiple of it. The gate/up kernel's output blocks are this wide too.
ACT_BLOCK = 128
# The smallest K of a Triton FP8 dot (Hopper's FP8 MMA instruction shape).
_MIN_FP8_K = 32
# Tiles: 64-token blocks, 128-wide output blocks; gate/up: two float32 [64, 128] accumulators
# over 8 warps, linear and down: one over 4. Per stage at most x (64 x 128, compute dtype) + Wg,
# Wu (128 x 128 each, e4m3) = 48 KiB; compiled for an H100 (3 stages, bench/compile_check.py):
# 56 KiB (gate/up, linear) and 40 KiB (down) of the 227 KiB a block may use, 88 KiB at float32.
BLOCK_T, BLOCK_N = 64, 128
_WARPS_GATE_UP, _WARPS, _STAGES = 8, 4, 3
# SMs of an H100 / H200: how many programs of a grid run at once (one per SM at these tiles).
GPU_CORES = 132


def _fp8_tensor_core_dot(dot):
    """``dot`` (Triton's tt.dot builder) with e4m3 x e4m3 dots allowed Hopper's FP8 MMA."""
    from jaxlib.mlir import ir

    def fp8_dot(a, b, c, *, input_precision=None, max_num_imprecise_acc=None, **kw):
        a_type = ir.RankedTensorType(a.type)
        if max_num_imprecise_acc is None and isinstance(a_type.element_type,
                                                        ir.Float8E4M3FNType):
            max_num_imprecise_acc = a_type.shape[-1]     # this dot's K: <= ACT_BLOCK
        return dot(a, b, c, input_precision=input_precision,
                   max_num_imprecise_acc=max_num_imprecise_acc, **kw)
    fp8_dot.wrapped = dot
    return fp8_dot


def enable_fp8_tensor_cores() -> bool:
    """Let Pallas's Triton lowering run these kernels' e4m3 dots on Hopper's FP8 tensor cores.

    jax 0.10's lowering builds ``tt.dot`` without ``max_num_imprecise_acc``; Triton then runs
    an e4m3 x e4m3 dot as f16 MMAs (``mma.sync ... f16``, the operands widened in registers),
    because Hopper's FP8 ``wgmma`` accumulates in reduced precision and Triton uses it only
    where a dot allows that over some K. Each dot here is at most ACT_BLOCK = 128 deep and its
    float32 result is scaled and added outside the tensor cores (DeepSeek-V3's promotion every
    128), so the allowance is the dot's own K: the compiled kernels hold ``wgmma ... e4m3.e4m3``
    (bench/compile_check.py names each kernel's MMA instructions beside its shared memory).
    The lowering's ``tt_dialect`` is wrapped, e4m3 operands only (no other Pallas kernel has
    them), once per process; if jax's internals have moved it logs why and leaves them (f16
    MMAs: the same results, slower) and tests/kernels/test_fp8_gemm.py fails. Returns whether
    the wrapper is in place."""
    try:
        from jax._src.pallas.triton import lowering
        dialect = lowering.tt_dialect
        if getattr(dialect.dot, "wrapped", None) is not None:
            return True

        class _Dialect:
            dot = staticmethod(_fp8_tensor_core_dot(dialect.dot))

            def __getattr__(self, name):
                return getattr(dialect, name)
        lowering.tt_dialect = _Dialect()
        return True
    except (ImportError, AttributeError) as e:
        logger.warning("fp8_gemm: e4m3 dots run as f16 MMAs on Hopper (%s)", e)
        return False


def k_block(k: int) -> int | None:
    """Input channels per activation scale for an input k wide (None: no FP8 dot fits)."""
    return _divisor_tile(k, ACT_BLOCK, _MIN_FP8_K)


def pallas_unsupported_reason(x_shape, w_shape, weight_dtype, *, swiglu=False) -> str | None:
    """None when the kernels compile for these shapes on the target traced for, else why not.
    ``w_shape`` [K, N] (the gate's, ``swiglu=True``: N is then the intermediate size)."""
    if _backend.under_auto_partitioned_mesh():
        return "traced under a mesh outside shard_map (GSPMD replicates a Triton kernel)"
    if _backend.backend() == "tpu":
        return "no TPU kernel: the rollout's int8 weights run as qwix's GEMMs on TPU"
    if jnp.dtype(weight_dtype) != jnp.dtype(E4M3):
        return f"weights in {jnp.dtype(weight_dtype).name}, the kernels take e4m3"
    k, n = w_shape
    if len(x_shape) != 2 or x_shape[1] != k:
        return f"x must be [T, {k}], got {tuple(x_shape)}"
    if k_block(k) is None:
        return f"input width {k} is not a multiple of {_MIN_FP8_K}"
    if swiglu and n % ACT_BLOCK:
        return f"intermediate size {n} is not a multiple of {ACT_BLOCK}"
    if _divisor_tile(n, BLOCK_N) is None:
        return f"output width {n} is not a multiple of 16"
    return None


def resolve_impl(impl: str, x_shape=None, w_shape=None, weight_dtype=None, *,
                 swiglu=False) -> str:
    """"auto" -> "pallas" on GPU (unless pallas_unsupported_reason; logged once), "reference"
    (the caller's qwix GEMMs) on CPU and TPU."""
    if impl == "auto" and _backend.backend() == "tpu":
        return "reference"
    check = None
    if x_shape is not None:
        check = lambda: pallas_unsupported_reason(x_shape, w_shape, weight_dtype, swiglu=swiglu)
    return _backend.resolve_impl(impl, IMPLS, on_cpu="reference", kernel="fp8_gemm",
                                 check=check)


def _block_quantize(a):
    """a float32 [rows, block] -> (e4m3, float32 scales [rows, 1]): each row's absmax / 448
    (1 for a zero row)."""
    amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
    s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (a / s).astype(E4M3), s


def block_quantize(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, K / block]): the kernels' activation
    quantization in jnp."""
    t, k = x.shape
    q, s = jax.vmap(_block_quantize, in_axes=1, out_axes=1)(
        x.astype(jnp.float32).reshape(t, k // block, block))
    return q.reshape(t, k), s[..., 0]


# ------------------------------------------------------------------------------------------------
# the arithmetic in jnp (the kernels' references)
# ------------------------------------------------------------------------------------------------

def _f32(a):
    return a.astype(jnp.float32)


def _blocked_dot(xq, sx, w):
    """sum over K blocks of (xq_b w_b) * sx_b in float32: xq e4m3 [T, K], sx [T, K / b]."""
    t, k = xq.shape
    nb = sx.shape[1]
    parts = jnp.einsum("tbc,bcn->tbn", _f32(xq).reshape(t, nb, k // nb),
                       _f32(w).reshape(nb, k // nb, -1))
    return jnp.sum(parts * sx[..., None], axis=1)


def fp8_linear_reference(x, w, sw, bias=None):
    """fp8_linear's arithmetic: x [T, K] (compute dtype), w e4m3 [K, N], sw [1, N], bias [N]
    -> [T, N] in x's dtype."""
    xq, sx = block_quantize(x, k_block(x.shape[1]))
    y = _blocked_dot(xq, sx, w) * _f32(sw)
    return (y if bias is None else y + _f32(bias)).astype(x.dtype)


def fp8_swiglu_mlp_reference(x, wg, sg, wu, su, wd, sd):
    """The MLP kernels' arithmetic: x [T, D]; wg, wu e4m3 [D, I], wd e4m3 [I, D] with their
    output-channel scales -> (y [T, D] in x's dtype, the e4m3 act [T, I], its scales
    [T, I / 128])."""
    xq, sx = block_quantize(x, k_block(x.shape[1]))
    g = (_blocked_dot(xq, sx, wg) * _f32(sg)).astype(x.dtype)
    u = (_blocked_dot(xq, sx, wu) * _f32(su)).astype(x.dtype)
    aq, sa = block_quantize(_silu32(_f32(g)) * _f32(u), ACT_BLOCK)
    return (_blocked_dot(aq, sa, wd) * _f32(sd)).astype(x.dtype), aq, sa


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

def _quantized_tile(x_ref, k, bk):
    """Inside a kernel: the k-th [rows, bk] tile of x, quantized (e4m3, scales [rows, 1])."""
    return _block_quantize(x_ref[:, pl.ds(pl.multiple_of(k * bk, bk), bk)].astype(jnp.float32))


def _linear_kernel(x_ref, w_ref, sw_ref, *refs, bk: int, n_k: int):
    *b_ref, y_ref = refs

    def body(k, acc):
        xq, s = _quantized_tile(x_ref, k, bk)
        w = w_ref[pl.ds(pl.multiple_of(k * bk, bk), bk), :]
        return acc + jnp.dot(xq, w, preferred_element_type=jnp.float32) * s

    acc = lax.fori_loop(0, n_k, body, jnp.zeros(y_ref.shape, jnp.float32))
    y = acc * sw_ref[...].astype(jnp.float32)
    if b_ref:
        y = y + b_ref[0][...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)


def _gate_up_kernel(x_ref, wg_ref, wu_ref, sg_ref, su_ref, a_ref, as_ref, *, bk: int, n_k: int):
    def body(k, acc):
        ag, au = acc
        xq, s = _quantized_tile(x_ref, k, bk)
        k0 = pl.multiple_of(k * bk, bk)
        ag = ag + jnp.dot(xq, wg_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32) * s
        au = au + jnp.dot(xq, wu_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32) * s
        return ag, au

    zero = jnp.zeros(a_ref.shape, jnp.float32)
    g, u = lax.fori_loop(0, n_k, body, (zero, zero))
    dt = x_ref.dtype
    g = (g * sg_ref[...].astype(jnp.float32)).astype(dt).astype(jnp.float32)
    u = (u * su_ref[...].astype(jnp.float32)).astype(dt).astype(jnp.float32)
    aq, s = _block_quantize(_silu32(g) * u)
    a_ref[...] = aq
    as_ref[...] = s


def _down_kernel(a_ref, as_ref, wd_ref, sd_ref, y_ref, *, n_k: int):
    def body(k, acc):
        k0 = pl.multiple_of(k * ACT_BLOCK, ACT_BLOCK)
        part = jnp.dot(a_ref[:, pl.ds(k0, ACT_BLOCK)], wd_ref[pl.ds(k0, ACT_BLOCK), :],
                       preferred_element_type=jnp.float32)
        return acc + part * as_ref[:, pl.ds(k, 1)]

    acc = lax.fori_loop(0, n_k, body, jnp.zeros(y_ref.shape, jnp.float32))
    y_ref[...] = (acc * sd_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def _tiles(t: int, n: int) -> tuple[int, int, int]:
    """(block_t, block over the output width n, padded T)."""
    bt = _divisor_tile(t, BLOCK_T) or BLOCK_T
    return bt, _divisor_tile(n, BLOCK_N), -(-t // bt) * bt


def _call(kernel, name, grid, in_specs, out_specs, out_shape, warps, *args):
    enable_fp8_tensor_cores()          # lowered with the program, after this trace
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=_backend.interpret_mode(),
        compiler_params=_backend.triton_params(warps, _STAGES), name=name)(*args)


def _rows(x, bt):
    """x padded to whole token blocks, and its spec (token blocks are the fastest grid axis:
    the programs that read a weight column run in the same wave)."""
    t, k = x.shape
    t_pad = -(-t // bt) * bt
    x = x if t_pad == t else jnp.pad(x, ((0, t_pad - t), (0, 0)))
    return x, pl.BlockSpec((bt, k), lambda r, c: (r, 0))


def _check(x, w, swiglu=False):
    reason = pallas_unsupported_reason(x.shape, w.shape, w.dtype, swiglu=swiglu)
    if reason is not None:
        raise ValueError(f"pallas_kernels.fp8_gemm: {reason}")


def fp8_linear(x: jax.Array, w: jax.Array, sw: jax.Array, bias: jax.Array | None = None):
    """x [T, K] (compute dtype) @ e4m3 w [K, N] * sw [1, N] (+ bias [N]) -> [T, N] in x's
    dtype, in the fp8_linear kernel."""
    _check(x, w)
    t, k = x.shape
    n = w.shape[1]
    bt, bn, _ = _tiles(t, n)
    bk = k_block(k)
    xp, x_spec = _rows(x, bt)
    chan = pl.BlockSpec((1, bn), lambda r, c: (0, c))
    extra = () if bias is None else (bias.reshape(1, n),)
    y = _call(functools.partial(_linear_kernel, bk=bk, n_k=k // bk), "fp8_linear",
              (xp.shape[0] // bt, n // bn),
              [x_spec, pl.BlockSpec((k, bn), lambda r, c: (0, c)), chan] + [chan] * len(extra),
              pl.BlockSpec((bt, bn), lambda r, c: (r, c)),
              jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype), _WARPS, xp, w, sw, *extra)
    return y[:t]


def _gate_up(xp, wg, sg, wu, su, bt):
    """The gate/up kernel on whole token blocks xp [T_pad, D] -> (e4m3 act [T_pad, I], float32
    scales [T_pad, I / 128])."""
    t_pad, d = xp.shape
    i = wg.shape[1]
    bk = k_block(d)
    col = pl.BlockSpec((d, ACT_BLOCK), lambda r, c: (0, c))
    chan = pl.BlockSpec((1, ACT_BLOCK), lambda r, c: (0, c))
    return _call(
        functools.partial(_gate_up_kernel, bk=bk, n_k=d // bk), "fp8_swiglu_gate_up",
        (t_pad // bt, i // ACT_BLOCK), [pl.BlockSpec((bt, d), lambda r, c: (r, 0)), col, col,
                                        chan, chan],
        (pl.BlockSpec((bt, ACT_BLOCK), lambda r, c: (r, c)),
         pl.BlockSpec((bt, 1), lambda r, c: (r, c))),
        (jax.ShapeDtypeStruct((t_pad, i), E4M3),
         jax.ShapeDtypeStruct((t_pad, i // ACT_BLOCK), jnp.float32)),
        _WARPS_GATE_UP, xp, wg, wu, sg, su)


def fp8_swiglu_mlp(x: jax.Array, wg, sg, wu, su, wd, sd) -> jax.Array:
    """y = (silu(x Wg) * (x Wu)) Wd with e4m3 weights, in the gate/up and down kernels: x [T, D]
    in the compute dtype, wg/wu e4m3 [D, I], wd e4m3 [I, D], their output-channel scales sg/su
    [1, I], sd [1, D] -> [T, D] in x's dtype."""
    _check(x, wg, swiglu=True)
    t, d = x.shape
    i = wg.shape[1]
    bt, bn, _ = _tiles(t, d)
    xp, _ = _rows(x, bt)
    t_pad = xp.shape[0]
    aq, sa = _gate_up(xp, wg, sg, wu, su, bt)
    y = _call(functools.partial(_down_kernel, n_k=i // ACT_BLOCK), "fp8_down",
              (t_pad // bt, d // bn),
              [pl.BlockSpec((bt, i), lambda r, c: (r, 0)),
               pl.BlockSpec((bt, i // ACT_BLOCK), lambda r, c: (r, 0)),
               pl.BlockSpec((i, bn), lambda r, c: (0, c)),
               pl.BlockSpec((1, bn), lambda r, c: (0, c))],
              pl.BlockSpec((bt, bn), lambda r, c: (r, c)),
              jax.ShapeDtypeStruct((t_pad, d), x.dtype), _WARPS, aq, sa, wd, sd)
    return y[:t]


# ------------------------------------------------------------------------------------------------
# Declared cost of the Triton kernels (opaque to XLA's cost model and to an HLO walk)
# ------------------------------------------------------------------------------------------------

def fp8_gemm_kernel_cost(kernel: str, operands, outputs, *,
                         cores: int = GPU_CORES) -> tuple[float, float]:
    """(bytes, flops) of one launch of a kernel of this module, named as in the compiled program
    (KERNEL_NAMES), from its operand and output shapes [(dtype, dims), ...].

    fp8_linear: operands x [T, K], W [K, N], its scales [1, N] (, bias [1, N]); output [T, N].
    fp8_swiglu_gate_up: x [T, D], Wg, Wu [D, I], their scales; outputs act [T, I] and its scales
    [T, I / 128]. fp8_down: act, its scales, Wd [I, D], its scales; output y [T, D].
    Flops: the GEMMs, 2 T K N per weight matrix. Bytes: the outputs once; the weights, scales
    and bias once (token blocks are the fastest grid axis, so the programs that read a weight
    column run in the same wave); the token-row operands (x, or act and its scales) once per
    wave of ``cores`` programs (an upper bound: they are the smaller operands and may stay in
    L2 across waves)."""
    (_, (t, k)) = operands[0]
    if kernel == "fp8_linear":
        row_ops, mats = operands[:1], operands[1:2]
    elif kernel == "fp8_swiglu_gate_up":
        row_ops, mats = operands[:1], operands[1:3]
    elif kernel == "fp8_down":
        row_ops, mats = operands[:2], operands[2:3]
    else:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNEL_NAMES}")
    n = mats[0][1][1]
    bt, bn, t_pad = _tiles(t, n)
    blocks = n // (ACT_BLOCK if kernel == "fp8_swiglu_gate_up" else bn)
    waves = -(-(t_pad // bt) * blocks // cores)
    weights = sum(_nbytes(o) for o in operands[len(row_ops):])
    rows = sum(_nbytes(o) for o in row_ops)
    written = sum(_nbytes(o) for o in outputs)
    return float(written + weights + waves * rows), float(2 * len(mats) * t * k * n)
