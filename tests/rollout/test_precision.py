"""FP8 rollouts (issue 41): the quantized projections against a plain jnp reference, the fp8 KV
store's writes, the engine's samples against bf16's, the memory plan's slots, the door's refusals
and the behaviour-gap metrics."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

from brorl_jax.algo.losses import behaviour_gap
from brorl_jax.config import ConfigError, validate
from brorl_jax.models import ModelConfig, transformer
from brorl_jax.models.precision import (
    QUANTIZED_PROJECTIONS,
    is_quantized,
    rollout_weight_bytes,
    with_precision,
)
from brorl_jax.rollout import Engine, plan_slots
from brorl_jax.rollout.programs import _write_kv, in_rollout_layout, rollout_layout
from configs import tiny
from pallas_kernels.decode_attention import dequantize_kv, quantize_kv

E4M3_MAX = 448.0
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_model_config(dtype="bfloat16")
    return cfg, transformer.init_params(cfg, jax.random.PRNGKey(0))


def _plain_fp8_matmul(x, w):
    """The W8A8 projection written out: x quantized per row (absmax / 448), w per output column,
    an f32 matmul of the e4m3 values, both scales on the output."""
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / E4M3_MAX
    sw = jnp.max(jnp.abs(wf), axis=0, keepdims=True) / E4M3_MAX
    x8 = (xf / sx).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    w8 = (wf / sw).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (x8 @ w8) * sx * sw


def test_fp8_projections_equal_the_plain_w8a8_formula(model):
    cfg, params = model
    fp8 = with_precision(cfg, "fp8")
    layout = jax.jit(lambda p: rollout_layout(p, fp8))(params)
    layer = layout["layers"][0]
    assert is_quantized(layer) and in_rollout_layout(layout, fp8)
    assert not in_rollout_layout(layout, cfg)        # a bf16 engine would lay it out again
    assert rollout_layout(layout, fp8) is layout     # ... an fp8 one takes it as it is
    for name in QUANTIZED_PROJECTIONS:
        q = layer[name]["kernel"].array
        assert q.qvalue.dtype == jnp.float8_e4m3fn
        assert q.scale.shape == (1, q.qvalue.shape[1])       # one scale per output channel
    # the quantized layer's q projection (bias added) against the formula
    bf = jax.tree.map(lambda x: x[0].astype(jnp.bfloat16), params["layers"])
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 1, cfg.hidden_size), jnp.bfloat16)
    pos = jnp.zeros((5, 1), jnp.int32)
    q_fp8, _, _ = transformer.layer_qkv(layer, cfg, x, pos)
    h = transformer.RMSNorm(cfg.rms_norm_eps, jnp.bfloat16, jnp.float32).apply(
        {"params": bf["input_norm"]}, x).reshape(5, -1)
    want = _plain_fp8_matmul(h, bf["q_proj"]["kernel"]) + bf["q_proj"]["bias"].astype(jnp.float32)
    got = q_fp8.reshape(5, -1).astype(jnp.float32)    # position 0: RoPE is the identity
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    # and it is not the bf16 projection: the quantization is really applied
    q_bf, _, _ = transformer.layer_qkv(bf, cfg, x, pos)
    assert float(jnp.max(jnp.abs(q_bf.astype(jnp.float32) - q_fp8.astype(jnp.float32)))) > 0


@pytest.mark.parametrize("store", [jnp.uint8, jnp.float8_e4m3fn])
def test_fp8_kv_write_stores_values_and_scales(store):
    layers, pages, hkv, ps, dh = 2, 5, 2, 4, 16
    k = jnp.zeros((layers, pages, hkv, ps, dh), store)
    ks = jnp.zeros((layers, pages, hkv, ps), jnp.float32)
    vals = jax.random.normal(jax.random.PRNGKey(0), (3, hkv, dh)) * jnp.array([1.0, 30.0, 1e-3])[:, None, None]
    page, offset = jnp.array([1, 4, 2]), jnp.array([3, 0, 2])
    k, ks = _write_kv(k, ks, 1, page, offset, vals.astype(jnp.bfloat16))
    got = dequantize_kv(k[1, page, :, offset], ks[1, page, :, offset])
    want = dequantize_kv(*quantize_kv(vals.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(got, want)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of its row's amax
    amax = jnp.max(jnp.abs(vals), axis=-1, keepdims=True)
    assert float(jnp.max(jnp.abs(got - vals) / amax)) <= 2.0 ** -4
    assert int(jnp.count_nonzero(ks[0])) == 0        # the other layer untouched


@pytest.fixture(scope="module")
def sampled(model):
    cfg, params = model
    out = {}
    for w, kv in (("bf16", "bf16"), ("fp8", "fp8")):
        out[w, kv] = Engine(with_precision(cfg, w, kv)).generate(
            params, PROMPTS, rollouts_per_prompt=4, max_new_tokens=10, temperature=1.0, seed=3)
    return out


def test_fp8_rollouts_stay_close_to_bf16(sampled):
    """The same keys draw nearly the same samples: FP8 moves the distribution a little (on this
    random tiny model: > 90% of tokens equal, log-probs within 0.05 on average)."""
    base = sampled["bf16", "bf16"]
    for key in (("fp8", "fp8"),):
        res = sampled[key]
        same = np.asarray(res.tokens) == np.asarray(base.tokens)
        assert same.mean() >= 0.9, (key, same.mean())
        mask = np.asarray(base.mask) & np.asarray(res.mask)
        gap = np.abs(np.asarray(res.logprobs) - np.asarray(base.logprobs))[mask]
        assert 0 < gap.mean() < 0.05, (key, gap.mean())


def test_fp8_kv_cache_gives_more_slots_in_the_same_budget():
    """Qwen2.5-1.5B's shapes (Dh 128) at the paper's 16k context: an e4m3 KV cache with a
    float32 scale per position and head takes 132 / 256 of bf16's bytes, so a fixed budget holds
    1.90x the slots (657 -> 1248; a slot's logits rows, which do not shrink, keep it under
    1.94x; at a 4k context they weigh more: 1.77x); fp8 weights take about half the rollout
    copy."""
    cfg = ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                      intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, head_dim=128, rope_theta=1e6, rope_scaling=None,
                      rms_norm_eps=1e-6, attention_bias=True, qk_norm=False,
                      tie_word_embeddings=True, max_position_embeddings=32768, bos_token_id=None,
                      eos_token_ids=(2,), param_dtype="float32", dtype="bfloat16")
    budget = 70 * 2**30
    call = (64, 1024, 512, 16384 - 1024, budget)
    slots = {kv: plan_slots(with_precision(cfg, kv=kv), *call).slots for kv in ("bf16", "fp8")}
    assert slots["fp8"] >= 1.89 * slots["bf16"], slots
    n = 1_543_714_304
    assert rollout_weight_bytes(with_precision(cfg, "fp8"), n) < 0.6 * rollout_weight_bytes(cfg, n)


def test_fp8_without_the_correction_is_refused_at_the_door():
    for key, value in (("tis_mode", "off"), ("recompute_old_logprobs", False)):
        cfg = tiny.get_config()
        cfg.rollout.kv_dtype = "fp8"
        setattr(cfg.algo, key, value)
        with pytest.raises(ConfigError, match=f"rollout.kv_dtype='fp8'.*algo.{key}"):
            validate(cfg)
    cfg = tiny.get_config()
    cfg.rollout.weight_dtype = "fp4"
    with pytest.raises(ConfigError, match="rollout.weight_dtype"):
        validate(cfg)


def test_behaviour_gap_is_the_k3_estimate():
    trainer = jnp.log(jnp.array([0.5, 0.25, 0.9]))
    rollout = jnp.log(jnp.array([0.5, 0.5, 0.6]))
    gap, k3 = behaviour_gap(trainer, rollout)
    r = np.array([1.0, 0.5, 1.5])          # pi_old / mu
    np.testing.assert_allclose(gap, np.abs(np.log(r)), rtol=1e-6)
    np.testing.assert_allclose(k3, r - 1 - np.log(r), rtol=1e-5, atol=1e-7)
    assert float(k3[0]) == 0.0 and bool(jnp.all(k3 >= 0))


def test_training_rollouts_take_the_precision_and_evaluation_stays_bf16():
    from brorl_jax.train.context import eval_sampling
    from brorl_jax.train.rollout_calls import training_call
    cfg = tiny.get_config()
    cfg.rollout.weight_dtype, cfg.rollout.kv_dtype = "fp8", "fp8"
    run = validate(cfg)
    assert training_call(run).precision == ("fp8", "fp8")
    assert eval_sampling(run).precision == ("bf16", "bf16")
    cfg.eval.low_precision = True
    assert eval_sampling(validate(cfg)).precision == ("fp8", "fp8")
    assert dataclasses.replace(training_call(run)).model_config(
        tiny_model_config()).kv_precision == "fp8"


def test_fp8_weights_with_a_recorded_moe_routing_quantize_the_layer_that_records_it():
    """A MoE rollout under fp8 weights that records its routing (algo.routing_replay="rollout")
    runs its layers' finish through the quantized module too (transformer.layer_finish_routed):
    the same tokens and routing whether it records or not, and a routing of the right shape."""
    cfg = tiny_model_config(model_type="qwen3_moe", attention_bias=False, qk_norm=True,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            norm_topk_prob=True, dtype="bfloat16")
    params = transformer.init_params(cfg, jax.random.PRNGKey(1))
    fp8 = with_precision(cfg, "fp8")
    kw = dict(rollouts_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=0)
    plain = Engine(fp8).generate(params, PROMPTS, **kw)
    recorded = Engine(fp8, record_routing=True).generate(params, PROMPTS, **kw)
    np.testing.assert_array_equal(recorded.tokens, plain.tokens)
    assert recorded.routing.shape == (3, 2, 4, cfg.num_hidden_layers, 2)
    assert recorded.routing.max() < cfg.num_experts and recorded.routing.min() >= 0
