"""pallas_kernels.swiglu_mlp: the SwiGLU MLP with its elementwise work inside the GEMMs.

The kernels run interpreted here (impl="pallas") against the plain XLA expression, in values and
in all four gradients; the model's MLP takes them where cfg.mlp_impl resolves to them (GPU);
under the "dots" remat policy the backward reruns no kernel (the saved names); "auto" picks the
kernels for a cuda target only, and the update step lowered for cuda holds them.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

import pallas_kernels as pk
from pallas_kernels import swiglu_mlp as sm


def _inputs(t, d, i, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (t, d))
    wg, wu = (jax.random.normal(k, (d, i)) / np.sqrt(d) for k in ks[1:3])
    wd = jax.random.normal(ks[3], (i, d)) / np.sqrt(i)
    ct = jax.random.normal(ks[4], (t, d))
    return tuple(a.astype(dtype) for a in (x, wg, wu, wd)), ct


# (T, D, I): T padded to a tile (40), whole tiles, and an intermediate size of 16-wide tiles
@pytest.mark.parametrize("shape", [(40, 32, 48), (128, 64, 128)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_equal_the_xla_mlp_in_values_and_gradients(shape, dtype):
    args, ct = _inputs(*shape, jnp.dtype(dtype))

    def loss(impl):
        return lambda *a: (sm.swiglu_mlp(*a, impl=impl).astype(jnp.float32) * ct).sum()

    y_k = sm.swiglu_mlp(*args, impl="pallas")
    y_r = sm.swiglu_mlp(*args, impl="reference")
    assert y_k.shape == y_r.shape and y_k.dtype == y_r.dtype == jnp.dtype(dtype)
    g_k = jax.grad(loss("pallas"), argnums=(0, 1, 2, 3))(*args)
    g_r = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(*args)
    # float32: summation order; bf16: the XLA expression rounds g, u, their product and d act
    # to bf16 between its kernels, the kernels keep them in float32 (a few bf16 ulps)
    rel = 2e-5 if dtype == "float32" else 3e-2
    for a, b in [(y_k, y_r), *zip(g_k, g_r)]:
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = float(np.abs(b).max())
        assert scale > 0
        np.testing.assert_allclose(a, b, rtol=0, atol=rel * scale)


def _tiny_model(mlp_impl, **over):
    return tiny_model_config(**dict(dict(intermediate_size=48, eos_token_ids=(0,),
                                         mlp_impl=mlp_impl), **over))


@pytest.mark.parametrize("remat", [False, "full", "dots"])
def test_the_model_with_the_kernels_gives_the_xla_values_and_gradients(remat):
    """forward() with mlp_impl="pallas" (the kernels, interpreted) equals mlp_impl="reference"
    (flax's Dense layers) over the same parameters, under each remat policy."""
    from brorl_jax.models import forward, init_params
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 64)
    params = init_params(_tiny_model("reference"), jax.random.PRNGKey(0))
    out = {}
    for impl in ("pallas", "reference"):
        cfg = _tiny_model(impl)
        loss = lambda p: (forward(p, cfg, tokens, return_hidden=True, remat=remat) ** 2).mean()
        out[impl] = jax.jit(jax.value_and_grad(loss))(params)
    (v_k, g_k), (v_r, g_r) = out["pallas"], out["reference"]
    np.testing.assert_allclose(float(v_k), float(v_r), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_r)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=1e-4 * float(np.abs(np.asarray(b)).max()) + 1e-12)
    assert float(jnp.abs(g_k["layers"]["gate_proj"]["kernel"]).max()) > 0


@pytest.mark.parametrize("remat,saved", [("dots", 2), ("full", 0)])
def test_dots_remat_saves_the_kernel_outputs_by_name(remat, saved):
    """Traced for cuda, a 2-layer forward under the "dots" policy keeps each layer's g and u
    (swiglu_mlp.SAVED_NAMES) for the backward, so the backward's kernel reads them and no
    gate/up GEMM is rerun (the optimized H100 program has one gate/up kernel per layer and pass:
    bench/_roofline_update.py); "full" keeps none of them."""
    from jax._src.ad_checkpoint import saved_residuals

    from brorl_jax.models import forward, init_params
    cfg = _tiny_model("auto", dtype="bfloat16", hidden_size=64, intermediate_size=128)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jnp.zeros((2, 32), jnp.int32)
    loss = lambda p: forward(p, cfg, tokens, return_hidden=True, remat=remat).astype(
        jnp.float32).sum()
    with pk.compile_target("cuda"):
        kept = [why for _, why in saved_residuals(loss, params)]
    for name in sm.SAVED_NAMES:
        assert sum(f"named '{name}'" in why for why in kept) == saved, (name, kept)


def test_auto_picks_the_kernels_for_cuda_only_and_says_why_not(caplog, monkeypatch):
    from pallas_kernels import _backend
    monkeypatch.setattr(_backend, "_logged_fallbacks", set())   # once per process: start afresh
    x, w = (4096, 1536), (1536, 8960)
    # here (CPU: the XLA expression), or on the GPU the device check runs these tests on
    assert sm.resolve_impl("auto", x, w, jnp.bfloat16) == (
        "reference" if pk.interpret_mode() else "pallas")
    with pk.compile_target("cuda"):
        assert sm.resolve_impl("auto", x, w, jnp.bfloat16) == "pallas"
        caplog.set_level(logging.WARNING, logger="pallas_kernels")
        assert sm.resolve_impl("auto", x, (1536, 8968), jnp.bfloat16) == "reference"
        with pytest.raises(ValueError, match="intermediate size 8968"):
            sm.resolve_impl("pallas", x, (1536, 8968), jnp.bfloat16)
        mesh = jax.sharding.AbstractMesh((2,), ("data",))
        with jax.sharding.use_abstract_mesh(mesh):
            assert sm.resolve_impl("auto", x, w, jnp.bfloat16) == "reference"
    with pk.compile_target("tpu"):
        assert sm.resolve_impl("auto", x, w, jnp.bfloat16) == "reference"
        with pytest.raises(ValueError, match="no TPU kernel"):
            sm.resolve_impl("pallas", x, w, jnp.bfloat16)
    msgs = [r.getMessage() for r in caplog.records if "swiglu_mlp" in r.getMessage()]
    assert any("8968" in m for m in msgs) and any("shard_map" in m for m in msgs)
    assert not any("TPU" in m for m in msgs)      # on TPU the XLA MLP is the design, not a fallback
    assert sm.resolve_impl("reference") == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        sm.resolve_impl("fused")


def test_declared_cost_counts_the_gemms_and_the_tiles_reads():
    """Qwen2.5-1.5B's MLP at 4096 tokens: flops are the GEMMs'; bytes are the outputs, the
    weights once and x once per wave of 132 programs (forward: 32 x 70 programs, 17 waves)."""
    t, d, i = 4096, 1536, 8960
    bf = lambda *s: ("bf16", s)
    b, f = sm.swiglu_mlp_kernel_cost("swiglu_gate_up", [bf(t, d), bf(d, i), bf(d, i)],
                                     [bf(t, i)] * 3)
    assert f == 2 * 2 * t * d * i
    assert b == 3 * t * i * 2 + 2 * d * i * 2 + 17 * t * d * 2
    # the backward's 256-token blocks: 16 x 70 programs, 9 waves; it writes d gate, d up, act
    b, f = sm.swiglu_mlp_kernel_cost("swiglu_bwd", [bf(t, d), bf(i, d), bf(t, i), bf(t, i)],
                                     [bf(t, i)] * 3)
    assert f == 2 * t * d * i
    assert b == 5 * t * i * 2 + d * i * 2 + 9 * t * d * 2
    with pytest.raises(ValueError, match="unknown kernel"):
        sm.swiglu_mlp_kernel_cost("mha_forward", [bf(t, d)], [])
