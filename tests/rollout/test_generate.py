"""brorl_jax.rollout.generate: shared-prefix decoding equals the naive repeated-prompt path and the
model's own forward pass; result layout, stop tokens, caching and bad input. (Memory budgets,
greedy parity and the scheduler itself: test_scheduler.py.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_testutil import EOS, PROMPTS, tiny_model

from brorl_jax.rollout import Engine, generate, generate_naive

pytestmark = pytest.mark.slow     # many model compiles: out of `-m "not slow"`

N, S = 4, 10


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def sampled(model):
    return generate(model, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0,
                    top_k=20, top_p=0.9, seed=11)


def _forward_logits(model, seq):
    """Model logits f32[len(seq), V]; right-padded to one fixed length so it compiles once
    (causal attention: padding after the sequence does not change its logits)."""
    padded = np.zeros((1, 48), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(model(padded))[0, : len(seq)]


def _forward_logprobs(model, prompt, response, temperature):
    seq = list(prompt) + list(response)
    logits = _forward_logits(model, seq)[len(prompt) - 1 : -1]
    t = temperature if temperature > 0 else 1.0
    lp = jax.nn.log_softmax(logits / t, axis=-1)
    return np.asarray(lp)[np.arange(len(response)), np.asarray(response)]


def test_result_layout_and_padding(sampled):
    r = sampled
    g = len(PROMPTS)
    assert r.tokens.shape == (g, N, S) and r.tokens.dtype == np.int32
    assert r.logprobs.shape == (g, N, S) and r.logprobs.dtype == np.float32
    assert r.lengths.shape == (g, N) and r.lengths.dtype == np.int32
    assert r.finished.dtype == bool and r.truncated.dtype == bool
    np.testing.assert_array_equal(r.prompt_lengths, [len(p) for p in PROMPTS])
    np.testing.assert_array_equal(r.mask, np.arange(S) < r.lengths[..., None])
    assert np.all(r.tokens[~r.mask] == 0) and np.all(r.logprobs[~r.mask] == 0)
    assert np.all(r.logprobs[r.mask] <= 0)
    assert np.all(r.finished ^ r.truncated)
    assert np.all(r.lengths[r.truncated] == S)
    # a finished sample ends with exactly one stop token, at its last position
    for g_, n_ in zip(*np.nonzero(r.finished)):
        toks = r.tokens[g_, n_, : r.lengths[g_, n_]]
        assert toks[-1] == EOS and EOS not in toks[:-1]
    assert np.all(r.tokens[r.truncated] != EOS)
    assert r.finished.any() and r.truncated.any(), "test model should exercise both outcomes"


def test_shared_prefix_matches_naive_repeated_prompts(model, sampled):
    naive = generate_naive(model, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S,
                           temperature=1.0, top_k=20, top_p=0.9, seed=11)
    np.testing.assert_array_equal(sampled.tokens, naive.tokens)
    np.testing.assert_array_equal(sampled.lengths, naive.lengths)
    np.testing.assert_array_equal(sampled.finished, naive.finished)
    np.testing.assert_allclose(sampled.logprobs, naive.logprobs, atol=2e-4)


def test_logprobs_equal_model_forward(model, sampled):
    for temperature, r in [(1.0, sampled)]:
        for g, prompt in enumerate(PROMPTS):
            for n in range(N):
                length = r.lengths[g, n]
                want = _forward_logprobs(model, prompt, r.tokens[g, n, :length], temperature)
                np.testing.assert_allclose(r.logprobs[g, n, :length], want, atol=2e-4)


def test_logprobs_at_temperature_are_of_the_scaled_unfiltered_distribution(model):
    r = generate(model, PROMPTS[:2], rollouts_per_prompt=2, max_new_tokens=6, temperature=0.6,
                 top_k=5, seed=3)
    for g, prompt in enumerate(PROMPTS[:2]):
        for n in range(2):
            length = r.lengths[g, n]
            want = _forward_logprobs(model, prompt, r.tokens[g, n, :length], 0.6)
            np.testing.assert_allclose(r.logprobs[g, n, :length], want, atol=2e-4)


def test_greedy_tokens_are_argmax_of_forward(model):
    r = generate(model, PROMPTS, rollouts_per_prompt=1, max_new_tokens=S, temperature=0.0)
    for g, prompt in enumerate(PROMPTS):
        response = list(r.tokens[g, 0, : r.lengths[g, 0]])
        logits = _forward_logits(model, list(prompt) + response)[len(prompt) - 1 : -1]
        np.testing.assert_array_equal(np.argmax(logits, axis=-1), response)


def test_same_seed_reproduces_and_other_seed_differs(model, sampled):
    again = generate(model, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0,
                     top_k=20, top_p=0.9, seed=11)
    np.testing.assert_array_equal(again.tokens, sampled.tokens)
    other = generate(model, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0,
                     top_k=20, top_p=0.9, seed=12)
    assert not np.array_equal(other.tokens, sampled.tokens)
    # samples of one prompt have independent streams
    assert len({tuple(row) for row in sampled.tokens[1]}) > 1


def test_pallas_kernels_in_the_loop_match_reference(model):
    kw = dict(rollouts_per_prompt=3, max_new_tokens=5, temperature=0.8, top_p=0.9, seed=5)
    prompts = PROMPTS[:2]
    ref = generate(model, prompts, impl="reference", **kw)
    ker = generate(model, prompts, impl="pallas", **kw)
    np.testing.assert_array_equal(ker.tokens, ref.tokens)
    np.testing.assert_allclose(ker.logprobs, ref.logprobs, atol=2e-5)


def test_second_call_with_same_bucketed_shapes_does_not_recompile(model):
    engine = Engine(model.config)
    kw = dict(rollouts_per_prompt=2, max_new_tokens=4, temperature=1.0, eos_ids=[EOS])
    engine.generate(model.params, [[7, 8, 9], [10]], seed=0, **kw)
    sizes = engine.num_compiled()
    # different prompts, lengths and seed, same buckets (G=2, P=8)
    engine.generate(model.params, [[11, 12], [13, 14, 15, 16, 17]], seed=1, **kw)
    assert engine.num_compiled() == sizes


def test_stop_tokens_come_from_the_model_or_argument(model, sampled):
    r = generate(model, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0,
                 top_k=20, top_p=0.9, seed=11, eos_ids=[])
    assert not r.finished.any() and np.all(r.lengths == S)
    # before its first EOS every sample agrees with the run that stops at EOS
    np.testing.assert_array_equal(r.tokens[sampled.mask], sampled.tokens[sampled.mask])


def test_params_override(model):
    zero = jax.tree.map(jnp.zeros_like, model.params)
    # the settings of test_greedy_tokens_are_argmax_of_forward (same compiled programs)
    r = generate(model, PROMPTS, rollouts_per_prompt=1, max_new_tokens=S, temperature=0.0,
                 params=zero)
    # all-zero params -> uniform logits -> argmax is token 0 and log-prob is -log V
    assert np.all(r.tokens == 0)
    np.testing.assert_allclose(r.logprobs[r.mask], -np.log(model.config.vocab_size), rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[]), "empty"),
    (dict(prompts="hello"), "token-id lists"),
    (dict(prompts=[list(range(4, 100))]), "max_position_embeddings"),
    (dict(prompts=[[1, 2, 500]]), "vocab_size"),
    (dict(rollouts_per_prompt=0), "rollouts_per_prompt"),
    (dict(rollouts_per_prompt=-3), "rollouts_per_prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_input_raises_clear_errors(model, kwargs, match):
    args = dict(prompts=[[5, 6]], rollouts_per_prompt=2, max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, **args)
