"""The host-side algorithm of a step (brorl_jax/algo/host.py): pure functions over an explicit
CollectState whose JSON form (the checkpoint's) round-trips exactly, and the split of the algo
settings between the update's jit key (UpdateConfig) and what only the collect reads."""
import dataclasses
import json

import numpy as np
import pytest

from brorl_jax.algo import host, policies
from brorl_jax.config import UpdateConfig, default_config, make_config, update_config


def test_collect_keys_leave_the_updates_jit_key_alone():
    """The update's static argument (UpdateConfig, RunConfig.update) holds only settings the
    update reads: a key only the collect reads compiles no update again."""
    upd = {f.name for f in dataclasses.fields(UpdateConfig)}
    keys = set(default_config().algo)
    assert upd - {"temperature", "remat"} <= keys          # algo.<same name>, key for key
    base = default_config()
    changed = {"dynamic_sampling": False, "correct_threshold": 0.5, "advantage": "grpo",
               "max_generation_rounds": 3, "generation_batch_multiplier": 1.75,
               "reward_clip_high": 0.9, "length_penalty": True, "pack_sequences": False,
               "advantage_ema_decay": 0.5, "dynamic_sampling_cap_policy": "pad",
               "prompts_per_step": 64, "stream_rounds": True}
    assert not set(changed) & upd
    for key, value in changed.items():
        cfg = base.copy_and_resolve_references()
        cfg.algo[key] = value
        assert update_config(cfg) == update_config(base), key      # same compiled update
        assert make_config(cfg) != make_config(base), key
    cfg = base.copy_and_resolve_references()
    cfg.rollout.overgenerate_factor, cfg.rollout.adaptive_n = 2.0, True
    assert update_config(cfg) == update_config(base)
    assert make_config(cfg).rollout.overgenerate_factor == 2.0
    cfg = base.copy_and_resolve_references()
    cfg.algo.kl_coef = 0.5                                   # an update key does change it
    assert update_config(cfg) != update_config(base)


def test_collect_state_json_round_trip_and_the_checkpoint_format():
    assert host.CollectState().to_json() == {}         # the paper's recipe: nothing to save
    state = host.CollectState(pass_rates={3: 1 / 3, 7: 0.1 + 0.2},
                              advantage_normalizer={"ema_std": 0.123456789012345})
    saved = json.loads(json.dumps(state.to_json()))
    assert saved == {"pass_rates": {"3": 1 / 3, "7": 0.1 + 0.2},
                     "advantage_normalizer": {"ema_std": 0.123456789012345}}
    assert host.CollectState.from_json(saved) == state  # exact: floats round-trip through JSON
    # earlier checkpoints' forms (FixedN: {}; AdaptiveN before a visit: empty rates) load
    assert host.CollectState.from_json({}) == host.CollectState()
    assert host.CollectState.from_json({"pass_rates": {}}) == host.CollectState()
    assert host.CollectState.from_json(None) == host.CollectState()


def test_observe_is_adaptive_n_and_pure():
    cfg = make_config(rollouts_per_prompt=8, prompts_per_step=2, adaptive_n=True,
                         adaptive_n_buckets="4,8,12", adaptive_n_thresholds="0.6,0.3",
                         adaptive_n_ema_decay=0.75)
    s0 = host.CollectState()
    assert host.samples_per_prompt(cfg, s0, [1, 2]) == [8, 8]     # unseen: the middle bucket
    s1 = host.observe(cfg, s0, [(7, 1.0), (7, 0.0), (3, 1 / 3)])
    assert s0.pass_rates == {}                                     # the input is not changed
    ref = policies.AdaptiveN((4, 8, 12), (0.6, 0.3), decay=0.75)
    for i, r in [(7, 1.0), (7, 0.0), (3, 1 / 3)]:
        ref.observe(i, r)
    assert s1.pass_rates == ref.rates
    assert host.samples_per_prompt(cfg, s1, [7, 3, 5]) == [4, 8, 8]
    assert host.max_group_rows(cfg) == 12
    fixed = make_config(rollouts_per_prompt=8, prompts_per_step=2)
    assert host.observe(fixed, s0, [(7, 1.0)]) is s0              # a fixed N keeps no rates
    assert host.samples_per_prompt(fixed, s1, [7, 3]) == [8, 8]


def _candidates(m, s=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, s + 1, m)
    mask = np.arange(s) < lengths[:, None]
    class C:        # what a rollout.GroupResult carries
        tokens = np.where(mask, rng.integers(1, 50, (m, s)), 0)
        logprobs = np.where(mask, -rng.random((m, s)), 0.0)
    C.mask, C.lengths = mask, lengths
    return C


def test_make_group_selects_shapes_and_counts():
    cfg = make_config(rollouts_per_prompt=4, prompts_per_step=2, overgenerate_factor=1.5,
                         reward_clip_low=0.0, reward_clip_high=0.5, max_new_tokens=8)
    m = host.num_candidates(cfg, 4)
    assert m == 6
    cands = _candidates(m)
    rewards = np.array([1, 0, 1, 0, 0, 1], np.float32)
    group, info = host.make_group(cfg, cands, rewards, n=4, prompt_ids=[9, 9], index=11, step=0,
                                  round_=0, position=1)
    assert (info.candidates, info.kept, info.pass_rate) == (6, 4, 0.5)
    assert group.n == 4 and group.index == 11 and group.prompt_ids == [9, 9]
    assert info.clipped == int(np.sum(group.rewards > 0.5)) and info.clip_checked == 4
    np.testing.assert_array_equal(group.shaped, np.minimum(group.rewards, 0.5))
    # the same seeds pick the same candidates: a resumed step repeats the selection
    again, _ = host.make_group(cfg, cands, rewards, n=4, prompt_ids=[9, 9], index=11, step=0,
                               round_=0, position=1)
    np.testing.assert_array_equal(group.tokens, again.tokens)
    # options off: every candidate kept as is, nothing clipped
    off = make_config(rollouts_per_prompt=4, prompts_per_step=2)
    g, i = host.make_group(off, _candidates(4), rewards[:4], n=4, prompt_ids=[1], index=0,
                           step=0, round_=0, position=0)
    assert (i.candidates, i.unique, i.clip_checked) == (4, 0, 0)
    np.testing.assert_array_equal(g.shaped, rewards[:4])


def test_advantages_ema_state_is_returned_not_kept():
    cfg = make_config(advantage_normalizer="ema", advantage_ema_decay=0.5)
    shaped = [np.array([1.0, 0.0, 0.0, 0.0]), np.array([1.0, 1.0, 0.0])]
    lengths = [np.ones(4), np.ones(3)]
    s0 = host.CollectState()
    adv, s1 = host.advantages(cfg, s0, shaped, lengths)
    assert s0.advantage_normalizer == {} and s1.advantage_normalizer["ema_std"] > 0
    want, st = policies.ema_normalizer("reinforce_pp_baseline",
                                       *policies.pad_groups([s.astype(np.float32)
                                                             for s in shaped]),
                                       {}, eps=cfg.algo.advantage_eps, whiten_eps=cfg.algo.whiten_eps,
                                       decay=0.5)
    np.testing.assert_array_equal(np.concatenate(adv), want[policies.pad_groups(shaped)[1]])
    assert st == s1.advantage_normalizer
    _, s2 = host.advantages(cfg, s1, shaped, lengths)
    assert s2.advantage_normalizer["ema_std"] == pytest.approx(s1.advantage_normalizer["ema_std"])
    assert host.advantages(cfg, s1, [], []) == ([], s1)


def test_stream_admission_oversupplies_by_the_pass_rate_and_runs_one_step_ahead_with_k():
    """algo.host.prompts_to_feed: k = 0 keeps ceil(needed / pass rate) prompts in flight; k >=
    1 one step's groups more; never more than the pool nor past the step's cap; nothing once
    the step is full. groups_needed counts whole groups; is_stale is the bound k."""
    k0 = make_config(rollouts_per_prompt=8, prompts_per_step=4, generation_batch_multiplier=2.0)
    k1 = make_config(rollouts_per_prompt=8, prompts_per_step=4, generation_batch_multiplier=2.0,
                     stream_rounds=True, max_staleness=1)
    feed = lambda cfg, **kw: host.prompts_to_feed(cfg, **{**dict(
        needed=4, step_groups=4, in_flight=0, fed=0, cap=80, pool=100, pass_rate=0.4), **kw})
    assert feed(k0) == 10 and feed(k1) == 20                # ceil(4 / 0.4), ceil(8 / 0.4)
    assert feed(k0, in_flight=7) == 3 and feed(k0, in_flight=12) == 0
    assert feed(k0, pool=6) == 6 and feed(k0, fed=78) == 2 and feed(k0, needed=0) == 0
    assert feed(k0, pass_rate=0.0) == 80                    # nothing kept yet: up to the cap
    assert host.groups_needed(k0, 32, 8) == 4 and host.groups_needed(k0, 7, 8) == 0
    assert host.groups_needed(k0, 15, 8) == 1
    s0 = host.CollectState()
    assert host.stream_pass_rate(k0, s0) == 0.5             # 1 / generation_batch_multiplier
    s1 = host.stream_counts_after(host.stream_counts_after(s0, 2, 5), 1, 5)
    assert s1.stream_counts == (3, 10) and host.stream_pass_rate(k0, s1) == 0.3
    assert host.CollectState.from_json(json.loads(json.dumps(s1.to_json()))) == s1
    assert not host.is_stale(k1, 3, 4) and host.is_stale(k1, 2, 4) and host.is_stale(k0, 3, 4)
    assert not host.is_stale(k0, 4, 4)
