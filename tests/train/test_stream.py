"""One stream per step (algo.stream_rounds) and bounded staleness (algo.max_staleness), on the
tiny run with a fake verifier (train/collect.py with train/feeds.py's stream feed, algo/host.py's admission
rule): with k = 0 every sample the update uses is on-policy and its behaviour log-probs are the
current weights'; with k = 1 groups are carried into the next step, none is used twice, none is
lost without being counted, none is older than k; a run restarted from a checkpoint step's
state repeats the uninterrupted run exactly (the stream is closed at checkpoint steps)."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_collect import FakeScorer, spy_update

from brorl_jax import algo
from brorl_jax.rewards.health import VerifierHealth
from brorl_jax.train import collect
from brorl_jax.train.context import Scored
from brorl_jax.train.loop import Trainer
from brorl_jax.train.step import rl_step
from configs import tiny

pytestmark = pytest.mark.slow     # compiles the tiny model's rollout and update

CHECKPOINT_EVERY = 3


class FilteringScorer(FakeScorer):
    """Prompts whose answer is a multiple of 3 get all-wrong groups (the filter drops them), the
    others mixed ones: a pass rate near 2/3, so the stream has to oversupply."""

    def score(self, records, tokens, lengths):
        out = np.zeros(len(records), np.float32)
        if int(records[0]["ground_truth"]) % 3:
            out[: max(1, len(records) // 4)] = 1.0
        return Scored(out, VerifierHealth())


class JitteryScorer:
    """The wrapped scorer's verdicts after a random 0-20 ms (a remote service's latency)."""

    def __init__(self, inner):
        self.inner, self.rng = inner, np.random.default_rng(0)

    def score(self, records, tokens, lengths):
        time.sleep(float(self.rng.uniform(0, 0.02)))
        return self.inner.score(records, tokens, lengths)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    c = tiny.get_config()
    c.sft.steps = 0                       # the fake verifier needs no trained policy
    c.algo.kl_coef = 0.0
    c.algo.stream_rounds, c.algo.max_staleness = True, 1
    c.train.checkpoint_every, c.train.steps = CHECKPOINT_EVERY, 100
    tr = Trainer(c, str(tmp_path_factory.mktemp("stream")))
    tr.ctx.scorer = FilteringScorer(tr.ctx.scorer)
    yield tr
    tr.close()


def _with_staleness(trainer, k):
    trainer.ctx.cfg = trainer.ctx.cfg.replace("algo", max_staleness=k)


def _spy_groups(monkeypatch, seen):
    """Every group the stream scores: (loader index, version, step, candidates)."""
    real = collect.host.make_group

    def make_group(cfg, candidates, rewards, **kw):
        seen.append(dict(index=kw["index"], version=kw["round_"], step=kw["step"],
                         tokens=candidates.tokens, logprobs=candidates.logprobs,
                         lengths=candidates.lengths, prompt=list(kw["prompt_ids"]),
                         versions=candidates.versions))
        return real(cfg, candidates, rewards, **kw)
    monkeypatch.setattr(collect.host, "make_group", make_group)


def _recomputed(model, params, prompt, tokens, lengths):
    """log softmax(logits)[token] of every response token [n, S] under `params` (T = 1)."""
    width = 32      # right-padded to one width (causal: the padding changes no logit): one compile
    seq = np.zeros((len(tokens), width), np.int32)
    for i, t in enumerate(tokens):
        seq[i, :len(prompt) + len(t)] = prompt + list(t)
    logits = np.asarray(model(seq, params=params), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    p = len(prompt)
    rows = np.arange(len(tokens))[:, None]
    out = logp[rows, p - 1 + np.arange(tokens.shape[1])[None], tokens]
    return np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], out, 0.0)


def _run(trainer, steps, state=None, cstate=None, data_iter=None, start=0, record=None):
    ctx = trainer.ctx
    state = state or ctx.new_train_state(jax.tree.map(jnp.copy, ctx.model.params))
    cstate = cstate or algo.CollectState()
    data_iter = data_iter or iter(trainer.loader)
    out = []
    for step in range(start, start + steps):
        if record is not None:
            record[step] = (jax.tree.map(jnp.copy, state), cstate.to_json(),
                            data_iter.get_state(), collect.carried_stream(ctx) is None)
        params = jax.tree.map(np.asarray, state.params)
        state, cstate, m = rl_step(ctx, state, cstate, data_iter, step)
        out.append((m, params))
    return state, cstate, out


def test_stream_at_k0_uses_only_on_policy_samples_with_their_behaviour_logprobs(
        trainer, monkeypatch):
    _with_staleness(trainer, 0)
    seen, batches = [], []
    _spy_groups(monkeypatch, seen)
    spy_update(trainer.ctx, batches)
    try:
        _, cstate, out = _run(trainer, 2)
    finally:
        del trainer.ctx.runtime.update
    for m, _ in out:
        assert m["staleness/max"] == 0 and m["staleness/mean"] == 0
        assert m["staleness/age0_samples"] > 0 and "staleness/age1_samples" not in m
        assert m["rollout/carried_samples"] == 0 and m["staleness/dropped_samples"] == 0
        assert m["dynamic_sampling/kept_groups"] == trainer.cfg.algo.prompts_per_step
        assert 0 < m["rollout/step_occupancy"] <= 1
    assert collect.carried_stream(trainer.ctx) is None and cstate.stream_counts[1] == len(seen)
    assert 0 < cstate.stream_counts[0] < cstate.stream_counts[1]        # some groups filtered
    assert all(g["version"] == g["step"] for g in seen)
    model = trainer.ctx.model
    for g in seen:
        want = _recomputed(model, out[g["step"]][1], g["prompt"], g["tokens"], g["lengths"])
        np.testing.assert_allclose(g["logprobs"], want, atol=2e-4)


@pytest.mark.parametrize("groups_in_flight", [1, 3])
def test_stream_at_k1_carries_groups_each_used_once_none_lost_none_too_old(
        trainer, monkeypatch, groups_in_flight):
    """Also with 3 groups scored at once (rewards.groups_in_flight): the filter sees each group
    3 groups late, and the groups taken but not settled when a step fills go back to the
    stream (the next step's, or discarded at a close), each still used once."""
    _with_staleness(trainer, 1)
    monkeypatch.setattr(trainer.ctx, "cfg", trainer.ctx.cfg.replace(
        "rewards", groups_in_flight=groups_in_flight))
    if groups_in_flight > 1:       # verdicts end out of order: the collect must not care
        monkeypatch.setattr(trainer.ctx, "scorer", JitteryScorer(trainer.ctx.scorer))
    seen = []
    _spy_groups(monkeypatch, seen)
    steps = 2 * CHECKPOINT_EVERY
    _, cstate, out = _run(trainer, steps)
    metrics = [m for m, _ in out]
    m_cand = trainer.cfg.rollout.rollouts_per_prompt
    for s, m in enumerate(metrics):
        assert m["staleness/max"] <= 1
        # the histogram: the samples the update used at ages 0 and 1, agreeing with mean and max
        h0, h1 = m["staleness/age0_samples"], m["staleness/age1_samples"]
        assert h0 + h1 > 0 and "staleness/age2_samples" not in m
        assert m["staleness/mean"] == pytest.approx(h1 / (h0 + h1))
        assert m["staleness/max"] == int(h1 > 0)
        if (s + 1) % CHECKPOINT_EVERY == 0:           # a checkpoint step closes the stream
            assert m["rollout/carried_samples"] == 0
    assert any(m["rollout/carried_samples"] > 0 for m in metrics)
    assert any(m["staleness/mean"] > 0 for m in metrics)            # carried groups trained on
    # every sample fed is handed out (scored or dropped as too old) or discarded at a close
    fed = sum(m["rollout/fed_prompts"] for m in metrics) * m_cand
    assert fed == sum(m["perf/generated_samples"] + m["rollout/discarded_samples"]
                      for m in metrics)
    assert sum(m["perf/generated_samples"] for m in metrics) == \
        len(seen) * m_cand + sum(m["staleness/dropped_samples"] for m in metrics)
    # no group scored (so possibly trained on) twice; none older than k
    assert len({g["index"] for g in seen}) == len(seen)
    assert all(0 <= g["step"] - g["version"] <= 1 for g in seen)
    # behaviour log-probs: a group admitted and finished under one version is that version's;
    # a carried one's tokens are, up to each sample's recorded switch (GroupResult.versions)
    model = trainer.ctx.model
    carried = 0
    for g in seen:
        want = _recomputed(model, out[g["version"]][1], g["prompt"], g["tokens"], g["lengths"])
        assert g["versions"][0][0] == g["version"]
        if g["version"] == g["step"]:
            assert len(g["versions"]) == 1
            np.testing.assert_allclose(g["logprobs"], want, atol=2e-4)
        else:
            carried += 1
            # no swap recorded: it was complete (fetched, not yet handed out) at the swap
            later = g["versions"][1:]
            assert len(later) <= 1
            switch = later[0][1] if later else g["lengths"]
            for j, t in enumerate(np.minimum(switch, g["lengths"])):
                np.testing.assert_allclose(g["logprobs"][j, :t], want[j, :t], atol=2e-4)
    assert carried > 0
    assert collect.carried_stream(trainer.ctx) is None    # the last step closed it (a checkpoint step)


class SlowScorer:
    """The trainer's scorer, `delay` seconds slower per group (a verifier with latency), and
    two groups in three all wrong (dropped by the filter), so a step needs more prompts decoded
    after the groups being scored: the engine has work to wait for the verifier with."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.calls = inner, delay, 0

    def score(self, records, tokens, lengths):
        import time
        time.sleep(self.delay)
        self.calls += 1
        got = self.inner.score(records, tokens, lengths)
        return got if self.calls % 3 == 0 else Scored(np.zeros_like(got.rewards), got.health)


def test_who_waited_for_whom_is_measured(trainer, monkeypatch):
    """time/device_waited_for_host_s: the engine idle between two of its device calls, timed by
    the scheduler's waiter thread, so a consumer that holds the stream (here a verifier taking
    0.25 s a group) shows as device idle; time/host_waited_for_device_s: the host blocked on
    the device. Both per step, within the step's wall time; the same schedule without the
    latency shows (almost) none of that idle."""
    _with_staleness(trainer, 0)
    inner, out = trainer.ctx.scorer, []
    for delay in (0.0, 0.25):
        monkeypatch.setattr(trainer.ctx, "scorer", SlowScorer(inner, delay))
        out.append(_run(trainer, 1)[2][0][0])
    fast, slow = out
    for m in (fast, slow):
        idle, wait = m["time/device_waited_for_host_s"], m["time/host_waited_for_device_s"]
        assert 0 <= idle <= m["time/rollout_s"] + m["time/scoring_s"]
        assert 0 < wait <= m["time/rollout_s"]
    groups = slow["perf/generated_samples"] // trainer.cfg.rollout.rollouts_per_prompt
    assert groups == fast["perf/generated_samples"] // trainer.cfg.rollout.rollouts_per_prompt
    assert groups >= 4
    assert slow["time/device_waited_for_host_s"] - fast["time/device_waited_for_host_s"] \
        >= 0.5 * 0.25 * (groups - 2)


def test_restart_from_a_checkpoint_steps_state_repeats_the_run(trainer):
    """What a checkpoint saves at a checkpoint step (train state, collect state's JSON, data
    position), restored into fresh objects, gives the uninterrupted run's parameters bit for
    bit two steps later, with groups carried across the steps in between."""
    _with_staleness(trainer, 1)
    record = {}
    steps = CHECKPOINT_EVERY + 2
    whole, _, out = _run(trainer, steps, record=record)
    assert any(m["rollout/carried_samples"] > 0 for m, _ in out[CHECKPOINT_EVERY:])
    state, cjson, data_state, closed = record[CHECKPOINT_EVERY]
    assert closed                           # nothing in flight at a checkpoint step
    data_iter = iter(trainer.loader)
    data_iter.set_state(data_state)
    resumed, _, _ = _run(trainer, 2, state=state, cstate=algo.CollectState.from_json(cjson),
                         data_iter=data_iter, start=CHECKPOINT_EVERY)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(whole.params),
                            jax.tree_util.tree_leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
