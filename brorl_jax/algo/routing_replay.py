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
forward gets (``routed``) and the per-step metrics (``routing_metrics``).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("off", "rollout")   # algo.routing_replay
NO_REPLAY_ROWS = 8           # rows of the batch the no-replay metric forward reads


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


def sample_rows(batch, rows: int = NO_REPLAY_ROWS):
    """The TokenRows, loss mask and rollout log-probs of up to ``rows`` batch rows that hold
    loss tokens (repeated to ``rows`` rows: one compiled shape), or None when none does."""
    mask = np.asarray(batch.loss_mask)
    idx = np.flatnonzero(mask.any(axis=1))
    if idx.size == 0:
        return None
    idx = np.resize(idx[:rows], rows)
    take = lambda x: None if x is None else np.asarray(x)[idx]
    return (jax.tree.map(take, batch.token_rows()), mask[idx],
            np.asarray(batch.old_logprobs)[idx])


@functools.lru_cache(maxsize=4)
def _measures(model_cfg, algo_cfg, rows: int):
    """Jitted (log-probs as the update computes them, the model's own routing) of TokenRows."""
    from brorl_jax.algo.update import make_logprob_fn
    from brorl_jax.models import forward
    logprob = make_logprob_fn(model_cfg, algo_cfg, micro_batch_size=rows)

    def own_routing(params, rows):
        mask, segments = (None, rows.segment_ids) if rows.segment_ids is not None else \
            (rows.attention_mask, None)
        _, ids = forward(params, model_cfg, rows.input_tokens, positions=rows.positions,
                         attention_mask=mask, segment_ids=segments, return_hidden=True,
                         return_routing=True)
        return jnp.moveaxis(ids, 0, 2)                  # [B, T, L, K]

    return jax.jit(lambda p, r: logprob(p, r)[0]), jax.jit(own_routing)


def routing_metrics(model_cfg, algo_cfg, params, batch, rows: int = NO_REPLAY_ROWS) -> dict:
    """Per step, a mixture-of-experts model only ({} otherwise), on ``rows`` rows of the batch
    (``sample_rows``), over their loss tokens (the response tokens, each predicted at the
    position of the token before it):
      moe/logprob_gap_mean_noreplay  mean |update log-prob - rollout log-prob|, own routing
      moe/logprob_gap_mean           the same with the batch's replayed routing when it has one
                                     (algo.routing_replay="rollout"), else = _noreplay
      moe/routing_mismatch_frac      (with a recording) tokens whose top-k set differs in any
                                     layer between the rollout and the update's own routing
      moe/routing_mismatch_frac_layer   the same per (token, layer)."""
    if not model_cfg.is_moe:
        return {}
    got = sample_rows(batch, rows)
    if got is None:
        return {}
    tok_rows, mask, rollout_lp = got
    logprob, own_routing = _measures(model_cfg, algo_cfg, rows)
    m = mask.astype(np.float32)
    gap = lambda lp: float(np.sum(np.abs(np.asarray(lp) - rollout_lp) * m) / max(m.sum(), 1.0))
    out = {"moe/logprob_gap_mean_noreplay": gap(logprob(params, tok_rows.replace(routing=None)))}
    if tok_rows.routing is None:
        out["moe/logprob_gap_mean"] = out["moe/logprob_gap_mean_noreplay"]
        return out
    out["moe/logprob_gap_mean"] = gap(logprob(params, tok_rows))
    token, layer = mismatch(tok_rows.routing, own_routing(params, tok_rows), mask)
    out["moe/routing_mismatch_frac"], out["moe/routing_mismatch_frac_layer"] = (
        float(token), float(layer))
    return out
