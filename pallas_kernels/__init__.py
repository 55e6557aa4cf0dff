"""Pallas kernels for brorl_jax's hot paths, each with a plain-jnp reference beside it.

This package never imports brorl_jax. Kernels interpret on CPU and compile on GPU/TPU; the mode
comes from the backend (`interpret_mode()`).
"""
from pallas_kernels._backend import backend, interpret_mode, jax_triton_available

__all__ = ["backend", "interpret_mode", "jax_triton_available"]
