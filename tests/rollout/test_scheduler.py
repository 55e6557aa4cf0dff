"""The rollout scheduler: continuous batching (refills, tail compaction) gives the samples of the lock
step and of the naive path for every slot budget; it compiles only its slot buckets; it streams
every group exactly once, before the call ends; per-call statistics."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from rollout_testutil import EOS, PROMPTS, prompt_rng, tiny_model

from brorl_jax.rollout import Engine, generate_naive, plan_slots, rollout_bytes
from brorl_jax.rollout.plan import slot_buckets, stop_table

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

N, S = 6, 12
STOPS = [EOS] + list(range(4, 128, 4))        # 32 stop ids: mixed lengths, some truncated
P_BUCKET = 32                                 # bucket of the longest prompt in PROMPTS (21)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engines(model):
    return {"continuous": Engine(model.config), "lockstep": Engine(model.config, schedule="lockstep")}


def _budget(model, slots):
    return None if slots is None else rollout_bytes(model.config, len(PROMPTS), P_BUCKET, N, S,
                                                    slots)


def _check_same(got, want, what):
    np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=what)
    np.testing.assert_array_equal(got.finished, want.finished, err_msg=what)
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=what)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-4, err_msg=what)


SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9, seed=7)
GREEDY = dict(temperature=0.0, seed=0)


@pytest.mark.parametrize("setting,budgets", [
    (SAMPLED, {"continuous": (len(PROMPTS), None), "lockstep": (8,)}),
    (GREEDY, {"continuous": (8,), "lockstep": (len(PROMPTS),)}),
], ids=["sampled", "greedy"])
def test_continuous_equals_lockstep_equals_naive(model, engines, setting, budgets):
    """Budgets from one slot per prompt (4) through 8 to every sample in a slot (24), over the
    two schedules and both settings; mixed lengths."""
    kw = dict(rollouts_per_prompt=N, max_new_tokens=S, eos_ids=STOPS, **setting)
    naive = generate_naive(model, PROMPTS, **kw)
    assert naive.lengths.min() < naive.lengths.max()                  # mixed lengths
    if setting["temperature"] > 0:
        assert naive.lengths.min() == 1 and naive.truncated.any() and naive.finished.any()
    else:       # greedy: every sample of a prompt is the same
        assert np.all(naive.tokens == naive.tokens[:, :1])
    for schedule, slot_counts in budgets.items():
        for slots in slot_counts:
            r = engines[schedule].generate(model.params, PROMPTS,
                                           memory_budget_bytes=_budget(model, slots), **kw)
            assert r.stats["num_slots"] == (len(PROMPTS) * N if slots is None else slots)
            _check_same(r, naive, f"{schedule} with {slots} slots")
            if slots is not None and slots < len(PROMPTS) * N:
                assert r.stats["refills"] > 0


def test_refills_and_compactions_compile_only_the_slot_buckets(model):
    """8 prompts x 16 samples through 64 slots: many refills, then the tail is compacted through
    the buckets; the engine compiles one decode program per bucket at most, and a second call
    with other prompts compiles nothing beyond the bucket set."""
    engine = Engine(model.config)
    n, s = 16, 10
    prompts = prompt_rng(3, [4, 7, 2, 8, 5, 3, 6, 1])
    budget = rollout_bytes(model.config, len(prompts), 8, n, s, 64)
    plan = plan_slots(model.config, len(prompts), 8, n, s, budget)
    assert plan.slots == 64 and plan.buckets == slot_buckets(64) == (64, 56, 48, 40, 32, 28, 24,
                                                                    20, 16, 14, 12, 10, 8)
    kw = dict(rollouts_per_prompt=n, max_new_tokens=s, eos_ids=STOPS, temperature=1.0, seed=1,
              memory_budget_bytes=budget)
    r = engine.generate(model.params, prompts, **kw)
    # samples stopping at token 0 never take a slot; every other one after the first 64 refills
    assert r.stats["refills"] == r.stats["assigned"] - 64 > 20
    assert 1 <= r.stats["compactions"] <= len(plan.buckets) - 1
    compiled = engine.num_compiled()
    assert compiled["decode"] <= len(plan.buckets)
    assert compiled["compact"] <= len(plan.buckets) - 1
    assert compiled["admit"] <= 2
    r2 = engine.generate(model.params, prompt_rng(4, [1, 8, 3, 3, 2, 5, 7, 4]),
                         **dict(kw, seed=2))
    # another call may drain through other buckets, never beyond the set
    again = engine.num_compiled()
    assert again["decode"] <= len(plan.buckets) and again["compact"] <= len(plan.buckets) - 1
    assert {k: v for k, v in again.items() if k not in ("decode", "compact")} == {
        k: v for k, v in compiled.items() if k not in ("decode", "compact")}
    assert not np.array_equal(r.tokens, r2.tokens)
    naive = generate_naive(model, prompts, **{k: v for k, v in kw.items()
                                              if k != "memory_budget_bytes"})
    _check_same(r, naive, "refills and compactions vs naive")


def test_stream_hands_out_every_group_once_before_the_call_ends(model, engines):
    """One prompt's worth of slots: prompts go through in turn and the first groups are handed
    out (decode_step) well before the last; every sample arrives exactly once, in complete
    groups equal to generate's."""
    engine = engines["continuous"]
    kw = dict(rollouts_per_prompt=N, max_new_tokens=S, eos_ids=STOPS, **SAMPLED,
              memory_budget_bytes=_budget(model, N))
    whole = engine.generate(model.params, PROMPTS, **kw)
    stream = engine.stream(model.params, PROMPTS, **kw)
    groups = list(stream)
    assert sorted(g.prompt_index for g in groups) == list(range(len(PROMPTS)))
    steps = [g.decode_step for g in groups]
    assert steps == sorted(steps) and steps[0] < steps[-1] == stream.stats["decode_steps"]
    for g in groups:
        assert g.tokens.shape == (N, S) and g.lengths.shape == (N,)
        np.testing.assert_array_equal(g.tokens, whole.tokens[g.prompt_index])
        np.testing.assert_array_equal(g.lengths, whole.lengths[g.prompt_index])
        np.testing.assert_allclose(g.logprobs, whole.logprobs[g.prompt_index], atol=1e-6)
        assert g.prompt_length == len(PROMPTS[g.prompt_index])
    assert [g.seconds for g in groups] == sorted(g.seconds for g in groups)


def test_stream_consumer_runs_while_decoding_goes_on(model, engines):
    """The background thread keeps decoding while the consumer holds a group: the next groups
    are complete (queued) before the consumer asks for them."""
    engine = engines["continuous"]
    kw = dict(rollouts_per_prompt=N, max_new_tokens=S, eos_ids=STOPS, **SAMPLED,
              memory_budget_bytes=_budget(model, N))
    stream = engine.stream(model.params, PROMPTS, **kw)
    first = next(stream)
    deadline = threading.Event()
    for _ in range(200):           # the consumer is busy with `first`; the thread goes on
        if stream._queue.qsize() >= len(PROMPTS) - 1:
            break
        deadline.wait(0.05)
    assert stream._queue.qsize() >= len(PROMPTS) - 1
    rest = list(stream)
    assert len(rest) == len(PROMPTS) - 1 and first.prompt_index not in {g.prompt_index for g in rest}
    # a drained stream ends at once, again and on close (the loop leaves a `with` block after
    # iterating it to the end: that once waited forever for a second end)
    closer = threading.Thread(target=lambda: (stream.close(), list(stream), stream.result()))
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "close() after the end blocked"
    assert stream.finished_at is not None and stream.finished_at >= stream.started_at


def test_stream_close_stops_early_and_result_assembles(model, engines):
    engine = engines["continuous"]
    kw = dict(rollouts_per_prompt=N, max_new_tokens=S, eos_ids=STOPS, **SAMPLED,
              memory_budget_bytes=_budget(model, N))
    with engine.stream(model.params, PROMPTS, **kw) as stream:
        next(stream)
    assert stream._thread.join(timeout=60) is None and not stream._thread.is_alive()
    full = engine.stream(model.params, PROMPTS, background=False, **kw).result()
    assert full.tokens.shape == (len(PROMPTS), N, S)


def test_stats_per_call(model, engines):
    r = engines["continuous"].generate(model.params, PROMPTS, rollouts_per_prompt=N,
                                       max_new_tokens=S, eos_ids=STOPS,
                                       memory_budget_bytes=_budget(model, len(PROMPTS)), **SAMPLED)
    st = r.stats
    assert st["useful_tokens"] == int(r.lengths.sum())
    assert st["num_slots"] == len(PROMPTS) and st["refills"] > 0
    assert 0 < st["occupancy"] <= 1 and 0 < st["mean_live_slots"] <= st["num_slots"]
    assert st["decode_steps"] >= r.lengths.max() - 1
    assert st["round_trips"] >= len(PROMPTS) // st["pool_size"]
    for key in ("prefill_seconds", "decode_seconds", "host_seconds", "total_seconds"):
        assert st[key] >= 0


def test_stop_table_takes_hundreds_of_ids(model):
    ids = list(range(5, 125)) + list(range(5, 125, 3))          # 120 distinct ids, repeats
    table = stop_table(model.config, ids)
    assert table.shape == (128,) and table.sum() == 120 and table[5] and not table[4]
    with pytest.raises(ValueError, match="eos_ids"):
        stop_table(model.config, [3, 128])


def test_bad_engine_arguments(model):
    with pytest.raises(ValueError, match="schedule"):
        Engine(model.config, schedule="waves")
    with pytest.raises(ValueError, match="impl"):
        Engine(model.config, impl="fast")
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        Engine(model.config).generate(model.params, PROMPTS, rollouts_per_prompt=2,
                                      max_new_tokens=4, memory_budget_bytes=-5)


def test_short_of_pages_samples_wait_or_restart_and_come_out_the_same(model):
    """8 slots but pages for only 8 x 16 positions while every sample runs 40 tokens (3 pages):
    slots wait for pages and, when all of them wait, the youngest restarts; the samples still
    equal the naive path's."""
    engine = Engine(model.config, kv_fraction=0.25)
    kw = dict(rollouts_per_prompt=N, max_new_tokens=40, temperature=1.0, seed=3, eos_ids=[])
    budget = rollout_bytes(model.config, len(PROMPTS), P_BUCKET, N, 40, 8, kv_fraction=0.25)
    r = engine.generate(model.params, PROMPTS, memory_budget_bytes=budget, **kw)
    st = r.stats
    assert st["num_slots"] == 8 and st["pages_per_device"] == 8 and st["page_size"] == 16
    assert st["stalls"] > 0 and st["restarts"] > 0
    _check_same(r, generate_naive(model, PROMPTS, **kw), "short of pages")
