"""The import path of the jax_triton sampling kernel; its code is in
pallas_kernels/sampling/triton_lang.py (jax_triton and triton still import only when it runs)."""
from pallas_kernels.sampling.triton_lang import (  # noqa: F401
    BLOCK,
    COMPILE_CAPABILITY,
    NUM_WARPS,
    sample_tokens_triton,
    unsupported_reason,
)
