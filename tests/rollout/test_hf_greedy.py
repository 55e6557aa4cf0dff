"""Greedy rollouts equal transformers' greedy ``generate`` token for token on tiny HF models."""
from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: E402  (a declared test dependency: missing it must fail, not skip)
import transformers  # noqa: E402

from brorl_jax.models import from_pretrained  # noqa: E402
from brorl_jax.rollout import generate  # noqa: E402

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

EOS = 2


def _tiny_hf_model(kind: str, path, seed: int):
    torch.manual_seed(seed)
    common = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                  tie_word_embeddings=(kind == "llama"))
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=10000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3_moe":  # every layer sparse: 8 experts, top-2, gates renormalised
        cfg = transformers.Qwen3MoeConfig(rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":  # the same experts, gates as they come, a shared expert of 40
        cfg = transformers.Qwen2MoeConfig(rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32,
                                          shared_expert_intermediate_size=40, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        cfg = transformers.LlamaConfig(rope_theta=500000.0, **common)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                # peaked distributions (and decided routers): no near-ties for float noise to flip
                p.mul_(6.0)
            else:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3_moe", "qwen2_moe"])
def test_greedy_matches_transformers_generate(kind, tmp_path):
    hf = _tiny_hf_model(kind, tmp_path,
                        seed={"qwen2": 1, "llama": 2, "qwen3_moe": 3, "qwen2_moe": 4}[kind])
    model = from_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 211, n)] for n in (3, 17, 9)]
    max_new = 12
    ours = generate(model, prompts, rollouts_per_prompt=2, max_new_tokens=max_new, temperature=0.0)
    assert model.generation_eos_ids == (EOS,)
    for g, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=EOS, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        if EOS in want:  # transformers pads after EOS; our length counts the EOS
            want = want[: want.index(EOS) + 1]
        for n in range(2):
            got = ours.tokens[g, n, : ours.lengths[g, n]].tolist()
            assert got == want, (kind, g, n)
            assert bool(ours.finished[g, n]) == (want[-1] == EOS)
