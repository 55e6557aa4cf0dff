"""Shared helpers for tests/models: tiny random HF checkpoints built with transformers+torch.

(A uniquely named module, not conftest.py: the tests/* folders are not packages.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch  # noqa: E402  (a declared test dependency: missing it must fail, not skip)
import transformers  # noqa: E402

VOCAB = 97


def hf_config(kind: str, *, heads: int = 4, kv_heads: int = 2, tie: bool = False, **extra):
    """A tiny transformers config (hidden 64, 2 layers) of the given family."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(extra)
    if kind == "qwen2":
        return transformers.Qwen2Config(rope_theta=10000.0, **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=16, rope_theta=1_000_000.0, **common)
    if kind == "qwen3_moe":  # 8 experts of width 32, top-2 (Qwen3-30B-A3B: 128, top-8)
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True)
        return transformers.Qwen3MoeConfig(head_dim=16, rope_theta=1_000_000.0,
                                           **dict(moe, **common))
    if kind == "qwen2_moe":  # q/k/v biases, a shared expert of width 48, gates as they come
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, norm_topk_prob=False)
        return transformers.Qwen2MoeConfig(rope_theta=10000.0, **dict(moe, **common))
    if kind == "llama":
        return transformers.LlamaConfig(
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small so that the llama3 rescaling changes some frequencies of a 16-dim head.
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    raise ValueError(kind)


_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# A MoE router's weights are scaled by this: N(0, 0.02) logits are nearly uniform, and float
# noise could flip a near-tie between the k-th and the next expert.
ROUTER_SCALE = 10.0


def make_hf_model(kind: str, path: Path, seed: int = 0, **config_kwargs):
    """Build a random tiny HF model, perturb its norms/biases (so they are not trivially 1/0),
    scale a MoE router and Qwen2-MoE's shared-expert gate (ROUTER_SCALE: a sigmoid that varies
    between tokens, not ~0.5 everywhere), save it with save_pretrained to ``path`` and return the
    eager-attention torch model."""
    torch.manual_seed(seed)
    cfg = hf_config(kind, **config_kwargs)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, _CLASSES[kind])(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.mul_(ROUTER_SCALE)
    model.save_pretrained(path)
    return model


def torch_logits(model, tokens: np.ndarray, mask=None, positions=None) -> np.ndarray:
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(mask.astype(np.int64))
    if positions is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions, np.int64))
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens.astype(np.int64)), **kwargs)
    return out.logits.float().numpy()


def padded_batch(rng: np.random.Generator, batch: int, length: int, left: bool):
    """Random tokens with per-row lengths; returns (tokens, mask, positions) numpy arrays."""
    lengths = rng.integers(length // 2, length + 1, size=batch)
    lengths[0] = length
    tokens = rng.integers(3, VOCAB, size=(batch, length))
    mask = np.zeros((batch, length), bool)
    for b, n in enumerate(lengths):
        if left:
            mask[b, length - n :] = True
        else:
            mask[b, :n] = True
    tokens = np.where(mask, tokens, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) * mask
    return tokens.astype(np.int32), mask, positions.astype(np.int32)
