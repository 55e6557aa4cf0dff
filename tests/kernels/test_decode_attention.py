"""pallas_kernels.decode_attention: reference == brute force over concatenated KV, kernels ==
reference (interpret mode on CPU, both the Triton and the Mosaic structure), over GQA ratios,
ragged prefix/suffix lengths, prompt pools with per-slot indices, empty slots and store rows; the
kernels lower for GPU and TPU at the real models' shapes."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import CUSTOM_CALL

import pallas_kernels as pk
from pallas_kernels import targets as tg
from pallas_kernels.decode_attention import (
    default_page_size,
    resolve_impl,
    shared_prefix_decode_attention,
    shared_prefix_decode_attention_pallas,
    shared_prefix_decode_attention_reference,
    slot_decode_attention,
    slot_decode_attention_pallas,
    slot_decode_attention_reference,
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


@pytest.mark.parametrize("shape,family", [(SLOT_SHAPES[0], "mosaic"), (SLOT_SHAPES[1], "triton")])
def test_slot_kernels_match_reference(shape, family):
    """Both kernel structures (GPU: in-kernel loops; TPU: scalar-prefetch grid), interpreted."""
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


def lower_slot_attention(platform, heads, kv_heads, head_dim, dtype) -> str:
    c = tg.SLOT_DECODE_ATTENTION
    mesh = (jax.sharding.use_abstract_mesh(pk.tpu_abstract_mesh()) if platform == "tpu"
            else contextlib.nullcontext())
    with pk.compile_target(platform), mesh:
        page = default_page_size()
        b, k, p, own = c["slots"], c["pool"], c["prompt"], c["own"]
        sds = jax.ShapeDtypeStruct
        pool = sds((c["layers"], k, kv_heads, p, head_dim), dtype)
        pages = sds((c["layers"], int(b * own // page * c["page_fraction"]), kv_heads, page,
                     head_dim), dtype)
        i32 = lambda *shape: sds(shape, jnp.int32)
        f = jax.jit(lambda q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer: slot_decode_attention(
            q, pk_, pv, pln, pidx, gk, gv, tab, sln, layer=layer, impl="pallas"))
        return f.trace(sds((b, heads, head_dim), dtype), pool, pool, i32(k), i32(b), pages,
                       pages, i32(b, own // page), i32(b), i32()).lower(
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
