"""Backend detection shared by the kernels.

Kernels run compiled on GPU/TPU and interpreted on CPU. The mode is always derived from the
backend JAX is running on, never chosen by hand, so the same call works everywhere.
"""
from __future__ import annotations

import functools

import jax


def backend() -> str:
    """The platform of JAX's default backend: "cpu", "gpu" or "tpu"."""
    return jax.default_backend()


def interpret_mode() -> bool:
    """True where Pallas kernels must be interpreted (no accelerator compiler for them)."""
    return backend() not in ("gpu", "tpu")


@functools.lru_cache(maxsize=None)
def jax_triton_available() -> bool:
    """jax_triton imports only on a CUDA build of JAX; import it lazily and only on GPU."""
    if backend() != "gpu":
        return False
    try:
        import jax_triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def resolve_impl(impl: str, impls: tuple[str, ...], *, on_cpu: str) -> str:
    """A kernel's `impl` argument: "auto" -> "pallas" on GPU/TPU, `on_cpu` where Pallas only
    interprets; anything else must be one of `impls`."""
    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        return on_cpu if interpret_mode() else "pallas"
    return impl
