"""Backend detection shared by the kernels, and the compile-target switch.

Kernels run compiled on GPU/TPU and interpreted on CPU. The mode is always derived from the
platform the kernels are traced for, never chosen by hand: normally JAX's default backend; inside
``compile_target("cuda" | "tpu")`` that platform, so that
``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` on a CPU-only machine holds the
real (compiled) kernel, not its interpreted jnp form.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import jax

# "cuda"/"tpu" JAX lowering-platform names -> the backend names kernels branch on.
_TARGETS = {"cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}
_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_target", default=None)


@contextlib.contextmanager
def compile_target(platform: str) -> Iterator[None]:
    """Trace the kernels in their compiled form for ``platform`` ("cuda" or "tpu").

    Inside the context, :func:`backend` reports the target ("gpu"/"tpu"), so kernels pick their
    compiled lowering and that platform's compiler parameters, and ``impl="auto"`` selects the
    kernels as it would on that hardware. Use it around tracing/lowering only: running the traced
    kernels still needs the real device.
    """
    if platform not in _TARGETS:
        raise ValueError(f"compile_target platform must be 'cuda' or 'tpu', got {platform!r}")
    token = _target.set(_TARGETS[platform])
    try:
        yield
    finally:
        _target.reset(token)


def backend() -> str:
    """The platform kernels are traced for: the compile target if one is set, else JAX's default
    backend ("cpu", "gpu" or "tpu")."""
    return _target.get() or jax.default_backend()


def interpret_mode() -> bool:
    """True where Pallas kernels must be interpreted (no accelerator compiler for them)."""
    return backend() not in ("gpu", "tpu")


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


def resolve_impl(impl: str, impls: tuple[str, ...], *, on_cpu: str) -> str:
    """A kernel's `impl` argument: "auto" -> "pallas" on GPU/TPU, `on_cpu` where Pallas only
    interprets; anything else must be one of `impls`."""
    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        return on_cpu if interpret_mode() else "pallas"
    return impl
