"""A tiny, locally built HF-format model for demos and smoke runs (no download).

``ensure_demo_model()`` writes a Qwen2-style checkpoint (random init, hidden 128, 4 layers,
4 query / 2 key-value heads, tied embeddings) with a character-level tokenizer sized for small
arithmetic prompts ("What is 23 + 45?" -> "68"), then returns its directory. The demo loads it
through the same ``from_pretrained`` path as a real checkpoint.

``ensure_demo_model(moe=True)`` (``ensure_demo_moe_model``; ``builtin:demo_moe``) writes its
mixture-of-experts sibling: the same tokenizer, chat template, seed, attention shapes and
embeddings, Qwen3-MoE shaped (model_type "qwen3_moe": q/k norms, no attention biases, every
layer's MLP DEMO_MOE_EXPERTS experts of width DEMO_MOE_WIDTH, top-DEMO_MOE_TOP_K, normalised
gates), for the MoE demo (configs/demo.py:moe=1).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import jax

from .builtin_store import default_cache_dir, materialize
from .config import ModelConfig
from .hf import CONFIG_NAME, WEIGHTS_NAME, Model, save_pretrained
from .transformer import init_params

DEMO_MODEL_NAME = "demo_model_v3"  # bump the suffix whenever the recipe below changes
DEMO_MOE_MODEL_NAME = "demo_moe_model_v1"  # the same rule, for demo_moe_model_config's recipe
DEMO_SEED = 0
# The MoE sibling's experts (Qwen3-30B-A3B's norm_topk_prob; 8 experts, 2 per token).
DEMO_MOE_EXPERTS, DEMO_MOE_TOP_K, DEMO_MOE_WIDTH = 8, 2, 64

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK) + ROLE_TOKENS
# Reasoning Gym's answer tags as single (non-special, so decoding keeps them) tokens: the demo's
# completions are "<answer>68</answer></s>", five tokens instead of twenty.
ANSWER_TOKENS = ("<answer>", "</answer>")
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
# GPT-2 byte-level names of the two characters above that are not printable ASCII.
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}
# Each message is <|role|>content</s> and a newline; the generation prompt opens the assistant
# turn, so a completion is the answer text followed by </s> (the generation eos).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_demo_tokenizer():
    """Character-level tokenizer wrapped as a transformers ``PreTrainedTokenizerFast`` with
    pad/bos/eos/unk and the chat template.

    Ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, 4-6 role tokens, then digits, letters, punctuation,
    space, newline, then <answer> and </answer> (105 tokens). A run of characters outside the set
    maps to one <unk>.

    It is written as a byte-level BPE with no merges, the shape of Qwen2's own tokenizer, with
    space and newline under their byte-level names (BYTE_LEVEL): transformers 5's AutoTokenizer
    loads any model_type "qwen2" directory as Qwen2Tokenizer, which rebuilds the pipeline as
    byte-level BPE from tokenizer.json's vocabulary, and with plain " " and "\n" entries it
    dropped every space and newline. In this shape both loaders give the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {BYTE_LEVEL.get(token, token): i
             for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=UNK, fuse_unk=True))
    # Every character is its own token (no merges); decoding maps the byte-level names back.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(ANSWER_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def demo_model_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> ModelConfig:
    """The demo architecture: Qwen2-style, hidden 128, 4 layers, GQA 4/2, tied embeddings."""
    return ModelConfig(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        attention_bias=True,
        qk_norm=False,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=bos_token_id,
        eos_token_ids=(eos_token_id,),
    )


def demo_moe_model_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> ModelConfig:
    """The demo architecture as a Qwen3-MoE: demo_model_config's embeddings, layers and
    attention heads, with Qwen3's q/k norms and no attention biases, and every layer's MLP a
    sparse mixture of DEMO_MOE_EXPERTS experts of width DEMO_MOE_WIDTH, top-DEMO_MOE_TOP_K
    with normalised gates (as Qwen3-30B-A3B)."""
    return demo_model_config(vocab_size, bos_token_id, eos_token_id).replace(
        model_type="qwen3_moe", attention_bias=False, qk_norm=True,
        num_experts=DEMO_MOE_EXPERTS, num_experts_per_tok=DEMO_MOE_TOP_K,
        moe_intermediate_size=DEMO_MOE_WIDTH, norm_topk_prob=True)


def ensure_demo_model(path: str | os.PathLike | None = None, moe: bool = False) -> str:
    """Build the demo checkpoint at ``path`` (default ``default_cache_dir()/DEMO_MODEL_NAME``,
    or ``DEMO_MOE_MODEL_NAME`` with ``moe``: the mixture-of-experts sibling,
    demo_moe_model_config) unless it is already there, and return the directory as a string.

    Deterministic (fixed seed), idempotent, and atomic: the model is written to a temporary
    sibling directory and renamed into place, so concurrent callers never see a partial model.
    """
    name, architecture = ((DEMO_MOE_MODEL_NAME, demo_moe_model_config) if moe
                          else (DEMO_MODEL_NAME, demo_model_config))
    target = Path(path).expanduser() if path is not None else default_cache_dir() / name

    def write(tmp: Path) -> None:
        tokenizer = build_demo_tokenizer()
        cfg = architecture(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
        params = init_params(cfg, jax.random.PRNGKey(DEMO_SEED))
        save_pretrained(Model(cfg, params, tokenizer, cfg.eos_token_ids), tmp)

    return materialize(target, (CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json"), write,
                       "demo MoE model" if moe else "demo model")


def ensure_demo_moe_model(path: str | os.PathLike | None = None) -> str:
    """``ensure_demo_model(path, moe=True)``: the demo's mixture-of-experts sibling
    (``builtin:demo_moe``)."""
    return ensure_demo_model(path, moe=True)
