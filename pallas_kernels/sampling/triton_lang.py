"""Plain sampling (temperature, no top-k/top-p) as a hand-written Triton kernel via jax_triton.

The rollout's hot path at BroRL's settings (T = 1, no filtering): per decode step one token per
row of ``logits[S, V]``, S up to 512, V ~152k. One Triton program per row sweeps the row twice in
``BLOCK``-wide tiles (never the whole row at once):

  1. running max ``m`` and ``s = sum exp(z - m)`` with rescaling (z = x / T); greedy: first argmax;
  2. inverse CDF: running prefix sums of ``exp(z - m)`` (``tl.cumsum`` in the tile); the token is
     the first index whose inclusive prefix exceeds ``u * s``.

Same contract and the same draw as :func:`pallas_kernels.sampling.sample_tokens_reference` with
``top_k=0, top_p=1`` (up to float rounding exactly at a bucket edge).

``jax_triton`` and ``triton`` are imported lazily: they import only with a CUDA build of JAX
(the ``gpu`` / ``compile`` extras). Running needs an NVIDIA GPU; tracing inside
``pallas_kernels.compile_target("cuda")`` on a machine without one compiles for
``COMPILE_CAPABILITY`` (sm_90, H100/H200): Triton -> PTX -> cubin with Triton's bundled ptxas.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend

BLOCK = 2048          # tile width: 16 f32 per thread over 4 warps
NUM_WARPS = 4
COMPILE_CAPABILITY = 90   # what a deviceless trace compiles for (H100/H200)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sample_rows(x_ptr, u_ptr, vocab, stride, temperature, tok_ptr, logp_ptr,
                    BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        row = tl.program_id(0)
        base_ptr = x_ptr + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        arg = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = tl.load(base_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            z = x / temperature
            tmax = tl.max(z, axis=0)
            if GREEDY:
                first = tl.min(tl.where(z == tmax, cols, 2147483647), axis=0)
                arg = tl.where(tmax > m, first, arg)
            m_new = tl.maximum(m, tmax)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        if GREEDY:
            tl.store(tok_ptr + row, arg)
            tl.store(logp_ptr + row, m - lse)
        else:
            target = tl.load(u_ptr + row) * s
            run = tl.full((), 0.0, tl.float32)
            found = tl.full((), 0, tl.int32)
            tok = tl.full((), 0, tl.int32)
            z_tok = tl.full((), 0.0, tl.float32)
            last = tl.full((), -1, tl.int32)
            z_last = tl.full((), 0.0, tl.float32)
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                valid = cols < vocab
                x = tl.load(base_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
                z = x / temperature
                e = tl.where(valid, tl.exp(z - m), 0.0)
                csum = tl.cumsum(e, axis=0)
                cnt = tl.sum(tl.where(run + csum <= target, 1, 0), axis=0)
                tsum = tl.sum(e, axis=0)
                cross = (found == 0) & (run + tsum > target) & (cnt < BLOCK)
                z_at = tl.sum(tl.where(offs == cnt, z, 0.0), axis=0)
                tok = tl.where(cross, start + cnt, tok)
                z_tok = tl.where(cross, z_at, z_tok)
                found = tl.where(cross, 1, found)
                run = run + tsum
                # the last index with positive weight (fallback when rounding misses the target)
                lst = tl.max(tl.where(e > 0.0, offs, -1), axis=0)
                z_l = tl.sum(tl.where(offs == lst, z, 0.0), axis=0)
                z_last = tl.where(lst >= 0, z_l, z_last)
                last = tl.where(lst >= 0, start + lst, last)
            tok = tl.where(found == 1, tok, last)
            z_tok = tl.where(found == 1, z_tok, z_last)
            tl.store(tok_ptr + row, tok)
            tl.store(logp_ptr + row, z_tok - lse)

    return sample_rows


def unsupported_reason(shape, dtype, *, top_k: int = 0, top_p: float = 1.0) -> str | None:
    """None when this kernel can run/compile for these logits on the current target, else why."""
    if top_k or top_p < 1.0:
        return "the jax_triton kernel does plain/greedy sampling only (top_k=0, top_p=1)"
    if _backend.backend() != "gpu":
        return f"jax_triton kernels are GPU-only (target {_backend.backend()!r})"
    if not _backend._jax_triton_importable():
        return "jax_triton is not installed (pip install -e '.[gpu]' or '.[compile]')"
    if len(shape) != 2 or jnp.dtype(dtype).name not in ("float32", "bfloat16", "float16"):
        return f"logits must be [S, V] float32/bfloat16/float16, got {shape} {jnp.dtype(dtype)}"
    return None


def sample_tokens_triton(logits: jax.Array, uniforms: jax.Array, *, temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``logits[S, V]``, ``uniforms[S]`` -> ``(tokens[S] int32, logp[S] f32)``; see module doc."""
    reason = unsupported_reason(logits.shape, logits.dtype, top_k=top_k, top_p=top_p)
    if reason is not None:
        raise ValueError(f"sample_tokens_triton: {reason}")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    import jax_triton as jt

    rows, vocab = logits.shape
    # a trace for a compile target without an attached GPU names the capability to compile for
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    greedy = temperature == 0.0
    tok, logp = jt.triton_call(
        logits, uniforms.astype(jnp.float32),
        vocab, vocab, float(temperature) if not greedy else 1.0,
        kernel=_kernel(),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(rows,),
        num_warps=NUM_WARPS,
        num_stages=1,
        compute_capability=None if on_gpu else COMPILE_CAPABILITY,
        name="sample_tokens_triton",
        BLOCK=BLOCK,
        GREEDY=greedy,
    )
    return tok, logp
