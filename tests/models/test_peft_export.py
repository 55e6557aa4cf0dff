"""A PEFT adapter directory (brorl_jax/models/peft_io.py) loads in peft + transformers onto the
base model and gives our merged model's logits, including adapters merged at reference resets
(exported as one adapter of the summed rank)."""
import jax
import jax.numpy as jnp
import numpy as np
from testutil import tiny_model_config

from brorl_jax.models import Model, lora, peft_io, save_pretrained, transformer


def test_peft_loads_the_export_and_gives_the_merged_models_logits(tmp_path):
    import peft
    import torch
    import transformers

    cfg = tiny_model_config(lora_rank=2, lora_alpha=6.0,
                            lora_targets=("q", "k", "o", "gate", "down"))
    params = transformer.init_params(cfg, jax.random.key(0))
    sets = []
    for seed in (1, 2):          # one merged at a reset, then the live one
        ad = lora.init_lora(cfg, jax.random.key(seed))
        sets.append({t: {"a": ab["a"], "b": 0.2 * jax.random.normal(jax.random.key(seed + 9),
                                                                    ab["b"].shape)}
                     for t, ab in ad.items()})
    merged = params
    for ad in sets:
        merged = lora.merge_lora(lora.with_adapters(merged, ad), cfg)
    tokens = np.array([[3, 9, 27, 17, 51, 25, 11, 33]], np.int32)
    ours = np.asarray(transformer.forward(merged, cfg, jnp.asarray(tokens)))
    assert np.abs(ours - np.asarray(transformer.forward(params, cfg, jnp.asarray(tokens)))).max() > 1e-2

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    save_pretrained(Model(cfg, params, None, (1,)), base_dir)
    peft_io.save_peft(sets, cfg, str(adapter_dir), str(base_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    assert model.peft_config["default"].r == 4
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
