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
The vocabulary is swept in tiles, never held whole (see the comment above the kernel). Everything is
elementwise ops, row reductions and an in-tile prefix sum, so it lowers to Triton (GPU, explicit
Triton parameters) and Mosaic (TPU) and interprets on CPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_mode

_IMPLS = ("auto", "reference", "pallas", "triton")   # triton: sampling_triton (jax_triton)
IMPLS = ("auto", "reference", "pallas")   # what the rollout may ask of all its kernels (rollout.impl)


def _check_args(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [samples, vocab], got shape {logits.shape}")
    if not temperature >= 0.0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no top-k filtering), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")


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
# Pallas kernel (sort-free, vocabulary in tiles)
# ----------------------------------------------------------------------------------------------
#
# A block of rows is swept over its vocabulary tiles several times ("passes"); per row only a few
# column vectors of state survive between tiles, so no block ever holds a whole vocabulary row:
#   stats     row max m and sum exp(x/T - m/T) (online), or for greedy the first argmax;
#   topk x8   radix-16 search for the k-th largest key: per pass 4 bits, 15 candidate counts;
#   mass      kept mass after top-k (the top-p target is a share of it);
#   topp x8   radix-16 search for the nucleus threshold (15 candidate masses per pass);
#   mass      final kept mass W;
#   cdf       running prefix sum of the kept weights: the token is the first index whose
#             inclusive prefix exceeds u * W (in-tile prefix: cumsum on Triton, a triangular
#             matmul on 128-lane chunks on Mosaic, which has no cumsum).
# Passes that filtering does not need are left out (plain sampling: stats + cdf).
# Family "triton": one program per row block, each pass a loop over tiles read from global memory.
# Family "mosaic": grid (row block, pass, tile), the tile DMA'd into VMEM, state in VMEM scratch.

_RADIX_BITS = 4
_N_CAND = (1 << _RADIX_BITS) - 1
_N_SEARCH = 32 // _RADIX_BITS
_INT_MIN = -(1 << 31)
# (rows per block, vocab tile) per family. Triton: an [8, 1024] f32 tile is 32 KiB of registers
# over 4 warps. Mosaic: [32, 2048] f32 tiles (256 KiB, double-buffered) keep the grid short.
_TILES = {"triton": (8, 1024), "mosaic": (32, 2048)}
_CHUNK = 128   # Mosaic in-tile prefix sums: one [rows, 128] @ [128, 128] matmul per lane chunk
_DTYPES = ("float32", "bfloat16", "float16")


def _ordered_key(x: jax.Array) -> jax.Array:
    """Monotone map float32 -> int32: a < b  <=>  key(a) < key(b) (for non-NaN floats)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _plan_passes(vocab: int, temperature: float, top_k: int, top_p: float) -> list[str]:
    if temperature == 0.0:
        return ["stats"]
    passes = ["stats"]
    topk = 0 < top_k < vocab
    if topk:
        passes += ["topk"] * _N_SEARCH
    if top_p < 1.0:
        if topk:
            passes += ["mass_k"]
        passes += ["topp"] * _N_SEARCH
    if topk or top_p < 1.0:
        passes += ["mass"]
    return passes + ["cdf"]


class _St:
    """Names of the per-row state columns ([rows, 1]; f32 unless noted)."""
    F32 = ("m", "s", "wk", "w", "base", "xtok", "xlast")
    I32 = ("arg", "kans", "pans", "tok", "found", "last")


def _init_state(rows):
    st = {k: jnp.zeros((rows, 1), jnp.float32) for k in _St.F32}
    st.update({k: jnp.zeros((rows, 1), jnp.int32) for k in _St.I32})
    st["m"] = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    st["last"] = jnp.full((rows, 1), -1, jnp.int32)
    return st


def _in_tile_prefix_count(e, shifted_target, family):
    """(#positions p of the tile with sum_{i<=p} e_i <= shifted_target, tile sum), per row."""
    if family == "triton":
        csum = jnp.cumsum(e, axis=-1)
        return jnp.sum(jnp.where(csum <= shifted_target, 1, 0), axis=-1, keepdims=True), \
            jnp.sum(e, axis=-1, keepdims=True)
    r = lax.broadcasted_iota(jnp.int32, (_CHUNK, _CHUNK), 0)
    c = lax.broadcasted_iota(jnp.int32, (_CHUNK, _CHUNK), 1)
    upper = jnp.where(r <= c, 1.0, 0.0).astype(jnp.float32)
    run = jnp.zeros((e.shape[0], 1), jnp.float32)
    cnt = jnp.zeros((e.shape[0], 1), jnp.int32)
    for k in range(e.shape[1] // _CHUNK):   # static lane-aligned chunks
        ek = e[:, k * _CHUNK:(k + 1) * _CHUNK]
        csum = run + jnp.dot(ek, upper, preferred_element_type=jnp.float32,
                             precision=lax.Precision.HIGHEST)
        cnt = cnt + jnp.sum(jnp.where(csum <= shifted_target, 1, 0), axis=-1, keepdims=True)
        run = run + jnp.sum(ek, axis=-1, keepdims=True)
    return cnt, run


def _tile_step(kind, st, x, col0, u, shift, *, vocab, temperature, top_k, top_p, family,
               lo=None):
    """Fold one tile x [rows, bv] (f32, columns col0..col0+bv) into state st for pass `kind`;
    only columns in [lo, vocab) count (lo default col0: the last tile of an unpadded row is read
    ending at the row's end, overlapping columns an earlier tile already counted).
    shift: the radix position of a search pass (traced int32 scalar)."""
    rows, bv = x.shape
    lcol = lax.broadcasted_iota(jnp.int32, (rows, bv), 1)
    col = col0 + lcol
    valid = col < vocab if lo is None else (col >= lo) & (col < vocab)
    x = jnp.where(valid, x, -jnp.inf)
    st = dict(st)
    if kind == "stats":
        tmax = jnp.max(x, axis=-1, keepdims=True)
        m_new = jnp.maximum(st["m"], tmax)
        if temperature == 0.0:
            first = jnp.min(jnp.where(x == tmax, col, jnp.int32(2**31 - 1)), axis=-1, keepdims=True)
            st["arg"] = jnp.where(tmax > st["m"], first, st["arg"])
            t = 1.0
        else:
            t = temperature
        zm_new = m_new / t
        scale = jnp.where(st["m"] == -jnp.inf, 0.0, jnp.exp(st["m"] / t - zm_new))
        st["s"] = st["s"] * scale + jnp.sum(jnp.exp(x / t - zm_new), axis=-1, keepdims=True)
        st["m"] = m_new
        return st
    e = jnp.exp((x - st["m"]) / temperature)           # 0 on padding
    key = _ordered_key(x)
    kept = valid
    if 0 < top_k < vocab and kind != "topk":
        kept = kept & (key >= (st["kans"] ^ jnp.int32(_INT_MIN)))
    if kind in ("topp", "mass", "cdf") and top_p < 1.0:
        if kind != "topp":
            kept = kept & (key >= (st["pans"] ^ jnp.int32(_INT_MIN)))
    if kind in ("topk", "topp"):
        name = "kans" if kind == "topk" else "pans"
        unit = jnp.int32(1) << shift
        ek = None if kind == "topk" else jnp.where(kept, e, 0.0)
        for c in range(1, _N_CAND + 1):   # candidates ans | c << shift, as signed thresholds
            thr = (st[name] | (jnp.int32(c) * unit)) ^ jnp.int32(_INT_MIN)
            if kind == "topk":
                val = jnp.sum(jnp.where(valid & (key >= thr), 1.0, 0.0), axis=-1, keepdims=True)
            else:
                val = jnp.sum(jnp.where(key >= thr, ek, 0.0), axis=-1, keepdims=True)
            # accumulate candidate c's count/mass across tiles in st["acc{c}"]
            st[f"acc{c}"] = st[f"acc{c}"] + val
        return st
    ek = jnp.where(kept, e, 0.0)
    if kind in ("mass_k", "mass"):
        st["wk" if kind == "mass_k" else "w"] = st["wk" if kind == "mass_k" else "w"] + jnp.sum(
            ek, axis=-1, keepdims=True)
        return st
    # cdf
    w_total = st["w"] if (0 < top_k < vocab or top_p < 1.0) else st["s"]
    target = u * w_total
    cnt, tsum = _in_tile_prefix_count(ek, target - st["base"], family)
    crossing = (st["found"] == 0) & (st["base"] + tsum > target) & (cnt < bv)
    x_at = jnp.sum(jnp.where(lcol == cnt, x, 0.0), axis=-1, keepdims=True)
    st["tok"] = jnp.where(crossing, col0 + cnt, st["tok"])
    st["xtok"] = jnp.where(crossing, x_at, st["xtok"])
    st["found"] = jnp.where(crossing, 1, st["found"])
    st["base"] = st["base"] + tsum
    last = jnp.max(jnp.where(kept, lcol, -1), axis=-1, keepdims=True)
    x_last = jnp.sum(jnp.where(lcol == last, x, 0.0), axis=-1, keepdims=True)
    st["xlast"] = jnp.where(last >= 0, x_last, st["xlast"])
    st["last"] = jnp.where(last >= 0, col0 + last, st["last"])
    return st


def _search_finish(kind, st, shift, *, top_k, top_p):
    """After a search pass over all tiles: fix the next radix digit, reset the accumulators."""
    st = dict(st)
    name = "kans" if kind == "topk" else "pans"
    if kind == "topk":
        bound = jnp.float32(top_k)
    else:
        bound = top_p * st["wk"]
    n_true = sum(jnp.where(st[f"acc{c}"] >= bound, 1, 0) for c in range(1, _N_CAND + 1))
    st[name] = st[name] | (n_true * (jnp.int32(1) << shift))
    for c in range(1, _N_CAND + 1):
        st[f"acc{c}"] = jnp.zeros_like(st[f"acc{c}"])
    return st


def _pass_finish(kind, st, *, vocab, top_k):
    st = dict(st)
    if kind == "stats" and not (0 < top_k < vocab):
        st["wk"] = st["s"]      # top-p without top-k: its target is a share of the whole mass
    return st


def _outputs(st, temperature):
    if temperature == 0.0:
        lse = st["m"] + jnp.log(st["s"])
        return st["arg"], st["m"] - lse
    lse = st["m"] / temperature + jnp.log(st["s"])
    tok = jnp.where(st["found"] == 1, st["tok"], st["last"])
    x_tok = jnp.where(st["found"] == 1, st["xtok"], st["xlast"])
    return tok, x_tok / temperature - lse


def _all_state(rows):
    st = _init_state(rows)
    st.update({f"acc{c}": jnp.zeros((rows, 1), jnp.float32) for c in range(1, _N_CAND + 1)})
    return st


def _pass_groups(passes):
    """[(kind, first pass index, count)] for runs of equal kinds."""
    groups = []
    for i, k in enumerate(passes):
        if groups and groups[-1][0] == k and k in ("topk", "topp"):
            groups[-1][2] += 1
        else:
            groups.append([k, i, 1])
    return [tuple(g) for g in groups]


def _triton_sampling_kernel(x_ref, u_ref, tok_ref, logp_ref, *, passes, bv, n_v, cfg):
    """One row block; each pass sweeps the row's ``n_v`` whole tiles of ``bv`` columns, then (a
    row whose width is not a multiple of bv, read unpadded) one more tile ending at the row's
    end, counting only its columns past the whole tiles."""
    rows = tok_ref.shape[0]
    width = x_ref.shape[1]
    u = u_ref[...]
    st = _all_state(rows)

    def sweep(kind, st, shift):
        def body(j, st):
            col0 = pl.multiple_of(j * bv, bv)
            x = x_ref[:, pl.ds(col0, bv)].astype(jnp.float32)
            return _tile_step(kind, st, x, col0, u, shift, **cfg)
        st = lax.fori_loop(0, n_v, body, st)
        if n_v * bv < width:
            x = x_ref[:, pl.ds(width - bv, bv)].astype(jnp.float32)
            st = _tile_step(kind, st, x, width - bv, u, shift, lo=n_v * bv, **cfg)
        return st

    for kind, _, count in _pass_groups(passes):
        if kind in ("topk", "topp"):
            def search(i, st, kind=kind):
                shift = jnp.int32(32 - _RADIX_BITS) - i * _RADIX_BITS
                st = sweep(kind, st, shift)
                return _search_finish(kind, st, shift, top_k=cfg["top_k"], top_p=cfg["top_p"])
            st = lax.fori_loop(0, count, search, st)
        else:
            st = _pass_finish(kind, sweep(kind, st, jnp.int32(0)), vocab=cfg["vocab"],
                              top_k=cfg["top_k"])
    tok, logp = _outputs(st, cfg["temperature"])
    tok_ref[...] = tok
    logp_ref[...] = logp


def _mosaic_sampling_kernel(x_ref, u_ref, tok_ref, logp_ref, *scratch, passes, names, cfg):
    p, j = pl.program_id(1), pl.program_id(2)
    n_v = pl.num_programs(2)
    refs = dict(zip(names, scratch))
    rows, bv = x_ref.shape

    @pl.when((p == 0) & (j == 0))
    def _():
        for k, v in _all_state(rows).items():
            refs[k][...] = v

    def load():
        return {k: r[...] for k, r in refs.items()}

    def store(st):
        for k, v in st.items():
            refs[k][...] = v

    x = x_ref[...].astype(jnp.float32)
    col0 = j * bv
    for kind, first, count in _pass_groups(passes):
        @pl.when((p >= first) & (p < first + count))
        def _(kind=kind, first=first):
            shift = jnp.int32(32 - _RADIX_BITS) - (p - first) * _RADIX_BITS
            st = _tile_step(kind, load(), x, col0, u_ref[...], shift, **cfg)

            @pl.when(j == n_v - 1)
            def _():
                if kind in ("topk", "topp"):
                    store(_search_finish(kind, st, shift, top_k=cfg["top_k"], top_p=cfg["top_p"]))
                else:
                    store(_pass_finish(kind, st, vocab=cfg["vocab"], top_k=cfg["top_k"]))

            @pl.when(j < n_v - 1)
            def _():
                store(st)

    @pl.when((p == len(passes) - 1) & (j == n_v - 1))
    def _():
        tok, logp = _outputs(load(), cfg["temperature"])
        tok_ref[...] = tok
        logp_ref[...] = logp


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
    if family == "triton":
        tok, logp = pl.pallas_call(
            functools.partial(_triton_sampling_kernel, passes=passes, bv=bv, n_v=n_v, cfg=cfg),
            grid=(spad // rows,),
            in_specs=[pl.BlockSpec((rows, vpad), lambda i: (i, 0)),
                      pl.BlockSpec((rows, 1), lambda i: (i, 0))],
            out_specs=[pl.BlockSpec((rows, 1), lambda i: (i, 0))] * 2,
            out_shape=out_shape,
            interpret=interpret_mode(),
            compiler_params=_backend.compiler_params("triton", num_warps=4, num_stages=2),
            name="sample_tokens",
        )(x, u)
    else:
        from jax.experimental.pallas import tpu as pltpu
        st = _all_state(rows)
        names = tuple(st)
        scratch = [pltpu.VMEM((rows, 1), st[k].dtype) for k in names]
        tok, logp = pl.pallas_call(
            functools.partial(_mosaic_sampling_kernel, passes=passes, names=names, cfg=cfg),
            grid=(spad // rows, len(passes), n_v),
            in_specs=[pl.BlockSpec((rows, bv), lambda i, p, j: (i, j)),
                      pl.BlockSpec((rows, 1), lambda i, p, j: (i, 0))],
            out_specs=[pl.BlockSpec((rows, 1), lambda i, p, j: (i, 0))] * 2,
            out_shape=out_shape,
            scratch_shapes=scratch,
            interpret=interpret_mode(),
            compiler_params=_backend.compiler_params(
                "mosaic", dimension_semantics=("parallel", "arbitrary", "arbitrary")),
            name="sample_tokens",
        )(x, u)
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
        "triton" (the jax_triton kernel of sampling_triton: GPU, plain/greedy sampling only).

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
        from pallas_kernels.sampling_triton import sample_tokens_triton
        fn = sample_tokens_triton
    else:
        fn = sample_tokens_pallas if use == "pallas" else sample_tokens_reference
    return fn(logits, uniforms, temperature=temperature, top_k=top_k, top_p=top_p)
