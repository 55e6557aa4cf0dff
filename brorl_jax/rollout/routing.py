"""Rollout routing record (rollout routing replay, R3; docs/algo.md "Routing replay").

A mixture-of-experts model's rollout can record, for every token it runs, the experts each layer
chose (top-k ids, ``models.moe.route``): the prompt's from prefill and each generated token's from
the decode step that reads it. The update replays them (``models.forward(routing=...)``) so the
trainer's log-probs are those of the rollout's routing. Recording is a static switch of the
programs (``programs.Spec.record_routing``): off, the programs are exactly the ones without it.

Layouts (L layers, K = num_experts_per_tok, ids packed as ``route_dtype``):
  prompt routing   ``[P, L, K]`` per prompt (row p: the experts prompt token p went to)
  response routing ``[N, S, L, K]`` per group (row t: the experts response token t went to when
                   it was the decode step's input; the last token of a sample is never an input,
                   its row is 0: it predicts nothing the loss reads)
"""
from __future__ import annotations

import jax.numpy as jnp

from brorl_jax.models import ModelConfig
from brorl_jax.models.moe import INT8_MAX_EXPERTS, route_dtype  # noqa: F401 (the packing)


def init_route(spec) -> dict:
    """The Pool's routing record (``programs.Spec.record_routing``), zeros: prefix_route
    [pool, P, L, Kx], res_route [pool + 1, Nd, S, L, Kx]; {} when not recorded."""
    if not spec.record_routing:
        return {}
    c = spec.cfg
    lk, dt = (c.num_hidden_layers, c.num_experts_per_tok), route_dtype(c)
    return dict(prefix_route=jnp.zeros((spec.pool, spec.prompt_len, *lk), dt),
                res_route=jnp.zeros((spec.pool + 1, spec.share, spec.max_new_tokens, *lk), dt))


def check_recordable(cfg: ModelConfig) -> None:
    """Only a mixture-of-experts model has routing to record."""
    if not cfg.is_moe:
        raise ValueError(f"record_routing: model_type={cfg.model_type!r} has no experts; "
                         "routing is recorded for mixture-of-experts models only "
                         "(algo.routing_replay='off' for dense models)")

