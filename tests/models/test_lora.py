"""LoRA adapters (brorl_jax/models/lora.py): B = 0 starts at the base model, the merged kernels
give the adapter forward's logits, targets are parsed and refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import tiny_model_config

from brorl_jax.models import lora, transformer

TOKENS = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7) % 64


@pytest.fixture(scope="module")
def model():
    cfg = tiny_model_config(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(lora.TARGETS))
    return cfg, transformer.init_params(cfg, jax.random.key(0))


def _trained(cfg, seed=2):
    """Adapters with B moved off zero (as after some updates)."""
    ad = lora.init_lora(cfg, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(ad)))
    return {t: {"a": ab["a"], "b": 0.05 * jax.random.normal(next(keys), ab["b"].shape)}
            for t, ab in ad.items()}


def test_fresh_adapters_give_the_base_models_logits(model):
    cfg, params = model
    ad = lora.init_lora(cfg, jax.random.key(1))
    assert all(float(jnp.abs(ab["b"]).max()) == 0 for ab in ad.values())
    assert all(float(jnp.abs(ab["a"]).max()) > 0 for ab in ad.values())
    base = transformer.forward(params, cfg, TOKENS)
    np.testing.assert_array_equal(transformer.forward(lora.with_adapters(params, ad), cfg, TOKENS),
                                  base)


@pytest.mark.parametrize("targets,loop", [(tuple(lora.TARGETS), "scan"),
                                          (("v", "down"), "unrolled")])
def test_merged_kernels_equal_the_adapter_forward(model, targets, loop, monkeypatch):
    """The adapter forward (the layers as a scan on CPU, unrolled on GPU/TPU: each layer reads
    its own adapters' slice either way) equals the forward of the merged kernels."""
    cfg, params = model
    cfg = cfg.replace(lora_targets=targets)
    ad = {t: ab for t, ab in _trained(cfg).items() if t in targets}
    with_ad = lora.with_adapters(params, ad)
    with monkeypatch.context() as m:
        m.setattr(transformer, "layer_loop_form", lambda: loop)
        adapted = transformer.forward(with_ad, cfg, TOKENS)
    merged = lora.merge_lora(with_ad, cfg)
    assert lora.KEY not in merged
    assert float(jnp.abs(adapted - transformer.forward(params, cfg, TOKENS)).max()) > 1e-2
    np.testing.assert_allclose(transformer.forward(merged, cfg, TOKENS), adapted, atol=2e-5)
    # untargeted kernels are the base's own buffers
    untouched = [p for t, p in lora.TARGETS.items() if t not in targets]
    for proj in untouched:
        assert merged["layers"][proj]["kernel"] is params["layers"][proj]["kernel"]


def test_merge_is_w_plus_scaled_a_b(model):
    cfg, params = model
    ad = _trained(cfg)
    merged = lora.merge_lora(lora.with_adapters(params, ad), cfg)
    want = params["layers"]["up_proj"]["kernel"] + 2.0 * ad["up"]["a"] @ ad["up"]["b"]
    np.testing.assert_allclose(merged["layers"]["up_proj"]["kernel"], want, rtol=1e-6, atol=1e-6)


def test_targets_parse_and_refuse_unknown_names():
    assert lora.parse_targets(" up,q ,down") == ("q", "up", "down")
    with pytest.raises(ValueError, match="'qq'"):
        lora.parse_targets("q,qq")
    with pytest.raises(ValueError, match="q,k,v,o,gate,up,down"):
        lora.parse_targets("")
    cfg = tiny_model_config()
    assert lora.max_rank(cfg, ("q", "k")) == 16 and lora.max_rank(cfg, ("up",)) == 32

