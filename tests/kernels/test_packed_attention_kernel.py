"""pallas_kernels.packed_attention: causal flash attention within the segments of packed rows.

Both kernel families interpret on CPU and must equal the jnp reference in values and in the
gradients of q, k, v (real tokens only: padding outputs are unspecified), on rows holding several
segments, grouped-query heads, a width that is not a whole number of tiles, and tiles small
enough that the causal block skipping is exercised. Lowered for cuda and for tpu (abstract TPU
mesh) the forward + backward holds the kernels' custom calls and no [T, T] array.
"""
from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import CUSTOM_CALL

import pallas_kernels as pk
from pallas_kernels.packed_attention import (
    packed_attention,
    packed_attention_cost,
    packed_attention_reference,
)


def _segments(width, lengths):
    seg = np.zeros((len(lengths), width), np.int32)
    for r, lens in enumerate(lengths):
        seg[r, :sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    return jnp.asarray(seg)


def _inputs(b, t, h, hkv, dh, seed=0):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return mk(b, t, h, dh), mk(b, t, hkv, dh), mk(b, t, hkv, dh), mk(b, t, h, dh)


def _check_against_reference(family, dims, lengths, block):
    b, t, h, hkv, dh = dims
    q, k, v, w = _inputs(b, t, h, hkv, dh)
    seg = _segments(t, lengths)
    real = (seg > 0)[..., None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v, seg), 0.0) * w)

    kernel = lambda q, k, v, s: packed_attention(q, k, v, s, impl="pallas", family=family,
                                                 block=block)
    got, g_got = jax.jit(jax.value_and_grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    want, g_want = jax.value_and_grad(loss(packed_attention_reference), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    out = kernel(q, k, v, seg)
    ref = packed_attention_reference(q, k, v, seg)
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), atol=2e-5)
    for name, a, r in zip("qkv", g_got, g_want):
        np.testing.assert_allclose(a, r, atol=5e-5, err_msg=f"d{name}")
    # the segments are really separate: a segment's outputs ignore the other segments' keys
    k2 = k.at[:, :lengths[0][0]].add(1.0)
    moved = kernel(q, k2, v, seg)
    later = slice(lengths[0][0], sum(lengths[0]))
    np.testing.assert_allclose(moved[0, later], out[0, later], atol=1e-5)


def test_triton_family_matches_reference():
    # 2 rows of width 40 (3 tiles of 16, the last padded): segments (11, 15, 9) + 5 padding and
    # (33) + 7 padding; 2 query heads over 1 key/value head
    _check_against_reference("triton", (2, 40, 2, 1, 16), [(11, 15, 9), (33,)], block=16)


@pytest.mark.slow
def test_mosaic_family_matches_reference():
    # TPU tiles are 128 wide: width 200 (2 tiles, the last padded), three segments + padding
    _check_against_reference("mosaic", (1, 200, 1, 1, 128), [(90, 60, 40)], block=128)


def test_auto_is_the_reference_on_cpu_and_checks_shapes():
    q, k, v, _ = _inputs(1, 8, 2, 1, 16)
    seg = _segments(8, [(5, 3)])
    np.testing.assert_array_equal(packed_attention(q, k, v, seg),
                                  packed_attention_reference(q, k, v, seg))
    with pytest.raises(ValueError, match="segment_ids"):
        packed_attention(q, k, v, seg[:, :4])
    with pytest.raises(ValueError, match="impl"):
        packed_attention(q, k, v, seg, impl="flash")


@contextlib.contextmanager
def _target(platform):
    with pk.compile_target(platform), contextlib.ExitStack() as stack:
        if platform == "tpu":
            stack.enter_context(jax.sharding.use_abstract_mesh(pk.tpu_abstract_mesh()))
        yield


def has_square(text: str, t: int) -> bool:
    """True if the module text holds an array with two trailing [t, t] dimensions."""
    return re.search(rf"\b{t}x{t}x", text) is not None


@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_forward_and_backward_lower_to_the_kernels_without_a_square(platform):
    from lowering import attention_fwd_bwd_text
    b, t, h, hkv, dh = 2, 256, 4, 2, 128
    sds = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    with _target(platform):
        text = attention_fwd_bwd_text(packed_attention, platform, b, t, h, hkv, dh)
    # GPU: forward, backward preprocessing, backward; TPU: forward, dK/dV, dQ
    assert text.count(CUSTOM_CALL[platform]) == 3
    assert not has_square(text, t)
    # the reference on the same shapes does hold one (the test can fail)
    ref = jax.jit(lambda q, k, v, s: packed_attention_reference(q, k, v, s)).trace(
        sds(b, t, h, dh), sds(b, t, hkv, dh), sds(b, t, hkv, dh), sds(b, t, dt=jnp.int32)).lower(
        lowering_platforms=(platform,)).as_text()
    assert has_square(ref, t)


def test_declared_cost_counts_the_causal_half():
    c = packed_attention_cost(8, 2048, 12, 128, 2)
    full = 8 * 12 * 2 * 2 * 2048 * 2048 * 128          # both matmuls over all T x T
    # 16 query tiles of 128: 136 of the 256 tile pairs (causal half + diagonal)
    assert c["forward"]["flops"] == pytest.approx(full * 136 / 256)
    assert full / 2 < c["forward"]["flops"] < 0.55 * full
    assert c["backward"]["flops"] > 3 * c["forward"]["flops"]
    assert c["forward"]["bytes"] >= 8 * 2048 * 12 * 128 * 2 * 4     # q, k, v, out at least
    assert c["tile_loads"]["forward"] > 4 * c["forward"]["bytes"]


@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_packed_update_step_lowers_with_the_kernel_and_no_square(platform):
    """The whole update step (pi_old pass, remat, two mini-batches) over packed rows with the
    default attention_impl: the attention kernels are in the program, no [T, T] array is, and
    the layers read per-layer buffers: nothing in the compute dtype (a layer's weights, a
    rematerialised layer's saved activations) is sliced out of a layer stack (the scan's
    dynamic_slice, a copy per layer and pass on the device; models.transformer.layer_loop_form)."""
    from lowering import T, kernel_names, packed_update_text
    with _target(platform):
        text = packed_update_text(platform, rows=4, hidden=128, kv_heads=1,
                                  rollouts_per_prompt=2, micro_batch_size=1)
    for name in kernel_names(platform):
        assert name in text
    assert not has_square(text, T)
    sliced = re.findall(r"stablehlo.dynamic_slice %\S+, [^:]*: \((tensor<[0-9x]*xbf16>)", text)
    assert "stablehlo.dynamic_slice" in text and not sliced, sorted(set(sliced))


def test_auto_falls_back_under_an_auto_partitioned_mesh():
    """Outside shard_map on a mesh GSPMD cannot partition the kernel: "auto" takes the reference
    (logged), so a sharded update still compiles; the kernel needs a shard_map there."""
    from pallas_kernels.packed_attention import resolve_impl
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    shape_q, shape_k = (2, 256, 4, 128), (2, 256, 2, 128)
    with pk.compile_target("cuda"):
        assert resolve_impl("auto", shape_q, shape_k, jnp.bfloat16) == "pallas"
        with jax.sharding.use_abstract_mesh(mesh):
            assert resolve_impl("auto", shape_q, shape_k, jnp.bfloat16) == "reference"
