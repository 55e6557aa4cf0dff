"""pallas_kernels.fp8_gemm: the rollout's FP8 GEMM kernels (issue 41): every projection's input
quantized in the kernel per (token, 128 channels), the SwiGLU MLP's down projection fed in e4m3.

The kernels run interpreted here against their arithmetic written in jnp, against the bf16
projections and the per-token form the plain qwix GEMMs compute (the 1 x 128 scales are no
worse); the model's quantized layer takes them where cfg.mlp_impl resolves to them (GPU: "auto"
for a cuda target only, e4m3 weights only); their declared cost counts what their tiles read and
write.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

import pallas_kernels as pk
from pallas_kernels import fp8_gemm as fm

E4M3 = jnp.float8_e4m3fn


def _quantized(key, shape, spread=1.0):
    """e4m3 weights with one scale per output channel (absmax / 448), as models.precision keeps
    them, and the float32 weights they stand for."""
    w = jax.random.normal(key, shape) / np.sqrt(shape[0]) * spread
    s = jnp.max(jnp.abs(w), axis=0, keepdims=True) / fm.E4M3_MAX
    return (w / s).astype(E4M3), s.astype(jnp.bfloat16), w


def _inputs(t, d, i, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    # a few outlier tokens and channels, as real activations have
    x = jax.random.normal(ks[0], (t, d)) * (1 + 20 * (jnp.arange(d) % 17 == 0))
    x = (x * (1 + 5 * (jnp.arange(t) % 7 == 0))[:, None]).astype(jnp.bfloat16)
    (wg, sg, fg), (wu, su, fu), (wd, sd, fd) = (
        _quantized(k, s) for k, s in zip(ks[1:], [(d, i), (d, i), (i, d)]))
    return x, (wg, sg, wu, su, wd, sd), (fg, fu, fd)


def _close_e4m3(a, b):
    """e4m3 values equal but for rare one-step roundings (the kernels sum the K blocks in
    another order than the einsum, so a value on a rounding boundary may land either side)."""
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert np.mean(a == b) > 0.99
    np.testing.assert_allclose(a, b, rtol=0.13, atol=2.0 ** -9)


# T padded to a 64-token tile (100), whole tiles (128); input widths of 96 (32-channel blocks)
# and 384 (three 128-channel blocks)
@pytest.mark.parametrize("shape", [(100, 96, 128), (128, 384, 256)])
def test_mlp_kernels_equal_their_jnp_arithmetic(shape):
    x, w, _ = _inputs(*shape)
    t, d, i = shape
    y = fm.fp8_swiglu_mlp(x, *w)
    y_ref, aq_ref, sa_ref = fm.fp8_swiglu_mlp_reference(x, *w)
    assert y.shape == (t, d) and y.dtype == jnp.bfloat16
    # the gate/up kernel's e4m3 output and its scales
    xp = jnp.pad(x, ((0, -t % 64), (0, 0)))
    aq, sa = fm._gate_up(xp, *w[:4], 64)
    assert aq.dtype == E4M3 and sa.shape == (xp.shape[0], i // fm.ACT_BLOCK)
    _close_e4m3(aq[:t], aq_ref)
    np.testing.assert_allclose(np.asarray(sa[:t]), np.asarray(sa_ref), rtol=0.02)
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=2e-2 * np.abs(y_ref).max())
    assert np.abs(y).max() > 0


@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_equals_its_jnp_arithmetic_and_the_bf16_projection(bias):
    """fp8_linear (T padded, a K of three 128-channel blocks, N of 80: 16-wide output tiles),
    against fp8_linear_reference and the plain projection over the weights it stands for."""
    x, _, _ = _inputs(100, 384, 128)
    w, sw, wf = _quantized(jax.random.PRNGKey(7), (384, 80))
    b = jax.random.normal(jax.random.PRNGKey(8), (80,)).astype(jnp.bfloat16) if bias else None
    y = fm.fp8_linear(x, w, sw, b)
    want = fm.fp8_linear_reference(x, w, sw, b)
    assert y.shape == (100, 80) and y.dtype == jnp.bfloat16
    y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-2 * np.abs(want).max())
    plain = np.asarray(x.astype(jnp.float32) @ (w.astype(jnp.float32) * sw.astype(jnp.float32)))
    if bias:
        plain = plain + np.asarray(b, np.float32)
    err = np.sqrt(np.mean((y - plain) ** 2)) / np.sqrt(np.mean(plain ** 2))
    assert 0 < err < 0.05


def test_block_scales_are_no_worse_than_per_token_scales():
    """Against the bf16 MLP over the weights the e4m3 ones stand for: the kernels' error is at
    most the per-token form's (what qwix's GEMMs compute: the down projection's input quantized
    by each token's absmax), and a small fraction of the output."""
    x, w, (fg, fu, fd) = _inputs(64, 64, 512)
    f = lambda a: a.astype(jnp.float32)
    deq = [f(q) * f(s) for q, s in zip(w[::2], w[1::2])]           # the weights as stored
    exact = (jax.nn.silu(f(x) @ deq[0]) * (f(x) @ deq[1])) @ deq[2]
    per_token = lambda a: fm.block_quantize(a, a.shape[1])          # one scale per row
    xq, sx = per_token(x)
    g = (f(xq) @ f(w[0]) * sx * f(w[1])).astype(jnp.bfloat16)
    u = (f(xq) @ f(w[2]) * sx * f(w[3])).astype(jnp.bfloat16)
    aq, sa = per_token(jax.nn.silu(f(g)) * f(u))
    per_token = (f(aq) @ f(w[4])) * sa * f(w[5])
    err = lambda y: float(jnp.sqrt(jnp.mean((f(y) - exact) ** 2)))
    e_kernel, e_token = err(fm.fp8_swiglu_mlp(x, *w)), err(per_token)
    assert e_kernel <= e_token
    assert e_kernel < 0.05 * float(jnp.sqrt(jnp.mean(exact ** 2)))


def test_the_quantized_layer_takes_the_kernels_where_mlp_impl_says():
    """models.precision.fused_linear / fused_mlp inside a quantized decoder layer:
    mlp_impl="pallas" runs the kernels (interpreted on CPU), "reference" qwix's GEMMs (what
    "auto" is on CPU); both near the bf16 layer."""
    from brorl_jax.models import transformer
    from brorl_jax.models.precision import with_precision
    from brorl_jax.rollout.programs import rollout_layout
    cfg = tiny_model_config(dtype="bfloat16", intermediate_size=256)
    params = transformer.init_params(cfg, jax.random.PRNGKey(0))
    fp8 = with_precision(cfg, "fp8")
    layer = jax.jit(lambda p: rollout_layout(p, fp8))(params)["layers"][0]
    bf = jax.tree.map(lambda a: a[0].astype(jnp.bfloat16), params["layers"])
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 1, cfg.hidden_size), jnp.bfloat16)
    attn = jax.random.normal(jax.random.PRNGKey(2), (5, 1, cfg.num_attention_heads,
                                                     cfg.head_dim), jnp.bfloat16)
    f = lambda c, p: np.asarray(transformer.layer_finish(p, c, x, attn), np.float32)
    want, plain = f(cfg, bf), f(fp8.replace(mlp_impl="reference"), layer)
    kernels = f(fp8.replace(mlp_impl="pallas"), layer)
    scale = np.abs(want).max()
    assert not np.array_equal(kernels, plain)          # a different path really ran
    for got in (plain, kernels):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale)
    np.testing.assert_allclose(kernels, plain, rtol=0, atol=1e-2 * scale)


def test_auto_picks_the_kernels_for_cuda_and_e4m3_only(caplog, monkeypatch):
    from pallas_kernels import _backend
    monkeypatch.setattr(_backend, "_logged_fallbacks", set())
    x, w = (256, 1536), (1536, 8960)
    assert fm.resolve_impl("auto", x, w, E4M3) == (
        "reference" if pk.interpret_mode() else "pallas")
    with pk.compile_target("cuda"):
        assert fm.resolve_impl("auto", x, w, E4M3) == "pallas"
        caplog.set_level(logging.WARNING, logger="pallas_kernels")
        assert fm.resolve_impl("auto", x, (1536, 8968), E4M3) == "reference"
        assert fm.resolve_impl("auto", x, w, jnp.int8) == "reference"
        with pytest.raises(ValueError, match="intermediate size 8976 is not a multiple of 128"):
            fm.resolve_impl("pallas", (256, 8960), (8960, 8960 + 16), E4M3, swiglu=True)
        assert fm.resolve_impl("pallas", (256, 8960), (8960, 8960 + 16), E4M3) == "pallas"
    with pk.compile_target("tpu"):
        assert fm.resolve_impl("auto", x, w, jnp.int8) == "reference"
    msgs = [r.getMessage() for r in caplog.records if "fp8_gemm" in r.getMessage()]
    assert any("output width 8968" in m for m in msgs) and any("int8" in m for m in msgs)
    assert fm.resolve_impl("reference") == "reference"
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fm.fp8_swiglu_mlp(jnp.zeros((4, 32), jnp.bfloat16), *_inputs(4, 32, 200)[1])


def test_declared_cost_counts_the_gemms_and_the_tiles_reads():
    """Qwen2.5-1.5B at 256 decode slots: flops are the GEMMs'; bytes the outputs, the weights,
    their scales and biases once, the token rows once per wave of 132 programs (gate/up: 4 x 70
    programs, 3 waves; down: 4 x 12, 1 wave; q: 4 x 12, 1 wave)."""
    t, d, i = 256, 1536, 8960
    f8, f32, bf = (lambda *s: ("f8e4m3fn", s)), (lambda *s: ("f32", s)), (lambda *s: ("bf16", s))
    b, f = fm.fp8_gemm_kernel_cost(
        "fp8_swiglu_gate_up", [bf(t, d), f8(d, i), f8(d, i), bf(1, i), bf(1, i)],
        [f8(t, i), f32(t, i // 128)])
    assert f == 2 * 2 * t * d * i
    assert b == (t * i + 4 * t * i // 128) + (2 * d * i + 2 * 2 * i) + 3 * (2 * t * d)
    b, f = fm.fp8_gemm_kernel_cost("fp8_down", [f8(t, i), f32(t, i // 128), f8(i, d), bf(1, d)],
                                   [bf(t, d)])
    assert f == 2 * t * d * i
    assert b == 2 * t * d + (i * d + 2 * d) + (t * i + 4 * t * i // 128)
    b, f = fm.fp8_gemm_kernel_cost("fp8_linear", [bf(t, d), f8(d, d), bf(1, d), bf(1, d)],
                                   [bf(t, d)])
    assert f == 2 * t * d * d
    assert b == 2 * t * d + (d * d + 2 * d + 2 * d) + 2 * t * d
    with pytest.raises(ValueError, match="unknown kernel"):
        fm.fp8_gemm_kernel_cost("swiglu_gate_up", [f8(t, d)], [])


def test_e4m3_dots_are_lowered_for_hoppers_fp8_tensor_cores(monkeypatch):
    """fp8_gemm.enable_fp8_tensor_cores: lowered for cuda, each e4m3 dot of the kernels allows
    reduced-precision accumulation over its own K (<= 128), which is what makes Triton emit
    Hopper's FP8 wgmma (bench/compile_check.py's smem column shows "wgmma e4m3"; without it,
    "mma f16"); a bf16 kernel's dots are left as they were."""
    from jax._src.pallas.triton import lowering
    from jaxlib.mlir import ir

    from pallas_kernels import swiglu_mlp
    assert fm.enable_fp8_tensor_cores() and fm.enable_fp8_tensor_cores()   # idempotent
    real, seen = lowering.tt_dialect.dot.wrapped, []

    def spy(a, b, c, **kw):
        seen.append((str(ir.RankedTensorType(a.type).element_type),
                     kw.get("max_num_imprecise_acc")))
        return real(a, b, c, **kw)
    monkeypatch.setattr(type(lowering.tt_dialect), "dot",
                        staticmethod(fm._fp8_tensor_core_dot(spy)))
    lower = lambda fn, *args: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    x, w, _ = _inputs(64, 96, 256)
    with pk.compile_target("cuda"):
        lower(fm.fp8_swiglu_mlp, x, *w)
        lower(fm.fp8_linear, x, w[0], w[1])
        # D = 96: the gate/up and linear kernels' K blocks of 32; down's of 128 (its input I)
        assert set(seen) == {("f8E4M3FN", 32), ("f8E4M3FN", 128)}
        seen.clear()
        x, w, _ = _inputs(64, 128, 256)
        lower(fm.fp8_swiglu_mlp, x, *w)
        assert set(seen) == {("f8E4M3FN", 128)}
        seen.clear()
        bf = jnp.zeros((128, 128), jnp.bfloat16)
        lower(lambda a, g: swiglu_mlp.swiglu_mlp(a, g, g, g, impl="pallas"), bf, bf)
    assert seen and set(seen) == {("bf16", None)}
