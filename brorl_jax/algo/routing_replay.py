"""Rollout routing replay (R3) for mixture-of-experts policies (docs/algo.md "Routing replay").

The router of a MoE model may choose other experts in the update than in the rollout (bf16 vs
f32, another kernel, a weight version apart): the update's log-prob of a token is then that of
another sub-network, and the importance ratios pi/pi_behaviour blow up. With
``algo.routing_replay="rollout"`` the rollout records each token's top-k experts per layer
(``rollout.Engine(record_routing=True)``, rollout/routing.py) and every forward of the update
(pi_old, the reference, the policy) takes them instead of its own top-k; the gates are still the
trainer's router probabilities at those experts (models/moe.route), so the router learns.

This module: the config's modes, the batch's routing (``attach_routing``: the groups' recorded
prompt and response routing laid out like the batch's tokens, packed or padded), the keyword a
forward gets (``routed``) and the routing disagreement (``mismatch``); the per-step metrics
are algo/routing_metrics.py.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("off", "rollout")   # algo.routing_replay


def replay_args(routing) -> dict:
    """forward()'s keyword for a batch's routing int[B, T, L, K] ({} for None)."""
    return {} if routing is None else {"routing": jnp.moveaxis(jnp.asarray(routing), 2, 0)}


def routed(mb: Any) -> dict:
    """PolicyFns.hidden's keyword for micro-batch ``mb`` ({} when it carries no routing, so
    a policy without the keyword, and every dense model, is called as before)."""
    routing = getattr(mb, "routing", None)
    return {} if routing is None else {"routing": routing}


def sequence_routing(groups: Sequence[Any], rows: int, seq_len: int) -> np.ndarray:
    """The groups' recorded routing per sequence in the batch's order (group by group, then
    padding rows): int[rows, seq_len, L, K], prompt token p at p, response token t at P + t;
    0 where nothing was recorded (padding, a sample's last token: no loss position reads it)."""
    first = groups[0]
    _, _, layers, k = first.routing.shape
    out = np.zeros((rows, seq_len, layers, k), first.routing.dtype)
    i = 0
    for grp in groups:
        p, n = len(grp.prompt_ids), grp.routing.shape[0]
        out[i:i + n, :p] = grp.prompt_routing[:p]
        width = min(grp.routing.shape[1], seq_len - p)
        out[i:i + n, p:p + width] = grp.routing[:, :width]
        i += n
    return out


def attach_routing(batch, groups: Sequence[Any], rows: int):
    """``batch`` (assemble_groups' UpdateBatch of ``groups``, ``rows`` sequence slots) with
    ``routing`` int[R, T, L, K] aligned with its input tokens; unchanged when the groups carry
    no recorded routing."""
    if not groups or getattr(groups[0], "routing", None) is None:
        return batch
    seq_len = batch.input_tokens.shape[1]
    per_seq = sequence_routing(groups, rows, seq_len)
    if not batch.packed:   # one sequence per row, position = column
        return batch.replace(routing=per_seq[:batch.input_tokens.shape[0]])
    seq, pos = np.asarray(batch.sequence_index), np.asarray(batch.positions)
    got = per_seq[np.maximum(seq, 0), np.minimum(pos, seq_len - 1)]
    return batch.replace(routing=np.where((seq >= 0)[..., None, None], got, 0).astype(got.dtype))


def mismatch(recorded, own, mask) -> tuple[jax.Array, jax.Array]:
    """recorded, own int[B, T, L, K] (top-k ids), mask bool[B, T] -> (fraction of masked tokens
    whose top-k set differs in any layer, fraction of masked (token, layer) pairs that differ).
    Sets: the order of the k ids does not matter."""
    a = jnp.sort(jnp.asarray(recorded, jnp.int32), axis=-1)
    b = jnp.sort(jnp.asarray(own, jnp.int32), axis=-1)
    differs = jnp.any(a != b, axis=-1)                           # [B, T, L]
    m = jnp.asarray(mask, jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    token = jnp.sum(jnp.any(differs, axis=-1) * m) / n
    layer = jnp.sum(jnp.mean(differs.astype(jnp.float32), axis=-1) * m) / n
    return token, layer

