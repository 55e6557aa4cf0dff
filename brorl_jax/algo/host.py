"""The host-side algorithm of one RL step (BroRL §3.1), as pure functions over an explicit state.

The train layer (brorl_jax/train/step.py) runs the rollouts and the verifiers; everything it
decides about their results is here, in host numpy, with no I/O and no device:

  samples_per_prompt(cfg, state, indices)   N of each prompt (FixedN = the paper's N, or AdaptiveN
                                            from the prompt's pass rate in `state`)
  make_group(cfg, candidates, rewards, ...) one prompt's group: over-generation selection of N of
                                            the candidates, the length penalty, reward clipping;
                                            and the prompt's observed pass rate
  observe(cfg, state, observations)         the new pass rates (AdaptiveN's EMA)
  GroupSampler (dynamic_sampling.py)        the group filter and the row budget, over rounds
  advantages(cfg, state, shaped, lengths)   the estimator and the normaliser (batch | ema) over
                                            every kept group of the step -> (advantages, state)
  update_batch(cfg, groups, advantages, ..) the fixed-shape (packed) update batch

`CollectState` is everything that carries from one step to the next: the pass rates of adaptive
N, the advantage EMA and the last step's verifier health. Its JSON form (`to_json`) is what the
checkpoint meta holds per process, so a resumed run continues with exactly the state an
uninterrupted one had. The settings are read from the typed run config (`RunConfig`,
brorl_jax/config/schema.py): none of them is in the update's jit key (UpdateConfig).

Adding a collect policy (docs/INTERFACES.md): a field in the schema (brorl_jax/config/schema.py),
a pure function here (state in, state out if it keeps any, a new CollectState field
with its to_json/from_json line), its metrics in train/collect.py, a test in tests/algo.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from brorl_jax.algo import policies, routing_replay
from brorl_jax.algo.batch import assemble_groups
from brorl_jax.algo.dynamic_sampling import Group
from brorl_jax.algo.length_penalty import apply_length_penalty
from brorl_jax.config.schema import RunConfig
from brorl_jax.rewards.health import VerifierHealth


@dataclasses.dataclass(frozen=True)
class CollectState:
    """What the collect carries between RL steps (checkpointed per process, `to_json`).

    pass_rates: prompt index -> EMA of its pass rate (AdaptiveN; empty with a fixed N).
    advantage_normalizer: the normaliser's state ({"ema_std": x} for "ema"; empty for "batch").
    health: the verifier verdicts of the last step (each step starts from none, so it is not
        checkpointed: a resumed step counts its own).
    stream_counts: (groups the filter kept, groups scored) over the run's streamed steps
        (algo.stream_rounds): the pass rate the stream's oversupply expects (stream_pass_rate).
    Only data that checkpoints: the live stream a step leaves paused for the next is the
    train layer's collector's (train/collect.py carried_stream), closed at every checkpoint
    step, so a resumed run starts where the uninterrupted one starts afresh."""
    pass_rates: Mapping[int, float] = dataclasses.field(default_factory=dict)
    advantage_normalizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    health: VerifierHealth = dataclasses.field(default_factory=VerifierHealth, compare=False)
    stream_counts: tuple = ()

    def to_json(self) -> dict:
        """The checkpoint meta's form ({} for the paper's recipe); floats round-trip exactly."""
        out: dict = {}
        if self.pass_rates:
            out["pass_rates"] = {str(k): float(v) for k, v in self.pass_rates.items()}
        if self.advantage_normalizer:
            out["advantage_normalizer"] = dict(self.advantage_normalizer)
        if self.stream_counts:
            out["stream_counts"] = [int(x) for x in self.stream_counts]
        return out

    @classmethod
    def from_json(cls, state: Mapping | None) -> "CollectState":
        state = state or {}
        return cls(pass_rates={int(k): float(v) for k, v in state.get("pass_rates", {}).items()},
                   advantage_normalizer=dict(state.get("advantage_normalizer", {})),
                   stream_counts=tuple(int(x) for x in state.get("stream_counts", ())))


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """What make_group decided, for the step's metrics and the pass-rate policy."""
    candidates: int           # m samples generated
    kept: int                 # n kept
    unique: int               # distinct completions among the m (only counted when m > n)
    duplicates_kept: int      # repeats among the n kept (only when m > n)
    clipped: int              # shaped rewards changed by clipping
    clip_checked: int         # shaped rewards clipping looked at (0 when clipping is off)
    pass_rate: float          # fraction of the m candidates with reward >= correct_threshold


# ------------------------------------------------------------------------------------------------
# How many samples per prompt
# ------------------------------------------------------------------------------------------------
def _policy(cfg: RunConfig, state: CollectState):
    policy = policies.samples_per_prompt_policy(cfg.rollout)
    if isinstance(policy, policies.AdaptiveN):
        policy.rates = dict(state.pass_rates)
    return policy


def max_group_rows(cfg: RunConfig) -> int:
    """The largest group the samples-per-prompt policy can make."""
    return policies.samples_per_prompt_policy(cfg.rollout).max_n


def group_size(cfg: RunConfig) -> int:
    """N, the nominal group size (policies.nominal_n): the stream's and the metrics' unit."""
    return policies.nominal_n(cfg.rollout)


def samples_per_prompt(cfg: RunConfig, state: CollectState, indices: Sequence[int]) -> list[int]:
    """N for each prompt (by its loader index) of a generation round."""
    policy = _policy(cfg, state)
    return [policy.n_for(int(i)) for i in indices]


def num_candidates(cfg: RunConfig, n: int) -> int:
    """Samples generated for a group of N: ceil(rollout.overgenerate_factor * N)."""
    return policies.num_candidates(n, float(cfg.rollout.overgenerate_factor))


def observe(cfg: RunConfig, state: CollectState,
            observations: Sequence[tuple[int, float]]) -> CollectState:
    """The state after the prompts' observed pass rates [(loader index, pass rate)], applied in
    order (AdaptiveN's EMA; a fixed N keeps no rates)."""
    policy = _policy(cfg, state)
    if not isinstance(policy, policies.AdaptiveN) or not observations:
        return state
    for index, rate in observations:
        policy.observe(index, rate)
    return dataclasses.replace(state, pass_rates=policy.rates)


# ------------------------------------------------------------------------------------------------
# One prompt's group: selection and reward shaping
# ------------------------------------------------------------------------------------------------
def make_group(cfg: RunConfig, candidates, rewards: np.ndarray, *, n: int,
               prompt_ids: Sequence[int], index: int, step: int, round_: int,
               position: int) -> tuple[Group, GroupInfo]:
    """One prompt's kept group from its m >= n candidates (a rollout.GroupResult, or anything
    with its tokens / logprobs / mask [m, S] and lengths [m]) and their verifier rewards [m]:
    n of them kept by rollout.select_rule when m > n (seeded by (train.seed, step, round,
    position in the round)), then the shaped reward (length penalty, clipping) that enters the
    advantages. `rewards` (the verifier's) stay what the group filter reads."""
    m = int(candidates.lengths.size)
    keep = np.arange(n)
    unique = dup = 0
    if m > n:
        rng = np.random.default_rng([cfg.train.seed, step, round_, int(position)])
        keep, info = policies.select_rollouts(candidates.tokens, candidates.lengths, rewards, n,
                                              cfg.rollout.select_rule, rng, cfg.algo.correct_threshold)
        unique, dup = info["unique"], info["duplicates_kept"]
    tok, lp, msk, lens, rew = (x[keep] for x in (candidates.tokens, candidates.logprobs,
                                                 candidates.mask, candidates.lengths, rewards))
    shaped = apply_length_penalty(rew[None], lens[None], step=step,
                                  max_length=cfg.rollout.max_new_tokens, algo_cfg=cfg.algo)[0]
    clipped = policies.clip_rewards(shaped, float(cfg.algo.reward_clip_low),
                                    float(cfg.algo.reward_clip_high))
    n_clipped = n_checked = 0
    if clipped is not shaped:
        n_clipped = int(np.sum(clipped != np.asarray(shaped, np.float32)))
        n_checked = clipped.size
    group = Group(prompt_ids=list(prompt_ids), tokens=tok, logprobs=lp, mask=msk, lengths=lens,
                  rewards=rew, shaped=np.asarray(clipped, np.float32), index=int(index))
    if getattr(candidates, "routing", None) is not None:    # algo.routing_replay="rollout"
        group.routing, group.prompt_routing = candidates.routing[keep], candidates.prompt_routing
    # every candidate counts for the prompt's difficulty estimate
    rate = float(np.mean(rewards >= cfg.algo.correct_threshold))
    return group, GroupInfo(candidates=m, kept=n, unique=unique, duplicates_kept=dup,
                            clipped=n_clipped, clip_checked=n_checked, pass_rate=rate)


# ------------------------------------------------------------------------------------------------
# The stream (algo.stream_rounds): how many prompts to feed, how old a sample may be
# ------------------------------------------------------------------------------------------------
def stream_pass_rate(cfg: RunConfig, state: CollectState) -> float:
    """The fraction of groups the filter keeps that the stream's oversupply expects: kept /
    scored over the run's streamed steps (state.stream_counts); before any, 1 /
    generation_batch_multiplier (the rounds' own guess: one round fills the step)."""
    if state.stream_counts and state.stream_counts[1] > 0:
        kept, scored = state.stream_counts
        return kept / scored
    return 1.0 / float(cfg.algo.generation_batch_multiplier)


def stream_counts_after(state: CollectState, kept: int, scored: int) -> CollectState:
    """The state with one more step's filter counts."""
    k0, s0 = state.stream_counts or (0, 0)
    return dataclasses.replace(state, stream_counts=(k0 + int(kept), s0 + int(scored)))


def groups_needed(cfg: RunConfig, rows_left: int, max_group_rows: int) -> int:
    """Kept groups still needed to fill the step's rows (0 once the batch is full: less room
    than the largest group, dynamic_sampling.GroupSampler.full)."""
    if rows_left < max_group_rows:
        return 0
    return (rows_left - max_group_rows) // group_size(cfg) + 1


def prompts_to_feed(cfg: RunConfig, *, needed: int, step_groups: int, in_flight: int,
                    fed: int, cap: int, pool: int, pass_rate: float) -> int:
    """How many prompts the stream admits now (issue 28's admission rule).

    needed: kept groups still needed this step; step_groups: the groups a step keeps (this
    process's prompts_per_step); in_flight: prompts fed and not handed out (this step's and
    carried); fed: prompts fed this step; cap: prompts one step may feed (max_generation_rounds
    x the round's prompts); pool: the engine's prompt-pool entries (more in flight only wait).
    The oversupply follows the observed pass rate p: prompts in flight while they are not
    expected to fill the step, ceil(needed / p). With max_staleness >= 1 the next step's
    prompts are admitted too, ceil((needed + step_groups) / p), so the engine stays busy while
    this step's stragglers finish; one step ahead, not k: more would only age the samples
    (groups come out roughly first in, first out), k is the bound, not the target. Never more
    in flight than the pool, never beyond the step's cap."""
    if needed <= 0:
        return 0
    ahead = step_groups if cfg.algo.max_staleness > 0 else 0
    target = min(pool, math.ceil((needed + ahead) / max(pass_rate, 1e-6)))
    return int(max(0, min(target - in_flight, cap - fed)))


def max_age(cfg: RunConfig) -> int:
    """The oldest (in steps) a sample the update uses may be: 0 = on-policy, nothing carried
    into the next step; k >= 1 = a stream's groups in flight are carried (BroRL's off-policy
    bound, algo.max_staleness)."""
    return int(cfg.algo.max_staleness)


def is_stale(cfg: RunConfig, version: int, step: int) -> bool:
    """A group whose prompt was admitted under the weights of step `version` (so its tokens
    span versions version..step) is too old for the update of `step` when step - version >
    max_staleness: it is dropped (and counted), never trained on."""
    return step - version > cfg.algo.max_staleness


# ------------------------------------------------------------------------------------------------
# Advantages and the update batch
# ------------------------------------------------------------------------------------------------
def advantages(cfg: RunConfig, state: CollectState, shaped: Sequence, lengths: Sequence
               ) -> tuple[list[np.ndarray], CollectState]:
    """Advantages of the kept groups of a step (shaped rewards [n_g] and response lengths [n_g]
    per group, of every process) by the configured estimator and normaliser: (per-group
    advantages, the state with the normaliser's new state). Whitening is token-weighted by the
    response lengths, as veRL's masked_whiten is."""
    if not shaped:
        return [], state
    rewards, mask = policies.pad_groups([np.asarray(s, np.float32) for s in shaped])
    lens, _ = policies.pad_groups([np.asarray(n, np.float32) for n in lengths])
    normalizer = policies.ADVANTAGE_NORMALIZERS[cfg.algo.advantage_normalizer]
    adv, norm_state = normalizer(cfg.algo.advantage, rewards, mask, dict(state.advantage_normalizer),
                                 eps=cfg.algo.advantage_eps, whiten_eps=cfg.algo.whiten_eps,
                                 decay=cfg.algo.advantage_ema_decay, lengths=lens)
    return ([adv[i, :len(s)] for i, s in enumerate(shaped)],
            dataclasses.replace(state, advantage_normalizer=dict(norm_state)))


def pack_units(ppo_mini_batches: int, num_processes: int) -> int:
    """Units of PPO mini-batches this process packs its rows into: lcm(M, P) / P."""
    return ppo_mini_batches // math.gcd(ppo_mini_batches, num_processes)


def update_batch(cfg: RunConfig, groups: Sequence[Group], advs: Sequence[np.ndarray], *,
                 rows: int, seq_len: int, pad_id: int, units: int, row_multiple: int = 1) -> dict:
    """This process's rows of the update batch (host numpy): packed (docs/algo.md "Sequence
    packing") unless algo.pack_sequences is off."""
    batch = assemble_groups(groups, advs, rows=rows, seq_len=seq_len, pad_id=pad_id,
                            pack=cfg.algo.pack_sequences, mini_batches=units,
                            row_multiple=row_multiple)
    return routing_replay.attach_routing(batch, groups, rows)   # None without a recording
