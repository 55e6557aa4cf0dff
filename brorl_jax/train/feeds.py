"""The two feeds of the collector (train/collect.py `collect`): where a step's groups come from.

  RoundsFeed   generation rounds of ceil(prompts_per_step * generation_batch_multiplier)
               prompts, one rollout call per N bucket (samples_per_prompt), groups scored as
               each call streams them out; the round's groups go to the filter together, in
               their positions' order, and its pass rates update the state (AdaptiveN).
  StreamFeed   one open rollout stream per step (algo.stream_rounds; docs/rollout.md "One
               stream across rounds and steps"): prompts fed by algo's prompts_to_feed as groups
               come out, each group filtered as soon as its verdict is in, too-old groups
               dropped (is_stale); the stream is carried into the next step in the paused
               engine (samples carried: algo.host.max_age >= 1) or closed
               (stream_ends_after).

A feed yields each group it takes out of the rollout as a :class:`Taken` (or SETTLE: "wait for
the oldest verdict now"), hears each settled group (`keep`), says when the step is full (`full`)
and gives taken groups back when it is (`give_back`); `finish` closes the step's books.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np

from brorl_jax import algo
from brorl_jax.algo import host
from brorl_jax.rollout.types import concat_groups
from brorl_jax.train.context import RunContext, Scored, merge_health

# What a feed yields when the collector must settle its oldest verdict before the next group
SETTLE = object()


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


class _Joined:
    """The verdicts of a knapsack group: its probe's (already in) and its chunks' (a future)."""

    def __init__(self, probe, seconds: float, rest: concurrent.futures.Future):
        self.probe, self.seconds, self.rest = probe, seconds, rest

    def result(self):
        rest, seconds = self.rest.result()
        return Scored(np.concatenate([self.probe.rewards, rest.rewards]),
                      merge_health([self.probe.health, rest.health])), self.seconds + seconds


@dataclasses.dataclass(frozen=True)
class Taken:
    """A group out of the rollout (a rollout.GroupResult) with what its scoring and
    algo's make_group need: the prompt's record, tokens and loader index, N, and the selection
    seed's round (rounds: the round; stream: the policy version it was admitted under) and
    position (rounds: in the round; stream: its prompt_index)."""
    group: Any
    record: dict
    prompt_ids: list
    index: int
    n: int
    round_: int
    position: int


def round_seed(seed: int, step: int, round_: int) -> int:
    """A distinct, reproducible rollout seed for every (run seed, step, generation round)."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


def call_seed(round_seed_: int, call: int) -> int:
    """The seed of the `call`-th rollout call (one per N bucket) of a round."""
    return (round_seed_ + call * 1_000_000_007) % (2**31 - 1)


def round_prompts(ctx: RunContext) -> int:
    """A generation round's prompts on this process (the loader's batch)."""
    return -(-ctx.cfg.round_prompts // ctx.runtime.num_processes)


# ------------------------------------------------------------------------------------------------
# Generation rounds
# ------------------------------------------------------------------------------------------------
class RoundsFeed:
    """Generation rounds until the filter is full or the round cap (module docstring)."""

    def __init__(self, ctx: RunContext, params, state: algo.CollectState, batch_source,
                 step: int, tally):
        self.ctx, self.params, self.state, self.batch_source = ctx, params, state, batch_source
        self.step, self.tally = step, tally
        self.depth = ctx.cfg.rewards.groups_in_flight
        tally.nominal_n = host.group_size(ctx.cfg)
        self._scoring = GroupScoring(ctx.scorer, self.depth, inline=True)
        self._placed: list = []
        self._observed: list = []
        self._probe_scored: dict = {}     # knapsack rounds: position -> (probe's verdicts, rest)
        tally.seconds.report("rollout", "scoring", "scoring_waited_for_rollout",
                             "rollout_idle_for_scoring", "host_waited_for_device",
                             "device_waited_for_host")

    def groups(self, verdicts):
        ctx, ccfg, tally = self.ctx, self.ctx.cfg, self.tally
        sampler = tally.sampler
        while True:
            try:
                if not sampler.need_more():
                    break
            except algo.DynamicSamplingError as e:      # cap policy "error"
                tally.cap_error = str(e)
                break
            batch = next(self.batch_source)
            seed = round_seed(ccfg.train.seed, self.step, sampler.rounds)
            ns = host.samples_per_prompt(ccfg, self.state, batch.index)
            self._placed, self._observed = [None] * len(ns), []
            if ccfg.rollout.knapsack:
                yield from self._knapsack_round(batch, seed, verdicts)
                ns = []
            tally.n_chosen += ns
            for b, (n, positions) in enumerate(algo.policies.group_by_n(ns)):
                # each group is scored as soon as its samples are done, while decoding goes on
                with ctx.rollouts(self.params, [batch.prompt_ids[p] for p in positions],
                                  n=host.num_candidates(ccfg, n), seed=call_seed(seed, b),
                                  sampling=ctx.train_sampling(self.step), stream=True) as st:
                    for gr in st:
                        p = positions[gr.prompt_index]
                        yield Taken(gr, batch.records[p], batch.prompt_ids[p],
                                    int(batch.index[p]), n, sampler.rounds, p)
                    while verdicts:             # the call's last verdicts, in arrival order
                        yield SETTLE
                    done = time.perf_counter()
                tally.add_call(st, done)
            self.state = host.observe(ccfg, self.state, self._observed)
            tally.every += self._placed
            sampler.add_round(self._placed)

    def _knapsack_round(self, batch, seed: int, verdicts):
        """rollout.knapsack (algo.policies.KnapsackN): a probe call of `probe` samples of every
        prompt, scored at once; then one call for the round's other samples as the policy
        shares them out, a prompt given k chunks fed k times (n = chunk; every copy draws its
        own samples); each prompt's probe and chunks, in order, are its group (its probe is
        not scored again: `score`)."""
        ctx, ccfg, tally = self.ctx, self.ctx.cfg, self.tally
        policy = algo.policies.samples_per_prompt_policy(ccfg.rollout)
        prompts = list(batch.prompt_ids)
        probes: list = [None] * len(prompts)
        with ctx.rollouts(self.params, prompts, n=policy.probe, seed=call_seed(seed, 0),
                          sampling=ctx.train_sampling(self.step), stream=True) as st:
            for gr in st:
                probes[gr.prompt_index] = gr
        tally.add_call(st, time.perf_counter())
        scored = [self._scoring.submit(batch.records[p], gr).result()
                  for p, gr in enumerate(probes)]
        totals = policy.allocate([int(np.sum(s.rewards >= ccfg.algo.correct_threshold))
                                  for s, _ in scored])
        tally.n_chosen += totals
        owner = [p for p, t in enumerate(totals) for _ in range((t - policy.probe) // policy.chunk)]
        chunks: list = [None] * len(owner)
        if owner:
            with ctx.rollouts(self.params, [prompts[p] for p in owner], n=policy.chunk,
                              seed=call_seed(seed, 1), sampling=ctx.train_sampling(self.step),
                              stream=True) as st:
                for gr in st:
                    chunks[gr.prompt_index] = gr
            tally.add_call(st, time.perf_counter())
        for p, gr in enumerate(probes):
            extra = [c for c, o in zip(chunks, owner) if o == p]
            self._probe_scored[p] = (scored[p], concat_groups(extra) if extra else None)
            yield Taken(concat_groups([gr] + extra), batch.records[p], batch.prompt_ids[p],
                        int(batch.index[p]), totals[p], tally.sampler.rounds, p)
        while verdicts:
            yield SETTLE

    def score(self, taken: Taken):
        if taken.position not in self._probe_scored:
            return self._scoring.submit(taken.record, taken.group)
        (probe, seconds), extra = self._probe_scored.pop(taken.position)
        if extra is None:
            future = concurrent.futures.Future()
            future.set_result((probe, seconds))
            return future
        return _Joined(probe, seconds, self._scoring.submit(taken.record, extra))

    def drops(self, taken: Taken) -> bool:
        return False

    def keep(self, taken: Taken, group: algo.Group, info) -> None:
        self._placed[taken.position] = group
        self._observed.append((taken.index, info.pass_rate))

    def full(self) -> bool:
        return False            # the filter sees a round's groups once the round is done

    def give_back(self, taken: Taken, verdicts) -> None:
        raise AssertionError("a round is never cut short")

    def finish(self) -> algo.CollectState:
        return self.state

    def close(self) -> None:
        self._scoring.close()


# ------------------------------------------------------------------------------------------------
# One stream per step (algo.stream_rounds), carried across steps (algo.host.max_age >= 1)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FedPrompt:
    prompt_ids: list
    record: dict
    index: int


@dataclasses.dataclass(eq=False)
class LiveStream:
    """The rollout stream a step leaves paused for the next: the engine's open stream (its
    handle, rollout.OpenStream), the prompts drawn from the loader and not fed yet, and per fed
    prompt (its prompt_index in the stream) its tokens, record and loader index. The stream
    labels the weights by the RL step they were used in (swap_params(params, step)), so a
    group's policy version is the step whose weights admitted it (GroupResult.versions[0]; the
    rest of GroupResult.versions says from which token on each sample was drawn by later
    weights). next_step: the step it was left for (a stream is only carried into that one)."""
    stream: Any
    sampling: Any
    pending: list = dataclasses.field(default_factory=list)    # [(prompt_ids, record, index)]
    fed: dict = dataclasses.field(default_factory=dict)        # prompt_index -> FedPrompt
    progress: Any = None              # stream.progress() at the end of the last step
    next_step: int = -1
    _scoring: Any = None              # GroupScoring: groups scored while the next ones decode

    def score(self, scorer, record: dict, gr, depth: int = 1):
        """Scores one group in the stream's scoring threads (`depth` calls at once) while the
        caller goes on decoding; -> a future of (Scored, seconds)."""
        if self._scoring is None:
            self._scoring = GroupScoring(scorer, depth)
        return self._scoring.submit(record, gr)

    @property
    def in_flight(self) -> int:
        """Fed prompts whose group the step has not taken: in the engine, or complete and kept
        by the stream's advance (decode_during_update) for the next step."""
        return self.stream.in_flight

    def close(self) -> None:
        self.stream.close()
        if self._scoring is not None:
            self._scoring.close()
            self._scoring = None


def stream_seed(seed: int, step: int) -> int:
    """The rollout seed of a stream opened at `step` (sample n of its g-th fed prompt draws
    from fold_in(seed, g * N + n): the stream's schedule never changes a sample)."""
    return call_seed(round_seed(seed, step, 0), 7)


def stream_ends_after(ctx: RunContext, step: int) -> bool:
    """Whether the stream is closed at the end of `step` (its groups in flight discarded): every
    step when no sample may be older than its step (max_age 0), and at every checkpoint step and the
    last one, in an uninterrupted run too, so a run resumed from any checkpoint repeats exactly
    what the uninterrupted one did (a stop by signal checkpoints the step it stops at: its
    carried work is lost, so that resume is exact only at train.checkpoint_every)."""
    t = ctx.cfg.train
    done = step + 1
    return (host.max_age(ctx.cfg) == 0 or done % t.checkpoint_every == 0
            or done >= t.steps)


def _prompts_of(batch) -> list:
    return [(list(batch.prompt_ids[p]), batch.records[p], int(batch.index[p]))
            for p in range(len(batch.index))]


class StreamFeed:
    """The step's groups from one open stream (module docstring): prompts are fed into the
    running engine as groups come out, while the kept groups plus the ones in flight (at the
    observed pass rate) cannot fill the step (algo's prompts_to_feed), until the filter is full
    or the step's cap (max_generation_rounds x the round's prompts) is fed and done. A group
    admitted under the weights of a step more than max_age steps back is dropped and
    counted. `live`: the stream the last step left (or None); `params` as the runtime's rollout
    takes them: a carried stream swaps them in."""

    def __init__(self, ctx: RunContext, params, state: algo.CollectState, batch_source,
                 step: int, tally, live: LiveStream | None):
        ccfg = ctx.cfg
        self.ctx, self.state, self.batch_source, self.step, self.tally = \
            ctx, state, batch_source, step, tally
        self.depth = ccfg.rewards.groups_in_flight
        self.n = tally.nominal_n = host.group_size(ccfg)
        self.round_prompts = round_prompts(ctx)
        self.cap = ccfg.algo.max_generation_rounds * self.round_prompts
        self.pass_rate = host.stream_pass_rate(ccfg, state)
        self.fed = 0
        self._finished = False
        st = tally.stream
        sampling = ctx.train_sampling(step)
        if live is not None and live.sampling != sampling:     # a scheduled temperature changed
            st.discarded += live.in_flight * host.num_candidates(ccfg, self.n)
            live.close()
            live = None
        if live is None:
            live = LiveStream(stream=ctx.rollouts(
                params, None, n=host.num_candidates(ccfg, self.n),
                seed=stream_seed(ccfg.train.seed, step), sampling=sampling,
                open_stream=dict(plan_prompts=self.round_prompts, version=step)),
                sampling=sampling)
        else:
            live.stream.swap_params(params, step)
        self.live = live
        self._start = live.progress or live.stream.progress()
        live.stream.resume()        # the pause (the last update) is not the device's idle
        tally.seconds.report("rollout", "scoring", "scoring_waited", "host_waited_for_device",
                             "device_waited_for_host")

    def _needed(self) -> int:
        sampler = self.tally.sampler
        return host.groups_needed(self.ctx.cfg, sampler.row_budget - sampler.rows_used,
                                  sampler.max_group_rows)

    def _feed(self, verdicts) -> None:
        """Admits the prompts algo's prompts_to_feed asks for now."""
        live, sampler = self.live, self.tally.sampler
        want = host.prompts_to_feed(self.ctx.cfg, needed=self._needed(),
                                    step_groups=sampler.row_budget // self.n,
                                    in_flight=live.in_flight + len(verdicts), fed=self.fed,
                                    cap=self.cap, pool=live.stream.pool_size,
                                    pass_rate=self.pass_rate)
        if want:
            while len(live.pending) < want:
                live.pending += _prompts_of(next(self.batch_source))
            take, live.pending = live.pending[:want], live.pending[want:]
            for gid, (ids, record, index) in zip(live.stream.feed([t[0] for t in take]), take):
                live.fed[gid] = FedPrompt(ids, record, index)
            self.fed += len(take)

    def groups(self, verdicts):
        live, sampler = self.live, self.tally.sampler
        while True:
            if self._needed() == 0:
                self.give_back(None, verdicts)
                return
            self._feed(verdicts)
            if live.in_flight == 0:
                if verdicts:                    # no group comes before these verdicts
                    yield SETTLE
                    continue
                sampler.rounds = -(-self.fed // self.round_prompts)  # the cap is fed and done
                try:
                    sampler.need_more()
                except algo.DynamicSamplingError as e:
                    self.tally.cap_error = str(e)
                return
            t0 = time.perf_counter()
            gr = next(live.stream)
            self.tally.seconds.rollout += time.perf_counter() - t0
            meta = live.fed.pop(gr.prompt_index)
            version = gr.versions[0][0]        # admitted under it: its oldest tokens
            yield Taken(gr, meta.record, meta.prompt_ids, meta.index, self.n, version,
                        gr.prompt_index)

    def score(self, taken: Taken):
        return self.live.score(self.ctx.scorer, taken.record, taken.group, self.depth)

    def drops(self, taken: Taken) -> bool:
        if host.is_stale(self.ctx.cfg, taken.round_, self.step):
            self.tally.stream.dropped += taken.group.lengths.size
            return True
        return False

    def keep(self, taken: Taken, group: algo.Group, info) -> None:
        sampler = self.tally.sampler
        self.tally.every.append(group)
        self.state = host.observe(self.ctx.cfg, self.state, [(taken.index,
                                                                      info.pass_rate)])
        rows_before = sampler.rows_used
        sampler.add_groups([group])
        if sampler.rows_used > rows_before:
            self.tally.stream.ages.extend([self.step - taken.round_] * group.n)

    def full(self) -> bool:
        return self._needed() == 0

    def give_back(self, taken: Taken | None, verdicts) -> None:
        """The groups taken and not settled when the step is full go back to the stream, last
        first: the next step's, if carried (their verdicts are asked again there)."""
        live = self.live
        if taken is not None:               # taken early: the next step's, if carried
            live.stream.unread(taken.group)
            live.fed[taken.group.prompt_index] = FedPrompt(taken.prompt_ids, taken.record,
                                                           taken.index)
        while verdicts:
            back, _ = verdicts.pop()
            live.stream.unread(back.group)
            live.fed[back.group.prompt_index] = FedPrompt(back.prompt_ids, back.record,
                                                          back.index)
            self.tally.generated_samples -= back.group.lengths.size

    def finish(self) -> algo.CollectState:
        """The step's books: the filter's rounds, the stream's statistics, the stream carried
        or closed (self.live None once closed), the stream's pass-rate counts."""
        ccfg, tally, live, sampler = self.ctx.cfg, self.tally, self.live, \
            self.tally.sampler
        sampler.rounds = -(-self.fed // self.round_prompts)
        end = live.stream.progress()
        delta = end - self._start
        tally.rollout.add_progress(delta)
        tally.seconds.host_waited_for_device = delta.host_wait
        tally.seconds.device_waited_for_host = delta.device_idle
        tally.n_chosen = [self.n] * len(tally.every)
        st = tally.stream
        st.fed, st.step_occupancy = self.fed, delta.occupancy
        in_flight = live.in_flight * host.num_candidates(ccfg, self.n)
        if stream_ends_after(self.ctx, self.step):
            st.discarded += in_flight
            live.close()
            self.live = None
        else:
            st.carried = in_flight
            live.progress, live.next_step = end, self.step + 1
        self._finished = True
        return host.stream_counts_after(self.state, sampler.passed_groups,
                                        sampler.generated_groups)

    def close(self) -> None:
        """After finish the stream is the collector's (carried or closed there); a step that
        failed before closes it."""
        if not self._finished and self.live is not None:
            self.live.close()
            self.live = None
