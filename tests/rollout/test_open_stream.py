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
    st.scheduler.feed(PROMPTS)
    st.scheduler.close_feed()
    return st.result()


def test_fed_prompts_give_the_one_shot_calls_samples_and_a_pause_keeps_them(model, engine):
    """Two prompts fed first, the others one per group handed out, with a pause (the iteration
    left suspended) in the middle: every group once, equal to the prompts fed at once."""
    want = _all_at_once(engine, model.params)
    st = _open(engine, model.params)
    sch = st.scheduler
    assert list(sch.feed(PROMPTS[:2])) == [0, 1]
    got, queue = {}, list(PROMPTS[2:])
    for gr in st:
        got[gr.prompt_index] = gr
        if queue:
            sch.feed([queue.pop(0)])
        if len(got) == 2:
            break                   # paused: slots, pages and pool kept
    assert sch.in_flight == len(PROMPTS) - 2
    sch.close_feed()
    for gr in st:
        assert gr.prompt_index not in got
        got[gr.prompt_index] = gr
    assert sorted(got) == list(range(len(PROMPTS)))
    for g, gr in got.items():
        np.testing.assert_array_equal(gr.tokens, want.tokens[g])
        np.testing.assert_array_equal(gr.lengths, want.lengths[g])
        np.testing.assert_allclose(gr.logprobs, want.logprobs[g], atol=2e-4)
    prog = sch.progress()
    assert prog["useful_tokens"] == int(want.lengths.sum())
    assert 0 < prog["live_slot_steps"] <= prog["slot_steps"]


def test_weight_swap_applies_at_the_next_device_call(model, engine):
    """Prompt 0 runs under the first weights; after a pause the weights are swapped: prompts
    fed after the swap sample exactly what the new weights give; a sample admitted before it
    keeps its first token (drawn at admission) and that token's log-prob under the old ones."""
    other = tiny_model(seed=1).params
    other = engine.rollout_params(other)
    new = _all_at_once(engine, other)
    st = _open(engine, model.params)
    sch = st.scheduler
    sch.feed(PROMPTS[:2])
    first = next(iter(st))                  # pause after the first group
    sch.swap_params(other)
    sch.feed(PROMPTS[2:])
    sch.close_feed()
    rest = {gr.prompt_index: gr for gr in st}
    assert first.prompt_index not in rest and len(rest) == len(PROMPTS) - 1
    old = _all_at_once(engine, model.params)
    # admitted after the swap: exactly the new weights' samples
    for g in (2, 3):
        np.testing.assert_array_equal(rest[g].tokens, new.tokens[g])
        np.testing.assert_allclose(rest[g].logprobs, new.logprobs[g], atol=2e-4)
    # admitted before: token 0 drawn under the old weights, no token from a third program
    caught = [g for g in (0, 1) if g != first.prompt_index]
    for g in caught:
        gr = rest[g]
        np.testing.assert_array_equal(gr.tokens[:, 0], old.tokens[g][:, 0])
        np.testing.assert_allclose(gr.logprobs[:, 0], old.logprobs[g][:, 0], atol=2e-4)
    with pytest.raises(RuntimeError, match="feed"):
        sch.feed([[5]])


def test_an_open_stream_with_nothing_in_flight_says_feed(model, engine):
    st = _open(engine, model.params)
    with pytest.raises(RuntimeError, match="feed\\(\\) prompts or close_feed"):
        next(iter(st))
    st2 = _open(engine, model.params)
    with pytest.raises(ValueError, match="at most 32"):
        st2.scheduler.feed([list(range(4, 40))])
