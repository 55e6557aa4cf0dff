"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE: router, top-k experts, grouped
GEMM, and Qwen2-MoE's shared expert.

One MoE layer (transformers' ``Qwen3MoeSparseMoeBlock``; Shazeer et al. 2017, Switch/GShard):
    p = softmax(h @ W_router)                      f32[N, E], from float32 router logits
    ids, w = top_k(p, K)                           ids int32[N, K], gates w f32[N, K]
    w = w / sum(w)                                 when norm_topk_prob
    out_n = sum_k w[n,k] * down_e(silu(gate_e(h_n)) * up_e(h_n))     with e = ids[n, k]
Params of one layer (the ``moe`` submodule of DecoderLayer):
    router [D, E], gate_proj [E, D, I], up_proj [E, D, I], down_proj [E, I, D]   (I = moe width)

Qwen2-MoE (transformers' ``Qwen2MoeSparseMoeBlock``; model_type "qwen2_moe", gates not
renormalised by default) adds a shared expert, a SwiGLU MLP of width S =
ModelConfig.shared_expert_intermediate_size that every token goes through, gated per token:
    out_n += sigmoid(h_n @ w_shared_gate) * shared_down(silu(shared_gate(h_n)) * shared_up(h_n))
with params shared_gate_proj [D, S], shared_up_proj [D, S], shared_down_proj [S, D],
shared_expert_gate [D, 1] (S = 0: none, Qwen3-MoE). It is a plain dense MLP on every token
(XLA's GEMMs; outside the routing, the routing record and the expert exchange), summed with the
routed output in float32. Not supported (refused by ModelConfig.from_hf_config): dense MLP layers
among the sparse ones (mlp_only_layers, decoder_sparse_step > 1) and sliding-window attention.

The experts run as a grouped GEMM: the N*K (token, choice) rows sorted by expert and one GEMM
per expert group (ModelConfig.moe_impl): "grouped" (the default, ``experts_grouped``:
pallas_kernels.grouped_gemm, Mosaic GPU kernels on an sm_90 GPU and megablox on TPU,
``jax.lax.ragged_dot`` on CPU), "ragged" (``experts_ragged``: ``jax.lax.ragged_dot`` everywhere;
XLA's GPU lowering of it pads the rows against every expert, docs/results.md) or "dense"
(``experts_dense``, the plain reference: every expert on every token, combined with a [N, E]
gate matrix that is zero off the chosen experts).
Under a mesh with an `expert` axis (config mesh.expert > 1) the block runs its expert function on
each device's own experts and exchanges the tokens (parallel/expert_parallel.py).

Routing hook (rollout routing replay, R3): ``SparseMoeBlock(h, routing)`` takes optional
``routing`` int32[N, K], expert ids chosen elsewhere (the rollout). Given, they replace the
block's own top-k, and the gates are still the router's probabilities at those experts
(renormalised as usual), so the router keeps its gradient. The block returns the ids it used
(its own top-k, or ``routing``) beside its output; transformer.forward(return_routing=True)
and transformer.layer_finish_routed hand them out per layer; with ``with_logits=True`` the
block also returns its float32 router logits (forward(return_router_logits=True): the router
load-balancing loss, algo/moe_losses.py).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from brorl_jax.parallel.expert_parallel import experts_on_mesh
from pallas_kernels import grouped_gemm as gg

from .config import ModelConfig


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool,
          routing: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits f32[N, E] -> (expert ids int32[N, K], gates f32[N, K]).

    Without ``routing`` the ids are the top-k of softmax(logits) (ties to the lower id); with it
    (int[N, K]) they are ``routing`` and the gates are the probabilities at those experts."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if routing is None:
        gates, ids = jax.lax.top_k(probs, top_k)
    else:
        if routing.shape != (*logits.shape[:-1], top_k):
            raise ValueError(f"routing shape {routing.shape}; expected "
                             f"{(*logits.shape[:-1], top_k)} (tokens, num_experts_per_tok)")
        ids = routing.astype(jnp.int32)
        gates = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids, gates


def experts_dense(x: jax.Array, ids: jax.Array, gates: jax.Array, gate_proj: jax.Array,
                  up_proj: jax.Array, down_proj: jax.Array) -> jax.Array:
    """Reference: every expert on every token, masked by the gates.

    x[N, D], ids int[N, K], gates f32[N, K], gate_proj/up_proj [E, D, I], down_proj [E, I, D]
    -> out[N, D] in x's dtype (the weighted sum over experts in float32)."""
    n, e = x.shape[0], gate_proj.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], ids].add(gates)
    g = jnp.einsum("nd,edi->eni", x, gate_proj)
    u = jnp.einsum("nd,edi->eni", x, up_proj)
    y = jnp.einsum("eni,eid->end", nn.silu(g) * u, down_proj)
    return jnp.einsum("end,ne->nd", y.astype(jnp.float32), combine).astype(x.dtype)


def _experts_sorted(x, ids, gates, gate_proj, up_proj, down_proj, gemm) -> jax.Array:
    """The N*K (token, choice) rows sorted by expert (stably), each expert's contiguous group
    multiplied by its weights with ``gemm(rows, w [E, ...], group_sizes)``, the rows put back in
    token order and summed over the K choices with their gates."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                       # rows grouped by expert
    sizes = jnp.bincount(flat, length=gate_proj.shape[0]).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)                       # [N*K, D]
    g = gemm(rows, gate_proj, sizes)
    u = gemm(rows, up_proj, sizes)
    y = gemm(nn.silu(g) * u, down_proj, sizes)                   # [N*K, D], expert order
    y = jnp.take(y, jnp.argsort(order), axis=0).reshape(n, k, -1)  # token order
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), gates).astype(x.dtype)


def experts_ragged(x: jax.Array, ids: jax.Array, gates: jax.Array, gate_proj: jax.Array,
                   up_proj: jax.Array, down_proj: jax.Array) -> jax.Array:
    """The grouped GEMM as ``jax.lax.ragged_dot``: same arguments and result as
    ``experts_dense``."""
    return _experts_sorted(x, ids, gates, gate_proj, up_proj, down_proj, jax.lax.ragged_dot)


def experts_grouped(x: jax.Array, ids: jax.Array, gates: jax.Array, gate_proj: jax.Array,
                    up_proj: jax.Array, down_proj: jax.Array) -> jax.Array:
    """The grouped GEMM as ``pallas_kernels.grouped_gemm`` (Mosaic GPU kernels on an sm_90 GPU,
    megablox on TPU; ``jax.lax.ragged_dot`` on CPU, where it is ``experts_ragged`` exactly)."""
    return _experts_sorted(x, ids, gates, gate_proj, up_proj, down_proj, gg.grouped_gemm)


EXPERT_FNS: dict[str, Callable[..., jax.Array]] = {"grouped": experts_grouped,
                                                   "ragged": experts_ragged,
                                                   "dense": experts_dense}

def may_run_kernel(cfg: ModelConfig) -> bool:
    """Whether a MoE model's experts may run a Pallas kernel on the platform traced for
    (moe_impl "grouped" on a GPU or TPU; runs_kernel decides per call from the shapes): its
    sharded steps are then traced under their mesh (algo.sharded_steps.traced_on)."""
    return cfg.is_moe and cfg.moe_impl == "grouped" and gg.kernel_platform()


def runs_kernel(cfg: ModelConfig, tokens: int, gate_proj: jax.Array) -> bool:
    """Whether the block's expert function runs a Pallas kernel on the platform traced for
    (moe_impl "grouped" where pallas_kernels.grouped_gemm resolves to one): under a mesh it then
    runs per device under shard_map (parallel/expert_parallel._per_device)."""
    rows = (tokens * cfg.num_experts_per_tok, gate_proj.shape[1])
    return (cfg.moe_impl == "grouped"
            and gg.resolve("auto", rows, gate_proj.shape, gate_proj.dtype) != "reference")


def shared_expert(h: jax.Array, gate_proj: jax.Array, up_proj: jax.Array, down_proj: jax.Array,
                  expert_gate: jax.Array) -> jax.Array:
    """Qwen2-MoE's shared expert on every token: h[N, D], gate_proj / up_proj [D, S],
    down_proj [S, D], expert_gate [D, 1] -> f32[N, D] =
    sigmoid(h @ expert_gate) * down(silu(gate(h)) * up(h)) (float32 gate and product)."""
    y = (nn.silu(h @ gate_proj) * (h @ up_proj)) @ down_proj
    g = jnp.einsum("nd,do->no", h, expert_gate, preferred_element_type=jnp.float32)
    return jax.nn.sigmoid(g) * y.astype(jnp.float32)


INT8_MAX_EXPERTS = 128     # ids 0..127 fit int8


def route_dtype(cfg: ModelConfig):
    """The dtype a routing record packs expert ids in (rollout routing replay: the rollout's
    record, rollout/routing.py, and the update batch's, algo/routing_replay.py): int8 up to 128
    experts, else int16."""
    return jnp.int8 if cfg.num_experts <= INT8_MAX_EXPERTS else jnp.int16


def routing_record_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Bytes of the routing record of ``tokens`` tokens: top-k ids per layer, ``route_dtype``
    (L x K x 1 or 2 bytes a token; 0 for a dense model, which records none)."""
    if not cfg.is_moe:
        return 0
    item = jnp.dtype(route_dtype(cfg)).itemsize
    return int(tokens) * cfg.num_hidden_layers * cfg.num_experts_per_tok * item


class SparseMoeBlock(nn.Module):
    """Router + experts of one layer (module docstring). ``__call__(h[N, D], routing=None)``
    -> (out[N, D], expert ids int32[N, K]); with ``with_logits=True`` also the router logits
    f32[N, E]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.normal(stddev=0.02)

    @nn.compact
    def __call__(self, h: jax.Array, routing: jax.Array | None = None,
                 with_logits: bool = False) -> tuple[jax.Array, ...]:
        cfg = self.cfg
        d, e, i = h.shape[-1], cfg.num_experts, cfg.moe_intermediate_size

        def param(name, shape):
            # given weights are taken as they are: under the rollout's expert parallelism each
            # device holds E/P experts (parallel/expert_parallel.py), which flax's shape check
            # of self.param would refuse
            if self.has_variable("params", name):
                return self.get_variable("params", name)
            return self.param(name, self.kernel_init, shape, self.param_dtype)
        router = param("router", (d, e))
        weights = [param("gate_proj", (e, d, i)).astype(self.dtype),
                   param("up_proj", (e, d, i)).astype(self.dtype),
                   param("down_proj", (e, i, d)).astype(self.dtype)]
        s = cfg.shared_expert_intermediate_size
        shared = [param("shared_gate_proj", (d, s)), param("shared_up_proj", (d, s)),
                  param("shared_down_proj", (s, d)),
                  param("shared_expert_gate", (d, 1))] if s else None
        if self.is_initializing():   # the params are made: no need to compile the experts
            return jnp.zeros_like(h), jnp.zeros((h.shape[0], cfg.num_experts_per_tok), jnp.int32)
        h = h.astype(self.dtype)
        logits = jnp.einsum("nd,de->ne", h, router.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        ids, gates = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, routing)
        # one device: the expert function; under a mesh with an expert axis the same function
        # on each device's experts, the tokens exchanged (parallel/expert_parallel.py)
        out = experts_on_mesh(EXPERT_FNS[cfg.moe_impl], h, ids, gates, *weights,
                              manual=runs_kernel(cfg, h.shape[0], weights[0]), num_experts=e,
                              capacity_factor=cfg.expert_capacity_factor)
        if shared is not None:
            out = (out.astype(jnp.float32)
                   + shared_expert(h, *(w.astype(self.dtype) for w in shared))).astype(out.dtype)
        return (out, ids, logits) if with_logits else (out, ids)
