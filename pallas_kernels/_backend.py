"""Backend detection shared by the kernels, the compile-target switch, and each platform's
compiler parameters.

Kernels run compiled on GPU/TPU and interpreted on CPU. The mode is always derived from the
platform the kernels are traced for, never chosen by hand: normally JAX's default backend; inside
``compile_target("cuda" | "tpu")`` that platform, so that
``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` on a CPU-only machine holds the
real (compiled) kernel, not its interpreted jnp form.

Which lowering each platform uses is fixed here, explicitly:

* GPU: **Triton** (``jax.experimental.pallas.triton.CompilerParams``). jax >= 0.10 sends a GPU
  ``pallas_call`` without compiler parameters to Mosaic GPU, whose copy/shared-memory rules our
  kernels are not written for, so every GPU kernel passes Triton parameters.
* TPU: **Mosaic TPU** (``jax.experimental.pallas.tpu.CompilerParams``: grid dimension semantics
  and a scoped-VMEM limit).

A kernel's structure follows its *family* (``kernel_family()``): "triton" (one program per row
block, an inner loop over vocabulary tiles read straight from global memory) or "mosaic" (the
vocabulary tiles are a grid axis, DMA'd into VMEM one at a time, running state in VMEM scratch).
On CPU both families interpret; "triton" is the default there and tests run both.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Callable, Iterator

import jax

logger = logging.getLogger("pallas_kernels")

# "cuda"/"tpu" JAX lowering-platform names -> the backend names kernels branch on.
_TARGETS = {"cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}
# The target lives in a JAX config state that is part of JAX's trace context, so that a jitted
# function traced inside compile_target and the same function traced outside it get different
# jit-cache entries (a contextvar would let the second trace reuse the first).
try:
    from jax._src import config as _jax_config
    _target_state = _jax_config.optional_enum_state(
        name="pallas_kernels_compile_target", enum_values=["gpu", "tpu"], default=None,
        help="pallas_kernels.compile_target: the platform kernels are traced for.",
        include_in_trace_context=True)
except Exception:  # pragma: no cover - a jax without this private API: plain contextvar
    _target_state = None
_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_target", default=None)

FAMILIES = ("triton", "mosaic")
# The TPU generation lowered for when no TPU is attached (bench/compile_check.py compiles for it).
DEFAULT_TPU_KIND = "TPU v5 lite"
# VMEM per TensorCore of DEFAULT_TPU_KIND, used when the device kind is unknown at trace time.
_DEFAULT_TPU_VMEM_BYTES = 128 * 1024 * 1024


@contextlib.contextmanager
def compile_target(platform: str) -> Iterator[None]:
    """Trace the kernels in their compiled form for ``platform`` ("cuda" or "tpu").

    Inside the context, :func:`backend` reports the target ("gpu"/"tpu"), so kernels pick their
    compiled lowering and that platform's compiler parameters, and ``impl="auto"`` selects the
    kernels as it would on that hardware. Use it around tracing/lowering only: running the traced
    kernels still needs the real device. For "tpu", some Mosaic constructs (rank-1 blocks, for
    one) also ask for the TPU device kind; the kernels of this package do not, others may: then
    trace under :func:`tpu_abstract_mesh` (or a mesh of real/topology TPU devices).
    """
    if platform not in _TARGETS:
        raise ValueError(f"compile_target platform must be 'cuda' or 'tpu', got {platform!r}")
    if _target_state is not None:
        with _target_state(_TARGETS[platform]):
            yield
        return
    token = _target.set(_TARGETS[platform])
    try:
        yield
    finally:
        _target.reset(token)


def tpu_abstract_mesh(axis_sizes: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("x",),
                      device_kind: str = DEFAULT_TPU_KIND) -> jax.sharding.AbstractMesh:
    """An abstract mesh of TPU devices of ``device_kind``: enter it with
    ``jax.sharding.use_abstract_mesh(...)`` while tracing for "tpu" on a machine without a TPU
    (Mosaic asks the current device for its kind: "Unsupported TPU device kind: cpu" otherwise)."""
    from jax._src.mesh import AbstractDevice  # no public constructor in jax 0.10
    dev = AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names), abstract_device=dev)


def backend() -> str:
    """The platform kernels are traced for: the compile target if one is set, else JAX's default
    backend ("cpu", "gpu" or "tpu")."""
    target = _target_state.value if _target_state is not None else _target.get()
    return target or jax.default_backend()


def interpret_mode() -> bool:
    """True where Pallas kernels must be interpreted (no accelerator compiler for them)."""
    return backend() not in ("gpu", "tpu")


def kernel_family(family: str | None = None) -> str:
    """The kernel structure to trace: ``family`` if given (tests interpret both on CPU), else
    "mosaic" on TPU and "triton" on GPU and CPU."""
    if family is None:
        return "mosaic" if backend() == "tpu" else "triton"
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if not interpret_mode() and family != kernel_family():
        raise ValueError(f"family={family!r} cannot compile for {backend()!r}; leave it None")
    return family


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler parameters (the explicit GPU lowering); None when interpreting."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_vmem_capacity_bytes() -> int:
    """VMEM per TensorCore of the TPU traced for (16 MiB on v2-v4, 64 MiB on v5p, 128 MiB on
    v5e/v6e); DEFAULT_TPU_KIND's when no TPU device kind is known (compile target, no mesh)."""
    try:
        from jax.experimental.pallas import tpu as pltpu
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except Exception:  # not tracing under a TPU device or abstract TPU mesh
        return _DEFAULT_TPU_VMEM_BYTES


def tpu_vmem_limit_bytes() -> int:
    """The scoped-VMEM limit Mosaic kernels ask for: half the core's VMEM (the compiler's
    default is 16 MiB, too little for [256, D] x [D, 512] tiles at D = 4096)."""
    return tpu_vmem_capacity_bytes() // 2


def tpu_vmem_budget_bytes() -> int:
    """What tiles are planned to use (estimated), a margin under tpu_vmem_limit_bytes()."""
    return tpu_vmem_limit_bytes() * 5 // 8


def mosaic_params(dimension_semantics: tuple[str, ...]):
    """Mosaic TPU compiler parameters; None when interpreting."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics,
                                vmem_limit_bytes=tpu_vmem_limit_bytes())


def compiler_params(family: str, *, num_warps: int = 4, num_stages: int = 2,
                    dimension_semantics: tuple[str, ...] = ()):
    """The compiler parameters of ``family`` (see module docstring); None when interpreting."""
    if family == "triton":
        return triton_params(num_warps, num_stages)
    return mosaic_params(dimension_semantics)


def under_auto_partitioned_mesh() -> bool:
    """True while tracing under a mesh whose axes (size > 1) are not all manual, i.e. outside
    shard_map: GSPMD cannot partition a Mosaic kernel there and replicates a Triton one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = set(mesh.manual_axes)
    return any(size > 1 and name not in manual
               for name, size in zip(mesh.axis_names, mesh.axis_sizes))


@functools.lru_cache(maxsize=None)
def _jax_triton_importable() -> bool:
    try:
        import jax_triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def jax_triton_available() -> bool:
    """jax_triton imports only on a CUDA build of JAX; import it lazily and only on GPU."""
    return backend() == "gpu" and _jax_triton_importable()


_logged_fallbacks: set[tuple[str, str]] = set()


def log_fallback_once(kernel: str, reason: str, fallback: str) -> None:
    """Log (once per kernel and reason) that impl="auto" did not pick the Pallas kernel."""
    key = (kernel, reason)
    if key in _logged_fallbacks:
        return
    _logged_fallbacks.add(key)
    logger.warning("%s: impl='auto' uses %r, not the Pallas kernel: %s", kernel, fallback, reason)


def resolve_impl(impl: str, impls: tuple[str, ...], *, on_cpu: str, kernel: str = "",
                 check: Callable[[], str | None] | None = None) -> str:
    """A kernel's `impl` argument: "auto" -> "pallas" on GPU/TPU, `on_cpu` where Pallas only
    interprets; anything else must be one of `impls`.

    check() returns None when the kernel compiles for the call at hand on this target, else the
    reason it does not: then "auto" falls back to `on_cpu` (logged once) and an explicit
    "pallas" raises that reason."""
    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        if interpret_mode():
            return on_cpu
        reason = check() if check is not None else None
        if reason is not None:
            log_fallback_once(kernel, reason, on_cpu)
            return on_cpu
        return "pallas"
    if impl == "pallas" and not interpret_mode() and check is not None:
        reason = check()
        if reason is not None:
            raise ValueError(f"{kernel}: impl='pallas' cannot compile here: {reason}. "
                             f"Use impl='auto' (falls back to {on_cpu!r}) or {on_cpu!r}.")
    return impl
