"""Attention with segment ids (packed rows, docs/algo.md "Sequence packing") equals running each
sequence on its own, for every attention implementation of forward(): the jnp reference, "xla"
(jax.nn.dot_product_attention), and the arguments the "cudnn" path hands to
jax.nn.dot_product_attention (checked here with its XLA implementation; cuDNN itself needs a GPU).
The query-chunked path is in tests/parallel/test_attention.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

from brorl_jax.models import forward, init_params
from brorl_jax.models.transformer import (
    attention,
    dot_product_attention_args,
    segment_attention_mask,
    segment_positions,
)

CFG = tiny_model_config(model_type="qwen3", attention_bias=False, qk_norm=True)
# two packed rows of width 12: lengths (5, 4, 2) + 1 padding, and (7) + 5 padding
ROW_LENGTHS = [(5, 4, 2), (7,)]
WIDTH = 12


def packed_inputs(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, CFG.vocab_size, (len(ROW_LENGTHS), WIDTH)).astype(np.int32)
    seg = np.zeros(tokens.shape, np.int32)
    for r, lens in enumerate(ROW_LENGTHS):
        seg[r, :sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    return tokens, seg


def sequences(tokens, seg):
    """(row, start, length) of every sequence."""
    out = []
    for r, lens in enumerate(ROW_LENGTHS):
        start = 0
        for n in lens:
            out.append((r, start, n))
            start += n
    return out


def unpacked(tokens, seg):
    """The same sequences one per row, right-padded: (tokens [S, W], mask [S, W])."""
    spans = sequences(tokens, seg)
    out = np.zeros((len(spans), WIDTH), np.int32)
    for i, (r, start, n) in enumerate(spans):
        out[i, :n] = tokens[r, start:start + n]
    lengths = np.array([n for _, _, n in spans])
    return out, np.arange(WIDTH)[None, :] < lengths[:, None]


def to_unpacked(x, tokens, seg):
    """Packed-row values [B, T, ...] -> the unpacked rows' [S, T, ...] (0 past each length)."""
    x = np.asarray(x)
    out = np.zeros((len(sequences(tokens, seg)), WIDTH) + x.shape[2:], x.dtype)
    for i, (r, start, n) in enumerate(sequences(tokens, seg)):
        out[i, :n] = x[r, start:start + n]
    return out


FORWARD = jax.jit(forward, static_argnums=1, static_argnames=("return_hidden", "remat"))


def close_to(a, b, rel=1e-5):
    """|a - b| <= rel * max|b| elementwise (float32 sums in another order)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * np.abs(b).max())


@pytest.fixture(scope="module")
def params():
    # scaled weights: sharp attention, so reading another sequence's keys would show
    return jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, init_params(CFG, jax.random.PRNGKey(0)))


def test_segment_positions_restart_per_sequence():
    _, seg = packed_inputs()
    np.testing.assert_array_equal(segment_positions(jnp.asarray(seg)),
                                  [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0],
                                   [0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0]])


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("impl", [
    "reference", "xla", "flash",
    # cuDNN runs only on a GPU and only in bf16/fp16 (the CPU check of its arguments is below)
    pytest.param("cudnn", marks=pytest.mark.skipif(not ON_GPU, reason="cuDNN needs a GPU"))])
def test_forward_with_segment_ids_equals_each_sequence_alone(params, impl):
    """Packed rows vs the same sequences one per row (the padded layout)."""
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    if impl == "cudnn":
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
    tokens, seg = packed_inputs()
    packed = FORWARD(params, cfg, jnp.asarray(tokens), segment_ids=jnp.asarray(seg))
    u_tokens, u_mask = unpacked(tokens, seg)
    alone = FORWARD(params, cfg, jnp.asarray(u_tokens), attention_mask=jnp.asarray(u_mask))
    close_to(to_unpacked(packed, tokens, seg)[u_mask], np.asarray(alone)[u_mask],
             rel=3e-2 if impl == "cudnn" else 1e-5)


def test_reference_gradients_with_segment_ids_equal_each_sequence_alone(params):
    tokens, seg = packed_inputs(1)
    rng = np.random.default_rng(2)
    w = rng.normal(size=tokens.shape + (CFG.hidden_size,)).astype(np.float32) * (seg > 0)[..., None]
    u_tokens, u_mask = unpacked(tokens, seg)
    u_w = to_unpacked(w, tokens, seg)

    def packed_loss(p):
        h = forward(p, CFG, jnp.asarray(tokens), segment_ids=jnp.asarray(seg), return_hidden=True,
                    remat=True)
        return jnp.sum(h * w)

    def alone_loss(p):
        h = forward(p, CFG, jnp.asarray(u_tokens), attention_mask=jnp.asarray(u_mask),
                    return_hidden=True)
        return jnp.sum(h * u_w)

    g_packed = jax.jit(jax.grad(packed_loss))(params)
    g_alone = jax.jit(jax.grad(alone_loss))(params)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone)):
        close_to(a, b)


@pytest.mark.parametrize("packed", [True, False])
def test_cudnn_arguments_express_the_reference_mask(packed):
    """What forward() hands jax.nn.dot_product_attention for "cudnn" (packed: causal + segment
    mask; unpacked: causal + key lengths of right-padded rows), run by its XLA implementation,
    equals the reference attention with the full mask."""
    rng = np.random.default_rng(3)
    b, t = len(ROW_LENGTHS), WIDTH
    q = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    _, seg = packed_inputs()
    seg = jnp.asarray(seg) if packed else None
    mask = seg > 0 if packed else jnp.arange(t)[None, :] < jnp.array([[t], [7]])
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]
    if packed:
        allowed = allowed & segment_attention_mask(seg)
    want = attention(q, k, v, allowed)
    kwargs = dot_product_attention_args("cudnn", mask, seg)
    got = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)


def test_segment_ids_and_attention_mask_together_is_an_error(params):
    tokens, seg = packed_inputs()
    with pytest.raises(ValueError, match="not both"):
        forward(params, CFG, jnp.asarray(tokens), attention_mask=jnp.asarray(seg > 0),
                segment_ids=jnp.asarray(seg))
