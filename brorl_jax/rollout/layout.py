"""The rollout's layouts of its data (rollout/programs.py runs on them): the parameter copy the
programs read (compute dtype, one buffer per layer, fp8 projections under
``cfg.weight_precision == "fp8"``) and the KV stores' dtype and writes (bit patterns on CPU, e4m3
values with their scales under ``cfg.kv_precision == "fp8"``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from brorl_jax.models import ModelConfig
from brorl_jax.models.lora import merge_lora
from brorl_jax.models.precision import is_quantized
from brorl_jax.models.transformer import dtype_of, quantize_layers
from pallas_kernels import _backend
from pallas_kernels.decode_attention import FP8_KV_DTYPE, quantize_kv

# ----------------------------------------------------------------------------------------------
# The rollout's parameter layout
# ----------------------------------------------------------------------------------------------


def rollout_layout(params: dict, cfg: ModelConfig) -> dict:
    """The parameters as the rollout's programs read them: floating leaves in the compute dtype
    (cast once, not inside every decode step) and the layer stack ``[L, ...]`` split into one
    buffer per layer (a tuple of L per-layer dicts), so each layer's weights are read in place:
    slicing layer l out of a stacked weight inside the decode loop (a ``lax.scan`` over layers)
    is a copy of every layer's weights on every step. With ``cfg.weight_precision == "fp8"`` each
    layer's projections are quantized (models.precision.quantize_layers: e4m3, per-output-channel
    scales from these weights). Already in this layout: unchanged.
    Run it under jit (``Runtime.rollout_params``, ``Engine.stream``): the outputs are separate
    buffers."""
    if in_rollout_layout(params, cfg):
        return params
    params = merge_lora(params, cfg)   # LoRA: W + (alpha / r) A B, no adapters left
    dt = dtype_of(cfg.dtype)
    cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x
    params = jax.tree.map(cast, params)
    layers = layer_list(params, cfg)
    if cfg.weight_precision == "fp8":
        layers = quantize_layers(layers, cfg)
    return dict(params, layers=layers)


def in_rollout_layout(params: dict, cfg: ModelConfig) -> bool:
    """True when ``params`` is in :func:`rollout_layout`'s layout (no conversion needed)."""
    dt = jnp.dtype(dtype_of(cfg.dtype))
    layers = params.get("layers")
    if not isinstance(layers, (tuple, list)):
        return False
    fp8 = cfg.weight_precision == "fp8"
    if any(is_quantized(lp) != fp8 for lp in layers):
        return False
    allowed = {dt, jnp.dtype(jnp.float8_e4m3fn)} if fp8 else {dt}
    return all(jnp.dtype(x.dtype) in allowed for x in jax.tree.leaves(params)
               if jnp.issubdtype(x.dtype, jnp.floating))


def layer_list(params: dict, cfg: ModelConfig) -> tuple:
    """The per-layer parameter dicts: the tuple of the rollout layout, or static slices of a
    stacked ``[L, ...]`` layer tree."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    return tuple(jax.tree.map(lambda x, i=i: x[i], layers) for i in range(cfg.num_hidden_layers))


# ----------------------------------------------------------------------------------------------
# The KV stores
# ----------------------------------------------------------------------------------------------


def kv_store_dtype(cfg: ModelConfig, attention_impl: str = "reference"):
    """dtype of the own-KV store: the compute dtype, except bfloat16 on CPU under the jnp
    reference, kept as uint16 bit patterns (XLA's CPU backend computes a bfloat16 scatter in
    float32, converting the whole store per layer and step; the reference reads the blocks back
    as bfloat16; the Pallas kernels take float stores)."""
    dt = jnp.dtype(dtype_of(cfg.dtype))
    cpu_reference = _backend.backend() == "cpu" and attention_impl == "reference"
    if cfg.kv_precision == "fp8":     # e4m3, as uint8 bit patterns on CPU (the same reason)
        return jnp.dtype(jnp.uint8) if cpu_reference else jnp.dtype(FP8_KV_DTYPE)
    if dt == jnp.bfloat16 and cpu_reference:
        return jnp.dtype(jnp.uint16)
    return dt


def _write_kv(pages, scales, layer, page, offset, values):
    """pages[layer, page[b], h, offset[b], :] = values[b, h]: one scatter, in place. In bounds by
    construction (``promise_in_bounds``: a bounds-checked scatter costs a pass over the pool).

    The store is scattered as rows ``[L * NP * Hkv, ps, Dh]`` (a free reshape), so the only
    window dimension is the minor ``Dh``: a scatter whose window is ``(Hkv, Dh)`` with the page
    offset between them makes XLA's TPU layout assignment pick a layout with ``Hkv`` next to
    ``Dh`` for the store, and then copy the whole page pool into the attention kernel's layout
    at every layer of every step.

    ``scales`` (an fp8 cache: ``[L, NP+1, Hkv, ps]`` float32, else None): the values are
    quantized per (position, KV head) (quantize_kv) and their scales written beside them.
    Returns (pages, scales)."""
    n_layers, n_pages, hkv, ps, dh = pages.shape
    b = page.shape[0]
    rows = ((layer * n_pages + page)[:, None] * hkv + jnp.arange(hkv)[None, :]).reshape(b * hkv)
    at = (rows, jnp.repeat(offset, hkv))
    if scales is not None:
        values, sc = quantize_kv(values)
        scales = scales.reshape(n_layers * n_pages * hkv, ps).at[at].set(
            sc.reshape(b * hkv), mode="promise_in_bounds").reshape(scales.shape)
    flat = pages.reshape(n_layers * n_pages * hkv, ps, dh)
    flat = flat.at[at].set(_as_store(values.reshape(b * hkv, dh), pages.dtype),
                           mode="promise_in_bounds")
    return flat.reshape(pages.shape), scales


def _as_store(values, dtype):
    """``values`` in a KV store's dtype: a uint16 / uint8 store holds the bit patterns of
    bfloat16 / e4m3 (kv_store_dtype)."""
    if dtype in (jnp.uint16, jnp.uint8):
        wide = jnp.bfloat16 if dtype == jnp.uint16 else FP8_KV_DTYPE
        return jax.lax.bitcast_convert_type(values.astype(wide), dtype)
    return values.astype(dtype)
