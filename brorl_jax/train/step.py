"""One RL step of BroRL (§3.1), step by step:

    train_state, collect_state, metrics = rl_step(ctx, train_state, collect_state, batch_source,
                                                  step)

  1. Rollouts: the policy's current parameters in the form the rollout takes; generation rounds
     of ceil(prompts_per_step * generation_batch_multiplier) prompts, N samples each (N per
     prompt under adaptive N; ceil(factor * N) candidates under over-generation).
  2. Rewards: every sample scored by its data source's verifier as soon as its group is done;
     selection of N of the candidates and reward shaping (length penalty, clipping).
  3. Dynamic sampling: groups with 0 < #correct < N kept, whole and in arrival order, until
     prompts_per_step * N rows are filled (or the round cap: error, or pad).
     With algo.stream_rounds the rounds are one stream (collect's stream feed): prompts enter
     the running engine as groups come out, while the kept and in-flight groups (at the
     observed pass rate) cannot fill the step; no round boundary drains the engine. With a
     staleness bound k >= 1 (algo.host.max_age) the groups still in flight are carried into
     the next step in the paused engine (decoding on with the new weights, each token's
     sampling log-prob its TIS behaviour policy) and a group admitted more than k steps back
     is dropped and counted.
  4. Verifier health: a data source whose every sample failed stops the run (before a
     dynamic-sampling error, which it would cause).
  5. Advantages: REINFORCE++-baseline (the configured estimator and normaliser) over every kept
     group of every process.
  6. The update batch: fixed-shape, packed rows.
  7. The update: reference log-probs when the KL term is on, then PPO (clip-higher, TIS, KL) in
     mini-batches; a non-finite loss or gradient skips it. With samples carried, the stream
     decodes on while it runs (algo.decode_during_update: on a disaggregated mesh, on the
     rollout devices; collect.decode_during_update).
  8. The periodic reference reset.

`ctx` is the run's context (train/context.py; it holds the stream a step leaves paused for the
next), `train_state` an algo.TrainState, `collect_state` the algo.CollectState that carries from
step to step (adaptive-N pass rates, the advantage EMA, the last step's verifier health),
`batch_source` an iterator of the loader's prompt batches and `step` the 0-based RL step
(every random draw derives from (seed, step)). The host-side decisions are algo/host.py's
pure functions; this function only wires them to the runtime and the verifiers, and returns
the step's metrics (reduced over processes, each by the reduction declared where it is made:
train/metrics.py). Nothing else is touched: the loop (train/loop.py) adds logging,
evaluation, checkpoints and signals.
"""
from __future__ import annotations

import dataclasses
import time

import jax

from brorl_jax import algo
from brorl_jax.algo.routing_metrics import routing_metrics
from brorl_jax.errors import TrainingStopped
from brorl_jax.train import collect
from brorl_jax.train.context import RunContext
from brorl_jax.train.metrics import MAX, SUM

# Update metrics logged under loss/ (the rest under update/).
LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high",
             "dual_clip_frac", "ratio_mean", "tis_dropped_frac", "tis_weight_mean")
# ... and under rollout/: the behaviour policy's gap to the trainer (losses.behaviour_gap)
ROLLOUT_GAP_KEYS = ("logprob_gap_mean", "behaviour_kl")


def rl_step(ctx: RunContext, train_state: algo.TrainState, collect_state: algo.CollectState,
            batch_source, step: int) -> tuple[algo.TrainState, algo.CollectState, dict]:
    """One RL step (module docstring) -> (train state, collect state, the step's metrics)."""
    where = f"step {step + 1}"
    # 1-3. rollouts, rewards, selection and shaping, dynamic sampling
    params = ctx.runtime.rollout_params(train_state.params)
    got, collect_state = collect.collect(ctx, params, collect_state, batch_source, step)
    collect_state = dataclasses.replace(collect_state, health=got.health)
    # 4. verifier health: every process's verdicts together
    if got.cap_error is not None:
        ctx.check_health(got.health, where, gather=False)
        raise TrainingStopped(f"{where}: {got.cap_error}")
    health = ctx.check_health(got.health, where)
    # 5. advantages over the kept groups of every process
    advs, collect_state = collect.advantages(ctx, collect_state, got.kept)
    # 6. the update batch (this process's rows)
    batch = collect.update_batch(ctx, got.kept, advs)
    metrics = collect.collect_metrics(ctx, got, collect_state, advs, step)
    metrics.update(health.metrics())
    metrics = ctx.runtime.reduce_metrics(metrics, sums=metrics.reduced_by(SUM),
                                         maxes=metrics.reduced_by(MAX))
    if ctx.runtime.model_cfg.is_moe and ctx.runtime.num_processes == 1:
        # moe/: routing disagreement and log-prob gaps on a sample of the batch (before the update)
        metrics.update(routing_metrics(ctx.runtime.model_cfg, ctx.update_config(step),
                                       train_state.params, batch))
    # 7. the update
    t0 = time.perf_counter()
    rng = jax.random.fold_in(jax.random.key(ctx.cfg.train.seed), step)
    train_state, upd = ctx.runtime.update(ctx.update_config(step), train_state, batch, rng)
    # the carried stream decodes on while the update runs (algo.decode_during_update)
    ahead = collect.decode_during_update(ctx, upd)
    metrics.update(update_metrics(jax.device_get(upd)))
    metrics["time/update_s"] = time.perf_counter() - t0
    metrics.update(ahead)
    # 8. the reference reset
    train_state, reset = algo.adapters.maybe_reset(train_state, ctx.cfg.update, ctx.optimizer,
                                                   ctx.mcfg, ctx.cfg.train.seed)
    if reset:
        train_state = ctx.runtime.relayout(train_state)
        metrics["ref_reset"] = 1
    return train_state, collect_state, metrics


def update_metrics(upd: dict) -> dict:
    """The update's metrics under loss/ (LOSS_KEYS), rollout/ (ROLLOUT_GAP_KEYS), mass_balance/
    or update/."""
    return {k if k.startswith("mass_balance/") else f"loss/{k}" if k in LOSS_KEYS else
            f"rollout/{k}" if k in ROLLOUT_GAP_KEYS else f"update/{k}": float(v)
            for k, v in upd.items()}
