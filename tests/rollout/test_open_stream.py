"""An open rollout stream (Engine.open_stream): prompts fed one by one while decoding goes on
give the samples of the same prompts fed at once (the schedule never changes a sample); a
paused stream resumes where it stopped; a weight swap takes effect at the next device call; a
stream asked for a group with none in flight says so."""
from __future__ import annotations

import numpy as np
import pytest
from rollout_testutil import EOS, PROMPTS, tiny_model

from brorl_jax.rollout import Engine

pytestmark = pytest.mark.slow     # compiles the rollout programs

N, S = 6, 12
STOPS = [EOS] + list(range(4, 128, 4))
KW = dict(rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0, top_k=20, top_p=0.9,
          seed=7, eos_ids=STOPS)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model.config)


def _open(engine, params):
    return engine.open_stream(params, prompt_len=21, plan_prompts=2, **KW)


def _all_at_once(engine, params):
    st = _open(engine, params)
    st.feed(PROMPTS)
    st.close_feed()
    return st.result()


def test_fed_prompts_give_the_one_shot_calls_samples_and_a_pause_keeps_them(model, engine):
    """Two prompts fed first, the others one per group handed out, with a pause (the iteration
    left suspended) in the middle: every group once, equal to the prompts fed at once."""
    want = _all_at_once(engine, model.params)
    st = _open(engine, model.params)
    assert list(st.feed(PROMPTS[:2])) == [0, 1]
    got, queue = {}, list(PROMPTS[2:])
    for gr in st:
        got[gr.prompt_index] = gr
        if queue:
            st.feed([queue.pop(0)])
        if len(got) == 2:
            break                   # paused: slots, pages and pool kept
    assert st.in_flight == len(PROMPTS) - 2
    st.close_feed()
    for gr in st:
        assert gr.prompt_index not in got
        got[gr.prompt_index] = gr
    assert sorted(got) == list(range(len(PROMPTS)))
    for g, gr in got.items():
        np.testing.assert_array_equal(gr.tokens, want.tokens[g])
        np.testing.assert_array_equal(gr.lengths, want.lengths[g])
        np.testing.assert_allclose(gr.logprobs, want.logprobs[g], atol=2e-4)
    prog = st.progress()
    assert prog.useful_tokens == int(want.lengths.sum())
    assert 0 < prog.live_slot_steps <= prog.slot_steps


def test_advance_decodes_with_no_consumer_and_keeps_the_groups_in_order(model, engine):
    """RolloutStream.advance (decoding while the update runs): it runs exactly the returns to
    the host it is asked for (none when `until` holds at once), stops at one (no device call in
    flight), keeps the groups that completed for __next__ in completion order, and changes no
    sample."""
    want = _all_at_once(engine, model.params)
    st = _open(engine, model.params)
    st.feed(PROMPTS)
    assert st.advance(until=lambda: True) == 0 and st.buffered == 0
    assert st.advance(2) == 2
    assert st._scheduler.counters.round_trips == 2       # the call's own counters
    buffered = st.buffered
    assert st.in_flight == len(PROMPTS)       # complete and kept ones count until taken
    st.close_feed()
    got = list(st)
    assert buffered > 0 and [g.decode_step for g in got] == sorted(g.decode_step for g in got)
    assert sorted(g.prompt_index for g in got) == list(range(len(PROMPTS)))
    for gr in got:
        np.testing.assert_array_equal(gr.tokens, want.tokens[gr.prompt_index])
        np.testing.assert_allclose(gr.logprobs, want.logprobs[gr.prompt_index], atol=2e-4)
    assert st.advance(3) == 0                 # nothing in flight: no call, no error


def test_weight_swap_applies_at_the_next_device_call(model, engine):
    """Prompt 0 runs under the first weights; after a pause the weights are swapped: prompts
    fed after the swap sample exactly what the new weights give (their versions say so); a
    sample caught in flight is the old weights' up to the token its record names, and the new
    ones' from there."""
    other = tiny_model(seed=1).params
    other = engine.rollout_params(other)
    new = _all_at_once(engine, other)
    st = _open(engine, model.params)
    st.feed(PROMPTS[:3])                    # 18 samples for 12 slots: some wait
    first = next(iter(st))                  # pause after the first group
    st.swap_params(other)
    assert st.version == 1
    st.feed(PROMPTS[3:])
    st.close_feed()
    rest = {gr.prompt_index: gr for gr in st}
    assert first.prompt_index not in rest and len(rest) == len(PROMPTS) - 1
    old = _all_at_once(engine, model.params)
    # admitted after the swap: exactly the new weights' samples
    np.testing.assert_array_equal(rest[3].tokens, new.tokens[3])
    np.testing.assert_allclose(rest[3].logprobs, new.logprobs[3], atol=2e-4)
    assert [(v, f.tolist()) for v, f in rest[3].versions] == [(1, [0] * N)]
    assert first.versions[0][0] == 0 and len(first.versions) == 1
    # admitted before, caught by the swap: each sample's tokens before its recorded switch are
    # the old weights' (tokens and log-probs), from it on the new weights drew them
    moved = []
    for g in [g for g in (0, 1, 2) if g != first.prompt_index]:
        gr = rest[g]
        (v0, zero), (v1, switch) = gr.versions
        assert (v0, v1) == (0, 1) and not zero.any()
        assert switch.min() >= 1                    # token 0 is drawn at admission
        for j in range(N):
            t = min(int(switch[j]), int(gr.lengths[j]))
            np.testing.assert_array_equal(gr.tokens[j, :t], old.tokens[g][j, :t])
            np.testing.assert_allclose(gr.logprobs[j, :t], old.logprobs[g][j, :t], atol=2e-4)
            if t < gr.lengths[j]:
                moved.append(not np.array_equal(gr.tokens[j], old.tokens[g][j]) or not
                             np.allclose(gr.logprobs[j], old.logprobs[g][j], atol=2e-4))
    assert moved and any(moved)         # samples caught mid-way, and the new weights show
    with pytest.raises(RuntimeError, match="feed"):
        st.feed([[5]])


def test_an_open_stream_with_nothing_in_flight_says_feed(model, engine):
    st = _open(engine, model.params)
    with pytest.raises(RuntimeError, match="feed\\(\\) prompts or close_feed"):
        next(iter(st))
    st2 = _open(engine, model.params)
    with pytest.raises(ValueError, match="at most 32"):
        st2.feed([list(range(4, 40))])


def test_the_plan_of_an_open_stream_is_the_layout_it_allocates(model, engine):
    """rollout.plan.stream_plan (what the memory plan counts for a stream, paused across the
    update with samples in flight) is the layout open_stream builds, and its bytes cover the
    device state the stream holds (pool, slots, KV pages)."""
    import jax

    from brorl_jax.rollout import plan as rollout_plan
    st = _open(engine, model.params)
    want = rollout_plan.stream_plan(model.config, engine.plan(2, 32, N, S), 32, S)
    assert st.plan == want and want.pool > engine.plan(2, 32, N, S).pool
    assert st.pool_size == want.pool
    sch = st._scheduler      # the device state it allocates (rollout-internal)
    sch.start()
    held = sum(x.nbytes for x in jax.tree.leaves((sch.pool, sch.slots, sch.kv)))
    assert 0.5 * want.bytes_per_device <= held <= want.bytes_per_device, (held, want)
    st.close()
