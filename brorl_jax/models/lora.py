"""LoRA adapters (Hu et al. 2021) as a separate parameter subtree beside the frozen base.

    params = {<the base model's params>,
              "lora": {"q": {"a": [L, D_in, r], "b": [L, r, D_out]}, ...}}   # one per target

A targeted projection y = x W computes y = x W + (alpha / r) (x A) B (eq. 3 of the paper, with
our [in, out] kernel layout: A [D_in, r], B [r, D_out]). B starts at zero, so step 0 is the base
model; A is drawn as PEFT draws it (kaiming-uniform, a = sqrt(5): U(-1/sqrt(D_in), 1/sqrt(D_in))).
Adapters are float32 (the optimizer's state is theirs alone); the base stays in the compute dtype.

Why not qwix.LoraProvider: it adds `kernel_lora_a/_b` inside each Dense's own parameters by
intercepting `dot_general` while a whole linen model is applied (`qwix.quantize_model`). Here the
layers are pure functions over a stacked `[L, ...]` param tree applied one `DecoderLayer` method
at a time inside a `lax.scan`, and on GPU the SwiGLU kernels read gate/up/down's kernels directly
(no Dense call to intercept); the adapters mixed into the base tree would also have to be masked
out of the optimizer, the reference and the checkpoint leaf by leaf. A separate subtree keeps
"only the adapters train" a split of the tree, and the merge for the rollout and the PEFT export
are ours to write either way (qwix has neither).

Applying them: `forward` (transformer.py) passes each layer's slice to `adapter_hooks`, a flax
method interceptor that adds the low-rank term to the targeted Dense calls. `merge_lora` folds
W + (alpha / r) A B into the kernels (the rollout's copy, the merged export, a reference reset).
"""
from __future__ import annotations

import contextlib
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig

# Short name -> the projection's module name in DecoderLayer (and in Hugging Face's layers).
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
           "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# Hugging Face (PEFT) module path of each target inside a decoder layer.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
KEY = "lora"
_MLP_TARGETS = ("gate", "up", "down")


def parse_targets(text: str) -> tuple[str, ...]:
    """"q,k,v" -> ("q", "k", "v") in TARGETS' order; ValueError naming an unknown target."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown LoRA target(s) {unknown or [text]}; use comma-separated "
                         f"names from {','.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


def enabled(cfg: ModelConfig) -> bool:
    return cfg.lora_rank > 0


def scale(cfg: ModelConfig) -> float:
    """alpha / r, the factor of A @ B."""
    return cfg.lora_alpha / cfg.lora_rank


def projection_dims(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(D_in, D_out) of a target's kernel."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, i), "up": (d, i),
            "down": (i, d)}[target]


def max_rank(cfg: ModelConfig, targets) -> int:
    """The largest rank the targets allow: the smallest dimension of their kernels."""
    return min(min(projection_dims(cfg, t)) for t in targets)


def init_lora(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh adapters: A ~ U(-1/sqrt(D_in), 1/sqrt(D_in)) float32 [L, D_in, r], B = 0 [L, r, D_out]."""
    out = {}
    for t, key in zip(cfg.lora_targets, jax.random.split(rng, len(cfg.lora_targets))):
        d_in, d_out = projection_dims(cfg, t)
        bound = 1.0 / math.sqrt(d_in)
        shape = (cfg.num_hidden_layers, d_in, cfg.lora_rank)
        out[t] = {"a": jax.random.uniform(key, shape, jnp.float32, -bound, bound),
                  "b": jnp.zeros((cfg.num_hidden_layers, cfg.lora_rank, d_out), jnp.float32)}
    return out


def adapter_count(cfg: ModelConfig) -> int:
    """Number of adapter parameters (for memory plans)."""
    if not enabled(cfg):
        return 0
    return cfg.num_hidden_layers * cfg.lora_rank * sum(
        sum(projection_dims(cfg, t)) for t in cfg.lora_targets)


def split(params: dict) -> tuple[dict | None, dict]:
    """(adapters or None, the base params without them); no copy."""
    return params.get(KEY), base_params(params)


def base_params(params: dict) -> dict:
    """The params with the adapters off (the frozen base; the KL reference under LoRA)."""
    if KEY not in params:
        return params
    return {k: v for k, v in params.items() if k != KEY}


def with_adapters(base: dict, adapters: dict | None) -> dict:
    return base if adapters is None else dict(base, **{KEY: adapters})


def trainable(params: dict):
    """What an optimizer trains: the adapters when there are any, else every parameter."""
    return params.get(KEY, params)


def with_trainable(params: dict, train):
    """`params` with its trainable part (trainable()) replaced by `train`."""
    return dict(params, **{KEY: train}) if KEY in params else train


def delta(a: jax.Array, b: jax.Array, s: float) -> jax.Array:
    """s * A @ B in float32: [..., D_in, r] x [..., r, D_out] -> [..., D_in, D_out]."""
    return s * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))


def merge_lora(params: dict, cfg: ModelConfig) -> dict:
    """The params with each targeted kernel W replaced by W + (alpha / r) A @ B (summed in
    float32, stored in W's dtype) and no adapters; unchanged without adapters. Stacked layers."""
    adapters, base = split(params)
    if adapters is None:
        return params
    layers = dict(base["layers"])
    s = scale(cfg)
    for t, ab in adapters.items():
        proj = TARGETS[t]
        w = layers[proj]["kernel"]
        merged = (w.astype(jnp.float32) + delta(ab["a"], ab["b"], s)).astype(w.dtype)
        layers[proj] = dict(layers[proj], kernel=merged)
    return dict(base, layers=layers)


def layer_config(cfg: ModelConfig) -> ModelConfig:
    """The config the layers run with under adapters: the fused SwiGLU kernels read gate, up and
    down's kernels directly (no Dense call for adapter_hooks), so MLP targets take the XLA
    expression."""
    if any(t in _MLP_TARGETS for t in cfg.lora_targets) and cfg.mlp_impl != "reference":
        return cfg.replace(mlp_impl="reference")
    return cfg


@contextlib.contextmanager
def adapter_hooks(adapters: dict, cfg: ModelConfig):
    """Inside: every targeted Dense of a DecoderLayer adds (alpha / r) (x A) B to its output.
    adapters: ONE layer's slice ({target: {"a": [D_in, r], "b": [r, D_out]}}), in the compute
    dtype."""
    by_module = {TARGETS[t]: ab for t, ab in adapters.items()}
    s = scale(cfg)

    def interceptor(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        ab = by_module.get(context.module.name)
        if ab is None or context.method_name != "__call__" or not isinstance(context.module,
                                                                            nn.Dense):
            return y
        x = args[0]
        low = jnp.dot(jnp.dot(x, ab["a"].astype(x.dtype)), ab["b"].astype(x.dtype))
        return y + (s * low).astype(y.dtype)

    with nn.intercept_methods(interceptor):
        yield



def adapted_layer(layer, cfg: ModelConfig):
    """forward()'s layer function (x, layer params) -> (x, None) made to take (x, (layer params,
    the layer's adapters)) and run under adapter_hooks."""
    def run(x, xs):
        layer_params, adapters = xs
        with adapter_hooks(adapters, cfg):
            return layer(x, layer_params)
    return run


def value_and_grad(fn):
    """jax.value_and_grad(fn, has_aux=True) with respect to trainable(params), fn(params, ...)
    taking the whole tree: under LoRA the frozen base gets no gradient (no [D_in, D_out] weight
    gradient GEMM, no float32 gradient buffer); without adapters, exactly jax.value_and_grad."""
    plain = jax.value_and_grad(fn, has_aux=True)

    def run(params, *args):
        if KEY not in params:
            return plain(params, *args)
        base = base_params(params)
        return jax.value_and_grad(lambda a: fn(with_adapters(base, a), *args), has_aux=True)(
            params[KEY])
    return run
