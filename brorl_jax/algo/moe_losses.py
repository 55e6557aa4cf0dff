"""The router load-balancing loss of a mixture-of-experts policy (``algo.moe_aux_loss_coef``,
off by default; docs/algo.md "Router load-balancing loss").

Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) as transformers'
``Qwen3MoeForCausalLM`` computes it (``load_balancing_loss_func``, transformers 5.25), over the
L layers' router logits of one forward and its real tokens n (mask m_n):
    p_{l,n} = softmax(router_logits_{l,n})                            f32[E]
    f_e = sum_{l,n} m_n #{k : top_k(p_{l,n})_k = e} / (L sum_n m_n)   (sums to K; no gradient)
    P_e = sum_{l,n} m_n p_{l,n,e} / (L sum_n m_n)
    aux = E sum_e f_e P_e                          (K when the load and the probabilities are uniform)
The counts f come from the router's own top-k, also under routing replay (as transformers'):
the loss is about the router, not about the experts that ran.

In the update (algo/update.py), with algo.moe_aux_loss_coef > 0, each micro-batch's forward
gives its aux; the mini-batch's is their mean weighted by each micro-batch's share of the
mini-batch's real tokens (``token_shares`` summed over the micro-batch), and coef * that is added
to the policy loss. Metrics: the update's ``moe_aux_loss`` (logged update/moe_aux_loss: the mean
over the step's mini-batches of that aux, before the coefficient; only when the loss is on) and,
every step of a MoE model whatever the coefficient, ``moe/aux_loss`` of algo/routing_metrics.py
(on its sample rows at the step-start params).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

AUX_SUM = "moe_aux_loss"      # the per-mini-batch sum the update's metrics carry, and its metric


def load_balancing_loss(router_logits: jax.Array, top_k: int,
                        mask: jax.Array | None = None) -> jax.Array:
    """router_logits f32[L, ..., E] (one forward's layers; the middle axes are tokens, e.g.
    [L, B, T, E]), mask bool/float[...] (real tokens; None = all) -> the scalar aux above.
    A forward without a real token gives 0 (transformers: nan)."""
    layers, e = router_logits.shape[0], router_logits.shape[-1]
    logits = router_logits.reshape(layers, -1, e).astype(jnp.float32)
    m = (jnp.ones(logits.shape[1], jnp.float32) if mask is None
         else jnp.asarray(mask, jnp.float32).reshape(-1))
    probs = jax.nn.softmax(logits, axis=-1)                             # [L, N, E]
    _, ids = jax.lax.top_k(probs, top_k)                                # [L, N, K]
    counts = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32) * m[None, :, None, None],
                     axis=(0, 1, 2))                                    # [E]
    total = layers * jnp.sum(m)
    denom = jnp.maximum(total, 1.0)
    tokens_per_expert = jax.lax.stop_gradient(counts) / denom
    prob_per_expert = jnp.sum(probs * m[None, :, None], axis=(0, 1)) / denom
    return jnp.where(total > 0, e * jnp.sum(tokens_per_expert * prob_per_expert), 0.0)


def forward_aux(out, model_cfg, tokens: jax.Array, mask, segment_ids):
    """forward(return_router_logits=True)'s (hidden, router logits f32[L, B, T, E]) -> (hidden,
    the forward's aux over its real tokens: segment_ids > 0, else mask, else all)."""
    h, logits = out
    return h, load_balancing_loss(logits, model_cfg.num_experts_per_tok,
                                  real_tokens(tokens, mask, segment_ids))


def enabled(cfg) -> bool:
    """Whether the update adds the loss (cfg: the UpdateConfig; off at 0, the default)."""
    return cfg.moe_aux_loss_coef > 0


def real_tokens(tokens: jax.Array, mask=None, segment_ids=None) -> jax.Array:
    """float32[R, T]: 1 at the real tokens of rows: packed rows' nonzero segments, else the
    padding mask (all ones without one)."""
    if segment_ids is not None:
        return (segment_ids > 0).astype(jnp.float32)
    if mask is not None:
        return mask.astype(jnp.float32)
    return jnp.ones(tokens.shape, jnp.float32)


def token_shares(mb) -> jax.Array:
    """float32[R, T]: a mini-batch's real tokens, each 1 / their number (the weight of a
    micro-batch's aux is the sum of its rows' shares)."""
    m = real_tokens(mb.input_tokens, mb.attention_mask, mb.segment_ids)
    return m / jnp.maximum(jnp.sum(m), 1.0)


def add_aux_loss(loss: jax.Array, sums: dict, aux: jax.Array, shares: jax.Array, cfg
                 ) -> tuple[jax.Array, dict]:
    """A micro-batch's (policy loss, metric sums) with algo.moe_aux_loss_coef times its
    share-weighted aux added (cfg: the UpdateConfig)."""
    weighted = aux * jnp.sum(shares)
    return loss + cfg.moe_aux_loss_coef * weighted, dict(sums, **{AUX_SUM: weighted})


def sum_keys(keys: tuple, on: bool) -> tuple:
    """The update's metric sums (losses.METRIC_SUMS) and, with the loss on, AUX_SUM."""
    return (*keys, AUX_SUM) if on else keys


def aux_metrics(m: dict) -> dict:
    """The step's ``moe_aux_loss`` from the stacked per-mini-batch sums ({} when off)."""
    return {AUX_SUM: jnp.mean(m[AUX_SUM])} if AUX_SUM in m else {}
