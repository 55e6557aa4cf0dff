"""pallas_kernels.grouped_gemm (the MoE experts' grouped GEMM) against jax.lax.ragged_dot.

The Hopper kernels run in Mosaic GPU's interpreter and megablox in Pallas's TPU interpreter on
this CPU: values and gradients (x and w) equal the reference's, with an empty group, rows past the
groups and a row count that is not a multiple of the tile. The model-level tests check the MoE
block through the kernel against the dense reference and what the lowered programs call."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import grouped_gemm as gg

M, G, K, N = 200, 4, 128, 64          # rows (not a multiple of 64), groups, contraction, columns
SIZES = (70, 0, 50, 64)               # an empty group; 184 of the 200 rows in groups


def _inputs():
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(kw, (G, K, N), jnp.float32)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (M, N), jnp.float32)
    return x, w, dy, jnp.asarray(SIZES, jnp.int32)


@pytest.mark.parametrize("impl", ["hopper", "megablox"])
def test_kernel_values_and_gradients_equal_ragged_dot(impl):
    x, w, dy, sizes = _inputs()

    def loss(fn, x, w):
        return jnp.sum(fn(x, w, sizes).astype(jnp.float32) * dy)

    kernel = lambda x, w, s: gg.grouped_gemm(x, w, s, impl=impl)
    got = kernel(x, w, sizes)
    want = gg.grouped_gemm_reference(x, w, sizes)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(got[184:], np.float32), 0.0)   # past the groups
    assert float(jnp.abs(got[:184].astype(jnp.float32)).max()) > 1.0
    got_g = jax.grad(functools.partial(loss, kernel), (0, 1))(x, w)
    want_g = jax.grad(functools.partial(loss, gg.grouped_gemm_reference), (0, 1))(x, w)
    for a, b in zip(got_g, want_g):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = np.abs(b).max()
        assert scale > 1.0
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * scale)
    np.testing.assert_array_equal(np.asarray(got_g[1][1], np.float32), 0.0)  # the empty group


def test_auto_picks_the_kernel_by_platform_and_falls_back_where_it_does_not_fit():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert gg.resolve("auto", (M, K), (G, K, N), bf16) == "reference"          # CPU
    with pk.compile_target("cuda"):
        assert gg.resolve("auto", (M, K), (G, K, N), bf16) == "hopper"
        assert gg.resolve("auto", (M, K), (G, K, N), f32) == "reference"       # dtype
        assert gg.resolve("auto", (M, 96), (G, 96, N), bf16) == "reference"    # K % 64
    with pk.compile_target("tpu"):
        assert gg.resolve("auto", (M, K), (G, K, N), f32) == "megablox"
    x, w, _, sizes = _inputs()
    with pytest.raises(ValueError, match="multiples of 64"):
        gg.grouped_gemm(x[:, :96], w[:, :96], sizes, impl="hopper")
    with pytest.raises(ValueError, match="impl must be one of"):
        gg.resolve("triton", (M, K), (G, K, N), bf16)
    with pytest.raises(ValueError, match=r"expected \[M, K\], \[G, K, N\], \[G\]"):
        gg.grouped_gemm(x, w, sizes[:3])


def test_moe_block_through_the_hopper_kernel_equals_the_dense_reference():
    from brorl_jax.models.moe import _experts_sorted, experts_dense, route
    n, d, e, k, i = 40, 64, 4, 2, 64
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (n, d)).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[1], (n, e)).at[:, 3].set(-30.0)       # expert 3 unused
    ws = [(0.3 * jax.random.normal(kk, s)).astype(jnp.bfloat16)
          for kk, s in zip(ks[2:], [(e, d, i), (e, d, i), (e, i, d)])]
    hopper = lambda *a: _experts_sorted(*a, functools.partial(gg.grouped_gemm, impl="hopper"))

    def loss(fn, x, ws):
        ids, gates = route(logits, k, True)
        return jnp.sum(fn(x, ids, gates, *ws).astype(jnp.float32) ** 2)

    got = jax.value_and_grad(functools.partial(loss, hopper), (0, 1))(x, ws)
    want = jax.value_and_grad(functools.partial(loss, experts_dense), (0, 1))(x, ws)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-2)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=3e-2 * np.abs(b).max())
    np.testing.assert_array_equal(np.asarray(got[1][1][0][3], np.float32), 0.0)


def test_the_moe_forward_lowers_to_the_kernel_for_gpu_and_tpu_also_under_a_mesh():
    """moe_impl "grouped" (the default): the Qwen3-MoE forward traced for a GPU calls the Mosaic
    GPU kernel, for a TPU megablox; under an auto-partitioned mesh (fsdp = 2) the kernel runs per
    device inside shard_map (GSPMD cannot split it); on CPU it is jax.lax.ragged_dot (no call)."""
    from testutil import tiny_model_config

    from brorl_jax.models import forward, init_params
    mc = tiny_model_config(model_type="qwen3_moe", attention_bias=False, qk_norm=True,
                           hidden_size=64, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, norm_topk_prob=True, dtype="bfloat16")
    assert mc.moe_impl == "grouped"
    params = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    fwd = jax.jit(lambda p, t: forward(p, mc, t))

    def lowered(platform):
        return fwd.trace(params, tokens).lower(lowering_platforms=(platform,)).as_text()

    assert "mosaic_gpu" not in lowered("cpu") and "tpu_custom_call" not in lowered("cpu")
    with pk.compile_target("cuda"):
        assert gg.CUSTOM_CALLS["hopper"] in lowered("cuda")
        mesh = jax.sharding.AbstractMesh((2,), ("fsdp",))
        with jax.sharding.use_abstract_mesh(mesh):
            text = lowered("cuda")
        assert gg.CUSTOM_CALLS["hopper"] in text and "manual" in text
    with pk.compile_target("tpu"), jax.sharding.use_abstract_mesh(pk.tpu_abstract_mesh()):
        assert gg.CUSTOM_CALLS["megablox"] in lowered("tpu")


def test_sharded_steps_trace_a_kernel_moe_model_under_its_mesh_even_without_an_expert_axis():
    """algo.sharded_steps.traced_on: a MoE model whose experts run the kernel (GPU/TPU) is traced
    under the mesh, so its blocks run the kernel per device (shard_map); a dense model, or the
    same model where the kernel does not run (CPU), keeps the plain trace."""
    from testutil import tiny_model_config

    from brorl_jax.algo.sharded_steps import traced_on
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))
    moe = tiny_model_config(model_type="qwen3_moe", attention_bias=False, qk_norm=True,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            norm_topk_prob=True)
    ambient = jax.sharding.get_abstract_mesh
    assert traced_on(mesh, ambient, moe)().empty                                # CPU: ragged_dot
    with pk.compile_target("cuda"):
        assert traced_on(mesh, ambient, moe)() == mesh.abstract_mesh
        assert traced_on(mesh, ambient, tiny_model_config())().empty           # dense
        ragged = moe.replace(moe_impl="ragged")
        assert traced_on(mesh, ambient, ragged)().empty
