"""Decoder-only transformer (Qwen2 / Qwen3 / Llama 3) as Flax linen modules + pure functions.

The modules (``RMSNorm``, ``DecoderLayer``) define the parameters and the math; everything the
rest of brorl_jax calls is a pure function of a plain param pytree (docs/INTERFACES.md, "models"):

    params = {"embed": {"embedding": [V, D]},
              "layers": {<DecoderLayer params, every leaf with a leading axis L>},
              "final_norm": {"scale": [D]},
              "lm_head": {"kernel": [D, V]}}          # absent when tie_word_embeddings

Per-layer leaves (before stacking): ``input_norm/scale [D]``, ``q_proj/kernel [D, H*Dh]``
(+ ``bias [H*Dh]``), ``k_proj/kernel [D, Hkv*Dh]``, ``v_proj/kernel [D, Hkv*Dh]`` (+ biases),
``o_proj/kernel [H*Dh, D]`` (+ ``bias`` for llama/qwen3 with attention_bias), ``q_norm/scale [Dh]``,
``k_norm/scale [Dh]`` (qwen3 only), ``post_attn_norm/scale [D]``, ``gate_proj/kernel [D, I]``,
``up_proj/kernel [D, I]``, ``down_proj/kernel [I, D]``; a mixture-of-experts family (qwen3_moe,
qwen2_moe) has ``moe/{router [D, E], gate_proj [E, D, I], up_proj [E, D, I], down_proj [E, I, D]}``
(+ qwen2_moe's shared expert ``moe/shared_*``) instead of the three MLP kernels (models/moe.py).

One layer (pre-norm, Llama/Qwen):
    x = x + o_proj(Attn(RoPE(q), RoPE(k), v))      with q,k,v = proj(RMSNorm(x))
    x = x + down_proj(silu(gate_proj(h)) * up_proj(h))   with h = RMSNorm(x)
Attention is causal softmax(q k^T / sqrt(Dh)) v with grouped-query heads (query head h reads
key/value head h // (H / Hkv), as transformers' ``repeat_kv``). Softmax and logits are float32.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from brorl_jax.parallel.attention import packed_attention_on_mesh
from pallas_kernels import _backend, swiglu_mlp

from . import lora, precision
from .config import ModelConfig
from .moe import SparseMoeBlock

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Same init as transformers' PreTrainedModel._init_weights (initializer_range=0.02).
_WEIGHT_INIT = nn.initializers.normal(stddev=0.02)
# Finite "minus infinity": a fully masked row (a padding query) then gives a uniform softmax
# instead of NaN, which keeps gradients finite.
_MASK_VALUE = float(np.finfo(np.float32).min)


def dtype_of(name: str) -> Any:
    """jnp dtype for a ModelConfig dtype string ("float32" | "bfloat16")."""
    return _DTYPES[name]


# ------------------------------------------------------------------------------------------------
# Rotary position embedding
# ------------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies f32[Dh/2] (RoFormer, Su et al. 2021, eq. 34), with scaling.

    inv_freq_i = theta^(-2i/Dh); "linear" divides by ``factor``; "llama3" applies Llama 3.1's
    wavelength-dependent rescaling (transformers ``_compute_llama3_parameters``). Computed in
    float32 as transformers does, so positions map to the same angles.
    """
    dim = cfg.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    scaling = cfg.rope_scaling_dict
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(scaling["factor"])
        low = np.float32(scaling["low_freq_factor"])
        high = np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = np.float32(2 * np.pi) / inv_freq
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the
        # band in between interpolated smoothly.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_type={rope_type!r} is not supported")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x[B,T,N,Dh] by angles positions[B,T] * inv_freq[Dh/2] (half-split layout).

    Matches transformers' ``rotate_half`` convention: out = x*cos + rotate_half(x)*sin with the
    two halves of the head dimension as the (real, imaginary) pairs. Computed in float32.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,Dh/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked grouped-query attention, the plain reference.

    q[B,Tq,H,Dh], k/v[B,Tk,Hkv,Dh], allowed bool[B,Tq,Tk] (True = query may read key)
    -> out[B,Tq,H,Dh] in v's dtype. Scores and softmax in float32. A row with no allowed key
    gives a uniform average instead of NaN (its output is meaningless and should be masked).
    """
    b, tq, h, dh = q.shape
    hkv = k.shape[2]
    if h % hkv != 0:
        raise ValueError(f"attention: {h} query heads is not a multiple of {hkv} key/value heads")
    qg = q.reshape(b, tq, hkv, h // hkv, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * np.float32(dh**-0.5)
    scores = jnp.where(allowed[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, h, dh).astype(v.dtype)


# ------------------------------------------------------------------------------------------------
# Flax modules
# ------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale, normalised in f32."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer. ``qkv`` and ``finish`` are the halves around attention."""

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        dense = functools.partial(nn.Dense, dtype=dt, param_dtype=pdt, kernel_init=_WEIGHT_INIT)
        norm = functools.partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)
        h, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.input_norm = norm()
        self.q_proj = dense(h * dh, use_bias=cfg.attention_bias)
        self.k_proj = dense(hkv * dh, use_bias=cfg.attention_bias)
        self.v_proj = dense(hkv * dh, use_bias=cfg.attention_bias)
        # Qwen2 has q/k/v biases only; Llama/Qwen3 attention_bias covers o_proj too.
        self.o_proj = dense(cfg.hidden_size, use_bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = norm()
            self.k_norm = norm()
        self.post_attn_norm = norm()
        if cfg.is_moe:
            self.moe = SparseMoeBlock(cfg, dt, pdt, _WEIGHT_INIT)
            return
        self.gate_proj = dense(cfg.intermediate_size, use_bias=False)
        self.up_proj = dense(cfg.intermediate_size, use_bias=False)
        self.down_proj = dense(cfg.hidden_size, use_bias=False)

    def proj(self, name: str, x: jax.Array) -> jax.Array:
        """q/k/v/o_proj of x [N, K]; fp8 weights: precision.fused_linear's kernel if it runs."""
        y = precision.fused_linear(self.cfg, x, self.params_or_none(), name)
        return getattr(self, name)(x) if y is None else y

    def params_or_none(self) -> dict | None:
        return None if self.is_initializing() else self.variables["params"]

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        b, t, _ = x.shape
        # Dense layers see [B*T, D]: XLA:CPU's weight-gradient matmul contracting over one
        # flattened axis is about twice as fast as over (B, T); the math is identical.
        hidden = self.input_norm(x).reshape(b * t, -1)
        q = self.proj("q_proj", hidden).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.proj("k_proj", hidden).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.proj("v_proj", hidden).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's Dh before RoPE.
            q = self.q_norm(q)
            k = self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def finish(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        if self.cfg.is_moe:
            return self.finish_routed(x, attn)[0]
        b, t, d = x.shape
        x = x.reshape(b * t, d) + self.proj("o_proj", attn.reshape(b * t, -1))
        hidden = self.post_attn_norm(x)
        return (x + self.mlp(hidden)).reshape(b, t, d)

    def finish_routed(self, x: jax.Array, attn: jax.Array, routing: jax.Array | None = None,
                      with_logits: bool = False) -> tuple[jax.Array, ...]:
        """``finish`` of a mixture-of-experts layer, also returning the experts it chose:
        routing int[B,T,K] (optional) replaces the router's top-k (moe.SparseMoeBlock)
        -> (x[B,T,D], expert ids int32[B,T,K]) (+ router logits f32[B,T,E] with_logits)."""
        b, t, d = x.shape
        x = x.reshape(b * t, d) + self.proj("o_proj", attn.reshape(b * t, -1))
        flat_routing = None if routing is None else routing.reshape(b * t, -1)
        out, ids, *logits = self.moe(self.post_attn_norm(x), flat_routing, with_logits)
        return ((x + out).reshape(b, t, d), ids.reshape(b, t, -1),
                *(lg.reshape(b, t, -1) for lg in logits))

    def mlp(self, hidden: jax.Array) -> jax.Array:
        """SwiGLU: down(silu(gate(h)) * up(h)). Where cfg.mlp_impl resolves to the kernels
        (GPU), pallas_kernels.swiglu_mlp computes the product inside the GEMMs over the same
        parameters; elsewhere (and while the parameters are created) the Dense layers do."""
        cfg, p = self.cfg, self.params_or_none()
        y = precision.fused_mlp(cfg, hidden, p)     # the rollout's fp8 weights' kernels
        if y is not None:
            return y
        if p is not None and not precision.is_quantized(p) and \
                swiglu_mlp.resolve_impl(cfg.mlp_impl, hidden.shape,
                                        (cfg.hidden_size, cfg.intermediate_size),
                                        hidden.dtype) == "pallas":
            return swiglu_mlp.swiglu_mlp(hidden, p["gate_proj"]["kernel"], p["up_proj"]["kernel"],
                                         p["down_proj"]["kernel"], impl="pallas")
        return self.down_proj(nn.silu(self.gate_proj(hidden)) * self.up_proj(hidden))

    def __call__(self, x: jax.Array, positions: jax.Array, allowed: jax.Array) -> jax.Array:
        q, k, v = self.qkv(x, positions)
        return self.finish(x, attention(q, k, v, allowed))


# ------------------------------------------------------------------------------------------------
# Pure functions of the param pytree
# ------------------------------------------------------------------------------------------------
def embed(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embedding: tokens int32[B,T] -> x[B,T,D] in the compute dtype."""
    table = params["embed"]["embedding"]
    return jnp.take(table, tokens, axis=0).astype(dtype_of(cfg.dtype))


def layer_qkv(
    layer_params: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Input RMSNorm, q/k/v projections (+bias), q/k RMSNorm (qwen3), RoPE at ``positions``.

    layer_params: ONE layer's params (no leading L axis); x[B,T,D], positions int[B,T]
    -> q[B,T,H,Dh], k[B,T,Hkv,Dh], v[B,T,Hkv,Dh] in the compute dtype.
    """
    return precision.layer_module(DecoderLayer, cfg, layer_params).apply(
        {"params": layer_params}, x, positions, method="qkv")


def layer_finish(layer_params: dict, cfg: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """o_proj + residual, post-attention RMSNorm, SwiGLU MLP + residual.

    x[B,T,D] (the layer's input), attn[B,T,H,Dh] (attention output) -> x[B,T,D].
    """
    return precision.layer_module(DecoderLayer, cfg, layer_params).apply(
        {"params": layer_params}, x, attn, method="finish")


def layer_finish_routed(layer_params: dict, cfg: ModelConfig, x: jax.Array, attn: jax.Array,
                        routing: jax.Array | None = None, with_logits: bool = False
                        ) -> tuple[jax.Array, ...]:
    """``layer_finish`` of a mixture-of-experts model (cfg.is_moe) that also returns the
    experts each token went to, and optionally takes them (routing replay, models/moe.py).

    x[B,T,D], attn[B,T,H,Dh], routing int[B,T,K] or None -> (x[B,T,D], ids int32[B,T,K]),
    with_logits: (x, ids, router logits f32[B,T,E]).
    """
    if not cfg.is_moe:
        raise ValueError(f"layer_finish_routed: model_type={cfg.model_type!r} has no experts")
    return precision.layer_module(DecoderLayer, cfg, layer_params).apply(
        {"params": layer_params}, x, attn, routing, with_logits, method="finish_routed")


def quantize_layers(layers, cfg: ModelConfig) -> tuple:
    """The rollout's fp8 (int8 on TPU) layers: models.precision.quantize_layers of DecoderLayer."""
    return precision.quantize_layers(DecoderLayer, layers, cfg)


def final_norm(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final RMSNorm: x[B,T,D] -> h[B,T,D]."""
    module = RMSNorm(cfg.rms_norm_eps, dtype_of(cfg.dtype), dtype_of(cfg.param_dtype))
    return module.apply({"params": params["final_norm"]}, x)


def lm_head_matrix(params: dict, cfg: ModelConfig) -> jax.Array:
    """Output projection W[D,V] (the embedding table transposed when tie_word_embeddings)."""
    if cfg.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


def lm_logits(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Logits f32[..., V] = h[..., D] @ W[D, V], accumulated in float32."""
    w = lm_head_matrix(params, cfg).astype(dtype_of(cfg.dtype))
    return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions int32[B,T] of packed rows: each sequence (a run of equal segment ids) counts
    from 0 at its first token; padding (segment 0) gets position 0."""
    seg = segment_ids.astype(jnp.int32)
    idx = jnp.arange(seg.shape[-1], dtype=jnp.int32)
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start = jax.lax.cummax(jnp.where(seg != prev, idx, 0), axis=1)
    return jnp.where(seg > 0, idx - start, 0).astype(jnp.int32)


def segment_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B,T,T]: query i may read key j when both belong to the same sequence of the packed
    row (equal segment ids) and j is a real token (segment id > 0). Causality is separate."""
    seg = segment_ids.astype(jnp.int32)
    return (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)


def dot_product_attention_args(impl: str, mask: jax.Array,
                               segment_ids: jax.Array | None) -> dict:
    """Keyword arguments of jax.nn.dot_product_attention for forward()'s masking, given the
    padding mask bool[B,T] and, for packed rows, segment ids int[B,T].

    "xla": the full causal & padding (& segment) mask. "cudnn": causal by index, plus
      * unpacked rows: key padding as per-row lengths (right padding only), so cuDNN's flash
        kernel never sees a [T, T] mask;
      * packed rows: the segment mask as `mask=`. jax 0.10.2's public dot_product_attention has
        no segment ids (only per-row query/key lengths [B]); a boolean mask is turned into an
        additive [B, 1, T, T] bias (and a bias gradient), so this path is correct but holds
        O(T^2) per row. jax's private cuDNN wrapper (jax._src.cudnn.fused_attention_stablehlo)
        takes packed segments as q/kv offsets and per-segment lengths [B, M] (Hopper+, a static
        maximum M of segments per row); Pallas alternatives with segment ids:
        jax.experimental.pallas.ops.gpu.attention.mha (Triton, equal q/kv heads) and the TPU
        splash attention. See docs/algo.md "Sequence packing".
    The returned dict leaves out `implementation` so the same arguments can be checked against
    the reference with implementation="xla" on a CPU."""
    causal = jnp.tril(jnp.ones((mask.shape[1], mask.shape[1]), bool))
    if impl == "cudnn":
        if segment_ids is None:
            return {"is_causal": True, "key_value_seq_lengths": mask.sum(-1).astype(jnp.int32)}
        return {"is_causal": True, "mask": segment_attention_mask(segment_ids)[:, None]}
    allowed = causal[None] & mask[:, None, :]
    if segment_ids is not None:
        allowed = allowed & segment_attention_mask(segment_ids)
    return {"mask": allowed[:, None]}


# What a rematerialised layer keeps for its backward pass (`remat` of forward()):
#   "full": only the layer's input; everything inside is recomputed (one extra forward).
#   "dots": also the outputs of the projections (matmuls without batch dimensions: q/k/v/o,
#           gate/up/down); the backward recomputes the norms, RoPE, SwiGLU and attention only.
#           With the fused SwiGLU kernels (cfg.mlp_impl) gate and up are saved by name
#           (swiglu_mlp.SAVED_NAMES): no kernel is rerun.
#   "none": not rematerialised (everything the backward reads is kept; same as remat=False).
# algo.update.plan_remat_policy picks one from the memory plan; True means "full".
REMAT_POLICIES = ("full", "dots", "none")


def remat_layer(layer, remat: bool | str):
    """`layer` under jax.checkpoint with the policy `remat` (False: not rematerialised)."""
    if remat is False or remat is None:
        return layer
    policy = "full" if remat is True else remat
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat policy {policy!r}; use one of {REMAT_POLICIES} (or True/False)")
    if policy == "none":
        return layer
    if policy == "full":
        return jax.checkpoint(layer)
    policy = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*swiglu_mlp.SAVED_NAMES))
    return jax.checkpoint(layer, policy=policy)


def default_positions(mask: jax.Array) -> jax.Array:
    """Positions int32[B,T] from a padding mask bool[B,T]: count of real tokens before each one.

    Works for left and right padding (a left-padded prompt starts at position 0 at its first
    real token); padding slots get position 0.
    """
    mask = mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32) * mask


def _check_tokens(tokens: jax.Array, name: str = "tokens", ndim: int = 2) -> None:
    if tokens.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {tokens.dtype}")


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    return_hidden: bool = False,
    remat: bool = False,
    routing: jax.Array | None = None,
    return_routing: bool = False,
    return_router_logits: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
    """Full-sequence forward pass.

    tokens int32[B,T]; positions int[B,T] (default: derived from attention_mask, see
    ``default_positions``, or restarting per sequence with segment_ids); attention_mask bool[B,T]
    (True = real token; default all True). Keys are masked by the causal mask (by array index)
    and the padding mask, so left or right padding both work.
    segment_ids int[B,T]: packed rows (several sequences per row, docs/INTERFACES.md "algo"):
    a token reads only earlier tokens of its own segment; 0 marks padding. Give it instead of
    attention_mask. Layers run as ``lax.scan`` over the stacked layer params; ``remat=True``
    (or a REMAT_POLICIES name) wraps each layer in ``jax.checkpoint`` (recompute activations
    in the backward pass; see remat_layer).
    Mixture-of-experts models only (models/moe.py): routing int[L,B,T,K] replaces each layer's
    own top-k experts (gates recomputed from the router); ``return_routing=True`` also returns
    the experts each layer used, int32[L,B,T,K]; ``return_router_logits=True`` each layer's
    router logits f32[L,B,T,E] (the load-balancing loss, algo/moe_losses.py).
    -> logits f32[B,T,V], or the final-normed hidden h[B,T,D] with ``return_hidden=True``
    (with ``return_routing``: the pair (that, routing); with ``return_router_logits`` the
    router logits come last).
    """
    _check_tokens(tokens)
    b, t = tokens.shape
    if segment_ids is not None:
        if attention_mask is not None:
            raise ValueError("forward: give attention_mask (padding) or segment_ids (packed rows), "
                             "not both; segment id 0 already marks padding")
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {(b, t)}")
        mask = segment_ids > 0
    else:
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
    if mask.shape != (b, t):
        raise ValueError(f"attention_mask shape {mask.shape} != tokens shape {(b, t)}")
    if positions is None:
        positions = default_positions(mask) if segment_ids is None else segment_positions(segment_ids)
    elif positions.shape != (b, t):
        raise ValueError(f"positions shape {positions.shape} != tokens shape {(b, t)}")
    if cfg.attention_impl == "flash":
        # causal flash attention over segments (a padding mask is one segment per row): the
        # Pallas kernel on GPU/TPU, its jnp reference where Pallas only interprets
        seg = segment_ids if segment_ids is not None else mask.astype(jnp.int32)
        # under a sharded step's mesh the kernel runs per device inside shard_map
        attend = lambda q, k, v: packed_attention_on_mesh(q, k, v, seg)
    elif cfg.attention_impl == "reference":
        allowed = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]  # [B,T,T]
        if segment_ids is not None:
            allowed = allowed & segment_attention_mask(segment_ids)
        attend = lambda q, k, v: attention(q, k, v, allowed)
    else:
        # "xla" or "cudnn" (flash attention). Rows past a length are garbage and masked by the
        # caller, as with the reference.
        kwargs = dot_product_attention_args(cfg.attention_impl, mask, segment_ids)
        attend = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation=cfg.attention_impl, **kwargs)

    adapters, base = lora.split(params)
    x, chosen = _run_layers(base, cfg, embed(params, cfg, tokens), positions, attend, remat,
                            routing, return_routing or return_router_logits, adapters,
                            router_logits=return_router_logits)
    h = final_norm(params, cfg, x)
    out = h if return_hidden else lm_logits(params, cfg, h)
    if not return_router_logits:
        return (out, chosen) if return_routing else out
    chosen, logits = chosen
    return (out, chosen, logits) if return_routing else (out, logits)


def _run_layers(params: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, attend,
                remat: bool | str, routing: jax.Array | None, return_routing: bool,
                adapters: dict | None = None, router_logits: bool = False
                ) -> tuple[jax.Array, Any]:
    """forward()'s layers over the embedded x[B,T,D] -> (x, the experts each layer used
    int32[L,B,T,K], or None for a dense model; with router_logits the pair (those, the router
    logits f32[L,B,T,E])). Under LoRA (models/lora.py) each layer also takes its adapters'
    slice."""
    layer_cfg = cfg if adapters is None else lora.layer_config(cfg)
    if not cfg.is_moe:
        if routing is not None or return_routing:
            raise ValueError(f"forward: routing is for mixture-of-experts models; "
                             f"model_type={cfg.model_type!r} has no experts")

        def layer(x: jax.Array, layer_params: dict) -> tuple[jax.Array, None]:
            q, k, v = layer_qkv(layer_params, layer_cfg, x, positions)
            return layer_finish(layer_params, layer_cfg, x, attend(q, k, v)), None
    else:
        if adapters is not None:
            raise ValueError("LoRA adapters on a mixture-of-experts model are not supported")

        def layer(x: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
            layer_params, layer_routing = xs
            q, k, v = layer_qkv(layer_params, cfg, x, positions)
            x, *out = layer_finish_routed(layer_params, cfg, x, attend(q, k, v), layer_routing,
                                          router_logits)
            return x, tuple(out) if router_logits else out[0]

    if adapters is not None:
        layer = lora.adapted_layer(layer, cfg)
    # The layers cast their float params to the compute dtype anyway; doing it once for the
    # stacked layer params (one fusion per leaf) instead of per layer inside the scan lets each
    # layer read its compute-dtype slice: the same values and the same gradients (a layer's
    # weight gradients are compute-dtype matmul results either way). The embedding is gathered
    # before its cast, as before, so its gradient still accumulates in its own dtype.
    step = remat_layer(layer, remat)
    layers = params["layers"]
    if layer_loop_form() == "scan" and not isinstance(layers, (tuple, list)):
        if cfg.is_moe:
            return jax.lax.scan(step, x, (compute_dtype_params(layers, cfg), routing))
        stack = layers if adapters is None else (layers, adapters)
        return jax.lax.scan(step, x, compute_dtype_params(stack, cfg))
    # one buffer per layer: each layer's slice is cast on its own (the slice and the cast
    # are one fusion, the bytes of the stacked cast) and its GEMMs read it in place
    per_layer = unstack_layers(layers, cfg.num_hidden_layers)
    if adapters is not None:
        per_layer = tuple(zip(per_layer, unstack_layers(adapters, cfg.num_hidden_layers)))
    chosen = []
    for i, layer_params in enumerate(per_layer):
        xs = compute_dtype_params(layer_params, cfg)
        if cfg.is_moe:  # a MoE layer's input: its params and its routing
            xs = (xs, None if routing is None else routing[i])
        x, ids = step(x, xs)
        chosen.append(ids)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *chosen) if cfg.is_moe else None


def layer_loop_form() -> str:
    """How forward() runs its layers, by the platform it is traced for (the backend, or
    pallas_kernels.compile_target): "scan" on CPU, a ``lax.scan`` over the stacked ``[L, ...]``
    layer params (one layer program: fast compiles, the numerics every recorded CPU run has);
    "unrolled" on GPU/TPU, one layer after another over per-layer buffers. A scan slices layer
    l's weights out of the stack in every step (a copy of every weight per pass), stacks the
    weight gradients back, and a rematerialised layer's saved activations go into stacks that
    the backward slices back out (with a whole-stack copy and a zero fill per pass): about
    200 GB per update step at 8 x 2048 tokens on Qwen2.5-1.5B (docs/algo.md)."""
    return "scan" if _backend.backend() == "cpu" else "unrolled"


def unstack_layers(layers, num_layers: int) -> tuple:
    """The stacked ``[L, ...]`` layer tree as L per-layer trees (a tuple or list: unchanged).
    ``lax.split``, so that the gradient is one concatenate per leaf, not L padded adds."""
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    leaves, tree = jax.tree.flatten(layers)
    parts = [jax.lax.split(x, (1,) * num_layers) for x in leaves]
    return tuple(jax.tree.unflatten(tree, [jnp.squeeze(p[i], 0) for p in parts])
                 for i in range(num_layers))


def compute_dtype_params(params, cfg: ModelConfig):
    """Float leaves cast to the compute dtype (what Dense / RMSNorm / embed cast them to at use);
    unchanged when the params already are in it."""
    dt = dtype_of(cfg.dtype)
    return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating)
                        and p.dtype != dt else p, params)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Random params (transformers' init: N(0, 0.02) weights, zero biases, unit norms).

    Layer params are created by ``jax.vmap`` over per-layer keys, so every leaf of
    ``params["layers"]`` has the leading axis L = num_hidden_layers.
    """
    return _init_params_jit(cfg, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(cfg: ModelConfig, rng: jax.Array) -> dict:
    pdt = dtype_of(cfg.param_dtype)
    rng_embed, rng_layers, rng_head = jax.random.split(rng, 3)
    x = jnp.zeros((1, 1, cfg.hidden_size), dtype_of(cfg.dtype))
    positions = jnp.zeros((1, 1), jnp.int32)
    allowed = jnp.ones((1, 1, 1), bool)
    layer = DecoderLayer(cfg)
    layers = jax.vmap(lambda r: layer.init(r, x, positions, allowed)["params"])(
        jax.random.split(rng_layers, cfg.num_hidden_layers)
    )
    params = {
        "embed": {
            "embedding": _WEIGHT_INIT(rng_embed, (cfg.vocab_size, cfg.hidden_size), pdt),
        },
        "layers": layers,
        "final_norm": {"scale": jnp.ones((cfg.hidden_size,), pdt)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {
            "kernel": _WEIGHT_INIT(rng_head, (cfg.hidden_size, cfg.vocab_size), pdt)
        }
    return params
