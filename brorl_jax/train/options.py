"""Opt-in training options that are NOT in the BroRL paper (docs/options.md; paper_notes.md §5).

The BroRL write-ups describe extras the paper does not contain. The ones that make sense are
offered here, every one off by default, so a config without them runs the paper's recipe bit for
bit (the loop's default code path does not call anything below except the two identity hooks
`Options.rollout_temperature` and `Options.update_temperature`):

  temperature schedule   rollout.temperature_schedule = "0:1.3,100:0.9,200:0.7"
  adaptive N             rollout.adaptive_n, adaptive_n_buckets, adaptive_n_thresholds,
                         adaptive_n_ema_decay: N per prompt from its EMA pass rate, in buckets
  over-generate/select   rollout.overgenerate_factor, rollout.select_rule
  reward clipping        algo.reward_clip_low / algo.reward_clip_high (defaults -inf / +inf)
  EMA normalisation      algo.advantage_normalizer = "ema", algo.advantage_ema_decay
  (Lion, warm-up + cosine, top-k/top-p and the entropy bonus live in the optimizer, sampler and
  loss; see docs/options.md.)

Everything here is host-side numpy and small pure functions, plus `Options`, which holds the
options' state (per-prompt pass rates, the EMA of the advantage std) and the generation-round
code used when adaptive N, over-generation, reward clipping or EMA normalisation is on
(`Options.collect`). That path builds groups of varying size and packs them into the SAME fixed
update batch of prompts_per_step * rollouts_per_prompt rows (padding rows masked), so the compiled
update never changes shape; rollout programs are compiled once per (N bucket, power-of-two prompt
count, prompt-length bucket) and then reused.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import numpy as np

SELECT_RULES = ("dedup_then_balanced", "dedup", "balanced")
ADVANTAGE_NORMALIZERS = ("batch", "ema")


# ------------------------------------------------------------------------------------------------
# Parsing (used by brorl_jax.config.validate: errors name the config key)
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
# Adaptive N: a per-prompt pass-rate estimate picks the prompt's bucket
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


@dataclasses.dataclass
class PassRateTracker:
    """EMA of each prompt's pass rate (#correct / #generated per visit), keyed by the loader's
    prompt index. rate <- decay * rate + (1 - decay) * observed; the first visit sets it."""
    decay: float = 0.5
    rates: dict[int, float] = dataclasses.field(default_factory=dict)

    def get(self, index: int) -> float | None:
        return self.rates.get(int(index))

    def update(self, index: int, observed: float) -> None:
        i = int(index)
        old = self.rates.get(i)
        self.rates[i] = float(observed) if old is None else \
            self.decay * old + (1.0 - self.decay) * float(observed)

    def state_dict(self) -> dict:
        """JSON-able copy (string keys; floats round-trip exactly through JSON)."""
        return {str(k): v for k, v in self.rates.items()}

    def load_state_dict(self, state: dict) -> None:
        self.rates = {int(k): float(v) for k, v in state.items()}


def group_by_n(ns: Sequence[int]) -> list[tuple[int, list[int]]]:
    """[(N, positions with that N)] in ascending N: one generate call per bucket."""
    out: dict[int, list[int]] = {}
    for pos, n in enumerate(ns):
        out.setdefault(int(n), []).append(pos)
    return sorted(out.items())


# ------------------------------------------------------------------------------------------------
# Over-generate then select
# ------------------------------------------------------------------------------------------------
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
# Rewards and advantages on groups of varying size
# ------------------------------------------------------------------------------------------------
def clip_rewards(rewards: np.ndarray, low: float, high: float) -> np.ndarray:
    """Rewards clipped to [low, high] (float32); the input itself when the range is (-inf, inf)."""
    if low == -math.inf and high == math.inf:
        return rewards
    return np.clip(np.asarray(rewards, np.float32), low, high).astype(np.float32)


def pad_groups(values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-group rewards -> (rewards [G, N_max] float64 zero-padded, sample_mask bool)."""
    g = len(values)
    n_max = max((len(v) for v in values), default=1)
    r = np.zeros((g, n_max), np.float64)
    mask = np.zeros((g, n_max), bool)
    for i, v in enumerate(values):
        r[i, :len(v)] = v
        mask[i, :len(v)] = True
    return r, mask


def _group_centered(rewards: np.ndarray, mask: np.ndarray) -> np.ndarray:
    counts = np.maximum(mask.sum(1, keepdims=True), 1)
    mean = np.where(mask, rewards, 0.0).sum(1, keepdims=True) / counts
    return np.where(mask, rewards - mean, 0.0)


def masked_advantages(name: str, rewards: np.ndarray, sample_mask: np.ndarray, *,
                      eps: float = 1e-6) -> np.ndarray:
    """The algo.ADVANTAGES estimators on groups of different sizes N_g (adaptive N).
    rewards [G, N_max], sample_mask [G, N_max] (True on the N_g real samples of group g) ->
    advantages float32 [G, N_max], 0 where masked. With every mask True this equals
    algo.compute_advantages(name, rewards) (float64 here, so equal to ~1e-6):
      reinforce_pp_baseline: R - mean_g(R), whitened over every real sample of the batch;
      grpo: (R - mean_g) / (std_g (ddof=1) + eps); rloo: N_g / (N_g - 1) (R - mean_g)."""
    r = np.asarray(rewards, np.float64)
    mask = np.asarray(sample_mask, bool)
    n_g = mask.sum(1, keepdims=True)
    if np.any((n_g == 1)):
        raise ValueError("every group needs >= 2 samples for a group baseline; got a group of 1")
    a = _group_centered(r, mask)
    if name == "reinforce_pp_baseline":
        total = max(mask.sum(), 1)
        mean = a[mask].sum() / total
        std = math.sqrt(((a - mean) ** 2)[mask].sum() / total)
        out = (a - mean) / (std + eps)
    elif name == "grpo":
        var = (a ** 2).sum(1, keepdims=True) / np.maximum(n_g - 1, 1)
        out = a / (np.sqrt(var) + eps)
    elif name == "rloo":
        out = a * n_g / np.maximum(n_g - 1, 1)
    else:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: "
                         "('reinforce_pp_baseline', 'grpo', 'rloo')")
    return np.where(mask, out, 0.0).astype(np.float32)


@dataclasses.dataclass
class EMAStdNormalizer:
    """algo.advantage_normalizer = "ema" (not in the paper; the paper whitens per batch):
    A = R - mean_group(R), divided by an EMA of the batch std of A instead of this batch's std.

      std_t = std over the real samples of the batch of A (population std, as the batch whitening)
      ema_t = std_1 at the first batch, then decay * ema_{t-1} + (1 - decay) * std_t
      A_norm = A / (ema_t + eps)
    (A has exact batch mean 0 because every group is centred, so only the scale differs from
    REINFORCE++-baseline; decay = 0 gives it back.) A batch with no real sample leaves ema as is."""
    decay: float = 0.99
    eps: float = 1e-6
    ema_std: float | None = None

    def __call__(self, rewards: np.ndarray, sample_mask: np.ndarray) -> np.ndarray:
        """rewards [G, N_max], sample_mask [G, N_max] -> advantages float32 [G, N_max]."""
        r = np.asarray(rewards, np.float64)
        mask = np.asarray(sample_mask, bool)
        a = _group_centered(r, mask)
        if not mask.any():
            return np.zeros(r.shape, np.float32)
        std = float(np.sqrt(np.mean(a[mask] ** 2)))
        self.ema_std = std if self.ema_std is None else \
            self.decay * self.ema_std + (1.0 - self.decay) * std
        return np.where(mask, a / (self.ema_std + self.eps), 0.0).astype(np.float32)

    def state_dict(self) -> dict:
        return {"ema_std": self.ema_std}

    def load_state_dict(self, state: dict) -> None:
        self.ema_std = state.get("ema_std")


# ------------------------------------------------------------------------------------------------
# Dynamic sampling over groups of varying N, packed into a fixed row budget
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Group:
    """One prompt's kept rollouts (n of them): tokens/logprobs/mask [n, S], lengths/rewards/
    shaped [n] (shaped = the reward that enters the advantage), prompt_ids the prompt tokens."""
    prompt_ids: list[int]
    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    shaped: np.ndarray

    @property
    def n(self) -> int:
        return len(self.rewards)


@dataclasses.dataclass
class RaggedGroupSampler:
    """Dynamic sampling (keep groups with 0 < #correct < N_g) whose kept groups are packed, whole
    and in arrival order, into a fixed budget of `row_budget` rows (prompts_per_step *
    rollouts_per_prompt). A group that does not fit the space left is dropped (like veRL's
    surplus groups). The batch is full once less room is left than the largest possible group
    (`max_group_rows`): the remaining < max_group_rows rows are padding (masked). At the round
    cap, cap_policy "error" raises DynamicSamplingError, "pad" pads the rest."""
    row_budget: int
    max_group_rows: int
    max_generation_rounds: int = 8
    cap_policy: str = "error"
    correct_threshold: float = 1.0
    enabled: bool = True
    rounds: int = 0
    generated_groups: int = 0
    passed_groups: int = 0
    rows_used: int = 0
    groups: list = dataclasses.field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.row_budget - self.rows_used < self.max_group_rows

    def _cap_message(self) -> str:
        return (f"dynamic sampling (adaptive N / over-generation) filled {self.rows_used} of "
                f"{self.row_budget} rows with {len(self.groups)} groups after {self.rounds} "
                f"rounds ({self.passed_groups} of {self.generated_groups} groups mixed); raise "
                "algo.max_generation_rounds or algo.generation_batch_multiplier, or set "
                "algo.dynamic_sampling_cap_policy='pad' to train on a partly masked batch")

    def need_more(self) -> bool:
        if self.full:
            return False
        if self.rounds >= self.max_generation_rounds:
            if self.cap_policy == "error":
                from brorl_jax.algo import DynamicSamplingError
                raise DynamicSamplingError(self._cap_message())
            return False
        return True

    def add_round(self, groups: Sequence[Group]) -> np.ndarray:
        """Records one generation round; returns the mixed mask [len(groups)] (the filter)."""
        self.rounds += 1
        mixed = np.zeros(len(groups), bool)
        for i, grp in enumerate(groups):
            n_correct = int(np.sum(grp.rewards >= self.correct_threshold))
            mixed[i] = (0 < n_correct < grp.n) if self.enabled else True
            self.generated_groups += 1
            if not mixed[i]:
                continue
            self.passed_groups += 1
            if self.rows_used + grp.n <= self.row_budget:
                self.groups.append(grp)
                self.rows_used += grp.n
        return mixed

    def stats(self) -> dict:
        return {"pass_rate": self.passed_groups / max(self.generated_groups, 1),
                "generation_rounds": float(self.rounds), "kept_groups": float(len(self.groups)),
                "padded_rows": float(self.row_budget - self.rows_used)}


def assemble_ragged_batch(groups: Sequence[Group], advantages: Sequence[np.ndarray], *,
                          rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """The update batch (docs/INTERFACES.md "algo") from groups of varying size: each group's
    rows as algo.assemble_update_batch builds them, concatenated, then padding rows (pad tokens,
    loss_mask False, advantage 0) up to exactly `rows`. advantages[g]: [n_g] float32."""
    from brorl_jax.algo import assemble_update_batch
    parts = [assemble_update_batch([grp.prompt_ids], grp.tokens[None], grp.logprobs[None],
                                   grp.mask[None], np.asarray(adv, np.float32)[None],
                                   seq_len=seq_len, pad_id=pad_id, pack=False)
             for grp, adv in zip(groups, advantages)]
    used = sum(p["advantages"].shape[0] for p in parts)
    if used > rows:
        raise ValueError(f"groups hold {used} rows, more than the batch's {rows}")
    pad = rows - used
    filler = {
        "input_tokens": np.full((pad, seq_len), pad_id, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (pad, seq_len)).copy(),
        "loss_mask": np.zeros((pad, seq_len), bool),
        "targets": np.full((pad, seq_len), pad_id, np.int32),
        "old_logprobs": np.zeros((pad, seq_len), np.float32),
        "ref_logprobs": np.zeros((pad, seq_len), np.float32),
        "advantages": np.zeros((pad,), np.float32),
    }
    return {k: np.concatenate([p[k] for p in parts] + [filler[k]], axis=0) for k in filler}


def ragged_rollout_monitoring(groups: Sequence[Group]) -> dict:
    """monitoring.rollout_monitoring over groups of varying size (group-averaged diversities,
    reward entropy over all samples)."""
    from brorl_jax.train.monitoring import ngram_diversity, path_diversity, reward_entropy
    path = [path_diversity(g.tokens[None], g.lengths[None])[0] for g in groups]
    ngram = [ngram_diversity(g.tokens[None], g.lengths[None], 3)[0] for g in groups]
    return {"monitor/path_diversity": float(np.mean(path)),
            "monitor/ngram3_diversity": float(np.mean(ngram)),
            "monitor/reward_entropy": reward_entropy(np.concatenate([g.rewards for g in groups]))}


# ------------------------------------------------------------------------------------------------
# Learning-rate schedule in RL steps (for logging)
# ------------------------------------------------------------------------------------------------
def scheduled_lr(optimizer_cfg, optimizer_steps: int) -> float:
    """The optimizer's learning rate after `optimizer_steps` updates (algo.optimizer schedule)."""
    from brorl_jax.algo.optimizer import learning_rate_schedule
    return float(learning_rate_schedule(optimizer_cfg)(optimizer_steps))


# ------------------------------------------------------------------------------------------------
# The options of one run
# ------------------------------------------------------------------------------------------------
class Options:
    """The run's opt-in options (all off by default) and their state.

    Loop hooks: rollout_temperature(step), update_temperature(step), custom_collect /
    collect(...), state_dict() / load_state_dict() (checkpoint meta "options")."""

    def __init__(self, cfg):
        r, a = cfg.rollout, cfg.algo
        self.cfg = cfg
        self.schedule = parse_temperature_schedule(r.temperature_schedule)
        self.adaptive_n = bool(r.adaptive_n)
        self.buckets, self.thresholds = parse_adaptive_n(r.adaptive_n_buckets,
                                                         r.adaptive_n_thresholds)
        self.overgenerate_factor = float(r.overgenerate_factor)
        self.select_rule = r.select_rule
        self.clip = (float(a.reward_clip_low), float(a.reward_clip_high))
        self.tracker = PassRateTracker(decay=float(r.adaptive_n_ema_decay))
        self.ema = (EMAStdNormalizer(decay=float(a.advantage_ema_decay))
                    if a.advantage_normalizer == "ema" else None)

    # -- what is on ------------------------------------------------------------------------------
    @property
    def clipping(self) -> bool:
        return self.clip != (-math.inf, math.inf)

    @property
    def custom_collect(self) -> bool:
        """True when the generation rounds need Options.collect (groups built per prompt)."""
        return (self.adaptive_n or self.overgenerate_factor > 1.0 or self.clipping
                or self.ema is not None)

    @property
    def stateful(self) -> bool:
        return self.adaptive_n or self.ema is not None

    # -- temperature schedule --------------------------------------------------------------------
    def rollout_temperature(self, step: int) -> float:
        """Sampling temperature of RL step `step`: rollout.temperature without a schedule."""
        return temperature_at(self.schedule, step, self.cfg.rollout.temperature)

    def update_temperature(self, step: int) -> float | None:
        """The temperature the update must use at `step` when it differs from the one compiled
        by default (log-probs are of logits / T, T = the sampling temperature); None otherwise."""
        if not self.schedule:
            return None
        t = self.rollout_temperature(step)
        default = self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0
        return None if t == default else t

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-able state for the checkpoint meta ({} when no option keeps state)."""
        out = {}
        if self.adaptive_n:
            out["pass_rates"] = self.tracker.state_dict()
        if self.ema is not None:
            out["advantage_ema"] = self.ema.state_dict()
        return out

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        if self.adaptive_n:
            self.tracker.load_state_dict(state.get("pass_rates", {}))
        if self.ema is not None:
            self.ema.load_state_dict(state.get("advantage_ema", {}))

    # -- generation rounds -----------------------------------------------------------------------
    def rollouts_for(self, index: int) -> int:
        """N for the prompt with loader index `index`."""
        if not self.adaptive_n:
            return int(self.cfg.rollout.rollouts_per_prompt)
        return choose_rollouts(self.tracker.get(index), self.buckets, self.thresholds)

    @property
    def max_group_rows(self) -> int:
        return max(self.buckets) if self.adaptive_n else int(self.cfg.rollout.rollouts_per_prompt)

    def collect(self, trainer, params, data_iter, step: int,
                round_seed: Callable[[int, int, int], int]) -> tuple[dict, dict]:
        """Trainer.collect with the options: per round, prompts are grouped by their N (one
        generate call per bucket), ceil(factor * N) candidates are generated and scored, N kept
        by rollout.select_rule, the pass-rate tracker updated, rewards shaped (length penalty,
        clipping), groups filtered and packed (RaggedGroupSampler); then advantages (masked, or
        EMA-normalised) and the fixed-shape update batch. Returns (batch, metrics) like
        Trainer.collect, plus adaptive_n/*, monitor/n_mean, monitor/selection_* metrics."""
        from brorl_jax import algo
        cfg, acfg = self.cfg, trainer.algo_cfg
        row_budget = cfg.algo.prompts_per_step * cfg.rollout.rollouts_per_prompt
        sampler = RaggedGroupSampler(
            row_budget=row_budget, max_group_rows=self.max_group_rows,
            max_generation_rounds=cfg.algo.max_generation_rounds,
            cap_policy=cfg.algo.dynamic_sampling_cap_policy,
            correct_threshold=cfg.algo.correct_threshold, enabled=cfg.algo.dynamic_sampling)
        temperature = self.rollout_temperature(step)
        thr = cfg.algo.correct_threshold
        t_roll = t_score = 0.0
        gen_tokens = gen_samples = 0
        rewards_all, lengths_all, truncated_all, selected_all, n_chosen = [], [], [], [], []
        cand_total = kept_total = unique_total = dup_kept = clipped = shaped_total = 0
        while sampler.need_more():
            batch = next(data_iter)
            seed = round_seed(cfg.train.seed, step, sampler.rounds)
            ns = [self.rollouts_for(i) for i in batch["index"]]
            n_chosen += ns
            groups: list[Group | None] = [None] * len(ns)
            for b, (n, positions) in enumerate(group_by_n(ns)):
                m = num_candidates(n, self.overgenerate_factor)
                t0 = time.perf_counter()
                res = trainer.generate(
                    params, [batch["prompt_ids"][p] for p in positions], n=m,
                    temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    seed=(seed + b * 1_000_000_007) % (2**31 - 1))
                t1 = time.perf_counter()
                rewards = trainer.score([batch["records"][p] for p in positions], res.tokens,
                                        res.lengths)
                t_roll += t1 - t0
                t_score += time.perf_counter() - t1
                gen_tokens += int(res.lengths.sum())
                gen_samples += res.lengths.size
                rewards_all.append(rewards.ravel())
                lengths_all.append(res.lengths.ravel())
                truncated_all.append(res.truncated.ravel())
                keep = np.broadcast_to(np.arange(n), (len(positions), n))
                if m > n:
                    rows = []
                    for j, p in enumerate(positions):
                        rng = np.random.default_rng(
                            [cfg.train.seed, step, sampler.rounds, int(p)])
                        idx, info = select_rollouts(res.tokens[j], res.lengths[j], rewards[j],
                                                    n, self.select_rule, rng, thr)
                        rows.append(idx)
                        unique_total += info["unique"]
                        dup_kept += info["duplicates_kept"]
                    keep = np.stack(rows)
                cand_total += m * len(positions)
                kept_total += n * len(positions)
                take = lambda x: np.take_along_axis(x, keep[..., None] if x.ndim == 3 else keep,
                                                    axis=1)
                tok, lp, msk = take(res.tokens), take(res.logprobs), take(res.mask)
                lens, rew = take(res.lengths), take(rewards)
                shaped = rew
                if acfg.length_penalty:
                    shaped = algo.apply_length_penalty(rew, lens, step=step,
                                                       max_length=cfg.rollout.max_new_tokens,
                                                       cfg=acfg)
                if self.clipping:
                    clipped_now = clip_rewards(shaped, *self.clip)
                    clipped += int(np.sum(clipped_now != np.asarray(shaped, np.float32)))
                    shaped_total += clipped_now.size
                    shaped = clipped_now
                for j, p in enumerate(positions):
                    if self.adaptive_n:
                        # every candidate counts: the estimate of the prompt's difficulty
                        self.tracker.update(batch["index"][p], float(np.mean(rewards[j] >= thr)))
                    groups[p] = Group(prompt_ids=list(batch["prompt_ids"][p]), tokens=tok[j],
                                      logprobs=lp[j], mask=msk[j], lengths=lens[j],
                                      rewards=rew[j], shaped=np.asarray(shaped[j], np.float32))
            selected_all += groups
            sampler.add_round(groups)
        kept = sampler.groups
        if kept:
            shaped_pad, smask = pad_groups([g.shaped for g in kept])
            if self.ema is not None:
                adv = self.ema(shaped_pad, smask)
            else:
                adv = masked_advantages(acfg.advantage_estimator, shaped_pad, smask,
                                        eps=acfg.advantage_eps)
            advantages = [adv[i, :g.n] for i, g in enumerate(kept)]
        else:
            advantages = []
        update_batch = assemble_ragged_batch(kept, advantages, rows=row_budget,
                                             seq_len=trainer.seq_len, pad_id=trainer.pad_id)
        from brorl_jax.train.monitoring import step_rollout_stats
        ds = sampler.stats()
        stats = step_rollout_stats(
            rewards_all, lengths_all, truncated_all, correct_threshold=thr,
            pass_rate=ds["pass_rate"], rounds=ds["generation_rounds"],
            kept_groups=ds["kept_groups"],
            # in units of nominal groups (rollouts_per_prompt rows), as the default path reports
            padded_groups=ds["padded_rows"] / cfg.rollout.rollouts_per_prompt,
            update_batch=update_batch, t_rollout=t_roll, t_scoring=t_score,
            generated_samples=gen_samples, generated_tokens=gen_tokens)
        stats["rollout/temperature"] = temperature
        stats.update(ragged_rollout_monitoring(selected_all))
        if self.adaptive_n:
            ns_arr = np.asarray(n_chosen)
            stats["monitor/n_mean"] = float(ns_arr.mean())
            for n in self.buckets:
                stats[f"adaptive_n/prompts_n{n}"] = int(np.sum(ns_arr == n))
            stats["adaptive_n/batch_rows_used"] = int(sampler.rows_used)
            stats["adaptive_n/padded_rows"] = int(ds["padded_rows"])
            stats["adaptive_n/tracked_prompts"] = len(self.tracker.rates)
        if self.overgenerate_factor > 1.0:
            stats["monitor/selection_kept_frac"] = kept_total / cand_total
            stats["monitor/selection_unique_frac"] = unique_total / cand_total
            stats["monitor/selection_duplicates_kept_frac"] = dup_kept / kept_total
        if self.clipping:
            stats["reward/clipped_frac"] = clipped / max(shaped_total, 1)
        if self.ema is not None:
            stats["advantage/ema_std"] = float(self.ema.ema_std) if self.ema.ema_std else 0.0
        if cfg.train.mass_balance_diagnostics:
            from brorl_jax.theory import group_reward_balance, reward_balance_metrics
            stats.update(reward_balance_metrics(group_reward_balance(
                np.stack([g.rewards for g in selected_all]), None, correct_threshold=thr)))
        return update_batch, stats
