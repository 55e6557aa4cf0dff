"""pallas_kernels.sampling: kernel == reference, and the draws follow softmax(logits / T)
restricted by top-k / top-p (chi-square goodness of fit)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels.sampling import (
    resolve_impl,
    sample_tokens,
    sample_tokens_pallas,
    sample_tokens_reference,
)

# (samples, vocab, temperature, top_k, top_p, kernel family); the Triton family reads 128-wide
# and the Mosaic family 256-wide vocabulary tiles here, so most rows span several tiles (both
# families interpret on CPU; on a GPU/TPU only the target's family runs).
CASES = [
    (13, 301, 1.0, 0, 1.0, "triton"),
    (13, 601, 1.0, 0, 1.0, "mosaic"),
    (7, 557, 1.0, 20, 0.5, "mosaic"),   # top-k alone / top-p alone: the goodness-of-fit tests
    (5, 64, 0.0, 0, 1.0, "triton"),
    (5, 300, 0.0, 0, 1.0, "mosaic"),
    (11, 50, 1.0, 1, 1.0, "triton"),
    (8, 33, 2.0, 40, 0.95, "triton"),  # top_k > vocab: no top-k filtering
]
BLOCK_V = {"triton": 128, "mosaic": 256}
ON_DEVICE = jax.default_backend() in ("gpu", "tpu")


def _family_or_skip(family):
    """On CPU both families interpret; on a device only the target's family compiles."""
    if ON_DEVICE and family != ("mosaic" if jax.default_backend() == "tpu" else "triton"):
        pytest.skip(f"the {family} family does not compile for {jax.default_backend()}")
    return family


def _numpy_filtered_probs(x: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 statement of the sampling distribution (HF order: top-k, then top-p)."""
    z = x.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(p, bool)
    if 0 < top_k < x.size:
        keep &= x >= x[order[top_k - 1]]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        csum = np.cumsum(q[order])
        cut = int(np.searchsorted(csum, top_p - 1e-12))
        keep &= x >= x[order[cut]]
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("s,v,temperature,top_k,top_p,family", CASES)
def test_kernel_matches_reference(s, v, temperature, top_k, top_p, family):
    _family_or_skip(family)
    rng = np.random.default_rng(s * v)
    logits = jnp.asarray(rng.standard_normal((s, v), np.float32) * 3.0)
    u = jnp.asarray(rng.random(s, np.float32))
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    tok_r, lp_r = sample_tokens_reference(logits, u, **kw)
    tok_p, lp_p = sample_tokens_pallas(logits, u, block_rows=4, block_v=BLOCK_V[family],
                                       family=family, **kw)
    np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok_r))
    np.testing.assert_allclose(np.asarray(lp_p), np.asarray(lp_r), atol=2e-6)
    # the log-prob is the temperature-scaled, unfiltered one
    t = temperature if temperature > 0 else 1.0
    want = jax.nn.log_softmax(logits / t, axis=-1)[jnp.arange(s), tok_r]
    np.testing.assert_allclose(np.asarray(lp_r), np.asarray(want), atol=2e-6)
    # every drawn token is in the kept set of the independent statement
    for row in range(s):
        if temperature > 0:
            probs = _numpy_filtered_probs(np.asarray(logits[row]), temperature, top_k, top_p)
            assert probs[int(tok_r[row])] > 0
        else:
            assert int(tok_r[row]) == int(np.argmax(np.asarray(logits[row])))


def test_kernel_matches_reference_on_ties_and_extreme_logits():
    logits = jnp.array([[0.0, 5.0, 5.0, 1.0, -1e9, 5.0, 2.0, -3.0],
                        [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0],
                        [100.0, -100.0, 0.0, 99.0, 98.5, -0.0, 3.0, 3.0]])
    for u in (jnp.array([0.0, 0.5, 0.999999]), jnp.array([0.3, 0.01, 0.7])):
        for kw, family in ((dict(top_k=2), "triton"), (dict(top_p=0.5), "mosaic"),
                           (dict(top_k=3, top_p=0.9), "triton"), (dict(temperature=0.0), "mosaic")):
            tr, lr = sample_tokens_reference(logits, u, **kw)
            tp, lp = sample_tokens_pallas(logits, u, family=None if ON_DEVICE else family, **kw)
            np.testing.assert_array_equal(np.asarray(tp), np.asarray(tr))
            np.testing.assert_allclose(np.asarray(lp), np.asarray(lr), atol=1e-5)


LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5], np.float32)
GOF = [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.75), (1.0, 6, 0.8)]
GOF_FAMILY = {g: ("triton", "mosaic")[i % 2] for i, g in enumerate(GOF)}


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token outside the kept set"
    return stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p", GOF)
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_draws_follow_filtered_softmax(temperature, top_k, top_p, impl):
    draws = 40_000 if impl == "reference" else 16_384
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (draws, LOGITS.size))
    u = jax.random.uniform(jax.random.PRNGKey(7), (draws,))
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if impl == "pallas":
        family = None if ON_DEVICE else GOF_FAMILY[(temperature, top_k, top_p)]
        # interpreted: few big blocks (fast); compiled: the default 8-row blocks
        tok, _ = sample_tokens_pallas(logits, u, block_rows=None if ON_DEVICE else 4096,
                                      family=family, **kw)
    else:
        tok, _ = sample_tokens_reference(logits, u, **kw)
    counts = np.bincount(np.asarray(tok), minlength=LOGITS.size)
    probs = _numpy_filtered_probs(LOGITS, temperature, top_k, top_p)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # the test has power: the distribution without the filter (or at T=1) is rejected
    wrong = []
    if top_k or top_p < 1.0:
        wrong.append(_numpy_filtered_probs(LOGITS, temperature, 0, 1.0))
    if temperature != 1.0:
        wrong.append(_numpy_filtered_probs(LOGITS, 1.0, top_k, top_p))
    for w in wrong:
        if counts[w == 0].sum() > 0:
            continue  # rejected outright: draws outside the wrong distribution's support
        assert stats.chisquare(counts[w > 0], w[w > 0] * counts.sum()).pvalue < 1e-6


def test_no_top_p_implementation_fails_goodness_of_fit():
    """A sampler that ignores top_p draws tokens outside the nucleus: the check rejects it."""
    draws = 40_000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (draws, LOGITS.size))
    u = jax.random.uniform(jax.random.PRNGKey(8), (draws,))
    tok, _ = sample_tokens_reference(logits, u, temperature=1.3, top_p=1.0)  # "forgot" top_p
    counts = np.bincount(np.asarray(tok), minlength=LOGITS.size)
    probs = _numpy_filtered_probs(LOGITS, 1.3, 0, 0.75)
    with pytest.raises(AssertionError, match="outside the kept set"):
        _chi2_pvalue(counts, probs)


def test_greedy_and_key_input():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((6, 40), np.float32))
    tok, lp = sample_tokens(logits, jax.random.PRNGKey(1), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(lp), np.max(np.asarray(jax.nn.log_softmax(logits)), -1), atol=1e-6)
    t1, _ = sample_tokens(logits, jax.random.PRNGKey(3))
    t2, _ = sample_tokens(logits, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))


def test_auto_impl_is_chosen_by_backend():
    expected = "reference" if jax.default_backend() == "cpu" else "pallas"
    assert resolve_impl("auto") == expected
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda")


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        sample_tokens(jnp.zeros((2, 5)), jnp.zeros((2,)), **kw)
    with pytest.raises(ValueError, match="uniforms"):
        sample_tokens(jnp.zeros((2, 5)), jnp.zeros((3,)))


# ------------------------------------------------------------------------------------------------
# the hand-written Triton kernel (jax_triton): PTX for sm_90 here, numerics on a GPU
# ------------------------------------------------------------------------------------------------

def _jax_triton_or_skip():
    try:
        import jax_triton  # noqa: F401
    except Exception as e:  # ImportError, or a jax without CUDA support
        pytest.skip(f"needs the optional extra '.[compile]' (jax-triton, triton, jax-cuda12-plugin;"
                    f" no GPU needed): {type(e).__name__}")


def test_triton_kernel_compiles_to_ptx_for_sm90(tmp_path, monkeypatch):
    """Traced for cuda on a machine without a GPU, jax_triton compiles the kernel for sm_90
    (Triton -> PTX -> cubin); the PTX it produced is checked here."""
    _jax_triton_or_skip()
    import jax_triton.triton_lib as tl_lib

    import pallas_kernels as pk
    from pallas_kernels.sampling.triton_lang import sample_tokens_triton

    monkeypatch.setattr(tl_lib, "_JAX_TRITON_DUMP_DIR", str(tmp_path))
    monkeypatch.setattr(tl_lib, "_COMPILED_KERNEL_CACHE", {})
    x = jax.ShapeDtypeStruct((512, 151_936), jnp.bfloat16)
    u = jax.ShapeDtypeStruct((512,), jnp.float32)
    for temperature in (1.0, 0.0):
        with pk.compile_target("cuda"):
            text = jax.jit(lambda x, u: sample_tokens_triton(x, u, temperature=temperature)).trace(
                x, u).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton_kernel_call" in text
    ptx = sorted(tmp_path.glob("*/*.ptx"))
    assert len(ptx) == 2   # sampling and greedy variants
    for path in ptx:
        src = path.read_text()
        assert ".target sm_90" in src and ".entry sample_rows" in src
        info = path.with_suffix(".compile_info").read_text()
        assert int(info.split("shared_mem_bytes:")[1]) <= 232_448   # H100 per-block limit


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the jax_triton kernel: needs a GPU")
@pytest.mark.parametrize("s,v,temperature,dtype", [
    (13, 301, 1.0, jnp.float32), (64, 4099, 0.7, jnp.float32), (32, 151_936, 1.0, jnp.bfloat16),
    (9, 2048, 0.0, jnp.float32), (16, 128_256, 0.0, jnp.bfloat16),
])
def test_triton_kernel_matches_reference(s, v, temperature, dtype):
    _jax_triton_or_skip()
    rng = np.random.default_rng(v)
    logits = jnp.asarray(rng.standard_normal((s, v), np.float32) * 3.0).astype(dtype)
    u = jnp.asarray(rng.random(s, np.float32))
    tok_r, lp_r = sample_tokens_reference(logits, u, temperature=temperature)
    tok_t, lp_t = sample_tokens(logits, u, temperature=temperature, impl="triton")
    np.testing.assert_array_equal(np.asarray(tok_t), np.asarray(tok_r))
    np.testing.assert_allclose(np.asarray(lp_t), np.asarray(lp_r), atol=2e-5)


def test_triton_impl_refuses_filters_and_other_targets():
    with pytest.raises(ValueError, match="plain/greedy"):
        sample_tokens(jnp.zeros((2, 50)), jnp.zeros((2,)), top_k=5, impl="triton")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU-only"):
            sample_tokens(jnp.zeros((2, 50)), jnp.zeros((2,)), impl="triton")
