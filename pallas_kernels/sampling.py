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

Kernel: the k-th largest logit and the nucleus threshold are found without sorting, by a 32-step
bitwise search on the order-preserving integer image of the float32 logits (each step is one
compare-and-reduce over the row); the inverse-CDF index is found the same way over ceil(log2 V) bits.
Everything is elementwise ops plus row reductions, so it lowers to Triton (GPU) and Mosaic (TPU) and
interprets on CPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode

_IMPLS = ("auto", "reference", "pallas")
IMPLS = _IMPLS  # public: the rollout kernel choices that config validation reads


def _check_args(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [samples, vocab], got shape {logits.shape}")
    if not temperature >= 0.0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no top-k filtering), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")


def resolve_impl(impl: str) -> str:
    """"auto" -> the Pallas kernel on GPU/TPU, the jnp reference on CPU (interpreting is slow)."""
    return _backend.resolve_impl(impl, _IMPLS, on_cpu="reference")


def sampling_uniforms(key: jax.Array, num_samples: int) -> jax.Array:
    """One uniform in [0, 1) per row from a key: ``uniforms[S]`` float32."""
    return jax.random.uniform(key, (num_samples,), jnp.float32)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp, sort-based filtering)
# ----------------------------------------------------------------------------------------------


def sample_tokens_reference(
    logits: jax.Array,
    uniforms: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp sampling: ``logits[S, V]``, ``uniforms[S]`` -> ``(tokens[S] int32, logp[S] f32)``.

    Top-k uses ``lax.top_k``, top-p a full descending sort + cumulative sum (the textbook way); the
    draw is the inverse CDF in vocabulary order described in the module docstring.
    """
    _check_args(logits, temperature, top_k, top_p)
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    if temperature == 0.0:
        tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, None], axis=-1)[:, 0]
        return tokens, logp
    z = x / temperature
    zmax = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - zmax)
    lse = zmax[:, 0] + jnp.log(jnp.sum(e, axis=-1))
    kept = jnp.ones_like(x, dtype=bool)
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        kept = x >= kth
    if top_p < 1.0:
        ek = jnp.where(kept, e, 0.0)
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        csum = jnp.cumsum(jnp.take_along_axis(ek, order, axis=-1), axis=-1)
        target = top_p * jnp.sum(ek, axis=-1, keepdims=True)
        # first sorted index whose cumulative mass reaches top_p; keep every logit >= its value
        cut = jnp.minimum(jnp.sum(csum < target, axis=-1, keepdims=True), vocab - 1)
        kept = kept & (x >= jnp.take_along_axis(sorted_x, cut, axis=-1))
    ek = jnp.where(kept, e, 0.0) if (0 < top_k < vocab or top_p < 1.0) else e
    tokens = _inverse_cdf(ek, uniforms.astype(jnp.float32))
    logp = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logp


def _inverse_cdf(weights: jax.Array, uniforms: jax.Array, block: int = 128) -> jax.Array:
    """``min{j : sum_{i<=j} w_i > u * sum_i w_i}`` per row of ``weights[S, V] >= 0``, always an
    index with ``w_j > 0``.

    Two-level prefix sums (block totals, then one block's entries) instead of a full-row cumsum:
    XLA's CPU cumsum over a [S, 32k] row costs as much as the LM-head matmul that produced it.
    """
    rows, vocab = weights.shape
    nb = -(-vocab // block)
    w = jnp.pad(weights, ((0, 0), (0, nb * block - vocab))).reshape(rows, nb, block)
    block_csum = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [S, nb]
    target = uniforms * block_csum[:, -1]
    iota_b = jnp.arange(nb)
    last_block = jnp.max(jnp.where(block_csum > jnp.concatenate(
        [jnp.zeros((rows, 1)), block_csum[:, :-1]], axis=-1), iota_b, 0), axis=-1)
    blk = jnp.minimum(jnp.sum(block_csum <= target[:, None], axis=-1), last_block)
    base = jnp.where(blk > 0, jnp.take_along_axis(block_csum, jnp.maximum(blk - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [S, block]
    iota = jnp.arange(block)
    last_nz = jnp.max(jnp.where(inner > 0, iota, 0), axis=-1)
    j = jnp.minimum(jnp.sum(base[:, None] + jnp.cumsum(inner, axis=-1) <= target[:, None], axis=-1),
                    last_nz)
    return (blk * block + j).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Pallas kernel (sort-free)
# ----------------------------------------------------------------------------------------------


def _ordered_key(x: jax.Array) -> jax.Array:
    """Monotone map float32 -> uint32: a < b  <=>  key(a) < key(b) (for non-NaN floats)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits >> 31
    # negative floats: flip every bit; non-negative: flip only the sign bit
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_with(pred, num_bits: int = 32) -> jax.Array:
    """Largest ``t`` (uint32, per row) with ``pred(t)`` true, for a predicate monotone decreasing
    in ``t`` and true at 0. Built bit by bit from the top: ``num_bits`` reductions over the row."""

    def body(i, ans):
        cand = ans | (jnp.uint32(1) << (jnp.uint32(num_bits - 1) - i.astype(jnp.uint32)))
        return jnp.where(pred(cand), cand, ans)

    rows = pred(jnp.uint32(0)).shape
    return jax.lax.fori_loop(0, num_bits, body, jnp.zeros(rows, jnp.uint32))


def _sampling_kernel(logits_ref, u_ref, tok_ref, logp_ref, *, vocab, temperature, top_k, top_p):
    x = logits_ref[...].astype(jnp.float32)  # [R, Vp]; columns >= vocab are padding
    rows, vpad = x.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, vpad), 1)
    valid = col < vocab
    x = jnp.where(valid, x, -jnp.inf)
    m = jnp.max(x, axis=-1, keepdims=True)
    if temperature == 0.0:
        # first index attaining the max
        tok = jnp.min(jnp.where(x == m, col, vpad), axis=-1)
        lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1))
        x_tok = jnp.max(jnp.where(col == tok[:, None], x, -jnp.inf), axis=-1)
        tok_ref[...] = tok.astype(jnp.int32)[:, None]
        logp_ref[...] = (x_tok - lse)[:, None]
        return
    e = jnp.exp((x - m) / temperature)  # 0 on padding
    kept = valid
    if top_k > 0 or top_p < 1.0:
        key = _ordered_key(x)
    if 0 < top_k < vocab:
        # k-th largest key: the largest t with #(key >= t) >= k
        kth = _largest_key_with(
            lambda t: jnp.sum(jnp.where(kept & (key >= t[..., None]), 1, 0), axis=-1) >= top_k
        )
        kept = kept & (key >= kth[:, None])
    if top_p < 1.0:
        ek = jnp.where(kept, e, 0.0)
        target = top_p * jnp.sum(ek, axis=-1)
        # nucleus threshold: the largest t whose upper set holds at least top_p of the mass
        thr = _largest_key_with(
            lambda t: jnp.sum(jnp.where(key >= t[..., None], ek, 0.0), axis=-1) >= target
        )
        kept = kept & (key >= thr[:, None])
    ek = jnp.where(kept, e, 0.0)
    target = u_ref[...][:, 0] * jnp.sum(ek, axis=-1)
    # token = largest p with sum_{i < p} ek_i <= target (then ek_p > 0, so p is a kept token)
    nbits = max(1, int(vpad - 1).bit_length())

    def prefix_le(p):
        return jnp.sum(jnp.where(col < p[:, None].astype(jnp.int32), ek, 0.0), axis=-1) <= target

    def body(i, pos):
        cand = pos + (jnp.int32(1) << (nbits - 1 - i))
        return jnp.where((cand < vpad) & prefix_le(cand), cand, pos)

    tok = jax.lax.fori_loop(0, nbits, body, jnp.zeros((rows,), jnp.int32))
    last_kept = jnp.max(jnp.where(kept, col, -1), axis=-1)
    tok = jnp.minimum(tok, last_kept)
    z = x / temperature
    zmax = m[:, 0] / temperature
    lse = zmax + jnp.log(jnp.sum(jnp.exp(z - zmax[:, None]), axis=-1))
    z_tok = jnp.max(jnp.where(col == tok[:, None], z, -jnp.inf), axis=-1)
    tok_ref[...] = tok[:, None]
    logp_ref[...] = (z_tok - lse)[:, None]


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "block_rows"))
def sample_tokens_pallas(
    logits: jax.Array,
    uniforms: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    block_rows: int = 8,
) -> tuple[jax.Array, jax.Array]:
    """Pallas sampling kernel, same contract as :func:`sample_tokens_reference`.

    Grid over blocks of ``block_rows`` rows; each program holds its rows' full (power-of-two padded)
    vocabulary, which is why ``block_rows * V`` should stay within on-chip memory (8 x 32k f32 = 1 MiB).
    """
    _check_args(logits, temperature, top_k, top_p)
    s, vocab = logits.shape
    vpad = 1 << max(0, (vocab - 1).bit_length())  # Triton blocks must be powers of two
    spad = -(-s // block_rows) * block_rows
    x = jnp.pad(logits.astype(jnp.float32), ((0, spad - s), (0, vpad - vocab)))
    u = jnp.pad(uniforms.astype(jnp.float32), (0, spad - s))[:, None]
    kernel = functools.partial(
        _sampling_kernel, vocab=vocab, temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p),
    )
    tok, logp = pl.pallas_call(
        kernel,
        grid=(spad // block_rows,),
        in_specs=[
            pl.BlockSpec((block_rows, vpad), lambda i: (i, 0)),
            pl.BlockSpec((block_rows, 1), lambda i: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((block_rows, 1), lambda i: (i, 0)),
            pl.BlockSpec((block_rows, 1), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((spad, 1), jnp.int32),
            jax.ShapeDtypeStruct((spad, 1), jnp.float32),
        ],
        interpret=interpret_mode(),
        name="sample_tokens",
    )(x, u)
    return tok[:s, 0], logp[:s, 0]


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
      impl: "auto" (kernel on GPU/TPU, reference on CPU), "reference" or "pallas".

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
    fn = sample_tokens_pallas if resolve_impl(impl) == "pallas" else sample_tokens_reference
    return fn(logits, uniforms, temperature=temperature, top_k=top_k, top_p=top_p)
