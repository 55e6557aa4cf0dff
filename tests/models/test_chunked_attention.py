"""Query-chunked attention equals the model's reference forward (values and gradients)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

from brorl_jax.models import ModelConfig, forward, init_params
from brorl_jax.models.chunked_attention import chunked_causal_attention, forward_hidden
from brorl_jax.models.transformer import attention

pytestmark = pytest.mark.slow     # many model compiles: out of `-m "not slow"`


def _cfg() -> ModelConfig:
    return tiny_model_config(tie_word_embeddings=True)


def test_chunked_attention_matches_reference_with_padding():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(2, 13, 4, 8)), jnp.float32)
    k = jnp.asarray(r.normal(size=(2, 13, 2, 8)), jnp.float32)
    v = jnp.asarray(r.normal(size=(2, 13, 2, 8)), jnp.float32)
    mask = jnp.asarray(np.arange(13)[None, :] < np.array([[13], [9]]))     # right padding
    allowed = jnp.tril(jnp.ones((13, 13), bool))[None] & mask[:, None, :]
    want = attention(q, k, v, allowed)
    got = chunked_causal_attention(q, k, v, mask, q_chunk=4)              # 13 = 3 x 4 + 1
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_forward_hidden_matches_model_forward_and_gradients():
    cfg = _cfg()
    params = init_params(cfg, jax.random.PRNGKey(0))
    r = np.random.default_rng(1)
    tokens = jnp.asarray(r.integers(0, 64, (2, 11)), jnp.int32)
    mask = jnp.asarray(np.arange(11)[None, :] < np.array([[11], [7]]))

    def ref(p):
        return forward(p, cfg, tokens, attention_mask=mask, return_hidden=True, remat=True)

    def got(p):
        return forward_hidden(p, cfg, tokens, attention_mask=mask, remat=True, q_chunk=4)

    np.testing.assert_allclose(got(params), ref(params), atol=2e-5)
    w = jnp.asarray(r.normal(size=(2, 11, 32)), jnp.float32) * mask[..., None]
    g_ref = jax.grad(lambda p: jnp.sum(ref(p) * w))(params)
    g_got = jax.grad(lambda p: jnp.sum(got(p) * w))(params)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_chunked_attention_with_segment_ids_equals_each_sequence_alone():
    """Packed rows (segment ids): forward_hidden with query chunks that cut across sequences
    equals the model's forward of the same sequences one per row (right-padded), values and
    gradients."""
    cfg = _cfg()
    params = jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, init_params(cfg, jax.random.PRNGKey(2)))
    r = np.random.default_rng(3)
    tokens = r.integers(0, 64, (2, 11)).astype(np.int32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32)
    spans = [(0, 0, 4), (0, 4, 3), (0, 7, 2), (1, 0, 6), (1, 6, 5)]
    w = r.normal(size=(2, 11, 32)).astype(np.float32) * (seg > 0)[..., None]
    u_tokens, u_w = np.zeros((5, 11), np.int32), np.zeros((5, 11, 32), np.float32)
    for i, (row, start, n) in enumerate(spans):
        u_tokens[i, :n], u_w[i, :n] = tokens[row, start:start + n], w[row, start:start + n]
    u_mask = jnp.asarray(np.arange(11)[None, :] < np.array([n for *_, n in spans])[:, None])

    def packed(p):
        return forward_hidden(p, cfg, jnp.asarray(tokens), segment_ids=jnp.asarray(seg), remat=True,
                              q_chunk=4)

    def alone(p):
        return forward(p, cfg, jnp.asarray(u_tokens), attention_mask=u_mask, return_hidden=True)

    h, h_alone = jax.jit(packed)(params), jax.jit(alone)(params)
    for i, (row, start, n) in enumerate(spans):
        np.testing.assert_allclose(h[row, start:start + n], h_alone[i, :n], atol=2e-5, rtol=1e-5)
    g_got = jax.jit(jax.grad(lambda p: jnp.sum(packed(p) * w)))(params)
    g_ref = jax.jit(jax.grad(lambda p: jnp.sum(alone(p) * u_w)))(params)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_ref)):     # float32 order: 1e-5 of max
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))
