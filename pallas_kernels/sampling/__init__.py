"""Token sampling for the decode loop: temperature, top-k, top-p (nucleus), greedy.

One row of ``logits[S, V]`` per sample. The draw uses one pre-generated uniform ``u`` per row and
inverse-CDF sampling over the kept tokens in *vocabulary order*::

    e_i   = exp((x_i - max_j x_j) / T) * kept_i
    token = min{ j : sum_{i <= j} e_i > u * sum_i e_i }

which is an exact draw from ``softmax(x / T)`` restricted to the kept set and renormalised. Because
the uniforms are inputs, the Pallas kernel and the plain-jnp reference see the same randomness and
return the same tokens (up to float rounding exactly at a bucket edge, probability ~1e-7 per draw).
One uniform per row instead of a Gumbel per logit keeps random-number generation O(S), not O(S*V),
which matters for V >= 32k.

Filtering follows Hugging Face's order (``TopKLogitsWarper`` then ``TopPLogitsWarper``):

* top-k keeps every token whose logit is >= the k-th largest logit (ties at the boundary are kept);
* top-p then keeps the smallest set of the highest-probability remaining tokens whose mass (under
  the temperature-scaled, top-k-renormalised distribution) reaches ``top_p`` (ties kept).

The log-prob returned is ``log_softmax(logits / T)[token]`` over the *full* vocabulary, i.e. before
top-k/top-p filtering: that is what a trainer recomputes from the same logits at the same temperature
(the truncated importance-sampling ratio of BroRL Sec. 3.1 compares exactly these two numbers).
Greedy (``temperature == 0``) returns ``argmax`` (first index on ties) and ``log_softmax(logits)``.

Kernel: the k-th largest logit and the nucleus threshold are found without sorting, by a radix-16
search on the order-preserving integer image of the float32 logits (8 passes over the vocabulary,
each counting 15 candidate thresholds); the inverse-CDF index by one pass of running prefix sums.
The vocabulary is swept in tiles, never held whole (see passes.py). Everything is
elementwise ops, row reductions and an in-tile prefix sum, so it lowers to Triton (GPU, explicit
Triton parameters) and Mosaic (TPU) and interprets on CPU.

Layout of this package (as jax.experimental.pallas.ops keeps a kernel's GPU and TPU forms apart):
this module holds the public functions, the impl choice and the tiles; reference.py the jnp
reference and the argument checks; passes.py the sort-free algorithm both kernel families run;
triton.py and mosaic.py the two families' grids and calls (see _backend); triton_lang.py the
plain-sampling kernel written in Triton itself, called through jax_triton (impl="triton").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.sampling import mosaic, triton
from pallas_kernels.sampling.passes import _CHUNK, _plan_passes
from pallas_kernels.sampling.reference import _check_args, sample_tokens_reference

__all__ = ["IMPLS", "resolve_impl", "sample_tokens", "sample_tokens_pallas", "sample_tokens_reference",
           "sample_tokens_traffic", "sampling_uniforms", "sampling_unsupported_reason"]

_IMPLS = ("auto", "reference", "pallas", "triton")   # triton: triton_lang.py (jax_triton)
IMPLS = ("auto", "reference", "pallas")   # what the rollout may ask of all its kernels (rollout.impl)


def resolve_impl(impl: str, logits: jax.Array | None = None) -> str:
    """"auto" -> the Pallas kernel on GPU/TPU, the jnp reference on CPU (interpreting is slow) or
    where the kernel does not compile for these logits (sampling_unsupported_reason; logged once)."""
    check = None
    if logits is not None:
        check = lambda: sampling_unsupported_reason(logits.shape, logits.dtype)
    return _backend.resolve_impl(impl, _IMPLS, on_cpu="reference", kernel="sample_tokens",
                                 check=check)


def sampling_uniforms(key: jax.Array, num_samples: int) -> jax.Array:
    """One uniform in [0, 1) per row from a key: ``uniforms[S]`` float32."""
    return jax.random.uniform(key, (num_samples,), jnp.float32)


def sample_tokens_traffic(operands, *, vocab: int, temperature: float = 1.0, top_k: int = 0,
                          top_p: float = 1.0) -> tuple[float, float]:
    """(HBM bytes, flops) of ONE call of the Pallas sampling kernel (the traffic declaration
    bench/roofline.py adds to its walk of the compiled program): ``operands`` [(dtype, shape)] of
    the custom call (logits [rows, width], uniforms [rows, 1]). Each pass of
    :func:`_plan_passes` (plain sampling: stats + cdf) sweeps every row's logits once; outputs are
    a token and a log-prob per row. Flops: a few per logit per pass (not counted as GEMM flops)."""
    (x_dt, (rows, width)) = operands[0]
    passes = len(_plan_passes(int(vocab), float(temperature), int(top_k), float(top_p)))
    return float(passes * rows * width * jnp.dtype(x_dt).itemsize + rows * 12), 0.0


# (rows per block, vocab tile) per family. Triton: an [8, 1024] f32 tile is 32 KiB of registers
# over 4 warps. Mosaic: [32, 2048] f32 tiles (256 KiB, double-buffered) keep the grid short.
_TILES = {"triton": (8, 1024), "mosaic": (32, 2048)}
_DTYPES = ("float32", "bfloat16", "float16")


def sampling_unsupported_reason(shape, dtype) -> str | None:
    """None when the sampling kernel compiles for logits of this shape/dtype on the current target
    (see _backend.compile_target), else why not; impl="auto" then uses the reference."""
    if len(shape) != 2:
        return f"logits must be [samples, vocab], got shape {shape}"
    if jnp.dtype(dtype).name not in _DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (the kernel takes {_DTYPES})"
    if _backend.under_auto_partitioned_mesh():
        return "traced under a mesh outside shard_map (GSPMD cannot partition a Pallas call)"
    return None


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "block_rows",
                                             "block_v", "family", "target"))
def _sample_tokens_pallas(logits, uniforms, *, temperature, top_k, top_p, block_rows, block_v,
                          family, target):
    del target   # part of the jit cache key only: a trace for a compile target is not reused
    s, vocab = logits.shape
    rows, bv = _TILES[family]
    rows = block_rows or rows
    if block_v:
        bv = block_v
    if family == "triton":   # Triton loads must be powers of two
        bv = min(bv, 1 << max(4, (vocab - 1).bit_length()))
    else:                    # Mosaic: lane-dense tiles, rows in whole sublane groups
        bv = min(bv, -(-vocab // _CHUNK) * _CHUNK)
        rows = -(-rows // 8) * 8
    vpad = -(-vocab // bv) * bv
    if family == "triton" and vocab >= bv:
        vpad = vocab     # no padded copy of the logits: the last tile is read ending at the row end
    spad = -(-s // rows) * rows
    x = logits
    if (spad, vpad) != (s, vocab):
        x = jnp.pad(x, ((0, spad - s), (0, vpad - vocab)))
    u = jnp.pad(uniforms.astype(jnp.float32), (0, spad - s))[:, None]
    passes = _plan_passes(vocab, float(temperature), int(top_k), float(top_p))
    cfg = dict(vocab=vocab, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
               family=family)
    out_shape = [jax.ShapeDtypeStruct((spad, 1), jnp.int32),
                 jax.ShapeDtypeStruct((spad, 1), jnp.float32)]
    n_v = vpad // bv     # whole tiles (Triton, unpadded: + one tile ending at the row's end)
    family_module = triton if family == "triton" else mosaic
    tok, logp = family_module.call(x, u, passes=passes, cfg=cfg, rows=rows, bv=bv, n_v=n_v,
                                   out_shape=out_shape)
    return tok[:s, 0], logp[:s, 0]


def sample_tokens_pallas(
    logits: jax.Array,
    uniforms: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    block_rows: int | None = None,
    block_v: int | None = None,
    family: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas sampling kernel, same contract as :func:`sample_tokens_reference`.

    Rows in blocks of ``block_rows``, the vocabulary in tiles of ``block_v`` (None: per-family
    defaults, see _TILES); ``family`` None = the target's (see _backend.kernel_family).
    """
    _check_args(logits, temperature, top_k, top_p)
    return _sample_tokens_pallas(
        logits, uniforms, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
        block_rows=block_rows, block_v=block_v, family=_backend.kernel_family(family),
        target=_backend.backend())


def sample_tokens(
    logits: jax.Array,
    key_or_uniforms: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row of ``logits[S, V]``.

    Args:
      logits: ``[S, V]`` float logits.
      key_or_uniforms: a PRNG key (one uniform per row is drawn from it) or ``uniforms[S]`` in [0, 1).
      temperature: softmax temperature; 0 means greedy (argmax).
      top_k: keep the k highest logits (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
      impl: "auto" (Pallas kernel on GPU/TPU, reference on CPU), "reference", "pallas", or
        "triton" (the jax_triton kernel of triton_lang.py: GPU, plain/greedy sampling only).

    Returns:
      ``tokens[S] int32`` and ``logp[S] f32 = log_softmax(logits / T)[token]`` before filtering.
    """
    _check_args(logits, temperature, top_k, top_p)
    k = key_or_uniforms
    is_key = jnp.issubdtype(k.dtype, jax.dtypes.prng_key) or (k.dtype == jnp.uint32 and k.shape == (2,))
    uniforms = sampling_uniforms(k, logits.shape[0]) if is_key else k
    if uniforms.shape != (logits.shape[0],):
        raise ValueError(
            f"uniforms must have shape [samples] = ({logits.shape[0]},), got {uniforms.shape}"
        )
    use = resolve_impl(impl, logits)
    if use == "triton":
        from pallas_kernels.sampling.triton_lang import sample_tokens_triton
        fn = sample_tokens_triton
    else:
        fn = sample_tokens_pallas if use == "pallas" else sample_tokens_reference
    return fn(logits, uniforms, temperature=temperature, top_k=top_k, top_p=top_p)
