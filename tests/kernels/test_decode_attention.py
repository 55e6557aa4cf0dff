"""pallas_kernels.decode_attention: reference == brute force over concatenated KV, kernels ==
reference (interpret mode on CPU, both the Triton and the Mosaic structure), over GQA ratios,
ragged prefix/suffix lengths, prompt pools with per-slot indices, empty slots and store rows; the
kernels lower for GPU and TPU at the real models' shapes."""
from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import CUSTOM_CALL

import pallas_kernels as pk
from pallas_kernels import targets as tg
from pallas_kernels.decode_attention import (
    FP8_KV_DTYPE,
    FP8_MAX,
    KVScales,
    default_page_size,
    dequantize_kv,
    quantize_kv,
    resolve_impl,
    shared_prefix_decode_attention,
    shared_prefix_decode_attention_pallas,
    shared_prefix_decode_attention_reference,
    slot_decode_attention,
    slot_decode_attention_pallas,
    slot_decode_attention_reference,
    slot_decode_attention_traffic,
)


def _inputs(b, n, h, hkv, dh, p, s, seed=0, dtype=jnp.float32):
    # numpy RNG: jax.random would compile one program per shape, which dominates these tiny tests
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    q, pk, pv = normal(b, n, h, dh), normal(b, p, hkv, dh), normal(b, p, hkv, dh)
    sk, sv = normal(b, n, s, hkv, dh), normal(b, n, s, hkv, dh)
    plen = rng.integers(1, p + 1, (b,))
    plen[0] = p
    slen = rng.integers(0, s + 1, (b, n))
    slen[0, 0] = s
    return q, pk, pv, jnp.asarray(plen, jnp.int32), sk, sv, jnp.asarray(slen, jnp.int32)


def _brute_force(q, pk, pv, plen, sk, sv, slen):
    """Softmax attention of each sample over concat(prompt KV[:plen], own KV[:slen]) in float64."""
    q, pk, pv, sk, sv = (np.asarray(a, np.float64) for a in (q, pk, pv, sk, sv))
    b, n, h, dh = q.shape
    g = h // pk.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        for j in range(n):
            k = np.concatenate([pk[i, : int(plen[i])], sk[i, j, : int(slen[i, j])]], 0)
            v = np.concatenate([pv[i, : int(plen[i])], sv[i, j, : int(slen[i, j])]], 0)
            for hh in range(h):
                sc = k[:, hh // g] @ q[i, j, hh] / np.sqrt(dh)
                w = np.exp(sc - sc.max())
                out[i, j, hh] = (w / w.sum()) @ v[:, hh // g]
    return out


# (B, N, H, Hkv, Dh, P, S): GQA ratios 1, 2, 4, 8 (MQA), ragged lengths
SHAPES = [
    (2, 5, 4, 2, 16, 37, 11),
    (1, 3, 4, 4, 8, 16, 8),
    (3, 4, 8, 2, 8, 9, 5),
    (2, 2, 8, 1, 16, 70, 33),
]


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]])
def test_reference_matches_brute_force(shape):
    args = _inputs(*shape)
    out = shared_prefix_decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(out), _brute_force(*args), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,family", [(SHAPES[0], "triton"), (SHAPES[3], "mosaic")])
def test_kernel_matches_reference(shape, family):
    args = _inputs(*shape, seed=1)
    ref = shared_prefix_decode_attention_reference(*args)
    # small blocks and tiles so the prompt and own-KV loops take several (partial) blocks
    out = shared_prefix_decode_attention_pallas(*args, family=family, tile=2, block_p=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_kernel_bfloat16_and_custom_scale():
    args = _inputs(2, 4, 4, 2, 16, 24, 7, seed=2, dtype=jnp.bfloat16)
    ref = shared_prefix_decode_attention_reference(*args, scale=0.3)
    out = shared_prefix_decode_attention(*args, scale=0.3, impl="pallas")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)


def test_auto_impl_is_chosen_by_backend():
    assert resolve_impl("auto") == ("reference" if jax.default_backend() == "cpu" else "pallas")


def test_bad_shapes_raise():
    q, pk, pv, plen, sk, sv, slen = _inputs(2, 3, 4, 2, 8, 12, 6)
    with pytest.raises(ValueError, match="multiple"):
        shared_prefix_decode_attention(q[:, :, :3], pk, pv, plen, sk, sv, slen)
    with pytest.raises(ValueError, match="suffix_len"):
        shared_prefix_decode_attention(q, pk, pv, plen, sk, sv, slen[:, :2])
    with pytest.raises(ValueError, match="prefix_k"):
        shared_prefix_decode_attention(q, pk[:1], pv, plen, sk, sv, slen)


# ----------------------------------------------------------------------------------------------
# The slot form: a pool of prompts, per-slot prompt index, paged own KV, a layer axis
# ----------------------------------------------------------------------------------------------


def _slot_inputs(b, k, h, hkv, dh, p, page, max_pages, *, layers=2, spare_pages=5, seed=0,
                 dtype=jnp.float32):
    """Slots with random prompts (20% empty), own lengths up to max_pages * page, each slot's
    pages scattered over a shared pool (a random permutation: no two slots share a page)."""
    rng = np.random.default_rng(seed)
    n_pages = b * max_pages + spare_pages

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    q = normal(b, h, dh)
    pk, pv = normal(layers, k, hkv, p, dh), normal(layers, k, hkv, p, dh)
    gk, gv = normal(layers, n_pages, hkv, page, dh), normal(layers, n_pages, hkv, page, dh)
    table = rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages)
    plen = rng.integers(1, p + 1, (k,))
    pidx = rng.integers(0, k, (b,))
    pidx[rng.random(b) < 0.2] = -1                      # empty slots
    slen = rng.integers(0, max_pages * page + 1, (b,))
    slen[0] = max_pages * page
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return q, pk, pv, i32(plen), i32(pidx), gk, gv, i32(table), i32(slen)


def _slot_brute_force(q, pk, pv, plen, pidx, gk, gv, table, slen, layer):
    q, pk, pv, gk, gv = (np.asarray(a, np.float64) for a in (q, pk, pv, gk, gv))
    b, h, dh = q.shape
    g = h // pk.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        if pidx[i] < 0:
            continue
        kp, n = int(pidx[i]), int(slen[i])
        own = lambda x: np.concatenate([x[layer, int(table[i, j])] for j in range(table.shape[1])],
                                       axis=1)[:, :n]          # [Hkv, n, Dh]
        k = np.concatenate([pk[layer, kp, :, : int(plen[kp])], own(gk)], 1)
        v = np.concatenate([pv[layer, kp, :, : int(plen[kp])], own(gv)], 1)
        for hh in range(h):
            sc = k[hh // g] @ q[i, hh] / np.sqrt(dh)
            w = np.exp(sc - sc.max())
            out[i, hh] = (w / w.sum()) @ v[hh // g]
    return out


# (slots, pool, H, Hkv, Dh, P, page, pages per slot): GQA 2 / 6 / 6, one to several pages
SLOT_SHAPES = [(13, 3, 4, 2, 16, 37, 16, 3), (8, 1, 6, 1, 8, 16, 16, 1), (24, 5, 12, 2, 16, 9, 8, 4)]


@pytest.mark.parametrize("shape", [SLOT_SHAPES[0], SLOT_SHAPES[2]])
def test_slot_reference_matches_brute_force(shape):
    args = _slot_inputs(*shape)
    out = slot_decode_attention_reference(*args, layer=1)
    np.testing.assert_allclose(np.asarray(out), _slot_brute_force(*args, 1), atol=2e-5, rtol=1e-5)


# GQA 20 on GPU: each slot's 20 rows in a 32-row register tile (masked past the slot's heads), 16
# slots of one prompt in three 6-slot prompt tiles (120 rows of 128, the last tile partly empty)
WIDE_GROUP = (16, 1, 40, 2, 8, 20, 16, 1)


@pytest.mark.parametrize("shape,family", [(SLOT_SHAPES[0], "mosaic"), (SLOT_SHAPES[1], "triton"),
                                          (WIDE_GROUP, "triton")])
def test_slot_kernels_match_reference(shape, family):
    """Both kernel structures (GPU: in-kernel loops, masked rows; TPU: scalar-prefetch grid),
    interpreted."""
    args = _slot_inputs(*shape, seed=4)
    layer = jnp.int32(1)       # traced, as in the decode loop's layer scan
    ref = slot_decode_attention_reference(*args, layer=layer)
    out = slot_decode_attention_pallas(*args, layer=layer, family=family)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_slot_reference_reads_uint16_pages_as_bfloat16():
    q, pk, pv, plen, pidx, gk, gv, table, slen = _slot_inputs(9, 2, 4, 2, 16, 12, 16, 2,
                                                              dtype=jnp.bfloat16, seed=5)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
    want = slot_decode_attention_reference(q, pk, pv, plen, pidx, gk, gv, table, slen, layer=0)
    got = slot_decode_attention_reference(q, pk, pv, plen, pidx, bits(gk), bits(gv), table, slen,
                                          layer=0)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_grouped_form_with_a_prompt_pool():
    q, pk, pv, plen, sk, sv, slen = _inputs(3, 4, 4, 2, 8, 12, 6, seed=6)
    pool_k, pool_v = pk[:2], pv[:2]
    index = jnp.asarray([[0, 1, 1, 0], [1, 1, -1, 0], [0, 0, 0, 1]], jnp.int32)
    out = shared_prefix_decode_attention(q, pool_k, pool_v, plen[:2], sk, sv, slen,
                                         prefix_index=index, impl="reference")
    for b in range(3):
        for n in range(4):
            if index[b, n] < 0:
                assert not np.asarray(out[b, n]).any()
                continue
            kp = int(index[b, n])
            want = _brute_force(q[b:b + 1, n:n + 1], pool_k[kp:kp + 1], pool_v[kp:kp + 1],
                                plen[kp:kp + 1], sk[b:b + 1, n:n + 1], sv[b:b + 1, n:n + 1],
                                slen[b:b + 1, n:n + 1])
            np.testing.assert_allclose(np.asarray(out[b, n]), want[0, 0], atol=2e-5)


# ----------------------------------------------------------------------------------------------
# Lowering for GPU (Triton) and TPU (Mosaic) at the real models' shapes, on this CPU machine
# (pallas_kernels/targets.py: MODEL_SHAPES, SLOT_DECODE_ATTENTION; full compiles of the same
# cases: bench/compile_check.py --kernels decode_attention_slots)
# ----------------------------------------------------------------------------------------------
# Qwen3-8B and Llama-3.1-8B have the same attention shape (32/8 heads of 128)
_ATTENTION_SHAPES = {(m.heads, m.kv_heads, m.head_dim): name
                     for name, m in reversed(tg.MODEL_SHAPES.items())}


def lower_slot_attention(platform, heads, kv_heads, head_dim, dtype, kv_dtype=None) -> str:
    """The lowered module text (``kv_dtype`` e4m3: with the KVScales of the store)."""
    c = tg.SLOT_DECODE_ATTENTION
    mesh = (jax.sharding.use_abstract_mesh(pk.tpu_abstract_mesh()) if platform == "tpu"
            else contextlib.nullcontext())
    with pk.compile_target(platform), mesh:
        page = default_page_size()
        b, k, p, own = c["slots"], c["pool"], c["prompt"], c["own"]
        sds = jax.ShapeDtypeStruct
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        pool = sds((c["layers"], k, kv_heads, p, head_dim), kv_dtype)
        pages = sds((c["layers"], int(b * own // page * c["page_fraction"]), kv_heads, page,
                     head_dim), kv_dtype)
        i32 = lambda *shape: sds(shape, jnp.int32)
        f32 = lambda x: sds(x.shape[:-1], jnp.float32)
        scales = ((KVScales(f32(pool), f32(pool), f32(pages), f32(pages)),)
                  if kv_dtype == FP8_KV_DTYPE else ())
        f = jax.jit(lambda q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer, *sc:
                    slot_decode_attention(q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer=layer,
                                          impl="pallas", kv_scales=sc[0] if sc else None))
        return f.trace(sds((b, heads, head_dim), dtype), pool, pool, i32(k), i32(b), pages,
                       pages, i32(b, own // page), i32(b), i32(), *scales).lower(
            lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", tg.DTYPES)
@pytest.mark.parametrize("shape", list(_ATTENTION_SHAPES), ids=list(_ATTENTION_SHAPES.values()))
@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_kernels_lower_for_gpu_and_tpu_at_model_shapes(platform, shape, dtype):
    text = lower_slot_attention(platform, *shape, jnp.dtype(dtype))
    # both kernels (prompt tiles, own KV) are in the lowered module as compiled custom calls
    assert text.count(CUSTOM_CALL[platform]) == 2
    assert "slot_decode_attention_prefix" in text and "slot_decode_attention_own" in text


def test_auto_falls_back_to_the_reference_where_the_kernels_do_not_compile():
    """On a target, impl="auto" takes the kernels for float stores and pages they read, the
    reference for a uint16 store (the CPU reference's bfloat16 bit patterns) or odd pages."""
    with pk.compile_target("cuda"):
        assert resolve_impl("auto", jnp.bfloat16, 16) == "pallas"
        assert resolve_impl("auto", jnp.uint16, 16) == "reference"
        assert resolve_impl("auto", jnp.float32, 24) == "reference"
        with pytest.raises(ValueError, match="page size"):
            resolve_impl("pallas", jnp.float32, 24)


# ----------------------------------------------------------------------------------------------
# An e4m3 KV store (issue 41): quantize_kv, and every form against dense attention over the
# dequantized KV (exact values, so the match is as tight as float32 attention)
# ----------------------------------------------------------------------------------------------


def test_quantize_kv_round_trip_is_within_e4m3_precision():
    rng = np.random.default_rng(7)
    mag = 10.0 ** rng.uniform(-6, 3, (3, 5, 1))            # rows of very different magnitudes
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * mag
    x[0, 0] = 0.0                                          # an all-zero row
    for dtype in (jnp.float32, jnp.bfloat16):
        xj = jnp.asarray(x, dtype)
        x8, scale = quantize_kv(xj)
        assert x8.dtype == FP8_KV_DTYPE and x8.shape == xj.shape
        assert scale.dtype == jnp.float32 and scale.shape == xj.shape[:-1]
        xf = np.asarray(xj, np.float32)
        amax = np.abs(xf).max(-1)
        err = np.abs(np.asarray(dequantize_kv(x8, scale)) - xf)
        assert np.all(err <= 2.0**-4 * amax[..., None])    # e4m3: 3 mantissa bits
        # per element: half an ulp of a normal e4m3 value, or of the subnormal step 2^-9
        assert np.all(err <= 2.0**-4 * np.abs(xf) + 2.0**-10 * np.asarray(scale)[..., None])
        # the row's largest element lands on +-448 (the whole e4m3 range is used); zeros stay 0
        top = np.abs(np.asarray(x8, np.float32)).max(-1)
        np.testing.assert_array_equal(top[amax > 0], FP8_MAX)
        assert not np.asarray(dequantize_kv(x8, scale))[0, 0].any() and np.isfinite(scale).all()


FP8_SHAPE = (7, 2, 4, 2, 16, 20, 16, 2)   # GQA 2, prompts of up to 20, two pages per slot


@functools.lru_cache(maxsize=None)
def _fp8_case():
    """Slots (_slot_inputs, layer 1 of 2) with the four KV arrays quantized (one jitted
    quantize_kv per array): (args with e4m3 KV, KVScales, the same args with the dequantized
    float32 KV, dense attention over those in float64 for f32 and for bf16 queries)."""
    q, pk, pv, plen, pidx, gk, gv, table, slen = _slot_inputs(*FP8_SHAPE, seed=8)
    quant = jax.jit(lambda *xs: [(x8, s, dequantize_kv(x8, s)) for x8, s in map(quantize_kv, xs)])
    (pk8, spk, pkd), (pv8, spv, pvd), (gk8, sgk, gkd), (gv8, sgv, gvd) = quant(pk, pv, gk, gv)
    deq = (q, pkd, pvd, plen, pidx, gkd, gvd, table, slen)
    want = {jnp.float32: _slot_brute_force(*deq, 1),
            jnp.bfloat16: _slot_brute_force(q.astype(jnp.bfloat16), *deq[1:], 1)}
    return ((q, pk8, pv8, plen, pidx, gk8, gv8, table, slen), KVScales(spk, spv, sgk, sgv),
            deq, want)


def test_fp8_kv_reference_matches_dense_attention_over_the_dequantized_kv():
    """The reference reads e4m3 blocks and their scale rows, from an e4m3 store (layer traced)
    or a uint8 one of its bit patterns (a pool without a layer axis), for f32 and bf16 queries
    (e4m3 widens to bf16 exactly: only p's rounding to bf16 for the PV dot is left)."""
    args, scales, _, want = _fp8_case()

    q, pk8, pv8, plen, pidx, gk8, gv8, table, slen = args
    bits = lambda x: jax.lax.bitcast_convert_type(x[1], jnp.uint8)      # layer 1, no layer axis
    u8 = (q, bits(pk8), bits(pv8), plen, pidx, bits(gk8), bits(gv8), table, slen)

    @jax.jit
    def forms(args, u8, scales):
        return (slot_decode_attention(*args, layer=jnp.int32(1), kv_scales=scales,
                                      impl="reference"),
                slot_decode_attention(*u8, kv_scales=KVScales(*(s[1] for s in scales)),
                                      impl="reference"),
                slot_decode_attention(q.astype(jnp.bfloat16), *args[1:], layer=1,
                                      kv_scales=scales, impl="reference"))

    compiled = forms.lower(args, u8, scales).compile()
    fp8, uint8, bf16 = compiled(args, u8, scales)
    # the stores are read as they are (e4m3, or its bits), a block at a time: XLA:CPU, which has
    # no e4m3 arithmetic, would otherwise widen each whole store to f16 per call
    stores = {",".join(map(str, x.shape)) for x in (args[1], args[5])}
    wide = {m.group(0) for m in re.finditer(r"\b(\w+)\[([\d,]+)\]", compiled.as_text())
            if m.group(2) in stores and m.group(1) not in ("u8", "f8e4m3fn")}
    assert not wide, wide
    for got in (fp8, uint8):
        np.testing.assert_allclose(np.asarray(got), want[jnp.float32], atol=2e-6, rtol=1e-5)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), want[jnp.bfloat16], atol=2e-2)


@pytest.mark.parametrize("family", ["triton", "mosaic"])
def test_fp8_kv_kernels_match_dense_attention_over_the_dequantized_kv(family):
    """Both kernel structures, interpreted: e4m3 blocks and scale rows loaded per prompt block
    (two of 16) and per page, dequantized in the kernel."""
    args, scales, _, want = _fp8_case()
    out = slot_decode_attention_pallas(*args, layer=jnp.int32(1), kv_scales=scales,
                                       family=family, block_p=16)
    np.testing.assert_allclose(np.asarray(out), want[jnp.float32], atol=2e-6, rtol=1e-5)


def test_fp8_kv_scales_are_checked_at_the_door():
    args, scales, deq, _ = _fp8_case()
    with pytest.raises(ValueError, match="kv_scales is None"):
        slot_decode_attention_reference(*args, layer=1)
    with pytest.raises(ValueError, match="an fp8 store is"):
        slot_decode_attention_pallas(*deq, layer=1, kv_scales=scales)
    bad = scales._replace(pages_v=scales.pages_v[..., :-1])
    with pytest.raises(ValueError, match=r"kv_scales.pages_v must be float32"):
        slot_decode_attention(*args, layer=1, kv_scales=bad)


_QWEN25_1P5B = next(s for s, n in _ATTENTION_SHAPES.items() if n == "qwen2.5-1.5b")
_HLO_DTYPES = {"bf16": "bfloat16", "f32": "float32", "i32": "int32", "f8E4M3FN": "float8_e4m3fn"}


@functools.lru_cache(maxsize=None)
def _lowered_calls(platform: str, fp8: bool) -> dict:
    """{kernel name: [(dtype name, shape)] of its custom call's operands} of the slot attention
    lowered for ``platform`` at Qwen2.5-1.5B's shapes (bf16 queries; e4m3 KV if ``fp8``)."""
    kv = FP8_KV_DTYPE if fp8 else jnp.bfloat16
    text = lower_slot_attention(platform, *_QWEN25_1P5B, jnp.bfloat16, kv_dtype=kv)
    calls = {}
    for line in text.splitlines():
        if CUSTOM_CALL[platform] in line and "stablehlo.custom_call" in line:
            name = next(n for n in ("slot_decode_attention_prefix", "slot_decode_attention_own")
                        if n in line)
            types = re.search(r"\} : \((.*?)\) ->", line).group(1)
            calls[name] = [(_HLO_DTYPES[d], tuple(int(x) for x in dims.split("x") if x))
                           for dims, d in re.findall(r"tensor<((?:\d+x)*)(\w+)>", types)]
    return calls


@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_fp8_kernels_lower_for_gpu_and_tpu_and_declare_their_bytes(platform):
    """Both kernels lower with e4m3 operands and two float32 scale rows after each call's KV; the
    traffic declaration (bench/roofline.py) finds q and the KV by position with or without them,
    counts the KV at 1 byte and 4 bytes of scale row per position of K and of V."""
    calls = _lowered_calls(platform, True)
    family = "triton" if platform == "cuda" else "mosaic"
    dh = _QWEN25_1P5B[2]
    for name in ("slot_decode_attention_prefix", "slot_decode_attention_own"):
        ops = calls[name]
        assert sum(d == "float8_e4m3fn" for d, _ in ops) == 2
        declare = lambda o: slot_decode_attention_traffic(
            name, o, group=_QWEN25_1P5B[0] // _QWEN25_1P5B[1], slots_per_prompt=[16] * 4,
            prompt_len=1000, own_len=300.5, family=family)[0]
        scale_at = [i for i, (d, s) in enumerate(ops) if d == "float32" and len(s) == 5]
        assert len(scale_at) == 2 and scale_at[1] == scale_at[0] + 1
        plain = [o for i, o in enumerate(ops) if i not in scale_at]
        b16 = [("bfloat16", s) if d == "float8_e4m3fn" else (d, s) for d, s in plain]
        assert b16 == _lowered_calls(platform, False)[name]   # the scale rows are all that's new
        kv_elems = declare(b16) - declare(plain)              # KV bytes at 2 minus at 1 byte
        assert kv_elems > 0
        # a float32 scale per position of K and of V, against Dh one-byte elements each
        assert declare(ops) - declare(plain) == pytest.approx(kv_elems * 4 / dh)


def test_auto_takes_the_kernels_for_an_fp8_store_on_gpu_and_tpu():
    for platform in CUSTOM_CALL:
        with pk.compile_target(platform):
            assert resolve_impl("auto", FP8_KV_DTYPE, default_page_size()) == "pallas"
            assert resolve_impl("auto", jnp.uint8, default_page_size()) == "reference"
