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
With algo.stream_rounds, `stream_groups` replaces the rounds: one open rollout stream per step
(kept in the CollectState across steps with algo.max_staleness >= 1), prompts fed by
algo.collect.prompts_to_feed, each group scored and filtered as it comes out, too-old groups
dropped (algo.collect.is_stale), the stream closed by `stream_ends_after`.
Then `advantages` (the normaliser over every kept group of every process) and `update_batch`.
Under several processes each process fills its share of the rows with its own prompts.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
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
# time/<key>: the host blocked on the rollout's device calls, and the rollout's device idle
# between two of its calls (rollout.Scheduler.waits), summed over the step's decoding
WAIT_KEYS = ("host_waited_for_device_s", "device_waited_for_host_s")


class GroupScoring:
    """Scores groups while decoding goes on (rewards.groups_in_flight): up to ``depth`` calls
    of the scorer at once, each in a thread of its own; ``inline`` with depth 1 scores in the
    caller's thread at submit. submit -> a future of (Scored, seconds the call took). The
    caller takes the verdicts in the order it submitted them, so what it decides from them
    does not depend on which call ends first."""

    def __init__(self, scorer, depth: int, *, inline: bool = False):
        self.scorer, self.depth = scorer, depth
        self.inline = inline and depth == 1
        self._pool = None

    def submit(self, record: dict, gr) -> concurrent.futures.Future:
        def run():
            t0 = time.perf_counter()
            scored = self.scorer.score([record] * gr.lengths.size, gr.tokens, gr.lengths)
            return scored, time.perf_counter() - t0
        if self.inline:
            future = concurrent.futures.Future()
            future.set_result(run())
            return future
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.depth, thread_name_prefix="group-scoring")
        return self._pool.submit(run)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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
    extra: dict = dataclasses.field(default_factory=dict)   # the stream's metrics (staleness/..)


def generate_groups(ctx: RunContext, params, state: algo.CollectState, batch_source, step: int
                    ) -> tuple[Collected, algo.CollectState]:
    """Generation rounds until dynamic sampling has filled this process's rows (or the round
    cap); `params` as the runtime's rollout takes them. -> (what was collected, the state with
    the observed pass rates)."""
    ccfg = ctx.cfg
    row_budget = ccfg.update_rows // ctx.runtime.num_processes
    sampler = algo.GroupSampler.from_config(ccfg, row_budget=row_budget,
                                            max_group_rows=host.max_group_rows(ccfg))
    sampling = ctx.train_sampling(step)
    every, infos, truncated, n_chosen, healths = [], [], [], [], []
    timing = dict.fromkeys(("rollout_s", "scoring_s", "scoring_waited_for_rollout_s",
                            "rollout_idle_for_scoring_s", *WAIT_KEYS), 0.0)
    stats = {**dict.fromkeys(ROLLOUT_STAT_KEYS, 0), "live_slot_steps": 0.0, "slot_steps": 0}
    samples, cap_error = 0, None
    # the pool's threads end with the rounds, also when a scorer raises
    with contextlib.closing(GroupScoring(ctx.scorer, ccfg.rewards.groups_in_flight, inline=True)) as scoring:
        while True:
            try:
                if not sampler.need_more():
                    break
            except algo.DynamicSamplingError as e:      # cap policy "error"
                cap_error = str(e)
                break
            batch = next(batch_source)
            seed = round_seed(ccfg.train.seed, step, sampler.rounds)
            ns = host.samples_per_prompt(ccfg, state, batch["index"])
            n_chosen += ns
            groups: list = [None] * len(ns)
            observed = []
            for b, (n, positions) in enumerate(algo.policies.group_by_n(ns)):
                # each group is scored as soon as its samples are done, while decoding goes on
                with ctx.rollouts(params, [batch["prompt_ids"][p] for p in positions],
                                  n=host.num_candidates(ccfg, n), seed=call_seed(seed, b),
                                  sampling=sampling, stream=True) as st:
                    scored_meanwhile = []       # (group, its position, its scoring future)

                    def take(gr, p, future, n=n):
                        nonlocal samples
                        scored, seconds = future.result()
                        timing["scoring_s"] += seconds
                        healths.append(scored.health)
                        samples += gr.lengths.size
                        truncated.append(gr.truncated)
                        index = int(batch["index"][p])
                        groups[p], info = host.make_group(
                            ccfg, gr, scored.rewards, n=n, prompt_ids=batch["prompt_ids"][p],
                            index=index, step=step, round_=sampler.rounds, position=p)
                        infos.append(info)
                        observed.append((index, info.pass_rate))

                    for gr in st:
                        p = positions[gr.prompt_index]
                        scored_meanwhile.append((gr, p, scoring.submit(batch["records"][p], gr)))
                        if len(scored_meanwhile) >= scoring.depth:      # in arrival order
                            take(*scored_meanwhile.pop(0))
                    while scored_meanwhile:
                        take(*scored_meanwhile.pop(0))
                    done = time.perf_counter()
                timing["rollout_s"] += st.finished_at - st.started_at
                stats = add_rollout_stats(stats, st.stats)
                timing["scoring_waited_for_rollout_s"] += st.wait_seconds
                timing["rollout_idle_for_scoring_s"] += max(0.0, done - st.finished_at)
                for key, stat in zip(WAIT_KEYS, ("host_wait_seconds", "device_idle_seconds")):
                    timing[key] += float(st.stats.get(stat, 0.0))
            state = host.observe(ccfg, state, observed)
            every += groups
            sampler.add_round(groups)
    return Collected(kept=list(sampler.groups), every=every, infos=infos, truncated=truncated,
                     n_chosen=n_chosen, sampler_stats=sampler.stats(),
                     rows_used=sampler.rows_used, health=merge_health(healths),
                     timing={f"time/{k}": v for k, v in timing.items()}, rollout_stats=stats,
                     generated_samples=samples, cap_error=cap_error), state


# ------------------------------------------------------------------------------------------------
# One stream per step (algo.stream_rounds), carried across steps (algo.max_staleness >= 1)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class LiveStream:
    """The rollout stream a step leaves paused for the next (CollectState.stream): the engine's
    open RolloutStream, the prompts drawn from the loader and not fed yet, and per fed prompt
    (its prompt_index in the stream) its tokens, record and loader index. The scheduler labels
    the weights by the RL step they were used in (swap_params(params, step)), so a group's
    policy version is the step whose weights admitted it (GroupResult.versions[0]; the rest of
    GroupResult.versions says from which token on each sample was drawn by later weights)."""
    stream: Any
    sampling: Any
    pending: list = dataclasses.field(default_factory=list)    # [(prompt_ids, record, index)]
    fed: dict = dataclasses.field(default_factory=dict)        # prompt_index -> FedPrompt
    progress: dict | None = None      # scheduler.progress() at the end of the last step
    _scoring: Any = None              # GroupScoring: groups scored while the next ones decode

    @property
    def scheduler(self):
        return self.stream.scheduler

    def score(self, scorer, record: dict, gr, depth: int = 1):
        """Scores one group in the stream's scoring threads (`depth` calls at once) while the
        caller goes on decoding; -> a future of (Scored, seconds)."""
        if self._scoring is None:
            self._scoring = GroupScoring(scorer, depth)
        return self._scoring.submit(record, gr)

    @property
    def in_flight(self) -> int:
        """Fed prompts whose group the step has not taken: in the engine, or complete and kept
        by RolloutStream.advance (decode_during_update) for the next step."""
        return self.scheduler.in_flight + self.stream.buffered

    def close(self) -> None:
        self.stream.close()
        if self._scoring is not None:
            self._scoring.close()
            self._scoring = None


@dataclasses.dataclass(frozen=True)
class FedPrompt:
    prompt_ids: list
    record: dict
    index: int


def stream_seed(seed: int, step: int) -> int:
    """The rollout seed of a stream opened at `step` (sample n of its g-th fed prompt draws
    from fold_in(seed, g * N + n): the stream's schedule never changes a sample)."""
    return call_seed(round_seed(seed, step, 0), 7)


def stream_ends_after(ctx: RunContext, step: int) -> bool:
    """Whether the stream is closed at the end of `step` (its groups in flight discarded): every
    step with max_staleness = 0 (nothing may be carried), and at every checkpoint step and the
    last one, in an uninterrupted run too, so a run resumed from any checkpoint repeats exactly
    what the uninterrupted one did (a stop by signal checkpoints the step it stops at: its
    carried work is lost, so that resume is exact only at train.checkpoint_every)."""
    t = ctx.cfg.train
    done = step + 1
    return (not ctx.cfg.carries_samples or done % t.checkpoint_every == 0
            or done >= t.steps)


def _open_stream(ctx: RunContext, params, step: int, sampling, round_prompts: int) -> LiveStream:
    ccfg = ctx.cfg
    st = ctx.runtime.open_stream(
        ctx.model, params, prompt_len=ctx.cfg.data.max_prompt_len, plan_prompts=round_prompts,
        rollouts_per_prompt=host.num_candidates(ccfg, host.group_size(ccfg)),
        max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, seed=stream_seed(ccfg.train.seed, step),
        eos_ids=ctx.eos_ids)
    st.scheduler.version = step
    return LiveStream(stream=st, sampling=sampling)


def stream_groups(ctx: RunContext, params, state: algo.CollectState, batch_source, step: int
                  ) -> tuple[Collected, algo.CollectState]:
    """The step's groups from one stream (docs/rollout.md "One stream across rounds and
    steps"): prompts are fed into the running engine as groups come out, while the kept groups
    plus the ones in flight (at the observed pass rate) cannot fill the step
    (algo.collect.prompts_to_feed), until dynamic sampling has filled this process's rows or the
    step's cap (max_generation_rounds x the round's prompts) is fed and done. A group admitted
    under the weights of a step more than max_staleness steps back is dropped and counted. The
    groups still in flight are carried into the next step in the paused engine (max_staleness
    >= 1), else discarded (stream_ends_after). `params` as the runtime's rollout takes them:
    a carried stream swaps them in. -> (what was collected, the state: the stream's pass-rate
    counts and the live stream or None)."""
    ccfg = ctx.cfg
    row_budget = ccfg.update_rows // ctx.runtime.num_processes
    max_rows = host.max_group_rows(ccfg)
    sampler = algo.GroupSampler.from_config(ccfg, row_budget=row_budget, max_group_rows=max_rows)
    sampling = ctx.train_sampling(step)
    n = host.group_size(ccfg)
    live: LiveStream | None = state.stream
    discarded = 0
    if live is not None and live.sampling != sampling:     # a scheduled temperature changed
        discarded += live.in_flight * host.num_candidates(ccfg, n)
        live.close()
        live = None
    # a generation round's prompts on this process (the loader's batch): the step's cap and the
    # slots' plan count in rounds
    round_prompts = -(-ccfg.round_prompts // ctx.runtime.num_processes)
    cap = ccfg.algo.max_generation_rounds * round_prompts
    if live is None:
        live = _open_stream(ctx, params, step, sampling, round_prompts)
    else:
        live.scheduler.swap_params(params, step)
    sch = live.scheduler
    pass_rate = host.stream_pass_rate(ccfg, state)
    every, infos, truncated, healths, ages = [], [], [], [], []
    timing = dict.fromkeys(("rollout_s", "scoring_s", "scoring_waited_s"), 0.0)
    samples = dropped = fed = 0
    cap_error = None
    # (group, its FedPrompt, version, its scoring future), in arrival order: the groups being
    # scored while the next ones decode, at most rewards.groups_in_flight; each is settled when
    # that many later groups have come out (or none comes), so the filter and the feed see it
    # at a fixed lag
    verdicts: list = []
    depth = ccfg.rewards.groups_in_flight

    def settle(v, state):
        """The group's verdict (waited for), its group and the filter: in arrival order."""
        gr, meta, version, future = v
        t0 = time.perf_counter()
        scored, seconds = future.result()
        timing["scoring_waited_s"] += time.perf_counter() - t0
        timing["scoring_s"] += seconds
        healths.append(scored.health)
        truncated.append(gr.truncated)
        group, info = host.make_group(ccfg, gr, scored.rewards, n=n, prompt_ids=meta.prompt_ids,
                                      index=meta.index, step=step, round_=version,
                                      position=gr.prompt_index)
        infos.append(info)
        every.append(group)
        state = host.observe(ccfg, state, [(meta.index, info.pass_rate)])
        rows_before = sampler.rows_used
        sampler.add_groups([group])
        if sampler.rows_used > rows_before:
            ages.extend([step - version] * group.n)
        return state

    def give_back():
        """The groups taken and not settled when the step is full go back to the stream, last
        first: the next step's, if carried (their verdicts are asked again there)."""
        nonlocal samples
        while verdicts:
            gr, meta, _, _ = verdicts.pop()
            live.stream.unread(gr)
            live.fed[gr.prompt_index] = meta
            samples -= gr.lengths.size

    start = live.progress or sch.progress()
    sch.resume()                        # the pause (the last update) is not the device's idle
    while True:
        needed = host.groups_needed(ccfg, row_budget - sampler.rows_used, max_rows)
        if needed == 0:
            give_back()
            break
        want = host.prompts_to_feed(ccfg, needed=needed, step_groups=row_budget // n,
                                    in_flight=live.in_flight + len(verdicts), fed=fed,
                                    cap=cap,
                                    pool=sch.spec.pool, pass_rate=pass_rate)
        if want:
            while len(live.pending) < want:
                live.pending += _prompts_of(next(batch_source))
            take, live.pending = live.pending[:want], live.pending[want:]
            for gid, (ids, record, index) in zip(sch.feed([t[0] for t in take]), take):
                live.fed[gid] = FedPrompt(ids, record, index)
            fed += len(take)
        if live.in_flight == 0:
            if verdicts:                    # no group comes before these verdicts
                state = settle(verdicts.pop(0), state)
                continue
            sampler.rounds = -(-fed // round_prompts)     # the cap is fed and done, not full
            try:
                sampler.need_more()
            except algo.DynamicSamplingError as e:
                cap_error = str(e)
            break
        t0 = time.perf_counter()
        gr = next(live.stream)
        timing["rollout_s"] += time.perf_counter() - t0
        if len(verdicts) >= depth:          # the oldest, scored while later ones decoded
            state = settle(verdicts.pop(0), state)
            if host.groups_needed(ccfg, row_budget - sampler.rows_used, max_rows) == 0:
                live.stream.unread(gr)      # taken early: the next step's, if carried
                give_back()
                break
        meta = live.fed.pop(gr.prompt_index)
        version = gr.versions[0][0]        # admitted under it: its oldest tokens
        samples += gr.lengths.size
        if host.is_stale(ccfg, version, step):
            dropped += gr.lengths.size
            continue
        verdicts.append((gr, meta, version, live.score(ctx.scorer, meta.record, gr, depth)))
    sampler.rounds = -(-fed // round_prompts)
    end = sch.progress()
    stats = _progress_delta(start, end)
    timing.update(zip(WAIT_KEYS, (end["host_wait"] - start["host_wait"],
                                  end["device_idle"] - start["device_idle"])))
    in_flight = live.in_flight * host.num_candidates(ccfg, n)
    carried = 0
    if stream_ends_after(ctx, step):
        discarded += in_flight
        live.close()
        live = None
    else:
        carried = in_flight
        live.progress = end
    state = host.stream_counts_after(state, sampler.passed_groups, sampler.generated_groups)
    state = dataclasses.replace(state, stream=live)
    ages_arr = np.asarray(ages or [0], np.float64)
    extra = {"staleness/mean": float(ages_arr.mean()), "staleness/max": int(ages_arr.max()),
             # the histogram: samples the update used at each age 0..max_staleness (steps)
             **{key: sum(1 for x in ages if x == a)
                for a, key in enumerate(staleness_keys(ccfg.algo.max_staleness))},
             "staleness/dropped_samples": dropped, "rollout/carried_samples": carried,
             "rollout/discarded_samples": discarded, "rollout/fed_prompts": fed,
             "rollout/step_occupancy": (stats["live_slot_steps"] / stats["slot_steps"]
                                        if stats["slot_steps"] else 0.0)}
    return Collected(kept=list(sampler.groups), every=every, infos=infos, truncated=truncated,
                     n_chosen=[n] * len(every), sampler_stats=sampler.stats(),
                     rows_used=sampler.rows_used, health=merge_health(healths),
                     timing={f"time/{k}": v for k, v in timing.items()}, rollout_stats=stats,
                     generated_samples=samples, cap_error=cap_error, extra=extra), state


def decode_during_update(ctx: RunContext, state: algo.CollectState, pending) -> dict:
    """While the update just dispatched runs (``pending``: any of its outputs, not waited for),
    the stream carried into the next step keeps decoding under the weights it has
    (docs/rollout.md "Decoding during the update"): algo.decode_during_update = D >= 0 decode
    calls exactly (a reproducible schedule; with the rollout colocated they queue behind the
    update), -1 = until the update is done when disaggregated (mesh.rollout_devices), else none.
    The groups that complete are kept for the next step's stream_groups, in order; the calls'
    statistics count in the next step's. -> the step's metrics of it."""
    live: LiveStream | None = state.stream
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


def staleness_keys(max_staleness: int) -> tuple[str, ...]:
    """The staleness histogram's metrics: the key at index a counts the samples the update used
    that were admitted a steps back (stream mode; ages 0..algo.max_staleness, every step)."""
    return tuple(f"staleness/age{a}_samples" for a in range(max_staleness + 1))


def _prompts_of(batch) -> list:
    return [(list(batch["prompt_ids"][p]), batch["records"][p], int(batch["index"][p]))
            for p in range(len(batch["index"]))]


def _progress_delta(start: dict, end: dict) -> dict:
    """The step's rollout statistics (add_rollout_stats' form) from two progress snapshots."""
    out = {k: end[k] - start[k] for k in ("decode_steps", "refills", "compactions",
                                          "useful_tokens", "live_slot_steps", "slot_steps")}
    out["useful_tokens"] = int(out["useful_tokens"])
    return out


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


def update_batch(ctx: RunContext, kept: Sequence[algo.Group], advs: list[np.ndarray]) -> dict:
    """This process's rows of the update batch. Each process packs its own groups into its units
    of PPO mini-batches; the processes then agree on the rows per unit."""
    ccfg, runtime = ctx.cfg, ctx.runtime
    procs = runtime.num_processes
    units = host.pack_units(ctx.cfg.algo.ppo_mini_batches, procs)
    batch = host.update_batch(ccfg, kept, advs, rows=ccfg.update_rows // procs,
                              seq_len=ctx.seq_len, pad_id=ctx.pad_id, units=units,
                              row_multiple=runtime.row_multiple)
    if ccfg.algo.pack_sequences and procs > 1:
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
    ccfg = ctx.cfg
    thr = ccfg.algo.correct_threshold
    out = step_metrics(got.every, got.truncated, got.sampler_stats, got.kept, advs, thr=thr,
                       n_nominal=host.group_size(ccfg))
    out.update(got.timing)
    out["perf/generated_samples"] = got.generated_samples
    out.update(rollout_metrics(got.rollout_stats))
    out.update(got.extra)
    if ctx.temperature_schedule:
        out["rollout/temperature"] = ctx.rollout_temperature(step)
    if ccfg.rollout.adaptive_n:
        ns_arr = np.asarray(got.n_chosen)
        out["monitor/n_mean"] = float(ns_arr.mean())
        buckets, _ = algo.policies.parse_adaptive_n(ccfg.rollout.adaptive_n_buckets,
                                                    ccfg.rollout.adaptive_n_thresholds)
        for n in buckets:
            out[f"adaptive_n/prompts_n{n}"] = int(np.sum(ns_arr == n))
        out["adaptive_n/batch_rows_used"] = int(got.rows_used)
        out["adaptive_n/padded_rows"] = int(got.sampler_stats["padded_rows"])
        out["adaptive_n/tracked_prompts"] = len(state.pass_rates)
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
