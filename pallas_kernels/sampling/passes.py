"""The sort-free sampling algorithm both kernel families run (triton.py, mosaic.py): one tile of
the vocabulary at a time, per-row state in [rows, 1] columns (plain jnp, so it lowers through
Triton and Mosaic alike and interprets on CPU).

A block of rows is swept over its vocabulary tiles several times ("passes"); per row only a few
column vectors of state survive between tiles, so no block ever holds a whole vocabulary row:
  stats     row max m and sum exp(x/T - m/T) (online), or for greedy the first argmax;
  topk x8   radix-16 search for the k-th largest key: per pass 4 bits, 15 candidate counts;
  mass      kept mass after top-k (the top-p target is a share of it);
  topp x8   radix-16 search for the nucleus threshold (15 candidate masses per pass);
  mass      final kept mass W;
  cdf       running prefix sum of the kept weights: the token is the first index whose
            inclusive prefix exceeds u * W (in-tile prefix: cumsum on Triton, a triangular
            matmul on 128-lane chunks on Mosaic, which has no cumsum).
Passes that filtering does not need are left out (plain sampling: stats + cdf).
Family "triton": one program per row block, each pass a loop over tiles read from global memory.
Family "mosaic": grid (row block, pass, tile), the tile DMA'd into VMEM, state in VMEM scratch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_RADIX_BITS = 4
_N_CAND = (1 << _RADIX_BITS) - 1
_N_SEARCH = 32 // _RADIX_BITS
_INT_MIN = -(1 << 31)
_CHUNK = 128   # Mosaic in-tile prefix sums: one [rows, 128] @ [128, 128] matmul per lane chunk


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
