"""Opt-in options that are not in the paper (brorl_jax/train/options.py, docs/options.md): each
changes behaviour as documented and is off by default; adaptive N does not recompile once its
buckets are warm; the options' state survives a checkpoint. The gradient-variance estimate is
checked against brute force in tests/algo/test_update.py
(test_grad_var_matches_brute_force_micro_batch_gradients)."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from brorl_jax import algo
from brorl_jax.config import ConfigError, default_config, validate
from brorl_jax.rollout import bucket_num_prompts
from brorl_jax.train import options as opt
from brorl_jax.train.loop import Trainer, _round_seed, algo_config, optimizer_config
from configs import tiny


# ------------------------------------------------------------------------------------------------
# Off by default
# ------------------------------------------------------------------------------------------------
def test_every_option_is_off_by_default():
    c = default_config()
    assert c.rollout.temperature_schedule == "" and c.rollout.adaptive_n is False
    assert c.rollout.overgenerate_factor == 1.0
    assert (c.rollout.top_k, c.rollout.top_p) == (0, 1.0)
    assert (c.algo.reward_clip_low, c.algo.reward_clip_high) == (-math.inf, math.inf)
    assert c.algo.advantage_normalizer == "batch" and c.algo.entropy_coef == 0.0
    assert (c.optim.name, c.optim.schedule) == ("adamw", "constant")
    o = opt.Options(c)
    assert not o.custom_collect and not o.stateful and o.state_dict() == {}
    assert all(o.update_temperature(s) is None for s in (0, 10, 10_000))
    assert all(o.rollout_temperature(s) == c.rollout.temperature for s in (0, 10_000))
    r = np.array([[3.0, -5.0]], np.float32)
    assert opt.clip_rewards(r, -math.inf, math.inf) is r


@pytest.mark.parametrize("key,value,pattern", [
    ("rollout.temperature_schedule", "0:1.3,x", r"'rollout.temperature_schedule'.*step:temp"),
    ("rollout.temperature_schedule", "10:1.3,5:0.9", r"steps must increase strictly"),
    ("rollout.temperature_schedule", "0:0", r"temperature > 0"),
    ("rollout.adaptive_n_buckets", "512,256", r"'rollout.adaptive_n_buckets'.*increasing"),
    ("rollout.adaptive_n_thresholds", "0.7", r"one value fewer"),
    ("rollout.adaptive_n_thresholds", "0.3,0.7", r"strictly decreasing"),
    ("rollout.overgenerate_factor", 0.5, r"'rollout.overgenerate_factor' must be >= 1.0"),
    ("rollout.select_rule", "best", r"'rollout.select_rule' is 'best'; allowed"),
    ("algo.reward_clip_high", -math.inf, r"'algo.reward_clip_low' < 'algo.reward_clip_high'"),
    ("algo.advantage_ema_decay", 1.0, r"'algo.advantage_ema_decay' must be in \[0, 1\)"),
    ("optim.final_lr_ratio", 1.5, r"'optim.final_lr_ratio' must be in \[0, 1\]"),
])
def test_bad_option_values_are_named(key, value, pattern):
    c = default_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_option_combinations_are_checked():
    c = default_config()
    c.rollout.adaptive_n = True
    c.algo.prompts_per_step, c.rollout.rollouts_per_prompt = 1, 512
    with pytest.raises(ConfigError, match=r"largest N \(768\) must fit .* 512 rows"):
        validate(c)
    c = default_config()
    c.algo.advantage_normalizer, c.algo.advantage = "ema", "grpo"
    with pytest.raises(ConfigError, match=r"'ema' replaces the batch whitening"):
        validate(c)


# ------------------------------------------------------------------------------------------------
# 1. Optimizer and schedule
# ------------------------------------------------------------------------------------------------
def _updates(cfg, steps=3):
    tx = algo.make_optimizer(optimizer_config(cfg, 0.1))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    out = []
    for i in range(steps):
        upd, state = tx.update({"w": jnp.array([0.5, -2.0, 1e-3]) * (i + 1)}, state, params)
        out.append(np.asarray(upd["w"]))
    return out


def test_default_optimizer_is_constant_adamw_bit_for_bit():
    c = default_config()
    c.optim.grad_clip, c.optim.weight_decay = 0.0, 0.01
    ref = optax.adamw(0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    params = {"w": jnp.ones(3)}
    state = ref.init(params)
    for i, got in enumerate(_updates(c)):
        want, state = ref.update({"w": jnp.array([0.5, -2.0, 1e-3]) * (i + 1)}, state, params)
        np.testing.assert_array_equal(got, np.asarray(want["w"]))


def test_lion_and_warmup_cosine_change_the_updates():
    c = default_config()
    c.optim.grad_clip, c.optim.weight_decay = 0.0, 0.0
    adamw = _updates(c)
    c.optim.name = "lion"
    lion = _updates(c)
    # Lion's update is lr * sign(...): every coordinate has magnitude exactly lr
    np.testing.assert_allclose(np.abs(lion[0]), 0.1, rtol=1e-6)
    assert not np.allclose(np.abs(adamw[1]), 0.1, rtol=1e-3)

    # warm-up and decay count RL steps; optax counts updates (ppo_mini_batches per RL step)
    c = default_config()
    c.optim.schedule, c.optim.warmup_steps, c.optim.final_lr_ratio = "warmup_cosine", 2, 0.1
    c.train.steps, c.algo.ppo_mini_batches = 10, 4
    ocfg = optimizer_config(c, 1.0)
    assert opt.scheduled_lr(ocfg, 0) == 0.0
    assert opt.scheduled_lr(ocfg, 2 * 4) == pytest.approx(1.0)          # peak after 2 RL steps
    assert opt.scheduled_lr(ocfg, 10 * 4) == pytest.approx(0.1)         # final ratio at the end
    assert 0.1 < opt.scheduled_lr(ocfg, 6 * 4) < 1.0


# ------------------------------------------------------------------------------------------------
# 2. Exploration: temperature schedule (top-k / top-p / entropy bonus pass through)
# ------------------------------------------------------------------------------------------------
def test_temperature_schedule_phases_and_update_temperature():
    sched = opt.parse_temperature_schedule("0:1.3, 100:0.9,200:0.7")
    assert sched == ((0, 1.3), (100, 0.9), (200, 0.7))
    got = [opt.temperature_at(sched, s, 1.0) for s in (0, 99, 100, 199, 200, 10_000)]
    assert got == [1.3, 1.3, 0.9, 0.9, 0.7, 0.7]
    assert opt.temperature_at(((50, 0.5),), 10, 1.2) == 1.2     # before the first entry
    c = default_config()
    c.rollout.temperature_schedule = "5:0.7"
    o = opt.Options(c)
    assert o.update_temperature(4) is None and o.update_temperature(5) == 0.7


def test_update_compiles_one_pair_per_scheduled_temperature(monkeypatch):
    """Trainer.update_fns: the default pair without a schedule; with one, one cached (update,
    log-prob) pair per distinct temperature, whose AlgoConfig.temperature is that temperature."""
    made = []

    def spy(mcfg, acfg, optimizer=None, **kw):
        made.append(acfg.temperature)
        return lambda *args: acfg.temperature

    monkeypatch.setattr(algo, "make_update_step", spy)
    monkeypatch.setattr(algo, "make_logprob_fn", lambda mcfg, acfg, **kw: spy(mcfg, acfg))
    trainer = Trainer.__new__(Trainer)            # only the attributes update_fns reads
    c = default_config()
    c.rollout.temperature_schedule = "0:1.3,2:0.9,4:1.0"
    trainer.cfg, trainer.n = c, c.rollout.rollouts_per_prompt
    trainer.options, trainer.algo_cfg = opt.Options(c), algo_config(c)
    trainer.mcfg, trainer.optimizer, trainer._fns_by_temperature = None, optax.sgd(1.0), {}
    trainer.update_fn, trainer.logprob_fn = "default_update", "default_logprob"
    pairs = [trainer.update_fns(s) for s in range(6)]
    assert pairs[0] is pairs[1] and pairs[2] is pairs[3] and pairs[0] is not pairs[2]
    assert pairs[4] == ("default_update", "default_logprob")   # 1.0 = the compiled default
    assert made == [1.3, 1.3, 0.9, 0.9]               # (update, log-prob) per temperature


def test_entropy_bonus_changes_the_loss_and_is_off_by_default():
    assert algo_config(default_config()).entropy_coef == 0.0
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.random((2, 5)), jnp.float32)
    ent = jnp.asarray(rng.random((2, 5)) + 0.5, jnp.float32)
    mask = jnp.ones((2, 5), bool)
    kw = dict(old_logp=logp, rollout_logp=logp, ref_logp=None, advantages=jnp.array([1.0, -1.0]),
              loss_mask=mask, agg_weights=jnp.full((2, 5), 0.1))
    c = default_config()
    base, sums = algo.policy_loss(logp, ent, cfg=algo_config(c), **kw)
    c.algo.entropy_coef = 0.02
    bonus, _ = algo.policy_loss(logp, ent, cfg=algo_config(c), **kw)
    assert float(bonus) == pytest.approx(float(base) - 0.02 * float(sums["entropy_loss"]))


# ------------------------------------------------------------------------------------------------
# 3. Adaptive N: bucket choice and the pass-rate tracker
# ------------------------------------------------------------------------------------------------
def test_choose_rollouts_by_pass_rate_and_unseen_prompts_get_the_middle_bucket():
    b, t = opt.parse_adaptive_n("256,512,768", "0.7,0.3")
    assert opt.choose_rollouts(None, b, t) == 512
    assert [opt.choose_rollouts(p, b, t) for p in (1.0, 0.7, 0.69, 0.3, 0.29, 0.0)] == \
        [256, 256, 512, 512, 768, 768]
    assert opt.group_by_n([8, 4, 8, 12]) == [(4, [1]), (8, [0, 2]), (12, [3])]


def test_pass_rate_tracker_ema_and_json_round_trip():
    tr = opt.PassRateTracker(decay=0.75)
    tr.update(7, 1.0)
    tr.update(7, 0.0)
    tr.update(3, 1 / 3)
    assert tr.get(7) == pytest.approx(0.75) and tr.get(3) == 1 / 3 and tr.get(5) is None
    back = opt.PassRateTracker(decay=0.75)
    back.load_state_dict(json.loads(json.dumps(tr.state_dict())))
    assert back.rates == tr.rates                   # exact: floats round-trip through JSON


# ------------------------------------------------------------------------------------------------
# 4. Over-generate then select
# ------------------------------------------------------------------------------------------------
def _cands():
    # 8 candidates of length 3: rows 0/1/2 are equal, 3/4 are equal; 0, 1, 2, 5 are correct
    toks = np.array([[1, 2, 3]] * 3 + [[4, 5, 6]] * 2 + [[7, 7, 7], [8, 8, 8], [9, 9, 9]])
    return toks, np.full(8, 3), np.array([1, 1, 1, 0, 0, 1, 0, 0], np.float32)


def test_select_dedup_drops_exact_duplicates_first():
    toks, lens, rew = _cands()
    idx, info = opt.select_rollouts(toks, lens, rew, 5, "dedup", np.random.default_rng(0))
    assert info["unique"] == 5 and info["duplicates_kept"] == 0
    assert len({toks[i].tobytes() for i in idx}) == 5
    idx, info = opt.select_rollouts(toks, lens, rew, 7, "dedup", np.random.default_rng(0))
    assert len(idx) == 7 and len(set(idx)) == 7 and info["duplicates_kept"] == 2


def test_select_balanced_and_dedup_then_balanced():
    toks, lens, rew = _cands()
    for seed in range(5):
        idx, _ = opt.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(seed))
        assert rew[idx].sum() == 2 and len(set(idx)) == 4
        idx, _ = opt.select_rollouts(toks, lens, rew, 4, "dedup_then_balanced",
                                     np.random.default_rng(seed))
        assert rew[idx].sum() == 2 and len({toks[i].tobytes() for i in idx}) == 4
    # a group with one correct candidate keeps it (balance as far as availability allows)
    rew1 = np.array([0, 0, 0, 0, 0, 1, 0, 0], np.float32)
    idx, _ = opt.select_rollouts(toks, lens, rew1, 4, "balanced", np.random.default_rng(1))
    assert 5 in idx
    # deterministic given the seed
    a, _ = opt.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(3))
    b, _ = opt.select_rollouts(toks, lens, rew, 4, "balanced", np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    assert opt.num_candidates(512, 1.0) == 512 and opt.num_candidates(4, 1.5) == 6


# ------------------------------------------------------------------------------------------------
# 5. Reward clipping, masked advantages, EMA normalisation
# ------------------------------------------------------------------------------------------------
def test_reward_clipping():
    r = np.array([[-3.0, 0.5, 4.0]], np.float32)
    np.testing.assert_array_equal(opt.clip_rewards(r, -2.0, 2.0), [[-2.0, 0.5, 2.0]])


@pytest.mark.parametrize("name", ["reinforce_pp_baseline", "grpo", "rloo"])
def test_masked_advantages_equal_the_registry_on_full_groups(name):
    r = np.random.default_rng(1).integers(0, 2, (5, 6)).astype(np.float32)
    got = opt.masked_advantages(name, r, np.ones(r.shape, bool))
    np.testing.assert_allclose(got, np.asarray(algo.compute_advantages(name, r)), atol=2e-5)


def test_masked_advantages_on_ragged_groups_match_brute_force():
    groups = [np.array([1.0, 0, 0, 1]), np.array([1.0, 0, 0, 0, 0, 0, 1, 1]), np.array([0.0, 1])]
    r, mask = opt.pad_groups(groups)
    centered = [g - g.mean() for g in groups]
    flat = np.concatenate(centered)
    want = [c / (flat.std() + 1e-6) for c in centered]          # population std, batch mean 0
    got = opt.masked_advantages("reinforce_pp_baseline", r, mask)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[i, :len(w)], w, rtol=1e-5)
        assert np.all(got[i, len(w):] == 0)
    got = opt.masked_advantages("rloo", r, mask)
    for i, g in enumerate(groups):
        loo = [g[j] - np.delete(g, j).mean() for j in range(len(g))]
        np.testing.assert_allclose(got[i, :len(g)], loo, rtol=1e-5)
    got = opt.masked_advantages("grpo", r, mask)
    for i, g in enumerate(groups):
        np.testing.assert_allclose(got[i, :len(g)], (g - g.mean()) / (g.std(ddof=1) + 1e-6),
                                   rtol=1e-5)


def test_ema_normalizer_uses_the_running_std():
    r1 = np.array([[1.0, 0, 0, 0], [1, 1, 0, 1]])
    r2 = np.array([[1.0, 0, 1, 0], [0, 0, 0, 1]]) * 3.0
    full = np.ones(r1.shape, bool)
    # decay 0 = this batch's std: REINFORCE++-baseline
    np.testing.assert_allclose(opt.EMAStdNormalizer(decay=0.0)(r1, full),
                               algo.compute_advantages("reinforce_pp_baseline", r1), atol=1e-5)
    ema = opt.EMAStdNormalizer(decay=0.5)
    ema(r1, full)
    s1 = np.std(r1 - r1.mean(1, keepdims=True))
    s2 = np.std(r2 - r2.mean(1, keepdims=True))
    got = ema(r2, full)
    assert ema.ema_std == pytest.approx(0.5 * s1 + 0.5 * s2)
    np.testing.assert_allclose(got, (r2 - r2.mean(1, keepdims=True)) / (0.5 * s1 + 0.5 * s2 + 1e-6),
                               rtol=1e-5)
    # an empty batch leaves the state; the state round-trips
    ema(r2, np.zeros(r2.shape, bool))
    assert ema.ema_std == pytest.approx(0.5 * s1 + 0.5 * s2)
    other = opt.EMAStdNormalizer(decay=0.5)
    other.load_state_dict(json.loads(json.dumps(ema.state_dict())))
    assert other.ema_std == ema.ema_std


# ------------------------------------------------------------------------------------------------
# Packing groups of varying N into the fixed update batch
# ------------------------------------------------------------------------------------------------
def _group(n, n_correct, s=3, prompt=(5, 6)):
    rew = np.zeros(n, np.float32)
    rew[:n_correct] = 1.0
    tok = np.arange(n * s).reshape(n, s).astype(np.int32) % 40 + 1
    return opt.Group(prompt_ids=list(prompt), tokens=tok,
                     logprobs=np.full((n, s), -0.5, np.float32), mask=np.ones((n, s), bool),
                     lengths=np.full(n, s), rewards=rew, shaped=rew)


def test_ragged_sampler_filters_per_group_and_packs_the_row_budget():
    s = opt.RaggedGroupSampler(row_budget=16, max_group_rows=8, max_generation_rounds=3,
                               cap_policy="error")
    mixed = s.add_round([_group(4, 0), _group(8, 3), _group(4, 4), _group(8, 8)])
    assert mixed.tolist() == [False, True, False, False]        # 0 < #correct < N_g
    assert s.need_more() and s.rows_used == 8
    s.add_round([_group(8, 1), _group(4, 2)])                    # 8 fits, then 4 does not
    assert s.rows_used == 16 and not s.need_more() and len(s.groups) == 2
    s = opt.RaggedGroupSampler(row_budget=16, max_group_rows=8, max_generation_rounds=1,
                               cap_policy="error")
    s.add_round([_group(4, 1)])
    with pytest.raises(algo.DynamicSamplingError, match="dynamic_sampling_cap_policy='pad'"):
        s.need_more()
    s.cap_policy = "pad"
    assert not s.need_more() and s.stats()["padded_rows"] == 12


def test_ragged_batch_has_the_fixed_shape_with_masked_padding():
    groups = [_group(4, 1), _group(8, 3, prompt=(7,))]
    adv = [np.arange(4, dtype=np.float32) + 1, -np.arange(8, dtype=np.float32) - 1]
    batch = opt.assemble_ragged_batch(groups, adv, rows=16, seq_len=6, pad_id=0)
    assert all(v.shape[0] == 16 for v in batch.values())
    ref = algo.assemble_update_batch([[7]], groups[1].tokens[None], groups[1].logprobs[None],
                                     groups[1].mask[None], adv[1][None], seq_len=6, pad_id=0,
                                     pack=False)
    for k, v in ref.items():
        np.testing.assert_array_equal(batch[k][4:12], v)
    assert not batch["loss_mask"][12:].any() and np.all(batch["advantages"][12:] == 0)


# ------------------------------------------------------------------------------------------------
# End to end on the tiny demo model
# ------------------------------------------------------------------------------------------------
def fake_score(records, tokens, lengths):
    """Deterministic rewards [G, N]: prompts with an even answer are easy (3/4 of the samples
    correct), odd ones hard (1/10, at least one), so groups are mixed and buckets differ."""
    g, n = lengths.shape
    out = np.zeros((g, n), np.float32)
    for i, rec in enumerate(records):
        frac = 0.75 if int(rec["ground_truth"]) % 2 == 0 else 0.1
        out[i, :max(1, round(frac * n))] = 1.0
    return out


def _compiles():
    counter = [0]

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            counter[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listen)
    return counter, listen


def test_off_by_default_runs_the_paper_path_unchanged(tmp_path, monkeypatch):
    """A config with every option key at its off value gives the same batch as the unchanged
    tiny config, and neither runs any option code (Options.collect would raise). The forced
    options path, with everything off, rebuilds the same batch (advantages to float rounding)."""
    def forbidden(*a, **k):
        raise AssertionError("an option code path ran with every option off")

    cfg = tiny.get_config()
    cfg.algo.kl_coef = 0.0
    off = tiny.get_config()
    off.algo.kl_coef = 0.0
    off.rollout.temperature_schedule, off.rollout.adaptive_n = "", False
    off.rollout.overgenerate_factor = 1.0
    off.algo.reward_clip_low, off.algo.reward_clip_high = -math.inf, math.inf
    off.algo.advantage_normalizer = "batch"
    assert algo_config(off) == algo_config(cfg) and optimizer_config(off, 1.0) == \
        optimizer_config(cfg, 1.0)
    batches = []
    trainer = Trainer(cfg, str(tmp_path / "a"))
    try:
        trainer.score = fake_score
        with monkeypatch.context() as m:
            m.setattr(opt.Options, "collect", forbidden)
            m.setattr(opt, "select_rollouts", forbidden)
            m.setattr(opt, "masked_advantages", forbidden)
            for c in (cfg, off):
                trainer.cfg, trainer.options = c, opt.Options(c)
                batch, stats = trainer.collect(trainer.model.params, iter(trainer.loader), 0)
                batches.append(batch)
        assert stats["dynamic_sampling/kept_groups"] >= 2
        assert stats["dynamic_sampling/padded_groups"] == 0
        forced, _ = trainer.options.collect(trainer, trainer.model.params, iter(trainer.loader),
                                            0, _round_seed)
    finally:
        trainer.close()
    for k in batches[0]:
        np.testing.assert_array_equal(batches[0][k], batches[1][k], err_msg=k)
        if k == "advantages":
            np.testing.assert_allclose(forced[k], batches[0][k], atol=1e-5)
        else:
            np.testing.assert_array_equal(forced[k], batches[0][k], err_msg=k)


def _options_config(steps=2, train_size=10):
    c = tiny.get_config()
    c.data.train_size = train_size         # prompts come back, so their pass rates are known
    c.algo.generation_batch_multiplier = 1.0
    c.algo.kl_coef = 0.0
    c.algo.advantage_normalizer, c.algo.advantage_ema_decay = "ema", 0.5
    c.algo.reward_clip_low, c.algo.reward_clip_high = 0.0, 0.5
    c.rollout.adaptive_n = True
    c.rollout.adaptive_n_buckets, c.rollout.adaptive_n_thresholds = "4,8,12", "0.6,0.3"
    c.rollout.adaptive_n_ema_decay = 0.0
    c.rollout.overgenerate_factor = 1.5
    c.rollout.temperature_schedule = "0:0.8,1000:0.7"
    c.optim.name, c.optim.schedule, c.optim.warmup_steps = "lion", "warmup_cosine", 1
    c.sft.steps = 0
    c.eval.num_prompts, c.eval.samples_per_prompt = 2, 2
    c.train.steps = steps
    return c


@pytest.fixture(scope="module")
def options_trainer(tmp_path_factory):
    trainer = Trainer(_options_config(), str(tmp_path_factory.mktemp("options")))
    trainer.score = fake_score
    yield trainer
    trainer.close()


def test_adaptive_n_does_not_recompile_once_buckets_are_warm(options_trainer):
    """Steps whose rollout shapes (N bucket x power-of-two prompt count) were all seen before
    compile nothing: not the rollout, not the update (fixed row budget), not the advantages."""
    trainer = options_trainer
    shapes_seen, calls = set(), []
    real_generate = trainer.generate

    def generate(params, prompt_ids, *, n, **kw):
        calls.append((bucket_num_prompts(len(prompt_ids)), n, kw["temperature"]))
        return real_generate(params, prompt_ids, n=n, **kw)

    trainer.generate = generate
    counter, listener = _compiles()
    state = trainer.new_state(jax.tree.map(jnp.copy, trainer.model.params))  # update donates
    data_iter = iter(trainer.loader)
    warm_steps, warm_mixed, n_values, batch_shapes = 0, 0, set(), set()
    try:
        for step in range(8):
            calls.clear()
            before = counter[0]
            batch, stats = trainer.collect(state.params, data_iter, step)
            update_fn, _ = trainer.update_fns(step)
            state, m = update_fn(state, jax.tree.map(jnp.asarray, batch),
                                 jax.random.fold_in(jax.random.key(0), step))
            jax.block_until_ready(state.params)
            compiled = counter[0] - before
            new = set(calls) - shapes_seen
            shapes_seen |= set(calls)
            batch_shapes.add(tuple(v.shape for v in batch.values()))
            n_values |= {n for n in (4, 8, 12) if stats.get(f"adaptive_n/prompts_n{n}", 0)}
            assert {c[1] for c in calls} <= {6, 12, 18}        # ceil(1.5 * N) candidates
            assert {c[2] for c in calls} == {0.8}              # the scheduled temperature
            if step > 0 and not new:
                assert compiled == 0, f"step {step} recompiled {compiled}x with warm buckets"
                warm_steps += 1
                warm_mixed += len({c[1] for c in calls}) >= 2     # several buckets in one step
            assert 4 <= stats["monitor/n_mean"] <= 12
            assert stats["monitor/selection_kept_frac"] == pytest.approx(2 / 3)
            assert np.isfinite(float(m["grad_var"]))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        trainer.generate = real_generate
    assert warm_steps >= 2 and warm_mixed >= 1 and n_values >= {4, 12}
    assert len(batch_shapes) == 1 and next(iter(batch_shapes))[0] == (16, 24 + 8)


def test_options_run_end_to_end_and_resume_exactly(tmp_path):
    """Trainer.run with every option on logs the options' metrics; a run stopped after step 1
    and resumed gives the same final parameters and option state (pass rates, advantage EMA) as
    an uninterrupted one: the state travels in the checkpoint meta."""
    from brorl_jax.train.checkpoint import Checkpointer
    from brorl_jax.train.logger import read_metrics

    def run(steps, workdir):
        # two prompts, both in every step: step 2 picks N from step 1's pass rates
        trainer = Trainer(_options_config(steps, train_size=2), str(workdir))
        trainer.score = fake_score
        try:
            trainer.run()
        finally:
            trainer.close()
        return trainer

    whole = run(2, tmp_path / "whole")
    records = read_metrics(os.path.join(whole.workdir, "metrics.jsonl"))
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        for key in ("monitor/n_mean", "adaptive_n/prompts_n8", "monitor/selection_kept_frac",
                    "monitor/selection_unique_frac", "reward/clipped_frac", "advantage/ema_std",
                    "monitor/effective_update_ratio", "monitor/path_diversity",
                    "monitor/ngram3_diversity", "monitor/reward_entropy", "update/grad_var"):
            assert key in r, key
        assert r["rollout/temperature"] == 0.8 and r["reward/clipped_frac"] > 0
    assert steps[0]["adaptive_n/prompts_n8"] == 2                          # unseen: middle
    assert (steps[1]["adaptive_n/prompts_n4"], steps[1]["adaptive_n/prompts_n12"]) == (1, 1)
    # linear warm-up from 0 over 1 RL step, then cosine decay (to 0.1 x lr at train.steps)
    assert steps[0]["optim/lr"] == 0.0
    assert steps[1]["optim/lr"] == pytest.approx(whole.lr)
    saved = whole.options.state_dict()
    assert saved["pass_rates"] and saved["advantage_ema"]["ema_std"] > 0
    ckpt = Checkpointer(os.path.join(whole.workdir, "checkpoints"))
    try:
        _, meta = ckpt.restore(2, whole.state)
    finally:
        ckpt.close()
    assert meta["options"] == json.loads(json.dumps(saved))

    run(1, tmp_path / "resumed")
    resumed = run(2, tmp_path / "resumed")
    assert resumed.options.state_dict() == saved
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(whole.state.params),
                            jax.tree_util.tree_leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
