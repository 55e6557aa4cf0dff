"""Grouped GEMM for mixture-of-experts layers: each contiguous group of rows times its own matrix.

``grouped_gemm(x [M, K], w [G, K, N], group_sizes int32[G], impl="auto") -> [M, N]`` (x's dtype):
rows [s_g, s_g + group_sizes[g]) of x are multiplied by w[g] (s_g the sizes' running sum); rows
past sum(group_sizes) give 0. The semantics of ``jax.lax.ragged_dot``, the reference, and
differentiable in x and w like it (group_sizes is an integer input, not differentiated).

Why a kernel. XLA's GPU lowering of ``jax.lax.ragged_dot`` (jax 0.10.2) is not a grouped GEMM:
it lays the M rows out against all G groups in a zero-padded [M, G, K] operand and contracts
over G x K, G times the flops needed and the operand written to memory. Compiled for an H100 at
Qwen3-30B-A3B's shapes (128 experts, K = 2048): the decode step's expert GEMMs read 181 GB and
run 120.9 TFLOP instead of 0.93; one GEMM of the update's 16k-token micro-batch needs 64 GiB of
temporaries (docs/results.md, "Mixture of experts: the decode step"). The kernels here read
each group's rows and its matrix, nothing else.

Implementations (``impl``):

* ``"hopper"``: jax's Mosaic GPU grouped GEMM for sm_90 (wgmma, TMA; vendored in
  ``_hopper_ragged_dot.py`` / ``_hopper_transposed.py``, see their headers), under a custom VJP:
  dx = the same kernel against a transposed copy of w, dw[g] = x_g^T dy_g by the transposed
  ragged dot. Tiles: 64 rows (the wgmma M), 128 (or 64) columns,
  64 of K (rows padded to a multiple of 64 when they are not one); K and N must be multiples of 64 and x, w bf16 or f16.
* ``"megablox"``: TPU: ``jax.experimental.pallas.ops.tpu.megablox.gmm`` (its own custom VJP with
  tgmm), tiles (128, 128, 128) capped at the shapes, rows padded to whole tiles.
* ``"reference"``: ``jax.lax.ragged_dot`` (autodiff).
* ``"auto"``: "hopper" on a GPU of compute capability 9.x (the compile target "cuda" counts as
  the H100/H200 it stands for), "megablox" on TPU, "reference" on CPU and other GPUs, and
  "reference" (logged once) where the shapes or dtypes do not fit the Hopper tiling.

On CPU an explicit "hopper" or "megablox" runs the kernel in Mosaic's interpreter (the tests
compare it with the reference there). Mosaic kernels cannot be auto-partitioned: under a mesh
they must run inside ``shard_map`` (brorl_jax.parallel.expert_parallel does that for the MoE
block).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _backend

IMPLS = ("auto", "hopper", "megablox", "reference")
# The Hopper kernels' names in the compiled program (a named scope around each call; the roofline
# declares their cost with grouped_gemm_kernel_cost): the row GEMM (forward and dx), the dw GEMM.
KERNEL_NAMES = ("grouped_gemm_wgrad", "grouped_gemm_rows")
# What the lowered programs call (custom-call targets) for each compiled form.
CUSTOM_CALLS = {"hopper": "mosaic_gpu", "megablox": "tpu_custom_call"}
# Hopper tiles: rows (wgmma's M), K step, pipeline depth; columns are 128 where N allows, else 64.
HOPPER_BLOCK_M, HOPPER_BLOCK_K, HOPPER_STAGES = 64, 64, 4
HOPPER_SMS = 132       # streaming multiprocessors of an H100 / H200 SXM: one persistent block each
MEGABLOX_TILE = 128


def grouped_gemm_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot``: the plain form every kernel is checked against."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def _block_n(n: int) -> int:
    return 128 if n % 128 == 0 else 64


def hopper_unfit(x_shape, w_shape, dtype) -> str | None:
    """Why the Hopper kernels cannot take these shapes (None: they can)."""
    k, n = w_shape[1], w_shape[2]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (the wgmma kernel takes bf16 or f16)"
    if k % HOPPER_BLOCK_K or n % 64:
        return f"K = {k} and N = {n} must be multiples of 64"
    return None


def _gpu_is_hopper() -> bool:
    if _backend._target_state is not None and _backend._target_state.value == "gpu":
        return True          # compiling for the H100 / H200 target description
    try:
        return str(jax.devices()[0].compute_capability).startswith("9")
    except Exception:        # pragma: no cover - a GPU without the attribute
        return False


def kernel_platform() -> bool:
    """Whether the platform traced for has a grouped-GEMM kernel (GPU or TPU; resolve decides
    per call, e.g. falling back on a non-Hopper GPU)."""
    return _backend.backend() in ("gpu", "tpu")


def resolve(impl: str, x_shape, w_shape, dtype) -> str:
    """The implementation ``impl`` means for this call (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = _backend.backend()
    if platform == "tpu":
        return "megablox"
    if platform != "gpu":
        return "reference"
    if not _gpu_is_hopper():
        _backend.log_fallback_once("grouped_gemm", "not an sm_90 GPU", "reference")
        return "reference"
    reason = hopper_unfit(x_shape, w_shape, dtype)
    if reason is not None:
        _backend.log_fallback_once("grouped_gemm", reason, "reference")
        return "reference"
    return "hopper"


def _interpret_gpu():
    """Mosaic GPU's interpreter parameters on CPU (None when compiling for a GPU)."""
    if not _backend.interpret_mode():
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _rows_below(y: jax.Array, total: jax.Array) -> jax.Array:
    """y with the rows at or past ``total`` set to 0 (the kernels do not write them)."""
    return jnp.where(jnp.arange(y.shape[0])[:, None] < total, y, jnp.zeros((), y.dtype))


def _pad_rows(a: jax.Array) -> jax.Array:
    """a with its rows padded by zeros to a multiple of the row tile: the kernels read whole
    tiles (a GPU's TMA fills rows past the end with zeros; the interpreter refuses them)."""
    pad = -a.shape[0] % HOPPER_BLOCK_M
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _hopper_fwd_call(x, w, sizes):
    from pallas_kernels.grouped_gemm._hopper_ragged_dot import ragged_dot
    with jax.named_scope(KERNEL_NAMES[1]):
        y = ragged_dot(_pad_rows(x), w, group_sizes=sizes, block_m=HOPPER_BLOCK_M,
                       block_n=_block_n(w.shape[2]), block_k=HOPPER_BLOCK_K,
                       max_concurrent_steps=HOPPER_STAGES, grid_block_n=1, num_sms=HOPPER_SMS,
                       interpret=_interpret_gpu())
    return _rows_below(y[:x.shape[0]], jnp.sum(sizes))


def _hopper_weight_grad(x, dy, sizes):
    from pallas_kernels.grouped_gemm._hopper_transposed import transposed_ragged_dot
    with jax.named_scope(KERNEL_NAMES[0]):
        dw = transposed_ragged_dot(_pad_rows(x), _pad_rows(dy), group_sizes=sizes,
                                   block_m=HOPPER_BLOCK_M, block_n=_block_n(dy.shape[1]),
                                   block_k=HOPPER_BLOCK_K, max_concurrent_steps=HOPPER_STAGES,
                                   grid_block_n=1, num_sms=HOPPER_SMS,
                                   interpret=_interpret_gpu())
    return jnp.where((sizes > 0)[:, None, None], dw, jnp.zeros((), dw.dtype))  # empty: unwritten


@jax.custom_vjp
def _hopper(x, w, sizes):
    return _hopper_fwd_call(x, w, sizes)


def _hopper_fwd(x, w, sizes):
    return _hopper(x, w, sizes), (x, w, sizes)


def _hopper_bwd(res, dy):
    x, w, sizes = res
    dy = dy.astype(x.dtype)
    # dx = dy w^T through a transposed copy of w, not the kernel's transpose_rhs (w transposed in
    # shared memory): Mosaic GPU's interpreter has no transposed wgmma operand (jax 0.10.2), so
    # only this form is checked here; the copy costs a read and write of w per backward GEMM.
    dx = _hopper_fwd_call(dy, jnp.swapaxes(w, 1, 2), sizes)
    dw = _hopper_weight_grad(x, dy, sizes).astype(w.dtype)
    return dx, dw, None


_hopper.defvjp(_hopper_fwd, _hopper_bwd)


def _megablox(x, w, sizes):
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    m, k = x.shape
    tiling = tuple(min(MEGABLOX_TILE, d) for d in (m, k, w.shape[2]))
    total = jnp.sum(sizes)
    pad = -m % tiling[0]              # gmm takes whole row tiles; padded rows are in no group
    # gmm leaves the rows past the groups unwritten, its backward's dx too: masking x's rows
    # makes their gradient 0 (a select, whatever gmm left there)
    xp = _rows_below(x, total)
    xp = jnp.pad(xp, ((0, pad), (0, 0))) if pad else xp
    with jax.named_scope("grouped_gemm_megablox"):
        y = gmm(xp, w, sizes, x.dtype, tiling, None, None, False, _backend.interpret_mode())
    return _rows_below(y[:m], total)


_HLO_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1}


def _itemsize(dtype: str) -> int:
    return _HLO_ITEMSIZE.get(dtype) or jnp.dtype(dtype).itemsize


def _nbytes(operand) -> int:
    dtype, dims = operand
    return _itemsize(dtype) * math.prod(dims)


def grouped_gemm_kernel_cost(kernel: str, operands, outputs, rows: int | None = None
                             ) -> tuple[float, float]:
    """(bytes, flops) of one launch of a Hopper kernel (KERNEL_NAMES), from its operand and
    output shapes [(dtype, dims), ...] in the compiled program, at the most tiles the launch can
    visit with ``rows`` of its M rows in groups (default all; fewer in an expert-parallel
    exchange buffer, whose empty slots are in no group), every group non-empty (as at 256
    decode slots over 128 experts).

    grouped_gemm_rows: operands group_sizes [G], x [M, K], w [G, K, N]; output [M, N]. It works
    on T = rows / 64 + G - 1 row tiles (one more per group boundary inside a tile; tiles past
    the groups skip their work); each reads its group's whole [K, N] matrix and its [64, K]
    rows (the rows' re-reads across the N / block_n column blocks of the same tile are taken to
    hit L2) and writes its rows: bytes = T (64 K + K N) + rows N (itemsize each) + the sizes;
    flops = 2 T 64 K N (whole tiles: the masked rows of a boundary tile are multiplied too).
    grouped_gemm_wgrad: operands the five [G] vectors, x [R, m],
    dy [R, n]; output [G, m, n]. Each (group, m block, n block) reads the group's rows of both
    (rounded up to 64): R' = R + 64 G rows, bytes = R' (m n / block_n + n m / block_m) + G m n,
    flops = 2 R' m n."""
    item = _itemsize(outputs[0][0])
    if kernel == "grouped_gemm_rows":
        (_, (g,)), (_, (m, k)), (_, (_, _, n)) = operands[:3]
        m = m if rows is None else min(m, rows)
        tiles = -(-m // HOPPER_BLOCK_M) + g - 1
        nbytes = tiles * (HOPPER_BLOCK_M * k + k * n) * item + m * n * item + _nbytes(operands[0])
        return float(nbytes), float(2 * tiles * HOPPER_BLOCK_M * k * n)
    if kernel == "grouped_gemm_wgrad":
        (_, (r, m)), (_, (_, n)) = operands[-2:]
        g = operands[0][1][0]
        rows = r + HOPPER_BLOCK_K * g
        grid_m, grid_n = m // HOPPER_BLOCK_M, n // _block_n(n)
        nbytes = rows * (m * grid_n + n * grid_m) * item + g * m * n * item
        return float(nbytes), float(2 * rows * m * n)
    raise ValueError(f"unknown kernel {kernel!r}; one of {KERNEL_NAMES}")


def grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                 impl: str = "auto") -> jax.Array:
    """x [M, K] rows grouped contiguously by ``group_sizes`` int[G], w [G, K, N] -> [M, N] in
    x's dtype (module docstring)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != w.shape[:1]:
        raise ValueError(f"grouped_gemm: x {x.shape}, w {w.shape}, group_sizes "
                         f"{group_sizes.shape}; expected [M, K], [G, K, N], [G]")
    w = w.astype(x.dtype)
    sizes = group_sizes.astype(jnp.int32)
    form = resolve(impl, x.shape, w.shape, x.dtype)
    if form == "hopper":
        reason = hopper_unfit(x.shape, w.shape, x.dtype)
        if reason is not None:
            raise ValueError(f"grouped_gemm(impl='hopper'): {reason}")
        return _hopper(x, w, sizes)
    if form == "megablox":
        return _megablox(x, w, sizes)
    return grouped_gemm_reference(x, w, sizes)


__all__ = ["CUSTOM_CALLS", "IMPLS", "KERNEL_NAMES", "grouped_gemm", "grouped_gemm_kernel_cost",
           "grouped_gemm_reference",
           "hopper_unfit", "kernel_platform", "resolve"]
