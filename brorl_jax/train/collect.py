"""The collect step of one RL step: generation rounds -> scoring -> dynamic sampling ->
advantages -> the fixed-shape update batch (BroRL §3.1). One path for every configuration.

Per generation round (ceil(prompts_per_step * generation_batch_multiplier) prompts):
  1. how many samples per prompt: the samples-per-prompt policy (FixedN = the paper's N, or
     AdaptiveN); prompts with the same N are generated in one call;
  2. over-generation (an option): ceil(factor * N) candidates, N kept by rollout.select_rule;
  3. scoring in the worker pool, each group as soon as the rollout streams it out (decoding goes
     on meanwhile; time/scoring_waited_for_rollout_s and time/rollout_idle_for_scoring_s say how
     long each side waited on the other), then reward shaping (length penalty, clipping);
  4. the group filter (algo.dynamic_sampling_rule) keeps groups in arrival order until the row
     budget (prompts_per_step * N) is full.
Then the advantage normaliser ("batch": the estimator's own; "ema": an option) over every kept
group of every process, and the batch (algo.assemble_groups).

The policies are small objects from algo/policies.py; the ones that keep state (AdaptiveN's pass
rates, the advantage EMA) are checkpointed through state_dict(). Under several processes each
process fills its share of the rows with its own prompts; the advantages are normalised over the
union (gathered through the runtime), so the options run multi-process too.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from brorl_jax import algo
from brorl_jax.algo import policies
from brorl_jax.train.monitoring import (
    effective_update_ratio,
    ngram_diversity,
    path_diversity,
    reward_entropy,
)

# generate(params, prompt_ids, *, n, temperature, seed, stream=True) -> rollout.RolloutStream
# (each prompt's rollout.GroupResult in completion order; a context manager)
GenerateFn = Callable[..., Any]
# score(records, tokens [G, N, S], lengths [G, N]) -> rewards float32 [G, N]
ScoreFn = Callable[[list, np.ndarray, np.ndarray], np.ndarray]


def round_seed(seed: int, step: int, round_: int) -> int:
    """A distinct, reproducible rollout seed for every (run seed, step, generation round)."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


class Collector:
    """Builds each step's update batch; owns the collect policies and their state."""

    def __init__(self, cfg, algo_cfg: algo.AlgoConfig, runtime, *, seq_len: int, pad_id: int):
        self.cfg = cfg
        self.algo_cfg = algo_cfg
        self.runtime = runtime
        self.seq_len = seq_len
        self.pad_id = pad_id
        r = cfg.rollout
        self.samples_per_prompt = policies.samples_per_prompt_policy(r)
        self.schedule = policies.parse_temperature_schedule(r.temperature_schedule)
        self.normalizer_state: dict = {}
        # each process fills an equal share of the update batch
        self.row_budget = algo_cfg.batch_rows // runtime.num_processes

    # -- checkpointed state ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-able state of the stateful policies ({} for the paper's recipe)."""
        out = dict(self.samples_per_prompt.state_dict())
        if self.normalizer_state:
            out["advantage_normalizer"] = dict(self.normalizer_state)
        return out

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.samples_per_prompt.load_state_dict(state)
        self.normalizer_state = dict(state.get("advantage_normalizer", {}))

    # -- per step settings ----------------------------------------------------------------------
    def rollout_temperature(self, step: int) -> float:
        """Sampling temperature of RL step `step`: rollout.temperature unless scheduled."""
        return policies.temperature_at(self.schedule, step, self.cfg.rollout.temperature)

    def update_config(self, step: int) -> algo.AlgoConfig:
        """The AlgoConfig of step `step`: log-probs are of logits / T with T the sampling
        temperature, so a scheduled temperature changes the update's config."""
        t = self.rollout_temperature(step)
        t = t if t > 0 else 1.0
        if t == self.algo_cfg.temperature:
            return self.algo_cfg
        return dataclasses.replace(self.algo_cfg, temperature=t)

    # -- the step -------------------------------------------------------------------------------
    def collect(self, params, data_iter, step: int, generate: GenerateFn,
                score: ScoreFn) -> tuple[dict, dict]:
        """-> (update batch of this process's rows (numpy), the step's rollout metrics)."""
        cfg, acfg = self.cfg, self.algo_cfg
        r = cfg.rollout
        sampler = algo.GroupSampler.from_config(acfg, row_budget=self.row_budget,
                                                max_group_rows=self.samples_per_prompt.max_n)
        temperature = self.rollout_temperature(step)
        factor = float(r.overgenerate_factor)
        thr = acfg.correct_threshold
        t_roll = t_score = waited = idle = 0.0
        engine_stats = {"useful_tokens": 0, "decode_steps": 0, "refills": 0, "compactions": 0,
                        "live_slot_steps": 0.0, "slot_steps": 0}
        gen_tokens = gen_samples = 0
        every: list[algo.Group] = []            # all groups after selection, for monitoring
        truncated, n_chosen = [], []
        sel = {"candidates": 0, "kept": 0, "unique": 0, "duplicates_kept": 0}
        clip_count = [0, 0]                     # rewards changed by clipping, rewards shaped
        while sampler.need_more():              # raises at the round cap with policy "error"
            batch = next(data_iter)
            seed = round_seed(cfg.train.seed, step, sampler.rounds)
            ns = [self.samples_per_prompt.n_for(i) for i in batch["index"]]
            n_chosen += ns
            groups: list[algo.Group | None] = [None] * len(ns)
            for b, (n, positions) in enumerate(policies.group_by_n(ns)):
                m = policies.num_candidates(n, factor)
                # each group is scored as soon as its samples are done, while decoding goes on
                with generate(params, [batch["prompt_ids"][p] for p in positions], n=m,
                              temperature=temperature,
                              seed=(seed + b * 1_000_000_007) % (2**31 - 1), stream=True) as st:
                    for gr in st:
                        p = positions[gr.prompt_index]
                        record = batch["records"][p]
                        t0 = time.perf_counter()
                        rewards = score([record], gr.tokens[None], gr.lengths[None])[0]
                        t_score += time.perf_counter() - t0
                        gen_tokens += int(gr.lengths.sum())
                        gen_samples += gr.lengths.size
                        truncated.append(gr.truncated)
                        groups[p] = self._group(gr, batch["prompt_ids"][p], rewards, n, p,
                                                int(batch["index"][p]), step, sampler.rounds,
                                                sel, clip_count)
                    done = time.perf_counter()
                t_roll += st.finished_at - st.started_at
                accumulate_rollout_stats(engine_stats, st.stats)
                waited += st.wait_seconds
                idle += max(0.0, done - st.finished_at)
            every += groups
            sampler.add_round(groups)
        advantages = self._advantages(sampler.groups)
        update_batch = self._batch(sampler.groups, advantages)
        ds = sampler.stats()
        stats = step_metrics(every, truncated, ds, sampler.groups, advantages, thr=thr,
                             n_nominal=acfg.rollouts_per_prompt)
        stats.update({"time/rollout_s": t_roll, "time/scoring_s": t_score,
                      # scoring overlaps decoding: how long each side waited on the other
                      "time/scoring_waited_for_rollout_s": waited,
                      "time/rollout_idle_for_scoring_s": idle,
                      "perf/generated_samples": gen_samples, "perf/generated_tokens": gen_tokens})
        stats.update(rollout_metrics(engine_stats))
        if self.schedule:
            stats["rollout/temperature"] = temperature
        if isinstance(self.samples_per_prompt, policies.AdaptiveN):
            ns_arr = np.asarray(n_chosen)
            stats["monitor/n_mean"] = float(ns_arr.mean())
            for n in self.samples_per_prompt.buckets:
                stats[f"adaptive_n/prompts_n{n}"] = int(np.sum(ns_arr == n))
            stats["adaptive_n/batch_rows_used"] = int(sampler.rows_used)
            stats["adaptive_n/padded_rows"] = int(ds["padded_rows"])
            stats["adaptive_n/tracked_prompts"] = len(self.samples_per_prompt.rates)
        if factor > 1.0:
            stats["monitor/selection_kept_frac"] = sel["kept"] / sel["candidates"]
            stats["monitor/selection_unique_frac"] = sel["unique"] / sel["candidates"]
            stats["monitor/selection_duplicates_kept_frac"] = sel["duplicates_kept"] / sel["kept"]
        if clip_count[1]:
            stats["reward/clipped_frac"] = clip_count[0] / clip_count[1]
        if "ema_std" in self.normalizer_state:
            stats["advantage/ema_std"] = float(self.normalizer_state["ema_std"])
        if cfg.train.mass_balance_diagnostics:
            from brorl_jax.theory import group_reward_balance, reward_balance_metrics
            stats.update(reward_balance_metrics(group_reward_balance(
                np.stack([g.rewards for g in every]), None, correct_threshold=thr)))
        return update_batch, stats

    def _group(self, gr, prompt_ids, rewards: np.ndarray, n: int, p: int, index: int,
               step: int, round_: int, sel: dict, clip_count: list) -> algo.Group:
        """One prompt's kept group from its streamed candidates (rollout.GroupResult) and their
        verifier rewards [m]: selection of n of m candidates (over-generation), the reward
        shaping, and the prompt's pass rate for the samples-per-prompt policy."""
        cfg, acfg = self.cfg, self.algo_cfg
        r, thr = cfg.rollout, acfg.correct_threshold
        m = gr.lengths.size
        keep = np.arange(n)
        if m > n:
            rng = np.random.default_rng([cfg.train.seed, step, round_, int(p)])
            keep, info = policies.select_rollouts(gr.tokens, gr.lengths, rewards, n,
                                                  r.select_rule, rng, thr)
            sel["unique"] += info["unique"]
            sel["duplicates_kept"] += info["duplicates_kept"]
        sel["candidates"] += m
        sel["kept"] += n
        tok, lp, msk, lens, rew = (x[keep] for x in (gr.tokens, gr.logprobs, gr.mask, gr.lengths,
                                                     rewards))
        shaped = algo.apply_length_penalty(rew[None], lens[None], step=step,
                                           max_length=r.max_new_tokens, cfg=acfg)[0]
        clipped = policies.clip_rewards(shaped, float(cfg.algo.reward_clip_low),
                                        float(cfg.algo.reward_clip_high))
        if clipped is not shaped:
            clip_count[0] += int(np.sum(clipped != np.asarray(shaped, np.float32)))
            clip_count[1] += clipped.size
        # every candidate counts for the prompt's difficulty estimate
        self.samples_per_prompt.observe(index, float(np.mean(rewards >= thr)))
        return algo.Group(prompt_ids=list(prompt_ids), tokens=tok, logprobs=lp, mask=msk,
                          lengths=lens, rewards=rew, shaped=np.asarray(clipped, np.float32),
                          index=index)

    def _batch(self, kept: Sequence[algo.Group], advantages: list[np.ndarray]) -> dict:
        """This process's rows of the update batch: packed (docs/algo.md "Sequence packing") unless
        algo.pack_sequences is off. Each process packs its own groups into its units of PPO
        mini-batches; the processes then agree on the rows per unit."""
        acfg, procs = self.algo_cfg, self.runtime.num_processes
        units = acfg.ppo_mini_batches // math.gcd(acfg.ppo_mini_batches, procs)  # lcm(M, P) / P
        batch = algo.assemble_groups(kept, advantages, rows=self.row_budget, seq_len=self.seq_len,
                                     pad_id=self.pad_id, pack=acfg.pack_sequences,
                                     mini_batches=units, row_multiple=self.runtime.row_multiple)
        if acfg.pack_sequences and procs > 1:
            per_unit = batch["input_tokens"].shape[0] // units
            rows = int(self.runtime.allgather_rows(np.array([per_unit])).max())
            batch = algo.pad_packed_rows(batch, rows, pad_id=self.pad_id)
        return batch

    def _advantages(self, kept: Sequence[algo.Group]) -> list[np.ndarray]:
        """Per kept group: advantages [n_g], normalised over the kept groups of all processes."""
        local = [(g.shaped.tolist(), g.lengths.tolist()) for g in kept]
        first = 0
        if self.runtime.num_processes > 1:       # normalise over the whole batch
            every = self.runtime.allgather_json(local)
            first = sum(len(x) for x in every[:self.runtime.process_index])
            local = [item for part in every for item in part]
        adv, self.normalizer_state = batch_advantages(
            self.algo_cfg, [s for s, _ in local], [n for _, n in local], self.normalizer_state)
        return adv[first:first + len(kept)]


def accumulate_rollout_stats(total: dict, call: dict) -> None:
    """Adds one rollout call's statistics (rollout.RolloutStream.stats) to the step's totals."""
    for k in ("useful_tokens", "decode_steps", "refills", "compactions"):
        total[k] += int(call.get(k, 0))
    steps = int(call.get("decode_steps", 0))
    total["live_slot_steps"] += float(call.get("mean_live_slots", 0.0)) * steps
    total["slot_steps"] += int(call.get("num_slots", 0)) * steps


def rollout_metrics(total: dict) -> dict:
    """The step's rollout statistics: useful tokens, decode steps, refills, compactions and the
    occupancy (live slots over slots, averaged over every decode step of the step's calls)."""
    out = {f"rollout/{k}": total[k]
           for k in ("useful_tokens", "decode_steps", "refills", "compactions")}
    if total["slot_steps"]:
        out["rollout/occupancy"] = total["live_slot_steps"] / total["slot_steps"]
    return out


def batch_advantages(acfg: algo.AlgoConfig, shaped: Sequence, lengths: Sequence,
                     state: dict) -> tuple[list[np.ndarray], dict]:
    """Advantages of the kept groups of a step (shaped rewards [n_g] and response lengths [n_g]
    per group) by the configured estimator and normaliser: (per-group advantages, new normaliser
    state). Whitening is token-weighted by the response lengths, as veRL's masked_whiten is."""
    if not shaped:
        return [], state
    rewards, mask = policies.pad_groups([np.asarray(s, np.float32) for s in shaped])
    lens, _ = policies.pad_groups([np.asarray(n, np.float32) for n in lengths])
    normalizer = policies.ADVANTAGE_NORMALIZERS[acfg.advantage_normalizer]
    adv, state = normalizer(acfg.advantage, rewards, mask, state, eps=acfg.advantage_eps,
                            whiten_eps=acfg.whiten_eps, decay=acfg.advantage_ema_decay,
                            lengths=lens)
    return [adv[i, :len(s)] for i, s in enumerate(shaped)], state


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
