"""fused_logprob (Pallas kernel, interpreted on CPU, and the chunked jnp path) against the naive
full-logits reference: values and gradients, float32 and bfloat16."""
import jax
import jax.numpy as jnp
import numpy as np
import procs
import pytest

from pallas_kernels import fused_logprob, fused_logprob_stats, interpret_mode
from pallas_kernels.fused_logprob import resolve_impl
from pallas_kernels.fused_logprob.reference import (
    fused_logprob_reference,
    fused_logprob_stats_reference,
)

# Odd sizes on purpose: T and V are not multiples of any tile, so padding/tail code runs.
T, D, V = 37, 32, 300
TEMP = 0.7


def _inputs(dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    h = jax.random.normal(k[0], (T, D)).astype(dtype)
    w = (jax.random.normal(k[1], (D, V)) * 0.5).astype(dtype)
    tg = jax.random.randint(k[2], (T,), 0, V)
    g_logp = jax.random.normal(k[3], (T,))
    g_ent = jax.random.normal(k[4], (T,))
    return h, w, tg, g_logp, g_ent


def _value_and_grads(impl, h, w, tg, g_logp, g_ent, **kw):
    """Values plus gradients of the scalar sum(g_logp * logp + g_ent * entropy): exercises both
    cotangent paths of the custom VJP at once."""
    def f(h, w):
        if impl == "reference":
            lp, en = fused_logprob_reference(h, w, tg, temperature=TEMP)
        else:
            lp, en = fused_logprob(h, w, tg, temperature=TEMP, impl=impl, **kw)
        return jnp.sum(g_logp * lp) + jnp.sum(g_ent * en), (lp, en)

    (_, (lp, en)), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)
    return lp, en, dh, dw


ON_DEVICE = jax.default_backend() in ("gpu", "tpu")
DEVICE_FAMILY = "mosaic" if jax.default_backend() == "tpu" else "triton"
CASES = [
    ("chunked", dict(block_t=8, block_v=64)),          # vocab tail chunk (300 = 4 * 64 + 44)
    ("chunked", dict(block_t=64, block_v=512)),        # one block each way
    ("pallas", dict(block_t=16, block_v=128, family="triton")),   # padded vocab, masked columns
    ("pallas", dict(block_t=16, block_v=128, block_d=16, family="triton")),  # two D tiles
    ("pallas", dict(block_t=16, block_v=128, family="mosaic")),   # vocab tiles as a grid axis
]


def _skip_other_family(kw):
    """On CPU both kernel families interpret; on a device only the target's compiles."""
    if ON_DEVICE and kw.get("family", DEVICE_FAMILY) != DEVICE_FAMILY:
        pytest.skip(f"the {kw['family']} family does not compile for {jax.default_backend()}")


@pytest.mark.parametrize("impl,kw", CASES)
def test_matches_reference_float32(impl, kw):
    _skip_other_family(kw)
    args = _inputs()
    ref = _value_and_grads("reference", *args)
    out = _value_and_grads(impl, *args, **kw)
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_lm_head"), out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("impl,kw", [CASES[0], CASES[2], CASES[4]])
def test_matches_reference_bfloat16(impl, kw):
    """bf16 inputs: both paths accumulate logits in f32, so values agree with the f32-accumulated
    reference to ~1e-2; gradients go through a bf16 matmul (dz cast to bf16) and agree to ~3e-2
    relative to their scale (stated tolerance)."""
    _skip_other_family(kw)
    args = _inputs(jnp.bfloat16)
    ref = _value_and_grads("reference", *args)
    out = _value_and_grads(impl, *args, **kw)
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_lm_head"), out, ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(np.abs(b).max(), 1.0)
        assert np.abs(a - b).max() <= 3e-2 * scale, (name, np.abs(a - b).max(), scale)
        assert out[2].dtype == jnp.bfloat16 and out[3].dtype == jnp.bfloat16


def test_gradient_is_finite_difference_correct():
    """Independent of the reference: a directional finite difference of the chunked path."""
    h, w, tg, g_logp, g_ent = _inputs(seed=3)
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    gl64, ge64, tg_np = np.asarray(g_logp, np.float64), np.asarray(g_ent, np.float64), np.asarray(tg)

    def scalar(hh, ww):  # float64 numpy, full softmax
        z = hh @ ww / TEMP
        z = z - z.max(1, keepdims=True)
        logp_all = z - np.log(np.exp(z).sum(1, keepdims=True))
        p = np.exp(logp_all)
        return float(np.sum(gl64 * logp_all[np.arange(T), tg_np]) + np.sum(ge64 * -(p * logp_all).sum(1)))

    _, _, dh, dw = _value_and_grads("chunked", h, w, tg, g_logp, g_ent, block_t=8, block_v=64)
    rng = np.random.default_rng(0)
    u_h, u_w = rng.normal(size=h64.shape), rng.normal(size=w64.shape)
    eps = 1e-5
    fd = (scalar(h64 + eps * u_h, w64 + eps * u_w) - scalar(h64 - eps * u_h, w64 - eps * u_w)) / (2 * eps)
    analytic = float(np.sum(np.asarray(dh) * u_h) + np.sum(np.asarray(dw) * u_w))
    assert abs(fd - analytic) <= 1e-4 * max(1.0, abs(fd))


@pytest.mark.parametrize("impl,kw", [CASES[0], CASES[4]])
def test_stats_match_reference(impl, kw):
    _skip_other_family(kw)
    h, w, tg, _, _ = _inputs(seed=1)
    ns = [1, 16, 512]
    out = fused_logprob_stats(h, w, tg, temperature=TEMP, impl=impl, unsampled_n=ns, **kw)
    ref = fused_logprob_stats_reference(h, w, tg, temperature=TEMP, unsampled_n=ns)
    assert out["sum_p2_unsampled"].shape == (T, len(ns))
    for k in ref:
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(ref[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    # Lemma 2 / Corollary 3: the unsampled second moment falls with n.
    u = np.asarray(out["sum_p2_unsampled"])
    assert np.all(u[:, 0] >= u[:, 1]) and np.all(u[:, 1] >= u[:, 2])


def test_jit_and_large_logits_stay_finite():
    """Under jit, and with logits large enough that a naive exp would overflow in f32."""
    h, w, tg, _, _ = _inputs(seed=2)
    f = jax.jit(lambda h, w: fused_logprob(h * 40.0, w, tg, impl="chunked", block_t=16, block_v=64))
    lp, en = f(h, w)
    ref_lp, ref_en = fused_logprob_reference(h * 40.0, w, tg)
    assert np.all(np.isfinite(lp)) and np.all(np.isfinite(en))
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(en, ref_en, atol=1e-3)


def test_auto_picks_chunked_on_cpu_and_naive_is_reference():
    if interpret_mode():
        assert resolve_impl("auto") == "chunked"
    else:
        assert resolve_impl("auto") == "pallas"
    h, w, tg, _, _ = _inputs()
    a = fused_logprob(h, w, tg, impl="naive")
    b = fused_logprob_reference(h, w, tg)
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("bad,match", [
    (dict(hidden=jnp.zeros((2, 3, 4))), "hidden must be"),
    (dict(lm_head=jnp.zeros((5, V))), "disagree on D"),
    (dict(targets=jnp.zeros((T + 1,), jnp.int32)), "targets must be"),
    (dict(targets=jnp.zeros((T,), jnp.float32)), "integer token ids"),
    (dict(temperature=0.0), "temperature"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_bad_input_gives_clear_error(bad, match):
    h, w, tg, _, _ = _inputs()
    kw = dict(hidden=h, lm_head=w, targets=tg)
    kw.update(bad)
    opts = {k: kw.pop(k) for k in ("temperature", "impl") if k in kw}
    with pytest.raises(ValueError, match=match):
        fused_logprob(kw["hidden"], kw["lm_head"], kw["targets"], **opts)


def test_vocab_split_over_a_mesh_axis_matches_reference():
    """fused_logprob_vocab_shard inside shard_map (4 simulated CPU devices, vocab over 2 of them):
    per-shard kernel/chunked stats merged with collectives, values and both gradients against the
    unsharded reference; also through brorl_jax.parallel.vocab_parallel_logprob(impl="pallas")."""
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = procs.run([sys.executable, os.path.join(here, "_vocab_shard_worker.py")], env=env,
                     capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(" ok ") == 3, proc.stdout
