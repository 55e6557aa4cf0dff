"""The collect of one RL step: generation rounds -> scoring -> the kept groups, then the
advantages and the update batch over every process (BroRL §3.1). One path for every
configuration; the decisions are algo/collect.py's pure functions, this module does the I/O
(rollouts, the verifier pool, cross-process gathers) and the step's rollout metrics.

Per generation round (ceil(prompts_per_step * generation_batch_multiplier) prompts):
  1. how many samples per prompt: algo.collect.samples_per_prompt (FixedN = the paper's N, or
     AdaptiveN from the CollectState's pass rates); prompts with the same N are generated in one
     call;
  2. over-generation (an option): ceil(factor * N) candidates, N kept by rollout.select_rule;
  3. scoring in the worker pool, each group as soon as the rollout streams it out (decoding goes
     on meanwhile; time/scoring_waited_for_rollout_s and time/rollout_idle_for_scoring_s say how
     long each side waited on the other), then reward shaping (length penalty, clipping):
     algo.collect.make_group;
  4. the group filter (algo.GroupSampler) keeps groups in arrival order until the row budget
     (prompts_per_step * N) is full; the round's pass rates update the CollectState.
Then `advantages` (the normaliser over every kept group of every process) and `update_batch`.
Under several processes each process fills its share of the rows with its own prompts.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from brorl_jax import algo
from brorl_jax.algo import collect as host
from brorl_jax.rewards.health import VerifierHealth
from brorl_jax.train.context import RunContext, merge_health
from brorl_jax.train.monitoring import (
    effective_update_ratio,
    ngram_diversity,
    path_diversity,
    reward_entropy,
)

ROLLOUT_STAT_KEYS = ("useful_tokens", "decode_steps", "refills", "compactions")


def round_seed(seed: int, step: int, round_: int) -> int:
    """A distinct, reproducible rollout seed for every (run seed, step, generation round)."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


def call_seed(round_seed_: int, call: int) -> int:
    """The seed of the `call`-th rollout call (one per N bucket) of a round."""
    return (round_seed_ + call * 1_000_000_007) % (2**31 - 1)


@dataclasses.dataclass
class Collected:
    """What the generation rounds of one step produced (this process's share)."""
    kept: list                      # algo.Group kept by dynamic sampling, in arrival order
    every: list                     # every group after selection (monitoring)
    infos: list                     # algo.collect.GroupInfo of every group
    truncated: list                 # per group: truncated [m] of its candidates
    n_chosen: list                  # N of every prompt generated
    sampler_stats: dict
    rows_used: int
    health: VerifierHealth          # the verdicts of every sample scored
    timing: dict                    # time/* seconds
    rollout_stats: dict             # summed rollout.RolloutStream.stats
    generated_samples: int
    cap_error: str | None = None    # the round cap was hit with cap policy "error"


def generate_groups(ctx: RunContext, params, state: algo.CollectState, batch_source, step: int
                    ) -> tuple[Collected, algo.CollectState]:
    """Generation rounds until dynamic sampling has filled this process's rows (or the round
    cap); `params` as the runtime's rollout takes them. -> (what was collected, the state with
    the observed pass rates)."""
    ccfg = ctx.collect_cfg
    row_budget = ccfg.batch_rows // ctx.runtime.num_processes
    sampler = algo.GroupSampler.from_config(ccfg, row_budget=row_budget,
                                            max_group_rows=host.max_group_rows(ccfg))
    sampling = ctx.train_sampling(step)
    every, infos, truncated, n_chosen, healths = [], [], [], [], []
    timing = dict.fromkeys(("rollout_s", "scoring_s", "scoring_waited_for_rollout_s",
                            "rollout_idle_for_scoring_s"), 0.0)
    stats = {**dict.fromkeys(ROLLOUT_STAT_KEYS, 0), "live_slot_steps": 0.0, "slot_steps": 0}
    samples, cap_error = 0, None
    while True:
        try:
            if not sampler.need_more():
                break
        except algo.DynamicSamplingError as e:      # cap policy "error"
            cap_error = str(e)
            break
        batch = next(batch_source)
        seed = round_seed(ccfg.seed, step, sampler.rounds)
        ns = host.samples_per_prompt(ccfg, state, batch["index"])
        n_chosen += ns
        groups: list = [None] * len(ns)
        observed = []
        for b, (n, positions) in enumerate(algo.policies.group_by_n(ns)):
            # each group is scored as soon as its samples are done, while decoding goes on
            with ctx.rollouts(params, [batch["prompt_ids"][p] for p in positions],
                              n=host.num_candidates(ccfg, n), seed=call_seed(seed, b),
                              sampling=sampling, stream=True) as st:
                for gr in st:
                    p = positions[gr.prompt_index]
                    record = batch["records"][p]
                    t0 = time.perf_counter()
                    scored = ctx.scorer.score([record] * gr.lengths.size, gr.tokens, gr.lengths)
                    timing["scoring_s"] += time.perf_counter() - t0
                    healths.append(scored.health)
                    samples += gr.lengths.size
                    truncated.append(gr.truncated)
                    index = int(batch["index"][p])
                    groups[p], info = host.make_group(
                        ccfg, gr, scored.rewards, n=n, prompt_ids=batch["prompt_ids"][p],
                        index=index, step=step, round_=sampler.rounds, position=p)
                    infos.append(info)
                    observed.append((index, info.pass_rate))
                done = time.perf_counter()
            timing["rollout_s"] += st.finished_at - st.started_at
            stats = add_rollout_stats(stats, st.stats)
            timing["scoring_waited_for_rollout_s"] += st.wait_seconds
            timing["rollout_idle_for_scoring_s"] += max(0.0, done - st.finished_at)
        state = host.observe(ccfg, state, observed)
        every += groups
        sampler.add_round(groups)
    return Collected(kept=list(sampler.groups), every=every, infos=infos, truncated=truncated,
                     n_chosen=n_chosen, sampler_stats=sampler.stats(),
                     rows_used=sampler.rows_used, health=merge_health(healths),
                     timing={f"time/{k}": v for k, v in timing.items()}, rollout_stats=stats,
                     generated_samples=samples, cap_error=cap_error), state


def advantages(ctx: RunContext, state: algo.CollectState, kept: Sequence[algo.Group]
               ) -> tuple[list[np.ndarray], algo.CollectState]:
    """Per kept group: advantages [n_g], normalised over the kept groups of all processes."""
    runtime = ctx.runtime
    local = [(g.shaped.tolist(), g.lengths.tolist()) for g in kept]
    first = 0
    if runtime.num_processes > 1:       # normalise over the whole batch
        every = runtime.allgather_json(local)
        first = sum(len(x) for x in every[:runtime.process_index])
        local = [item for part in every for item in part]
    adv, state = host.advantages(ctx.collect_cfg, state, [s for s, _ in local],
                                 [n for _, n in local])
    return adv[first:first + len(kept)], state


def update_batch(ctx: RunContext, kept: Sequence[algo.Group], advs: list[np.ndarray]) -> dict:
    """This process's rows of the update batch. Each process packs its own groups into its units
    of PPO mini-batches; the processes then agree on the rows per unit."""
    ccfg, runtime = ctx.collect_cfg, ctx.runtime
    procs = runtime.num_processes
    units = host.pack_units(ctx.algo_cfg.ppo_mini_batches, procs)
    batch = host.update_batch(ccfg, kept, advs, rows=ccfg.batch_rows // procs,
                              seq_len=ctx.seq_len, pad_id=ctx.pad_id, units=units,
                              row_multiple=runtime.row_multiple)
    if ccfg.pack_sequences and procs > 1:
        per_unit = batch["input_tokens"].shape[0] // units
        rows = int(runtime.allgather_rows(np.array([per_unit])).max())
        batch = algo.pad_packed_rows(batch, rows, pad_id=ctx.pad_id)
    return batch


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------
def add_rollout_stats(total: dict, call: dict) -> dict:
    """The step's totals with one rollout call's statistics (rollout.RolloutStream.stats)."""
    out = dict(total)
    for k in ROLLOUT_STAT_KEYS:
        out[k] += int(call.get(k, 0))
    steps = int(call.get("decode_steps", 0))
    out["live_slot_steps"] += float(call.get("mean_live_slots", 0.0)) * steps
    out["slot_steps"] += int(call.get("num_slots", 0)) * steps
    return out


def rollout_metrics(total: dict) -> dict:
    """The step's rollout statistics: useful tokens (every token generated, over-generated
    candidates included), decode steps, refills, compactions and the occupancy (live slots over
    slots, averaged over every decode step of the step's calls)."""
    out = {f"rollout/{k}": total[k] for k in ROLLOUT_STAT_KEYS}
    if total["slot_steps"]:
        out["rollout/occupancy"] = total["live_slot_steps"] / total["slot_steps"]
    return out


def collect_metrics(ctx: RunContext, got: Collected, state: algo.CollectState,
                    advs: Sequence[np.ndarray], step: int) -> dict:
    """The step's rollout metrics (this process's; the loop reduces them over processes)."""
    ccfg = ctx.collect_cfg
    thr = ccfg.correct_threshold
    out = step_metrics(got.every, got.truncated, got.sampler_stats, got.kept, advs, thr=thr,
                       n_nominal=ccfg.rollouts_per_prompt)
    out.update(got.timing)
    out["perf/generated_samples"] = got.generated_samples
    out.update(rollout_metrics(got.rollout_stats))
    if ctx.temperature_schedule:
        out["rollout/temperature"] = ctx.rollout_temperature(step)
    if ccfg.adaptive_n:
        ns_arr = np.asarray(got.n_chosen)
        out["monitor/n_mean"] = float(ns_arr.mean())
        buckets, _ = algo.policies.parse_adaptive_n(ccfg.adaptive_n_buckets,
                                                    ccfg.adaptive_n_thresholds)
        for n in buckets:
            out[f"adaptive_n/prompts_n{n}"] = int(np.sum(ns_arr == n))
        out["adaptive_n/batch_rows_used"] = int(got.rows_used)
        out["adaptive_n/padded_rows"] = int(got.sampler_stats["padded_rows"])
        out["adaptive_n/tracked_prompts"] = len(state.pass_rates)
    if float(ccfg.overgenerate_factor) > 1.0:
        cands = sum(i.candidates for i in got.infos)
        kept = sum(i.kept for i in got.infos)
        out["monitor/selection_kept_frac"] = kept / cands
        out["monitor/selection_unique_frac"] = sum(i.unique for i in got.infos) / cands
        out["monitor/selection_duplicates_kept_frac"] = \
            sum(i.duplicates_kept for i in got.infos) / kept
    checked = sum(i.clip_checked for i in got.infos)
    if checked:
        out["reward/clipped_frac"] = sum(i.clipped for i in got.infos) / checked
    if "ema_std" in state.advantage_normalizer:
        out["advantage/ema_std"] = float(state.advantage_normalizer["ema_std"])
    if ctx.cfg.train.mass_balance_diagnostics:
        from brorl_jax.theory import group_reward_balance, reward_balance_metrics
        out.update(reward_balance_metrics(group_reward_balance(
            np.stack([g.rewards for g in got.every]), None, correct_threshold=thr)))
    return out


def step_metrics(groups: Sequence[algo.Group], truncated: Sequence[np.ndarray], ds: dict,
                 kept: Sequence[algo.Group], advantages: Sequence[np.ndarray], *, thr: float,
                 n_nominal: int) -> dict:
    """The per-step rollout metrics: rewards, lengths, dynamic sampling and the BroRL write-ups'
    monitoring (diversity, effective update ratio, reward entropy) over the step's groups."""
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.concatenate([g.lengths for g in groups])
    return {
        "reward/mean": float(rewards.mean()),
        "reward/correct_frac": float((rewards >= thr).mean()),
        "dynamic_sampling/pass_rate": ds["pass_rate"],
        "dynamic_sampling/rounds": ds["generation_rounds"],
        "dynamic_sampling/kept_groups": ds["kept_groups"],
        # in units of nominal groups (rollouts_per_prompt rows)
        "dynamic_sampling/padded_groups": ds["padded_rows"] / n_nominal,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": int(lengths.max()),
        "response/truncated_frac": float(np.concatenate(truncated).mean()),
        "monitor/effective_update_ratio": effective_update_ratio(
            np.concatenate(list(advantages) or [np.zeros(0)]),
            np.concatenate([g.mask.any(-1) for g in kept] or [np.zeros(0, bool)])),
        "monitor/path_diversity": float(np.mean(
            [path_diversity(g.tokens[None], g.lengths[None])[0] for g in groups])),
        "monitor/ngram3_diversity": float(np.mean(
            [ngram_diversity(g.tokens[None], g.lengths[None], 3)[0] for g in groups])),
        "monitor/reward_entropy": reward_entropy(rewards),
    }
