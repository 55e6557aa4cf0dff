"""The rollout's precision: FP8 weights (qwix) and an FP8 KV cache (issue 41; docs/rollout.md).

A rollout engine's ModelConfig names what the rollout's copy of the model holds:
``weight_precision`` and ``kv_precision``, each ``"bf16"`` (the compute dtype, the default) or
``"fp8"`` (``with_precision``; config keys rollout.weight_dtype, rollout.kv_dtype). The update's
ModelConfig keeps the defaults: it always runs in its own dtypes.

**Weights.** ``quantize_layers`` turns each decoder layer's seven projections (q, k, v, o, gate,
up, down) into qwix ``QArray``s: e4m3 values with one scale per output channel (absmax over the
input axis, recomputed from the new weights at every update: no calibration data). The layer is
then applied through ``qwix.quantize_model(DecoderLayer, PtqProvider)``: activations are
quantized per token (absmax, dynamic) and each projection is an fp8 x fp8 ``dot_general`` with a
float32 accumulator, scaled by both scales on its output: the form XLA's GPU compiler rewrites to
a cuBLASLt FP8 GEMM on Hopper. The embedding, the norms, the biases and the LM head stay in the
compute dtype (the LM head's logits are the sampling distribution itself). On TPU, whose v5e has
no FP8 units, the same code quantizes to int8 (the MXU's int8 path; v5e's closest); the qtype is
chosen at trace time from the compile target.

Why qwix and not hand-written scales: it is the maintained JAX quantization library (MaxText and
Tunix use it; AQT is deprecated in its favour), its linen interception reaches the model's
``nn.Dense`` layers without touching their code, and its ``QArray`` dot_general picks the
quantized-operand GEMM that XLA fuses. What we add is only the choice of rule and the layer-list
layout.

**KV.** With ``kv="fp8"`` the rollout's prompt and page pools hold e4m3 values with one float32
scale per (position, KV head) (pallas_kernels.decode_attention.quantize_kv); the attention kernels
dequantize blocks as they read them (rollout/programs.py writes, the kernels read).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _backend

from .config import ModelConfig

# The projections quantized in each decoder layer (module names in transformer.DecoderLayer).
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj")
_LAYER_METHODS = ("qkv", "finish", "finish_routed")


def with_precision(cfg: ModelConfig, weights: str = "bf16", kv: str = "bf16") -> ModelConfig:
    """The rollout engine's model config: ``cfg`` with its copy's weights and KV cache in
    ``weights`` / ``kv`` ("bf16" | "fp8"; ModelConfig validates)."""
    return cfg.replace(weight_precision=weights, kv_precision=kv)


def weight_qtype():
    """The quantized weights' dtype on the current target: e4m3, or int8 on TPU (no FP8 units on
    v5e; read at trace time, so a compile for TPU from a CPU machine gets int8)."""
    return jnp.int8 if _backend.backend() == "tpu" else jnp.float8_e4m3fn


def _rules(qtype) -> list:
    import qwix
    return [qwix.QuantizationRule(module_path="(" + "|".join(QUANTIZED_PROJECTIONS) + ")",
                                  weight_qtype=qtype, act_qtype=qtype)]


@functools.lru_cache(maxsize=None)
def quantized_layer_module(layer_cls, cfg: ModelConfig, qtype_name: str):
    """``layer_cls(cfg)`` (transformer.DecoderLayer) under qwix's PTQ interception of its
    methods qkv, finish and finish_routed (a MoE model whose rollout records its routing)."""
    import qwix
    return qwix.quantize_model(layer_cls(cfg), qwix.PtqProvider(_rules(jnp.dtype(qtype_name))),
                               methods=_LAYER_METHODS)


def is_quantized(layer_params: dict) -> bool:
    """True when a layer's projections are qwix-quantized (quantize_layers' output)."""
    kernel = layer_params.get("q_proj", {}).get("kernel")
    return kernel is not None and not isinstance(kernel, (jax.Array, jax.ShapeDtypeStruct))


def layer_module(layer_cls, cfg: ModelConfig, layer_params: dict):
    """The linen module that applies ``layer_params``: ``layer_cls(cfg)``, or its quantized
    form for quantize_layers' output (transformer.layer_qkv / layer_finish)."""
    if not is_quantized(layer_params):
        return layer_cls(cfg)
    qvalue = layer_params["q_proj"]["kernel"].array.qvalue
    return quantized_layer_module(layer_cls, cfg, jnp.dtype(qvalue.dtype).name)


def _abstract_quantized(layer_cls, cfg: ModelConfig, layer_params: dict, qtype) -> Any:
    """The quantized layer's parameter tree as shapes (qwix's PTQ init, traced, nothing run)."""
    module = quantized_layer_module(layer_cls, cfg, jnp.dtype(qtype).name)
    dt = jnp.result_type(layer_params["q_proj"]["kernel"])
    x = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), dt)
    pos = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    attn = jax.ShapeDtypeStruct((1, 1, cfg.num_attention_heads, cfg.head_dim), dt)

    def init(x, pos, attn):
        key = jax.random.PRNGKey(0)
        a = module.init(key, x, pos, method="qkv")["params"]
        b = module.init(key, x, attn, method="finish")["params"]
        return {**a, **b}
    return jax.eval_shape(init, x, pos, attn)


def quantize_layers(layer_cls, layers, cfg: ModelConfig) -> tuple:
    """Each layer's projections quantized (weight_qtype, per-output-channel absmax scales in the
    compute dtype); everything else unchanged. Run under jit (rollout_layout)."""
    import qwix
    qtype = weight_qtype()
    return tuple(qwix.quantize_params(lp, _abstract_quantized(layer_cls, cfg, lp, qtype))
                 for lp in layers)


def _kernels_run(cfg: ModelConfig, x: jax.Array, qarray, swiglu: bool = False) -> bool:
    """True where pallas_kernels.fp8_gemm's kernels run a quantized projection: e4m3 weights on
    GPU, ``cfg.mlp_impl`` "auto" or "pallas" (elsewhere the layer's qwix GEMMs do)."""
    from pallas_kernels import fp8_gemm
    return fp8_gemm.resolve_impl(cfg.mlp_impl, x.shape, qarray.qvalue.shape, qarray.qvalue.dtype,
                                 swiglu=swiglu) == "pallas"


def fused_linear(cfg: ModelConfig, x: jax.Array, layer_params: dict | None,
                 name: str) -> jax.Array | None:
    """A quantized layer's projection ``name`` as pallas_kernels.fp8_gemm's fp8_linear kernel
    where it runs (``_kernels_run``): x [T, K] quantized in the kernel, the output written once
    in x's dtype. None elsewhere (or for a layer not quantized): its Dense layer runs it."""
    from pallas_kernels import fp8_gemm
    if layer_params is None or not is_quantized(layer_params):
        return None
    params = layer_params[name]
    w = params["kernel"].array
    if not _kernels_run(cfg, x, w):
        return None
    return fp8_gemm.fp8_linear(x, w.qvalue, w.scale, params.get("bias"))


def fused_mlp(cfg: ModelConfig, hidden: jax.Array, params: dict | None) -> jax.Array | None:
    """A quantized layer's SwiGLU MLP as pallas_kernels.fp8_gemm's gate/up and down kernels
    where they run (``_kernels_run``): the down projection's input handed over in e4m3 with a
    scale per (token, 128 channels), never written in the compute dtype. None elsewhere."""
    from pallas_kernels import fp8_gemm
    if params is None or not is_quantized(params):
        return None
    gate, up, down = (params[n]["kernel"].array for n in ("gate_proj", "up_proj", "down_proj"))
    if not _kernels_run(cfg, hidden, gate, swiglu=True):
        return None
    return fp8_gemm.fp8_swiglu_mlp(hidden, gate.qvalue, gate.scale, up.qvalue, up.scale,
                                   down.qvalue, down.scale)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each quantized projection of one layer."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    if cfg.is_moe:      # the experts (models/moe.py) stay in the compute dtype
        return attention
    return dict(attention, gate_proj=(d, i), up_proj=(d, i), down_proj=(i, d))


def rollout_weight_bytes(cfg: ModelConfig, num_params: int) -> int:
    """Bytes of the rollout's copy of a model of ``num_params`` parameters: all in the compute
    dtype, or under fp8 weights the projections at one byte each plus one compute-dtype scale
    per output channel."""
    item = jnp.dtype(cfg.dtype).itemsize
    if cfg.weight_precision != "fp8":
        return int(num_params) * item
    shapes = projection_shapes(cfg).values()
    quantized = cfg.num_hidden_layers * sum(a * b for a, b in shapes)
    scales = cfg.num_hidden_layers * sum(b for _, b in shapes)
    return quantized + (scales + int(num_params) - quantized) * item
