"""Small named policies of the collect step that are NOT in the BroRL paper (docs/options.md).

The collect step (brorl_jax/train/collect.py) has one path; these policies plug into it by config,
and each is off by default, so a config without them runs the paper's recipe:

  how many samples per prompt  FixedN (the paper) | AdaptiveN (rollout.adaptive_n: N per prompt
                               from its EMA pass rate, in buckets) | KnapsackN (rollout.knapsack:
                               a probe per round, then the round's samples by Knapsack RL's value)
  which candidates to keep     over-generation: ceil(rollout.overgenerate_factor * N) candidates,
                               N kept by rollout.select_rule (SELECT_RULES)
  reward shaping               clip_rewards (algo.reward_clip_low / high); the length penalty is
                               algo/length_penalty.py (ProRLv2)
  advantage normalisation      ADVANTAGE_NORMALIZERS: "batch" (the estimator's own, the paper) |
                               "ema" (an EMA of the batch std; its state is explicit)
  rollout temperature          rollout.temperature_schedule ("step:T,step:T")

Host-side numpy and pure functions; the stateful ones (AdaptiveN, the EMA) carry explicit state
that the collect step checkpoints. The parse_* helpers are also what config validation calls, so
their messages name the config key.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Sequence

import numpy as np

from brorl_jax.algo.advantages import compute_advantages


# ------------------------------------------------------------------------------------------------
# Parsing (errors name the config key)
# ------------------------------------------------------------------------------------------------
def parse_temperature_schedule(spec: str) -> tuple[tuple[int, float], ...]:
    """"step:temp,step:temp" -> ((step, temp), ...) with strictly increasing steps >= 0 and temps
    > 0; "" -> () (no schedule). Raises ValueError naming rollout.temperature_schedule."""
    key = "rollout.temperature_schedule"
    spec = spec.strip()
    if not spec:
        return ()
    out = []
    for part in spec.split(","):
        try:
            step_s, temp_s = part.split(":")
            step, temp = int(step_s), float(temp_s)
        except ValueError:
            raise ValueError(f"config key '{key}' = {spec!r}: entry {part.strip()!r} is not "
                             "'step:temperature'; write e.g. '0:1.3,100:0.9,200:0.7'.") from None
        if step < 0 or not temp > 0 or not math.isfinite(temp):
            raise ValueError(f"config key '{key}' = {spec!r}: entry {part.strip()!r} needs a step "
                             ">= 0 and a finite temperature > 0 (the update divides logits by it).")
        if out and step <= out[-1][0]:
            raise ValueError(f"config key '{key}' = {spec!r}: steps must increase strictly.")
        out.append((step, temp))
    return tuple(out)


def temperature_at(schedule: Sequence[tuple[int, float]], step: int, default: float) -> float:
    """The rollout temperature at RL step `step` (0-based): the temperature of the last schedule
    entry whose step is <= `step`; `default` (rollout.temperature) before the first entry."""
    temp = default
    for start, t in schedule:
        if step >= start:
            temp = t
    return temp


def parse_numbers(spec: str, key: str, kind: type = int) -> tuple:
    """"a,b,c" -> (a, b, c) of `kind`; the error names `key`."""
    try:
        return tuple(kind(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"config key '{key}' = {spec!r} must be a comma-separated list of "
                         f"{kind.__name__}s.") from None


def parse_adaptive_n(buckets: str, thresholds: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """rollout.adaptive_n_buckets ("256,512,768": N per difficulty, easy to hard, ascending) and
    rollout.adaptive_n_thresholds ("0.7,0.3": pass-rate boundaries, descending, one fewer than the
    buckets) -> (buckets, thresholds). Raises ValueError naming the key and the fix."""
    b = parse_numbers(buckets, "rollout.adaptive_n_buckets", int)
    t = parse_numbers(thresholds, "rollout.adaptive_n_thresholds", float)
    if not b or any(n < 1 for n in b) or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"config key 'rollout.adaptive_n_buckets' = {buckets!r} must list "
                         "rollouts per prompt >= 1 in strictly increasing order (easy to hard), "
                         "e.g. '256,512,768'.")
    if len(t) != len(b) - 1:
        raise ValueError(f"config key 'rollout.adaptive_n_thresholds' = {thresholds!r} must have "
                         f"one value fewer than rollout.adaptive_n_buckets ({len(b)} buckets -> "
                         f"{len(b) - 1} pass-rate thresholds), e.g. '0.7,0.3'.")
    if any(not 0.0 <= x <= 1.0 for x in t) or any(x <= y for x, y in zip(t, t[1:])):
        raise ValueError(f"config key 'rollout.adaptive_n_thresholds' = {thresholds!r} must be "
                         "pass rates in [0, 1] in strictly decreasing order (easiest first).")
    return b, t


# ------------------------------------------------------------------------------------------------
# How many samples per prompt
# ------------------------------------------------------------------------------------------------
def choose_rollouts(pass_rate: float | None, buckets: Sequence[int],
                    thresholds: Sequence[float]) -> int:
    """N for one prompt. buckets ascending (easy -> hard), thresholds descending pass rates:
    pass_rate >= thresholds[0] -> buckets[0], >= thresholds[1] -> buckets[1], ..., else the last.
    An unseen prompt (None) gets the middle bucket buckets[len // 2]."""
    if pass_rate is None:
        return int(buckets[len(buckets) // 2])
    for n, th in zip(buckets, thresholds):
        if pass_rate >= th:
            return int(n)
    return int(buckets[-1])


# The config key of N (the one name the door's messages and experiments use for it).
N_KEY = "rollout.rollouts_per_prompt"


@dataclasses.dataclass
class FixedN:
    """The paper: every prompt gets the config's N (N_KEY) samples."""
    n: int

    @property
    def max_n(self) -> int:
        return self.n

    def n_for(self, index: int) -> int:
        return self.n

    def observe(self, index: int, pass_rate: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclasses.dataclass
class AdaptiveN:
    """N per prompt from an EMA of its pass rate (#correct / #generated per visit), keyed by the
    loader's prompt index: rate <- decay * rate + (1 - decay) * observed; the first visit sets it.
    Not in the paper."""
    buckets: tuple[int, ...]
    thresholds: tuple[float, ...]
    decay: float = 0.5
    rates: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def max_n(self) -> int:
        return max(self.buckets)

    def n_for(self, index: int) -> int:
        return choose_rollouts(self.rates.get(int(index)), self.buckets, self.thresholds)

    def observe(self, index: int, pass_rate: float) -> None:
        i, old = int(index), self.rates.get(int(index))
        self.rates[i] = float(pass_rate) if old is None else \
            self.decay * old + (1.0 - self.decay) * float(pass_rate)

    def state_dict(self) -> dict:
        """JSON-able (string keys; floats round-trip exactly through JSON)."""
        return {"pass_rates": {str(k): v for k, v in self.rates.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rates = {int(k): float(v) for k, v in state.get("pass_rates", {}).items()}


def knapsack_value(n: int, p: float) -> float:
    """The value of n samples of a prompt of pass rate p, in Knapsack RL's form (Li et al. 2025,
    arXiv 2509.25849): P(the group holds a right and a wrong answer, so its gradient is not zero)
    = 1 - p^n - (1 - p)^n, times an information gain p (1 - p)^2 that favours hard but solvable
    prompts. Concave in n for a fixed p, so handing out samples greedily is optimal."""
    return (1.0 - p ** n - (1.0 - p) ** n) * p * (1.0 - p) ** 2


def knapsack_allocation(correct: Sequence[int], probe: int, budget: int, chunk: int,
                        max_n: int) -> list[int]:
    """Samples per prompt (its probe included) after a probe of `probe` samples each with
    `correct[i]` right: the round's `budget` samples minus the probes, handed out `chunk` at a
    time, each chunk to the prompt it raises knapsack_value most (ties: the lower index), none
    past `max_n`. The pass rate is the probe's posterior mean under a Beta(1/2, 1/2) prior,
    (k + 1/2) / (probe + 1), so an all-wrong probe still counts as solvable now and then (our
    choice; the paper estimates p from earlier epochs)."""
    totals = [int(probe)] * len(correct)
    rates = [(k + 0.5) / (probe + 1.0) for k in correct]

    def gain(i: int) -> float:
        return knapsack_value(totals[i] + chunk, rates[i]) - knapsack_value(totals[i], rates[i])

    heap = [(-gain(i), i) for i in range(len(totals)) if probe + chunk <= max_n]
    heapq.heapify(heap)
    spare = (int(budget) - probe * len(totals)) // chunk
    while spare > 0 and heap:
        _, i = heapq.heappop(heap)
        totals[i] += chunk
        spare -= 1
        if totals[i] + chunk <= max_n:
            heapq.heappush(heap, (-gain(i), i))
    return totals


@dataclasses.dataclass
class KnapsackN:
    """rollout.knapsack (not in the paper): each generation round first draws `probe` samples of
    every prompt, then shares the round's other samples (its prompts x the config's N, minus
    the probes) out by knapsack_allocation, in chunks of `chunk`, at most `max_n` per prompt. A
    prompt's probe and its chunks make one group. Nothing carries between rounds."""
    n: int
    probe: int
    chunk: int
    max_n: int

    def n_for(self, index: int) -> int:
        return self.probe

    def allocate(self, correct: Sequence[int]) -> list[int]:
        """Samples per prompt of a round whose probes had `correct` right answers."""
        return knapsack_allocation(correct, self.probe, len(correct) * self.n, self.chunk,
                                   self.max_n)

    def observe(self, index: int, pass_rate: float) -> None:
        pass


def nominal_n(rollout_cfg) -> int:
    """N, the samples per prompt the config sets (the paper's; adaptive N buckets around it)."""
    return int(rollout_cfg.rollouts_per_prompt)


def samples_per_prompt_policy(rollout_cfg) -> FixedN | AdaptiveN | KnapsackN:
    """The run's policy from the config's rollout section."""
    if rollout_cfg.knapsack:
        return KnapsackN(nominal_n(rollout_cfg), int(rollout_cfg.knapsack_probe),
                         int(rollout_cfg.knapsack_chunk), int(rollout_cfg.knapsack_max_n))
    if not rollout_cfg.adaptive_n:
        return FixedN(nominal_n(rollout_cfg))
    buckets, thresholds = parse_adaptive_n(rollout_cfg.adaptive_n_buckets,
                                           rollout_cfg.adaptive_n_thresholds)
    return AdaptiveN(buckets, thresholds, decay=float(rollout_cfg.adaptive_n_ema_decay))


def group_by_n(ns: Sequence[int]) -> list[tuple[int, list[int]]]:
    """[(N, positions with that N)] in ascending N: one generate call per bucket."""
    out: dict[int, list[int]] = {}
    for pos, n in enumerate(ns):
        out.setdefault(int(n), []).append(pos)
    return sorted(out.items())


# ------------------------------------------------------------------------------------------------
# Over-generate then select
# ------------------------------------------------------------------------------------------------
SELECT_RULES = ("dedup_then_balanced", "dedup", "balanced")


def num_candidates(n: int, factor: float) -> int:
    """Candidates generated for a group of N: ceil(factor * N) (factor 1.0 = N, the paper)."""
    return max(n, math.ceil(factor * n - 1e-9))


def _balanced(correct: list[int], wrong: list[int], k: int, want_correct: int) -> list[int]:
    """k of the candidates with as close to want_correct correct ones as availability allows."""
    c = min(len(correct), max(want_correct, k - len(wrong)), k)
    c = max(c, 0)
    return correct[:c] + wrong[:k - c]


def select_rollouts(tokens: np.ndarray, lengths: np.ndarray, rewards: np.ndarray, n: int,
                    rule: str, rng: np.random.Generator,
                    correct_threshold: float = 1.0) -> tuple[np.ndarray, dict]:
    """Keep n of a group's M >= n candidates. tokens [M, S], lengths [M], rewards [M] ->
    (sorted kept indices int [n], info {"unique": #distinct candidates, "duplicates_kept"}).

    Candidates are visited in a seeded random order (rng), so ties are broken without favouring
    low indices. Rules:
      "dedup": distinct completions first (exact token match); repeats only if fewer than n
               are distinct.
      "balanced": n with as close to n // 2 correct (reward >= correct_threshold) as possible.
      "dedup_then_balanced": balanced among the distinct ones, repeats (balanced) to fill.
    Not in the paper; the kept set is no longer an i.i.d. sample of the policy, so the gradient
    estimate is biased (the per-token log-probs, and so the TIS ratios, stay exact)."""
    if rule not in SELECT_RULES:
        raise ValueError(f"select rule {rule!r} unknown; allowed: {SELECT_RULES}")
    m = len(rewards)
    order = [int(i) for i in rng.permutation(m)]
    seen, primary, reserve = set(), [], []
    for i in order:
        key = np.asarray(tokens[i, :int(lengths[i])]).tobytes()
        (reserve if key in seen else primary).append(i)
        seen.add(key)
    info = {"unique": len(primary), "duplicates_kept": 0}
    if n >= m:
        return np.arange(m), info
    if rule == "balanced":
        primary, reserve = order, []
    is_correct = lambda i: rewards[i] >= correct_threshold
    if rule == "dedup":
        kept = primary[:n]
    else:
        k = min(n, len(primary))
        kept = _balanced([i for i in primary if is_correct(i)],
                         [i for i in primary if not is_correct(i)], k, n // 2)
    if len(kept) < n:
        rest = n - len(kept)
        have = sum(is_correct(i) for i in kept)
        if rule == "dedup":
            extra = reserve[:rest]
        else:
            extra = _balanced([i for i in reserve if is_correct(i)],
                              [i for i in reserve if not is_correct(i)], rest,
                              min(max(n // 2 - have, 0), rest))
        info["duplicates_kept"] = len(extra)
        kept = kept + extra
    return np.sort(np.asarray(kept, int)), info


# ------------------------------------------------------------------------------------------------
# Reward shaping and advantage normalisation
# ------------------------------------------------------------------------------------------------
def clip_rewards(rewards: np.ndarray, low: float, high: float) -> np.ndarray:
    """Rewards clipped to [low, high] (float32); the input itself when the range is (-inf, inf)."""
    if low == -math.inf and high == math.inf:
        return rewards
    return np.clip(np.asarray(rewards, np.float32), low, high).astype(np.float32)


def pad_groups(values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-group values -> (values [G, N_max] float32 zero-padded, sample_mask bool)."""
    g = len(values)
    n_max = max((len(v) for v in values), default=2)
    r = np.zeros((g, max(n_max, 2)), np.float32)
    mask = np.zeros(r.shape, bool)
    for i, v in enumerate(values):
        r[i, :len(v)] = v
        mask[i, :len(v)] = True
    return r, mask


def batch_normalizer(estimator: str, rewards, sample_mask, state: dict, *, eps: float,
                     whiten_eps: float, decay: float, lengths=None) -> tuple[np.ndarray, dict]:
    """The paper: the estimator's own normalisation (REINFORCE++-baseline whitens the batch)."""
    del decay
    adv = compute_advantages(estimator, rewards, sample_mask=sample_mask, eps=eps,
                             whiten_eps=whiten_eps, lengths=lengths)
    return np.asarray(adv, np.float32), state


def ema_normalizer(estimator: str, rewards, sample_mask, state: dict, *, eps: float,
                   whiten_eps: float, decay: float, lengths=None) -> tuple[np.ndarray, dict]:
    """algo.advantage_normalizer = "ema" (not in the paper): A = R - mean_group(R), divided by an
    EMA of the batch std of A instead of this batch's std:

      std_t = population std of A over the batch's real samples
      ema_t = std_1 at the first batch, then decay * ema_{t-1} + (1 - decay) * std_t
      A_norm = A / (ema_t + eps)
    (A has exact batch mean 0 because every group is centred, so only the scale differs from
    REINFORCE++-baseline; decay = 0 gives it back.) Pure: returns (advantages, new state); a batch
    without real samples leaves the state as is."""
    del estimator, lengths, whiten_eps
    mask = np.asarray(sample_mask, bool)
    a = np.asarray(compute_advantages("dr_grpo", rewards, sample_mask=mask), np.float64)
    if not mask.any():
        return np.zeros(a.shape, np.float32), state
    std = float(np.sqrt(np.mean(a[mask] ** 2)))
    old = state.get("ema_std")
    ema = std if old is None else decay * old + (1.0 - decay) * std
    return np.where(mask, a / (ema + eps), 0.0).astype(np.float32), {"ema_std": ema}


ADVANTAGE_NORMALIZERS: dict[str, Callable[..., tuple[np.ndarray, dict]]] = {
    "batch": batch_normalizer,
    "ema": ema_normalizer,
}
