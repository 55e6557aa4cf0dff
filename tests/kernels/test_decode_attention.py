"""pallas_kernels.decode_attention: reference == brute force over concatenated KV, kernel ==
reference (interpret mode on CPU), over GQA ratios and ragged prefix/suffix lengths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (
    resolve_impl, shared_prefix_decode_attention, shared_prefix_decode_attention_pallas,
    shared_prefix_decode_attention_reference,
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


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_brute_force(shape):
    args = _inputs(*shape)
    out = shared_prefix_decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(out), _brute_force(*args), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape):
    args = _inputs(*shape, seed=1)
    ref = shared_prefix_decode_attention_reference(*args)
    # small blocks so the prompt and suffix loops take several (partial) blocks
    out = shared_prefix_decode_attention_pallas(*args, block_n=2, block_p=16, block_s=8)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_kernel_bfloat16_and_custom_scale():
    args = _inputs(2, 4, 4, 2, 16, 24, 7, seed=2, dtype=jnp.bfloat16)
    ref = shared_prefix_decode_attention_reference(*args, scale=0.3)
    out = shared_prefix_decode_attention(*args, scale=0.3, impl="pallas")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)


def test_empty_suffix_is_prefix_only_attention():
    q, pk, pv, plen, sk, sv, _ = _inputs(2, 3, 4, 2, 8, 12, 6, seed=3)
    slen = jnp.zeros((2, 3), jnp.int32)
    out = shared_prefix_decode_attention(q, pk, pv, plen, sk, sv, slen, impl="pallas")
    np.testing.assert_allclose(np.asarray(out), _brute_force(q, pk, pv, plen, sk, sv, slen), atol=2e-5)


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
