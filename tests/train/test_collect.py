"""The one RL step (brorl_jax/train/step.py rl_step, its collect in train/collect.py and
algo/host.py): with every option off it is the paper's recipe step by step; with options on
it changes what they say, compiles no more once its shapes are warm, and its CollectState
survives a checkpoint (exact resume)."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax import algo
from brorl_jax.config import make_config, optimizer_config, update_config
from brorl_jax.rewards.health import VerifierHealth
from brorl_jax.rollout import bucket_num_prompts
from brorl_jax.train import collect
from brorl_jax.train.collect import round_seed
from brorl_jax.train.context import Scored, update_config_at
from brorl_jax.train.loop import Trainer
from brorl_jax.train.step import rl_step
from configs import tiny

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`


def fake_score(records, tokens, lengths):
    """Deterministic rewards [G, N]: prompts with an even answer are easy (3/4 of the samples
    correct), odd ones hard (1/10, at least one), so groups are mixed and buckets differ."""
    g, n = lengths.shape
    out = np.zeros((g, n), np.float32)
    for i, rec in enumerate(records):
        frac = 0.75 if int(rec["ground_truth"]) % 2 == 0 else 0.1
        out[i, :max(1, round(frac * n))] = 1.0
    return out


class FakeScorer:
    """The context's Scorer with fake_score's rewards (the real one is closed with it): each run
    of consecutive samples of the same record is one group."""

    def __init__(self, real=None, delay=0.0):
        self.real, self.delay, self.calls = real, delay, []

    def score(self, records, tokens, lengths):
        import time
        self.calls.append((time.perf_counter(), len(records)))
        time.sleep(self.delay)
        out, start = [], 0
        for i in range(1, len(records) + 1):
            if i == len(records) or records[i] is not records[start]:
                out.append(fake_score([records[start]], tokens[None, start:i],
                                      lengths[None, start:i])[0])
                start = i
        return Scored(np.concatenate(out), VerifierHealth())

    def close(self):
        if self.real is not None:
            self.real.close()


def fake_trainer(cfg, workdir) -> Trainer:
    trainer = Trainer(cfg, str(workdir))
    trainer.ctx.scorer = FakeScorer(trainer.ctx.scorer)
    return trainer


def assert_batches_equal(got: algo.UpdateBatch, want: algo.UpdateBatch):
    """The same fields present, every array equal."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def spy_update(ctx, batches: list):
    """Records every update batch (host numpy) the step hands the runtime."""
    real = ctx.runtime.update

    def update(acfg, state, batch, rng):
        batches.append(batch)
        return real(acfg, state, batch, rng)
    ctx.runtime.update = update


def test_options_off_is_the_paper_recipe_by_hand(tmp_path):
    """The collect's batch equals the recipe written out: one round of generation, scoring,
    0 < #correct < N, REINFORCE++-baseline over the kept groups' tokens, assemble_update_batch. Option
    keys set explicitly to their off values change nothing."""
    cfg = tiny.get_config()
    cfg.algo.kl_coef = 0.0
    off = cfg.copy_and_resolve_references()
    off.rollout.temperature_schedule, off.rollout.adaptive_n = "", False
    off.rollout.overgenerate_factor = 1.0
    off.algo.reward_clip_low, off.algo.reward_clip_high = -math.inf, math.inf
    off.algo.advantage_normalizer = "batch"
    assert update_config(off) == update_config(cfg) and optimizer_config(off) == optimizer_config(cfg)
    assert make_config(off) == make_config(cfg)
    trainer = fake_trainer(cfg, tmp_path / "a")
    ctx = trainer.ctx
    batches = []
    spy_update(ctx, batches)
    try:
        state = ctx.new_train_state(jax.tree.map(jnp.copy, ctx.model.params))  # update donates
        _, cstate, stats = rl_step(ctx, state, algo.CollectState(), iter(trainer.loader), 0)
        (batch,) = batches
        # by hand
        prompts = next(iter(trainer.loader))
        res = ctx.runtime.generate(ctx.model, ctx.model.params, prompts.prompt_ids,
                                   rollouts_per_prompt=cfg.rollout.rollouts_per_prompt,
                                   max_new_tokens=cfg.rollout.max_new_tokens,
                                   temperature=cfg.rollout.temperature,
                                   seed=round_seed(cfg.train.seed, 0, 0), eos_ids=ctx.eos_ids)
        rewards = fake_score(prompts.records, res.tokens, res.lengths)
    finally:
        trainer.close()
    assert cstate.to_json() == {}                     # the paper's recipe keeps no state
    kept = np.flatnonzero(algo.select_groups(rewards))[:cfg.algo.prompts_per_step]
    assert len(kept) == cfg.algo.prompts_per_step and stats["dynamic_sampling/rounds"] == 1
    adv = algo.compute_advantages("reinforce_pp_baseline", rewards[kept],
                                  lengths=res.lengths[kept])     # token-weighted, as veRL
    want = algo.assemble_update_batch(
        [list(prompts.prompt_ids[i]) for i in kept], res.tokens[kept], res.logprobs[kept],
        res.mask[kept], adv, seq_len=ctx.seq_len, pad_id=ctx.pad_id,
        mini_batches=cfg.algo.ppo_mini_batches)                       # packed, the default
    assert_batches_equal(batch, want)
    assert stats["dynamic_sampling/kept_groups"] == len(kept)
    assert stats["dynamic_sampling/padded_groups"] == 0


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
    c.algo.micro_batch_tokens = 24 + 8       # one packed row per micro-batch: grad_var defined
    c.eval.num_prompts, c.eval.samples_per_prompt = 2, 2
    c.train.steps = steps
    return c


def test_scheduled_temperature_changes_the_update_config_per_phase():
    c = tiny.get_config()
    c.rollout.temperature_schedule = "0:1.3,2:0.9,4:1.0"
    sched = algo.policies.parse_temperature_schedule(c.rollout.temperature_schedule)
    base = update_config(c)
    at = lambda s: update_config_at(base, algo.policies.temperature_at(sched, s, 1.0))
    temps = [at(s).temperature for s in range(6)]
    assert temps == [1.3, 1.3, 0.9, 0.9, 1.0, 1.0]
    assert at(4) is base                                     # 1.0 = the default config
    # one compiled pair per distinct config: the runtime keys its programs by UpdateConfig
    assert len({at(s) for s in range(6)}) == 3
    assert update_config_at(base, 0.0) is base              # greedy rollouts: plain softmax


@pytest.fixture(scope="module")
def options_trainer(tmp_path_factory):
    trainer = fake_trainer(_options_config(), tmp_path_factory.mktemp("options"))
    yield trainer
    trainer.close()


def _compiles():
    counter = [0]

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            counter[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listen)
    return counter, listen


def test_adaptive_n_does_not_recompile_once_buckets_are_warm(options_trainer):
    """Steps whose rollout shapes (N bucket x power-of-two prompt count x the slot buckets its
    tail drained through) were all seen before compile nothing: not the rollout, not the update
    (fixed row budget), not the advantages."""
    trainer = options_trainer
    ctx = trainer.ctx
    assert ctx.scorer.real.service.verifiers == ["reasoning_gym"]   # what the tiny data needs
    shapes_seen, rollouts, batches = set(), [], []
    real_rollouts = ctx.rollouts

    def rollouts_spy(params, prompt_ids, *, n, sampling, **kw):
        out = real_rollouts(params, prompt_ids, n=n, sampling=sampling, **kw)
        rollouts.append((bucket_num_prompts(len(prompt_ids)), n, sampling.temperature, out))
        return out

    ctx.rollouts = rollouts_spy
    spy_update(ctx, batches)
    counter, listener = _compiles()
    state = ctx.new_train_state(jax.tree.map(jnp.copy, ctx.model.params))  # update donates
    cstate = algo.CollectState()
    data_iter = iter(trainer.loader)
    warm_steps, warm_mixed, n_values, batch_shapes = 0, 0, set(), set()
    try:
        for step in range(8):
            rollouts.clear()
            before = counter[0]
            state, cstate, stats = rl_step(ctx, state, cstate, data_iter, step)
            batch = batches[-1]
            # each rollout's shapes, with every slot bucket it decoded at (stats after the end)
            calls = [(g, n, t, slots) for g, n, t, out in rollouts
                     for slots in {c[0] for c in out.stats["decode_calls"]}]
            jax.block_until_ready(state.params)
            compiled = counter[0] - before
            shape = tuple((jax.tree_util.keystr(p), v.shape)
                          for p, v in jax.tree_util.tree_leaves_with_path(batch))
            new = (set(calls) | {shape}) - shapes_seen
            shapes_seen |= set(calls) | {shape}
            batch_shapes.add(shape)
            n_values |= {n for n in (4, 8, 12) if stats.get(f"adaptive_n/prompts_n{n}", 0)}
            assert {c[1] for c in calls} <= {6, 12, 18}        # ceil(1.5 * N) candidates
            assert {c[2] for c in calls} == {0.8}              # the scheduled temperature
            if step > 0 and not new:     # rollout buckets and packed row bucket all seen
                assert compiled == 0, f"step {step} recompiled {compiled}x with warm buckets"
                warm_steps += 1
                warm_mixed += len({c[1] for c in calls}) >= 2     # several buckets in one step
            assert 4 <= stats["monitor/n_mean"] <= 12
            assert stats["monitor/selection_kept_frac"] == pytest.approx(2 / 3)
            assert np.isfinite(stats["update/grad_var"])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        del ctx.rollouts
    assert warm_steps >= 2 and warm_mixed >= 1 and n_values >= {4, 12}
    # packed rows of width prompt + response, their count in a few buckets
    assert len(batch_shapes) <= 3
    assert all(dict(sh)[".input_tokens"][1] == 24 + 8 for sh in batch_shapes)


def test_options_run_end_to_end_and_resume_exactly(tmp_path):
    """Trainer.run with every option on logs the options' metrics; a run stopped after step 1
    and resumed gives the same final parameters and policy state (pass rates, advantage EMA) as
    an uninterrupted one: the state travels in the checkpoint meta."""
    from brorl_jax.workdir.checkpoint import Checkpointer
    from brorl_jax.workdir.logger import read_metrics

    def run(steps, workdir):
        # two prompts, both in every step: step 2 picks N from step 1's pass rates
        trainer = fake_trainer(_options_config(steps, train_size=2), workdir)
        try:
            result = trainer.run()
        finally:
            trainer.close()
        return trainer, result

    whole, result = run(2, tmp_path / "whole")
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
    saved = result.collect_state.to_json()
    assert saved["pass_rates"] and saved["advantage_normalizer"]["ema_std"] > 0
    ckpt = Checkpointer(os.path.join(whole.workdir, "checkpoints"))
    try:
        _, meta = ckpt.restore(2, result.state)
    finally:
        ckpt.close()
    assert meta["collect_per_process"] == [json.loads(json.dumps(saved))]

    run(1, tmp_path / "resumed")
    resumed, resumed_result = run(2, tmp_path / "resumed")
    assert resumed_result.collect_state.to_json() == saved
    assert resumed_result.collect_state == result.collect_state
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(result.state.params),
                            jax.tree_util.tree_leaves(resumed_result.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


def test_groups_are_scored_while_decoding_goes_on(tmp_path):
    """Each group is scored as soon as the rollout streams it out: with a slow verifier (0.1 s a
    group) and a rollout made as slow (0.1 s of decoding before each group) the collect's wall
    time is clearly below rollout + scoring, the first scoring call starts before decoding has
    ended, the wait metrics and the rollout's stats are logged, and the batch is the one a fast
    verifier and rollout give (streaming changes when groups are scored, not what they are)."""
    import time

    cfg = tiny.get_config()
    cfg.algo.kl_coef = 0.0
    cfg.algo.generation_batch_multiplier = 8.0     # 16 prompts per round, 6 slots: groups
    cfg.rollout.memory_budget_gb = 0.0005          # finish one after another
    trainer = fake_trainer(cfg, tmp_path / "s")
    ctx = trainer.ctx
    streams = []
    real_rollouts = ctx.rollouts

    def rollouts_spy(*a, **kw):
        streams.append(real_rollouts(*a, **kw))
        return streams[-1]

    def collect_only(step=0):   # rl_step up to the update batch (the update is not timed here)
        got, state = collect.collect(ctx, ctx.model.params, algo.CollectState(),
                                             iter(trainer.loader), step)
        advs, state = collect.advantages(ctx, state, got.kept)
        return (collect.update_batch(ctx, got.kept, advs),
                collect.collect_metrics(ctx, got, state, advs, step))
    try:
        fast, fast_stats = collect_only()
        engine = ctx.runtime.rollout_engine(ctx.model.config)
        real_run = engine._run

        def slow_run(*a, **kw):         # the device loop, 0.1 s slower before each group
            for item in real_run(*a, **kw):
                if not isinstance(item, dict):
                    time.sleep(0.1)
                yield item
        engine._run = slow_run
        slow = FakeScorer(delay=0.1)
        real_scorer, ctx.scorer, ctx.rollouts = ctx.scorer, slow, rollouts_spy
        t0 = time.perf_counter()
        batch, stats = collect_only()
        wall = time.perf_counter() - t0
        ctx.rollouts = real_rollouts
        # four groups scored at once, their verdicts ending out of order: the same batch
        ctx.cfg = ctx.cfg.replace("rewards", groups_in_flight=4)
        jittery = FakeScorer(delay=0.1)
        jitter = iter(np.random.default_rng(3).uniform(0.0, 0.1, 64))
        spans, real_score = [], jittery.score

        def jittery_score(*a):
            t = time.perf_counter()
            time.sleep(next(jitter))
            out = real_score(*a)
            spans.append((t, time.perf_counter()))
            return out
        jittery.score = jittery_score
        ctx.scorer = jittery
        batch4, _ = collect_only()
        ctx.scorer = real_scorer
    finally:
        trainer.close()
    assert_batches_equal(batch4, fast)
    assert len(spans) == 16
    spans.sort()           # some call started before the one before it ended: they overlapped
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans
    calls = slow.calls
    # one call per group (its N samples), as it arrives
    assert [n for _, n in calls] == [cfg.rollout.rollouts_per_prompt] * 16
    (st,) = streams
    assert calls[0][0] < st.finished_at, "scoring waited for the whole rollout"
    assert stats["time/rollout_s"] >= 1.6 and stats["time/scoring_s"] >= 1.6
    assert wall < 0.8 * (stats["time/rollout_s"] + stats["time/scoring_s"]), (wall, stats)
    assert stats["time/rollout_s"] == pytest.approx(st.finished_at - st.started_at)
    assert stats["time/scoring_waited_for_rollout_s"] == pytest.approx(st.wait_seconds)
    assert 0 <= stats["time/scoring_waited_for_rollout_s"] < stats["time/rollout_s"]
    assert 0 <= stats["time/rollout_idle_for_scoring_s"] < stats["time/scoring_s"]
    # the rollout's own stats, summed over the step's calls
    assert stats["rollout/useful_tokens"] == st.stats["useful_tokens"] > 0
    assert "perf/generated_tokens" not in stats          # it always equalled useful_tokens
    assert stats["rollout/decode_steps"] == st.stats["decode_steps"] > 0
    assert stats["rollout/refills"] == st.stats["refills"] > 0
    assert stats["rollout/compactions"] == st.stats["compactions"]
    assert 0 < stats["rollout/occupancy"] <= 1
    assert_batches_equal(batch, fast)


def test_knapsack_round_probes_then_shares_out_the_round(tmp_path):
    """rollout.knapsack: a round's first call is the probe (n = probe, every prompt once), its
    second the chunks (n = chunk, each prompt as often as algo.policies.knapsack_allocation
    gives it chunks from the probe's verdicts); a group is its prompt's probe then its chunks,
    in order; the round spends its prompts x N samples, and every sample is scored once (the
    probe's verdicts are not asked again)."""
    from brorl_jax.algo import policies as pol
    cfg = tiny.get_config()
    cfg.algo.kl_coef, cfg.sft.steps = 0.0, 0
    cfg.algo.generation_batch_multiplier = 2.0                    # 4 prompts a round
    cfg.rollout.knapsack = True
    cfg.rollout.knapsack_probe, cfg.rollout.knapsack_chunk, cfg.rollout.knapsack_max_n = 4, 2, 16
    trainer = fake_trainer(cfg, tmp_path)
    ctx, calls = trainer.ctx, []
    real = ctx.rollouts

    class Spy:
        """A rollout stream that keeps the groups it hands out."""

        def __init__(self, st, groups):
            self._st, self._groups = st, groups

        def __enter__(self):
            self._st.__enter__()
            return self

        def __exit__(self, *exc):
            return self._st.__exit__(*exc)

        def __iter__(self):
            return self

        def __next__(self):
            gr = next(self._st)
            self._groups[gr.prompt_index] = gr
            return gr

        def __getattr__(self, name):
            return getattr(self._st, name)

    def rollouts(params, prompt_ids, **kw):       # every call's prompts, N and groups
        calls.append((prompt_ids, kw["n"], {}))
        return Spy(real(params, prompt_ids, **kw), calls[-1][2])
    ctx.rollouts = rollouts
    try:
        params = ctx.runtime.rollout_params(ctx.model.params)
        got, _ = collect.collect(ctx, params, algo.CollectState(), iter(trainer.loader), 0)
        scored_rows = sum(n for _, n in ctx.scorer.calls)
    finally:
        trainer.close()
    (probe_ids, n_probe, probes), (chunk_ids, n_chunk, chunks) = calls[:2]
    assert (n_probe, n_chunk) == (4, 2) and len(probe_ids) == 4
    right = [int(fake_score([rec], probes[p].tokens[None], probes[p].lengths[None]).sum())
             for p, rec in enumerate(next(iter(trainer.loader)).records)]
    totals = pol.knapsack_allocation(right, probe=4, budget=4 * 8, chunk=2, max_n=16)
    assert got.n_chosen[:4] == totals and len(set(totals)) > 1
    owners = [p for p, t in enumerate(totals) for _ in range((t - 4) // 2)]
    assert chunk_ids == [probe_ids[p] for p in owners]
    for p, group in enumerate(got.every[:4]):
        mine = [probes[p]] + [chunks[c] for c, o in enumerate(owners) if o == p]
        np.testing.assert_array_equal(group.tokens, np.concatenate([g.tokens for g in mine]))
    assert got.generated_samples == got.sampler.rounds * 4 * 8 == scored_rows
