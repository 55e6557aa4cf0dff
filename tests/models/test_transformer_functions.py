"""Pure transformer functions: layer-level API, KV-cache decoding (the naive rollout) against
forward, positions, grad and remat."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testutil import padded_batch
from testutil import tiny_model_config

from brorl_jax.models import (
    Model,
    ModelConfig,
    attention,
    embed,
    final_norm,
    forward,
    init_params,
    layer_finish,
    layer_qkv,
    lm_head_matrix,
)
from brorl_jax.rollout import generate_naive

VOCAB = 97


def tiny_config(model_type: str = "qwen2", **overrides) -> ModelConfig:
    """The HF comparisons' model (tests/models/models_testutil.py hf_config): hidden 64, vocab 97."""
    fields = dict(model_type=model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  head_dim=16, attention_bias=(model_type == "qwen2"),
                  qk_norm=(model_type == "qwen3"), max_position_embeddings=256, bos_token_id=1,
                  eos_token_ids=(2,))
    return tiny_model_config(**dict(fields, **overrides))


# One batch shape and two configs for the whole file: every jitted function compiles once per
# config (init_params and forward compiles dominate this file's run time on CPU).
BATCH, LENGTH = 3, 12
CONFIGS = {"qwen2": tiny_config("qwen2"), "qwen3": tiny_config("qwen3", tie_word_embeddings=True)}


@functools.cache
def params_for(model_type: str) -> dict:
    return init_params(CONFIGS[model_type], jax.random.PRNGKey(0))


forward_jit = jax.jit(forward, static_argnums=1, static_argnames=("return_hidden", "remat"))


def test_init_params_layout_matches_interfaces():
    cfg = tiny_config(tie_word_embeddings=True, param_dtype="bfloat16")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    assert set(shapes) == {"embed", "layers", "final_norm"}  # no lm_head when tied
    assert shapes["embed"]["embedding"].shape == (VOCAB, 64)
    assert shapes["final_norm"]["scale"].shape == (64,)
    assert shapes["layers"]["q_proj"]["kernel"].shape == (2, 64, 4 * 16)
    assert shapes["layers"]["k_proj"]["kernel"].shape == (2, 64, 2 * 16)
    assert shapes["layers"]["o_proj"]["kernel"].shape == (2, 4 * 16, 64)
    assert "bias" not in shapes["layers"]["o_proj"]  # qwen2: q/k/v biases only
    assert all(leaf.shape[0] == 2 for leaf in jax.tree.leaves(shapes["layers"]))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(shapes))

    params = params_for("qwen2")
    assert params["lm_head"]["kernel"].shape == (64, VOCAB)
    assert lm_head_matrix(params, CONFIGS["qwen2"]).shape == (64, VOCAB)
    # Different layers get different random weights; norms start at one, biases at zero.
    kernel = np.asarray(params["layers"]["gate_proj"]["kernel"])
    assert not np.array_equal(kernel[0], kernel[1])
    assert 0.015 < kernel.std() < 0.025
    np.testing.assert_array_equal(np.asarray(params["layers"]["input_norm"]["scale"]), 1.0)
    np.testing.assert_array_equal(np.asarray(params["layers"]["q_proj"]["bias"]), 0.0)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_layer_functions_compose_to_forward(model_type):
    """The layer-level API the rollout engine uses reproduces forward() exactly."""
    cfg, params = CONFIGS[model_type], params_for(model_type)
    tokens, mask, positions = padded_batch(np.random.default_rng(0), BATCH, LENGTH, left=True)

    @jax.jit
    def by_layers(params):
        x = embed(params, cfg, tokens)
        allowed = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None] & jnp.asarray(mask)[:, None, :]
        for i in range(cfg.num_hidden_layers):
            layer_params = jax.tree.map(lambda p: p[i], params["layers"])
            q, k, v = layer_qkv(layer_params, cfg, x, positions)
            assert q.shape == (BATCH, LENGTH, 4, 16)
            assert k.shape == v.shape == (BATCH, LENGTH, 2, 16)
            x = layer_finish(layer_params, cfg, x, attention(q, k, v, allowed))
        h = final_norm(params, cfg, x)
        return h @ lm_head_matrix(params, cfg), h

    logits, hidden = by_layers(params)
    ref = forward_jit(params, cfg, tokens, positions=positions, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(ref)[mask], atol=1e-5)
    ref_hidden = forward_jit(
        params, cfg, tokens, positions=positions, attention_mask=mask, return_hidden=True
    )
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), atol=1e-5)


def test_positions_derived_from_mask_for_left_and_right_padding():
    cfg, params = CONFIGS["qwen2"], params_for("qwen2")
    rng = np.random.default_rng(1)
    for left in (True, False):
        tokens, mask, positions = padded_batch(rng, BATCH, LENGTH, left=left)
        explicit = forward_jit(params, cfg, tokens, positions=positions, attention_mask=mask)
        derived = forward_jit(params, cfg, tokens, attention_mask=mask)
        np.testing.assert_allclose(np.asarray(derived)[mask], np.asarray(explicit)[mask], atol=1e-6)
        assert np.isfinite(np.asarray(derived)).all()  # padding rows too


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_kv_cache_decoding_matches_forward_position_by_position(model_type):
    """The tests' one decoder reference (rollout.generate_naive: a plain per-row KV cache, the
    engine is checked against it in tests/rollout) reproduces forward() at every generated
    position, for both families (qwen3: q/k norms, tied embeddings)."""
    cfg, params = CONFIGS[model_type], params_for(model_type)
    model = Model(cfg, params, None, cfg.eos_token_ids)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (7, 3, 5)]
    n, s = 2, LENGTH - 7
    r = generate_naive(model, prompts, rollouts_per_prompt=n, max_new_tokens=s, temperature=1.0,
                       seed=5)
    assert (r.lengths > 1).any()
    seqs = np.zeros((len(prompts) * n, LENGTH), np.int32)   # right padding: causal, no effect
    for i, (g, k) in enumerate(np.ndindex(len(prompts), n)):
        seq = prompts[g] + list(r.tokens[g, k, : r.lengths[g, k]])
        seqs[i, : len(seq)] = seq
    logp = np.asarray(jax.nn.log_softmax(forward_jit(params, cfg, seqs), axis=-1))
    for i, (g, k) in enumerate(np.ndindex(len(prompts), n)):
        p, length = len(prompts[g]), r.lengths[g, k]
        want = logp[i, p - 1 : p - 1 + length][np.arange(length), r.tokens[g, k, :length]]
        np.testing.assert_allclose(r.logprobs[g, k, :length], want, atol=1e-5)


def test_forward_under_grad_and_remat_gives_same_values_and_gradients():
    cfg, params = CONFIGS["qwen3"], params_for("qwen3")
    tokens, mask, positions = padded_batch(np.random.default_rng(4), BATCH, LENGTH, left=False)

    def loss(params, remat):
        logits = forward(params, cfg, tokens, positions=positions, attention_mask=mask, remat=remat)
        logp = jax.nn.log_softmax(logits[:, :-1])
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        weights = mask[:, 1:]
        return -(picked * weights).sum() / weights.sum(), logits

    @jax.jit
    def both(params):  # one compile for the plain and the rematerialised version
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        return grad_fn(params, False), grad_fn(params, True)

    ((value, logits), grads), ((value_remat, logits_remat), grads_remat) = both(params)
    assert np.isfinite(float(value))
    np.testing.assert_allclose(float(value_remat), float(value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logits_remat), np.asarray(logits), atol=1e-6)
    for g, g_remat in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g_remat), np.asarray(g), rtol=1e-4, atol=1e-7)
    # Gradients reach the q/k norms of both layers and the (tied) embedding.
    assert float(jnp.abs(grads["layers"]["q_norm"]["scale"]).min(axis=1).max()) > 0
    assert (np.abs(np.asarray(grads["layers"]["k_norm"]["scale"])).sum(axis=1) > 0).all()
    assert float(jnp.abs(grads["embed"]["embedding"]).max()) > 0
    # The remat checkpoint does not change forward values.
    plain = forward_jit(params, cfg, tokens, positions=positions, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(logits), atol=1e-6)


@pytest.mark.parametrize("remat", [False, "full", "dots"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unrolled_layers_give_the_scan_values_and_gradients(monkeypatch, remat, dtype):
    """GPU/TPU run the layers one by one over per-layer buffers (transformer.layer_loop_form),
    CPU as a lax.scan: the same function and the same stacked gradients, under each remat
    policy; in float32 to summation-order rounding (2e-5 of the largest entry), with bf16
    compute over float32 params (each layer's slice cast on its own) to bf16 rounding."""
    from brorl_jax.models import transformer
    cfg = CONFIGS["qwen3"].replace(dtype=dtype)
    params = params_for("qwen3")
    tokens, mask, positions = padded_batch(np.random.default_rng(5), BATCH, LENGTH, left=False)

    def loss(params):
        h = forward(params, cfg, tokens, positions=positions, attention_mask=mask,
                    return_hidden=True, remat=remat)
        return (h.astype(jnp.float32) ** 2 * mask[..., None]).mean()

    results = {}
    for form in ("scan", "unrolled"):
        monkeypatch.setattr(transformer, "layer_loop_form", lambda form=form: form)
        results[form] = jax.jit(jax.value_and_grad(loss))(params)
    (v_scan, g_scan), (v_unrolled, g_unrolled) = results["scan"], results["unrolled"]
    rtol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(float(v_unrolled), float(v_scan), rtol=rtol)
    assert jax.tree.structure(g_unrolled) == jax.tree.structure(g_scan)
    for a, b in zip(jax.tree.leaves(g_unrolled), jax.tree.leaves(g_scan)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = float(np.abs(np.asarray(b)).max())
        atol = 2e-5 * scale if dtype == "float32" else 2e-2 * scale
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)
    assert float(jnp.abs(g_scan["layers"]["down_proj"]["kernel"][1]).max()) > 0


def test_bad_inputs_raise_clear_errors():
    cfg, params = CONFIGS["qwen2"], params_for("qwen2")
    with pytest.raises(ValueError, match="tokens must have 2 dims"):
        forward(params, cfg, jnp.ones((5,), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask shape"):
        forward(params, cfg, jnp.ones((2, 5), jnp.int32), attention_mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="positions shape"):
        forward(params, cfg, jnp.ones((2, 5), jnp.int32), positions=jnp.zeros((2, 4), jnp.int32))


def test_xla_attention_impl_matches_reference_with_padding():
    """forward(attention_impl="xla") (jax.nn.dot_product_attention) == the plain reference,
    right padding included (the "cudnn" variant needs a GPU and is checked by the device script)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from brorl_jax.models import forward, init_params

    cfg = tiny_model_config(tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 10)), jnp.int32)
    mask = jnp.arange(10)[None, :] < jnp.array([[10], [6], [3]])
    ref = forward(params, cfg, tokens, attention_mask=mask)
    xla = forward(params, dataclasses.replace(cfg, attention_impl="xla"), tokens,
                  attention_mask=mask)
    np.testing.assert_allclose(np.asarray(xla)[np.asarray(mask)], np.asarray(ref)[np.asarray(mask)],
                               atol=1e-5)
