"""The collect of one RL step: groups out of the rollout -> scoring -> the kept groups, then the
advantages and the update batch over every process (BroRL §3.1). One loop for every
configuration (`collect`): take a group, score it (while decoding goes on), keep or drop it,
tally; the groups come from one of two feeds (train/feeds.py): generation rounds, or one open
stream per step (algo.stream_rounds). The decisions are algo/host.py's pure functions; this
module does the I/O (the verifier pool, cross-process gathers) and the step's rollout metrics.

  1. how many samples per prompt: algo.host.samples_per_prompt (FixedN = the paper's N, or
     AdaptiveN from the CollectState's pass rates); prompts with the same N are generated in one
     call (rounds);
  2. over-generation (an option): ceil(factor * N) candidates, N kept by rollout.select_rule;
  3. scoring in the worker pool, each group as soon as the rollout streams it out, up to
     rewards.groups_in_flight at once, the verdicts taken in arrival order; then reward shaping
     (length penalty, clipping): algo.host.make_group;
  4. the group filter (algo.GroupSampler) keeps groups until the row budget
     (prompts_per_step * N) is full; the pass rates update the CollectState.
With algo.stream_rounds the stream the step leaves paused (samples carried: algo.host.max_age) is the
collector's: it stays on the run context (`carried_stream`), never in the CollectState, which
holds only what checkpoints. Then `advantages` (the normaliser over every kept group of every
process) and `update_batch`. Under several processes each process fills its share of the rows
with its own prompts.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from brorl_jax import algo
from brorl_jax.algo import host
from brorl_jax.rewards.health import VerifierHealth
from brorl_jax.train.context import RunContext, merge_health
from brorl_jax.train.feeds import (
    SETTLE,
    GroupScoring,
    LiveStream,
    RoundsFeed,
    StreamFeed,
    Taken,
    call_seed,
    round_seed,
    stream_ends_after,
    stream_seed,
)
from brorl_jax.train.metrics import MAX, SUM, Metrics
from brorl_jax.train.monitoring import (
    effective_update_ratio,
    ngram_diversity,
    path_diversity,
    reward_entropy,
)

__all__ = ["GroupScoring", "LiveStream", "Tally", "advantages", "call_seed", "carried_stream",
           "collect", "collect_metrics", "decode_during_update", "round_seed",
           "stream_ends_after", "stream_seed", "update_batch"]


# ------------------------------------------------------------------------------------------------
# The tally of one step
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Seconds:
    """time/<name>_s of the step, for the names its feed reports (`report`): rollout (waiting
    for the rollout's groups), scoring (the scorer's calls), scoring_waited (the stream waiting
    for verdicts), scoring_waited_for_rollout / rollout_idle_for_scoring (rounds: who waited
    for whom), host_waited_for_device / device_waited_for_host (the rollout's device calls:
    the host blocked on them, the device idle between two of them)."""
    rollout: float = 0.0
    scoring: float = 0.0
    scoring_waited_for_rollout: float = 0.0
    rollout_idle_for_scoring: float = 0.0
    scoring_waited: float = 0.0
    host_waited_for_device: float = 0.0
    device_waited_for_host: float = 0.0
    reported: tuple = ()

    def report(self, *names: str) -> None:
        self.reported = tuple(f.name for f in dataclasses.fields(self) if f.name in names)

    def metrics(self) -> dict:
        return {f"time/{name}_s": getattr(self, name) for name in self.reported}


@dataclasses.dataclass
class RolloutTotals:
    """The step's rollout statistics: useful tokens (every token generated, over-generated
    candidates included), decode steps, refills, compactions, and live slot-steps over
    slot-steps (the occupancy, over every decode step of the step's calls)."""
    useful_tokens: int = 0
    decode_steps: int = 0
    refills: int = 0
    compactions: int = 0
    live_slot_steps: float = 0
    slot_steps: int = 0

    def add_call(self, stats: dict) -> None:
        """One rollout call's statistics (rollout.RolloutStream.stats)."""
        for k in ("useful_tokens", "decode_steps", "refills", "compactions"):
            setattr(self, k, getattr(self, k) + int(stats.get(k, 0)))
        steps = int(stats.get("decode_steps", 0))
        self.live_slot_steps += float(stats.get("mean_live_slots", 0.0)) * steps
        self.slot_steps += int(stats.get("num_slots", 0)) * steps

    def add_progress(self, delta) -> None:
        """What an open stream did in the step (a rollout.Progress difference)."""
        for k in ("useful_tokens", "decode_steps", "refills", "compactions", "live_slot_steps",
                  "slot_steps"):
            setattr(self, k, getattr(self, k) + getattr(delta, k))
        self.useful_tokens = int(self.useful_tokens)

    def metrics(self) -> Metrics:
        out = Metrics()
        out.put("rollout/useful_tokens", self.useful_tokens, SUM)
        for k in ("decode_steps", "refills", "compactions"):
            out.put(f"rollout/{k}", getattr(self, k))
        if self.slot_steps:
            out.put("rollout/occupancy", self.live_slot_steps / self.slot_steps)
        return out


@dataclasses.dataclass
class StreamTally:
    """The stream's own counts (algo.stream_rounds): the age (steps) of every sample the update
    uses, samples dropped as too old, carried into the next step or discarded, prompts fed,
    and the occupancy of the step's decoding; max_age: the staleness bound (algo.host.max_age)."""
    max_age: int = 0
    ages: list = dataclasses.field(default_factory=list)
    dropped: int = 0
    carried: int = 0
    discarded: int = 0
    fed: int = 0
    step_occupancy: float = 0.0

    def metrics(self) -> Metrics:
        ages = np.asarray(self.ages or [0], np.float64)
        out = Metrics()
        out.put("staleness/mean", float(ages.mean()))
        out.put("staleness/max", int(ages.max()), MAX)
        # the histogram: samples the update used at each age 0..max_age (steps)
        for a, key in enumerate(staleness_keys(self.max_age)):
            out.put(key, sum(1 for x in self.ages if x == a), SUM)
        out.put("staleness/dropped_samples", self.dropped, SUM)
        out.put("rollout/carried_samples", self.carried, SUM)
        out.put("rollout/discarded_samples", self.discarded, SUM)
        out.put("rollout/fed_prompts", self.fed, SUM)
        out.put("rollout/step_occupancy", self.step_occupancy)
        return out


@dataclasses.dataclass
class Tally:
    """What one step's collect produced (this process's share). sampler: the group filter
    (its kept groups, rows used, rounds and counts); every: every group after selection
    (monitoring); infos: algo.host.GroupInfo of every group; truncated: per group, truncated
    [m] of its candidates; n_chosen: N of every prompt generated; healths: the verdicts of
    every sample scored (`health` merges them); cap_error: the round cap was hit with cap
    policy "error"; stream: the stream's counts (algo.stream_rounds), else None; nominal_n:
    the configured N (a feed sets it)."""
    sampler: algo.GroupSampler
    every: list = dataclasses.field(default_factory=list)
    infos: list = dataclasses.field(default_factory=list)
    truncated: list = dataclasses.field(default_factory=list)
    n_chosen: list = dataclasses.field(default_factory=list)
    healths: list = dataclasses.field(default_factory=list)
    generated_samples: int = 0
    seconds: Seconds = dataclasses.field(default_factory=Seconds)
    rollout: RolloutTotals = dataclasses.field(default_factory=RolloutTotals)
    stream: StreamTally | None = None
    cap_error: str | None = None
    health: VerifierHealth | None = None
    nominal_n: int = 1

    @property
    def kept(self) -> list:
        """The groups the filter kept, in the order it took them."""
        return list(self.sampler.groups)

    def add_call(self, st, done: float) -> None:
        """A rollout call of the rounds that has ended (its RolloutStream): its statistics,
        and who waited for whom (`done`: when its last verdict was taken)."""
        s = self.seconds
        s.rollout += st.finished_at - st.started_at
        self.rollout.add_call(st.stats)
        s.scoring_waited_for_rollout += st.wait_seconds
        s.rollout_idle_for_scoring += max(0.0, done - st.finished_at)
        s.host_waited_for_device += float(st.stats.get("host_wait_seconds", 0.0))
        s.device_waited_for_host += float(st.stats.get("device_idle_seconds", 0.0))


# ------------------------------------------------------------------------------------------------
# The collector: one loop over the groups of a feed
# ------------------------------------------------------------------------------------------------
def carried_stream(ctx: RunContext) -> LiveStream | None:
    """The stream the last step left paused for the next (algo.host.max_age >= 1), or None;
    its handle (`.stream`, a rollout.OpenStream) says what is in flight."""
    return ctx.live_stream


def collect(ctx: RunContext, params, state: algo.CollectState, batch_source, step: int
            ) -> tuple[Tally, algo.CollectState]:
    """The step's groups until the group filter has filled this process's rows (or the cap):
    from generation rounds, or from the open stream (algo.stream_rounds); `params` as the
    runtime's rollout takes them. Each group is scored as it comes out (at most
    rewards.groups_in_flight verdicts pending), settled in arrival order (selection, shaping,
    its pass rate), then kept or dropped by the filter. -> (the tally, the state with the
    observed pass rates)."""
    ccfg = ctx.cfg
    sampler = algo.GroupSampler.from_config(
        ccfg, row_budget=ccfg.update_rows // ctx.runtime.num_processes,
        max_group_rows=host.max_group_rows(ccfg))
    tally = Tally(sampler=sampler)
    if ccfg.algo.stream_rounds:
        tally.stream = StreamTally(max_age=host.max_age(ccfg))
        live, ctx.live_stream = ctx.live_stream, None
        if live is not None and live.next_step != step:  # left by another sequence of steps
            live.close()
            live = None
        feed = StreamFeed(ctx, params, state, batch_source, step, tally, live)
    else:
        feed = RoundsFeed(ctx, params, state, batch_source, step, tally)
    verdicts: collections.deque = collections.deque()     # (Taken, its scoring future)
    with contextlib.closing(feed):
        with contextlib.closing(feed.groups(verdicts)) as groups:
            for taken in groups:
                if taken is SETTLE:
                    _settle(ctx, feed, tally, verdicts.popleft(), step)
                    continue
                if len(verdicts) >= feed.depth:  # the oldest, scored while later ones decoded
                    _settle(ctx, feed, tally, verdicts.popleft(), step)
                    if feed.full():
                        feed.give_back(taken, verdicts)
                        break
                tally.generated_samples += taken.group.lengths.size
                if feed.drops(taken):
                    continue
                verdicts.append((taken, feed.score(taken)))
        state = feed.finish()
    if ccfg.algo.stream_rounds:
        ctx.live_stream = feed.live
    tally.health = merge_health(tally.healths)
    return tally, state


def _settle(ctx: RunContext, feed, tally: Tally, verdict: tuple[Taken, Any], step: int) -> None:
    """A group's verdict (waited for), its selection and shaping, then the feed's filter."""
    taken, future = verdict
    t0 = time.perf_counter()
    scored, seconds = future.result()
    tally.seconds.scoring_waited += time.perf_counter() - t0
    tally.seconds.scoring += seconds
    tally.healths.append(scored.health)
    tally.truncated.append(taken.group.truncated)
    group, info = host.make_group(ctx.cfg, taken.group, scored.rewards, n=taken.n,
                                  prompt_ids=taken.prompt_ids, index=taken.index, step=step,
                                  round_=taken.round_, position=taken.position)
    tally.infos.append(info)
    feed.keep(taken, group, info)


def decode_during_update(ctx: RunContext, pending) -> dict:
    """While the update just dispatched runs (``pending``: any of its outputs, not waited for),
    the stream carried into the next step keeps decoding under the weights it has
    (docs/rollout.md "Decoding during the update"): algo.decode_during_update = D >= 0 decode
    calls exactly (a reproducible schedule; with the rollout colocated they queue behind the
    update), -1 = until the update is done when disaggregated (mesh.rollout_devices), else none.
    The groups that complete are kept for the next step's collect, in order; the calls'
    statistics count in the next step's. -> the step's metrics of it."""
    live = ctx.live_stream
    d = ctx.cfg.algo.decode_during_update
    if live is None or d == 0 or (d < 0 and not ctx.runtime.rollout_devices):
        return {}
    t0 = time.perf_counter()
    if d > 0:
        calls = live.stream.advance(d)
    else:
        leaves = [x for x in jax.tree.leaves(pending) if hasattr(x, "is_ready")]
        calls = live.stream.advance(until=lambda: all(x.is_ready() for x in leaves))
    return {"rollout/decode_calls_during_update": calls,
            "time/decode_during_update_s": time.perf_counter() - t0}


def staleness_keys(max_age: int) -> tuple[str, ...]:
    """The staleness histogram's metrics: the key at index a counts the samples the update used
    that were admitted a steps back (stream mode; ages 0..algo.host.max_age, every step)."""
    return tuple(f"staleness/age{a}_samples" for a in range(max_age + 1))


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
    adv, state = host.advantages(ctx.cfg, state, [s for s, _ in local],
                                 [n for _, n in local])
    return adv[first:first + len(kept)], state


def update_batch(ctx: RunContext, kept: Sequence[algo.Group], advs: list[np.ndarray]) -> algo.UpdateBatch:
    """This process's rows of the update batch. Each process packs its own groups into its units
    of PPO mini-batches; the processes then agree on the rows per unit."""
    ccfg, runtime = ctx.cfg, ctx.runtime
    procs = runtime.num_processes
    units = host.pack_units(ctx.cfg.algo.ppo_mini_batches, procs)
    batch = host.update_batch(ccfg, kept, advs, rows=ccfg.update_rows // procs,
                              seq_len=ctx.seq_len, pad_id=ctx.pad_id, units=units,
                              row_multiple=runtime.row_multiple)
    if ccfg.algo.pack_sequences and procs > 1:
        per_unit = batch.input_tokens.shape[0] // units
        rows = int(runtime.allgather_rows(np.array([per_unit])).max())
        batch = algo.pad_packed_rows(batch, rows, pad_id=ctx.pad_id)
    return batch


# ------------------------------------------------------------------------------------------------
# Metrics (each with its reduction over processes declared where it is made: train/metrics.py)
# ------------------------------------------------------------------------------------------------
def collect_metrics(ctx: RunContext, got: Tally, state: algo.CollectState,
                    advs: Sequence[np.ndarray], step: int) -> Metrics:
    """The step's rollout metrics (this process's; rl_step reduces them over processes)."""
    ccfg = ctx.cfg
    thr = ccfg.algo.correct_threshold
    sampler = got.sampler
    out = step_metrics(got.every, got.truncated, sampler.stats(), got.kept, advs, thr=thr,
                       n_nominal=got.nominal_n)
    out.update(got.seconds.metrics())
    out.put("perf/generated_samples", got.generated_samples, SUM)
    out.update(got.rollout.metrics())
    if got.stream is not None:
        out.update(got.stream.metrics())
    if ctx.temperature_schedule:
        out["rollout/temperature"] = ctx.rollout_temperature(step)
    if ccfg.rollout.adaptive_n:
        out.update(_adaptive_n_metrics(ccfg, got, state))
    if ccfg.rollout.knapsack:
        ns = np.asarray(got.n_chosen)
        out["monitor/n_mean"] = float(ns.mean())
        out["knapsack/n_max"] = int(ns.max())
        out["knapsack/probe_only_frac"] = float(np.mean(ns == ccfg.rollout.knapsack_probe))
    if float(ccfg.rollout.overgenerate_factor) > 1.0:
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


def _adaptive_n_metrics(ccfg, got: Tally, state: algo.CollectState) -> dict:
    ns_arr = np.asarray(got.n_chosen)
    out = {"monitor/n_mean": float(ns_arr.mean())}
    buckets, _ = algo.policies.parse_adaptive_n(ccfg.rollout.adaptive_n_buckets,
                                                ccfg.rollout.adaptive_n_thresholds)
    for n in buckets:
        out[f"adaptive_n/prompts_n{n}"] = int(np.sum(ns_arr == n))
    out["adaptive_n/batch_rows_used"] = int(got.sampler.rows_used)
    out["adaptive_n/padded_rows"] = int(got.sampler.stats()["padded_rows"])
    out["adaptive_n/tracked_prompts"] = len(state.pass_rates)
    return out


def step_metrics(groups: Sequence[algo.Group], truncated: Sequence[np.ndarray], ds: dict,
                 kept: Sequence[algo.Group], advantages: Sequence[np.ndarray], *, thr: float,
                 n_nominal: int) -> Metrics:
    """The per-step rollout metrics: rewards, lengths, dynamic sampling and the BroRL write-ups'
    monitoring (diversity, effective update ratio, reward entropy) over the step's groups."""
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.concatenate([g.lengths for g in groups])
    out = Metrics({
        "reward/mean": float(rewards.mean()),
        "reward/correct_frac": float((rewards >= thr).mean()),
        "dynamic_sampling/pass_rate": ds["pass_rate"],
        "dynamic_sampling/rounds": ds["generation_rounds"],
        "dynamic_sampling/kept_groups": ds["kept_groups"],
        # in units of nominal groups (of the configured N rows)
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
    })
    for key in ("dynamic_sampling/kept_groups", "dynamic_sampling/padded_groups"):
        out.reductions[key] = SUM       # add up over processes
    out.reductions["response/length_max"] = MAX
    return out
