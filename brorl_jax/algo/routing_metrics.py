"""The per-step metrics of routing replay (algo/routing_replay.py; docs/algo.md "Routing
replay"): a mixture-of-experts model's routing disagreement between the rollout and the update,
and the log-prob gap between them with and without the replayed routing, measured on a sample of
``NO_REPLAY_ROWS`` rows of the step's batch with the params the rollout sampled from."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from brorl_jax.algo.moe_losses import load_balancing_loss, real_tokens
from brorl_jax.algo.routing_replay import mismatch
from brorl_jax.algo.update import make_logprob_fn
from brorl_jax.models import forward

NO_REPLAY_ROWS = 8           # rows of the batch the metric forwards read


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
    """Jitted (log-probs as the update computes them, (the model's own routing, its router
    load-balancing loss)) of TokenRows."""
    logprob = make_logprob_fn(model_cfg, algo_cfg, micro_batch_size=rows)

    def own_routing(params, rows):
        mask, segments = (None, rows.segment_ids) if rows.segment_ids is not None else \
            (rows.attention_mask, None)
        _, ids, logits = forward(params, model_cfg, rows.input_tokens, positions=rows.positions,
                                 attention_mask=mask, segment_ids=segments, return_hidden=True,
                                 return_routing=True, return_router_logits=True)
        aux = load_balancing_loss(logits, model_cfg.num_experts_per_tok,
                                  real_tokens(rows.input_tokens, mask, segments))
        return jnp.moveaxis(ids, 0, 2), aux             # [B, T, L, K], scalar

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
      moe/routing_mismatch_frac_layer   the same per (token, layer)
      moe/aux_loss                   the router load-balancing loss (algo/moe_losses.py) of the
                                     rows' real tokens at these params, own routing (whether or
                                     not algo.moe_aux_loss_coef adds it to the update's loss)."""
    if not model_cfg.is_moe:
        return {}
    got = sample_rows(batch, rows)
    if got is None:
        return {}
    tok_rows, mask, rollout_lp = got
    logprob, own_routing = _measures(model_cfg, algo_cfg, rows)
    m = mask.astype(np.float32)
    gap = lambda lp: float(np.sum(np.abs(np.asarray(lp) - rollout_lp) * m) / max(m.sum(), 1.0))
    own, aux = own_routing(params, tok_rows)
    out = {"moe/logprob_gap_mean_noreplay": gap(logprob(params, tok_rows.replace(routing=None))),
           "moe/aux_loss": float(aux)}
    if tok_rows.routing is None:
        out["moe/logprob_gap_mean"] = out["moe/logprob_gap_mean_noreplay"]
        return out
    out["moe/logprob_gap_mean"] = gap(logprob(params, tok_rows))
    token, layer = mismatch(tok_rows.routing, own, mask)
    out["moe/routing_mismatch_frac"], out["moe/routing_mismatch_frac_layer"] = (
        float(token), float(layer))
    return out
