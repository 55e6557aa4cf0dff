"""The update step: loss and gradient equal an independent full-logits computation, micro-batch
accumulation does not change the result, NaN guard, PPO mini-batches, reference resets, fixed
shapes under dynamic sampling (no recompilation), and the real transformer end to end."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TOY_POLICY, VOCAB, random_batch, toy_logits, toy_params

from brorl_jax.algo import (
    Group,
    GroupSampler,
    assemble_groups,
    assemble_update_batch,
    compute_advantages,
    create_train_state,
    make_logprob_fn,
    make_optimizer,
    make_update_step,
    maybe_reset_reference,
    reset_reference,
)
from brorl_jax.config import make_config, optimizer_config, update_config


def _cfg(**kw):
    base = dict(rollouts_per_prompt=4, prompts_per_step=2, micro_batch_size=2, ppo_mini_batches=1,
                kl_coef=0.05, temperature=0.8, entropy_coef=0.01, tis_mode="ice_pop", tis_high=5.0)
    base.update(kw)
    return update_config(**base)


def _naive_logp_entropy(params, batch, temperature):
    logits = toy_logits(params, batch.input_tokens, batch.positions) / temperature
    logp_all = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logp_all, batch.targets[..., None], -1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, -1)


def test_update_equals_independent_loss_and_gradient():
    cfg = _cfg()
    params = toy_params()
    batch = random_batch(rows=8, seq=6)
    sgd = optax.sgd(1.0)   # new params = params - grad: exposes the gradient
    update = jax.jit(make_update_step(None, cfg, sgd, policy=TOY_POLICY))
    state = create_train_state(params, sgd)
    new_state, m = update(state, batch, jax.random.PRNGKey(0))

    old_logp, _ = _naive_logp_entropy(params, batch, cfg.temperature)
    mask = jnp.asarray(batch.loss_mask, jnp.float32)

    def independent(p):
        logp, ent = _naive_logp_entropy(p, batch, cfg.temperature)
        ratio = jnp.exp(logp - old_logp)
        adv = batch.advantages[:, None]
        surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
        k = jnp.exp(old_logp - batch.old_logprobs)
        w_is = jnp.where((k >= 0.5) & (k <= 5.0), k, 0.0)
        x = jnp.clip(logp - batch.ref_logprobs, -10, 10)
        per_tok = -w_is * surr + 0.05 * 0.5 * x ** 2 - 0.01 * ent
        return jnp.sum(per_tok * mask) / jnp.sum(mask)

    loss, grads = jax.value_and_grad(independent)(params)
    assert float(m["loss"]) == pytest.approx(float(loss), rel=1e-5)
    for k in params:
        np.testing.assert_allclose(params[k] - new_state.params[k], grads[k], rtol=2e-4, atol=1e-6)
    assert float(m["clip_frac"]) == 0.0          # pi_old == current policy in the only mini-batch
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["finite"]) == 1.0 and float(m["skipped"]) == 0.0
    assert int(new_state.step) == 1


def test_micro_batch_size_does_not_change_the_update():
    batch = random_batch(rows=8, seq=6, seed=1, pad_rows=2)
    opt = make_optimizer(optimizer_config(lr=1e-2))
    results = []
    for micro in (1, 4):
        for agg in ("token_mean", "seq_mean_token_mean"):
            cfg = _cfg(micro_batch_size=micro, ppo_mini_batches=2, loss_agg=agg)
            update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
            s, m = update(create_train_state(toy_params(), opt), batch, jax.random.PRNGKey(0))
            results.append((agg, s.params, float(m["loss"])))
    for agg in ("token_mean", "seq_mean_token_mean"):
        a, b = [r for r in results if r[0] == agg]
        assert a[2] == pytest.approx(b[2], rel=1e-5)
        for k in a[1]:
            np.testing.assert_allclose(a[1][k], b[1][k], rtol=1e-5, atol=1e-6)


def test_ppo_mini_batches_take_several_optimizer_steps():
    cfg = _cfg(ppo_mini_batches=4, ppo_epochs=2, micro_batch_size=1)
    opt = optax.adam(1e-2)
    update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
    s, m = update(create_train_state(toy_params(), opt), random_batch(rows=8), jax.random.PRNGKey(0))
    assert float(m["optimizer_steps"]) == 8
    assert int(s.opt_state[0].count) == 8
    # after the first mini-batch the policy has moved, so ratios differ from 1
    assert float(m["ratio_mean"]) != pytest.approx(1.0, abs=1e-7)


def test_nan_guard_skips_update_and_keeps_state():
    cfg = _cfg(ppo_mini_batches=2)
    opt = optax.adam(1e-2)
    update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
    batch = random_batch(rows=8)
    batch.advantages[0] = np.nan          # poisons the first mini-batch only
    state = create_train_state(toy_params(), opt)
    s, m = update(state, batch, jax.random.PRNGKey(0))
    assert float(m["skipped"]) == 1.0 and float(m["finite"]) == 0.0
    assert int(s.opt_state[0].count) == 1    # only the finite mini-batch stepped
    batch.advantages[:] = np.nan
    s2, m2 = update(state, batch, jax.random.PRNGKey(0))
    assert float(m2["skipped"]) == 2.0
    for k in state.params:
        np.testing.assert_array_equal(s2.params[k], state.params[k])
    jax.tree.map(np.testing.assert_array_equal, s2.opt_state, state.opt_state)


@pytest.mark.parametrize("reset_optimizer", [False, True])
def test_reference_reset_zeroes_kl_and_keeps_or_clears_optimizer(reset_optimizer):
    cfg = _cfg(kl_estimator="k3")
    opt = optax.adam(5e-2)
    update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
    logprobs = jax.jit(make_logprob_fn(algo_cfg=cfg, policy=TOY_POLICY))
    state = create_train_state(toy_params(), opt)
    batch = random_batch(rows=8)
    for _ in range(3):
        batch = batch.replace(ref_logprobs=np.asarray(logprobs(state.ref_params, batch)[0]))
        state, m = update(state, batch, jax.random.PRNGKey(0))
    assert float(m["kl"]) > 0
    count_before = int(state.opt_state[0].count)
    mu_before = state.opt_state[0].mu
    state = reset_reference(state, opt, reset_optimizer=reset_optimizer)
    pol, ref = logprobs(state.params, batch)[0], logprobs(state.ref_params, batch)[0]
    np.testing.assert_array_equal(pol, ref)
    batch = batch.replace(ref_logprobs=np.asarray(ref))
    _, m = update(state, batch, jax.random.PRNGKey(0))
    assert float(m["kl"]) == 0.0   # one mini-batch: measured before the policy moves
    if reset_optimizer:
        assert int(state.opt_state[0].count) == 0
        assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state[0].mu))
    else:
        assert int(state.opt_state[0].count) == count_before
        jax.tree.map(np.testing.assert_array_equal, state.opt_state[0].mu, mu_before)


def test_maybe_reset_reference_follows_interval():
    opt = optax.adam(1e-3)
    state = create_train_state(toy_params(), opt)
    cfg = _cfg(ref_reset_every=3)
    for step, expect in [(0, False), (2, False), (3, True), (6, True), (7, False)]:
        _, did = maybe_reset_reference(state.replace(step=jnp.int32(step)), cfg, opt)
        assert did == expect


def test_dynamic_sampling_padding_keeps_shapes_no_recompilation():
    """The compiled update sees [prompts_per_step * N, T] whether or not groups were filtered out."""
    cfg = _cfg(prompts_per_step=3, rollouts_per_prompt=2)
    ccfg = make_config(prompts_per_step=3, rollouts_per_prompt=2,
                       dynamic_sampling_cap_policy="pad", max_generation_rounds=1)
    opt = optax.adam(1e-3)
    update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
    state = create_train_state(toy_params(), opt)
    rng = np.random.default_rng(0)
    prompts = [[3, 4], [5], [6, 7, 8]]
    shapes = []
    for rewards in (np.array([[1, 0], [0, 1], [1, 0]]),     # nothing filtered
                    np.array([[1, 1], [0, 1], [0, 0]])):    # two groups filtered -> padded
        s = GroupSampler.from_config(ccfg)
        tokens = rng.integers(1, VOCAB, (3, 2, 4))
        logprobs = rng.normal(size=(3, 2, 4)) - 3
        s.add_round([Group(prompts[i], tokens[i], logprobs[i], np.ones((2, 4), bool),
                           np.full(2, 4), rewards[i].astype(np.float32),
                           rewards[i].astype(np.float32)) for i in range(3)])
        kept = s.groups
        adv = np.asarray(compute_advantages(ccfg.algo.advantage, np.stack([g.shaped for g in kept])))
        batch = assemble_groups(kept, list(adv), rows=ccfg.update_rows, seq_len=8)
        batch = batch.replace(ref_logprobs=np.zeros_like(batch.old_logprobs))   # KL on
        shapes.append(jax.tree.map(lambda v: v.shape, batch))
        _, m = update(state, batch, jax.random.PRNGKey(0))
        assert float(m["finite"]) == 1.0
    assert shapes[0] == shapes[1]
    assert update._cache_size() == 1
    # second batch: 1 kept group x 2 responses x 4 response tokens; padded rows add no tokens
    assert float(m["n_tokens"]) == 8


def test_assemble_update_batch_padded_layout():
    batch = assemble_update_batch([[7, 8]], np.array([[[1, 2, 3], [4, 5, 6]]]),
                                  np.array([[[-1., -2., -3.], [-4., -5., -6.]]]),
                                  np.array([[[True, True, False], [True, True, True]]]),
                                  np.array([[0.5, -0.5]]), seq_len=6, pack=False)
    np.testing.assert_array_equal(batch.input_tokens, [[7, 8, 1, 2, 3, 0], [7, 8, 4, 5, 6, 0]])
    np.testing.assert_array_equal(batch.targets, [[8, 1, 2, 3, 0, 0], [8, 4, 5, 6, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.old_logprobs, [[0, -1, -2, 0, 0, 0], [0, -4, -5, -6, 0, 0]])
    np.testing.assert_array_equal(batch.advantages, [0.5, -0.5])
    with pytest.raises(ValueError, match="seq_len"):
        assemble_update_batch([[7, 8]], np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), np.ones((1, 2, 3), bool),
                              np.zeros((1, 2)), seq_len=4)


def test_bad_batch_gives_clear_error():
    from brorl_jax.config import ConfigError
    with pytest.raises(ConfigError, match="'algo.micro_batch_size'=3 does not divide"):
        _cfg(micro_batch_size=3)
    update = make_update_step(None, _cfg(), optax.adam(1e-3), policy=TOY_POLICY)
    state = create_train_state(toy_params(), optax.adam(1e-3))
    with pytest.raises(ValueError, match="micro_batch_size"):
        update(state, random_batch(rows=7), None)
    bad = random_batch(rows=8).replace(ref_logprobs=None)     # the KL term is on
    with pytest.raises(ValueError, match="no ref_logprobs"):
        update(state, bad, None)


# A mixture-of-experts model's fields (qwen3_moe: q/k norms, no biases, 4 experts, top-2).
_MOE = dict(model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_real_transformer_logprobs_and_update(family):
    """With brorl_jax.models: the fused log-probs equal log_softmax of forward()'s logits, and one
    update step runs with finite metrics and zero KL against an identical reference; a
    mixture-of-experts policy's update moves its router (the gates carry its gradient) and its
    experts."""
    from brorl_jax.models import ModelConfig, forward, init_params
    fields = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, attention_bias=True,
                  qk_norm=False, tie_word_embeddings=True, max_position_embeddings=64,
                  bos_token_id=None, eos_token_ids=(1,))
    mc = ModelConfig(**dict(fields, **(_MOE if family == "qwen3_moe" else {})))
    params = init_params(mc, jax.random.PRNGKey(0))
    cfg = _cfg(ppo_mini_batches=2)
    batch = random_batch(rows=8, seq=6)
    logp, ent, stats = jax.jit(make_logprob_fn(mc, cfg, with_stats=True))(params, batch)
    logits = forward(params, mc, jnp.asarray(batch.input_tokens), positions=jnp.asarray(batch.positions))
    ref_all = jax.nn.log_softmax(logits / cfg.temperature, -1)
    ref = jnp.take_along_axis(ref_all, jnp.asarray(batch.targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["sum_p2"], jnp.sum(jnp.exp(2 * ref_all), -1), rtol=1e-5)
    batch = batch.replace(ref_logprobs=np.asarray(logp))
    opt = make_optimizer(optimizer_config(lr=1e-3))
    state = create_train_state(params, opt)
    new_state, m = jax.jit(make_update_step(mc, cfg, opt))(state, batch, jax.random.PRNGKey(0))
    assert float(m["finite"]) == 1.0 and float(m["optimizer_steps"]) == 2
    assert np.isfinite(float(m["kl"])) and float(m["entropy"]) > 0
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state.params, params)
    assert max(jax.tree.leaves(moved)) > 0
    if mc.is_moe:
        assert all(v > 0 for v in jax.tree.leaves(moved["layers"]["moe"])), moved["layers"]["moe"]


def test_grad_var_matches_brute_force_micro_batch_gradients():
    """grad_var = trace Cov of the mini-batch gradient from M micro-batch gradients, checked
    against gradients computed one micro-batch at a time by an independent loss."""
    cfg = _cfg(micro_batch_size=2, ppo_mini_batches=1, kl_coef=0.0, entropy_coef=0.0)
    batch = random_batch(rows=8, seq=6, seed=3)
    sgd = optax.sgd(1.0)
    update = jax.jit(make_update_step(None, cfg, sgd, policy=TOY_POLICY))
    _, m = update(create_train_state(toy_params(), sgd), batch, jax.random.PRNGKey(0))

    params = toy_params()
    old_logp, _ = _naive_logp_entropy(params, batch, cfg.temperature)
    mask = jnp.asarray(batch.loss_mask, jnp.float32)
    total = jnp.sum(mask)

    def part_loss(p, rows):
        logp, _ = _naive_logp_entropy(p, batch, cfg.temperature)
        ratio = jnp.exp(logp - old_logp)
        adv = batch.advantages[:, None]
        surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
        k = jnp.exp(old_logp - batch.old_logprobs)
        w = jnp.where((k >= 0.5) & (k <= 5.0), k, 0.0)
        sel = jnp.zeros(8).at[rows].set(1.0)[:, None]
        return jnp.sum(-w * surr * mask * sel) / total

    grads = [jax.grad(part_loss)(params, np.arange(i, i + 2)) for i in range(0, 8, 2)]
    flat = [np.concatenate([np.ravel(g[k]) for k in sorted(g)]) for g in grads]
    est = np.stack([4 * f for f in flat])                # each 4 g_i estimates G
    brute = np.sum((est - est.mean(0)) ** 2) / (4 - 1) / 4
    assert float(m["grad_var"]) == pytest.approx(brute, rel=1e-3)


def test_mass_balance_diagnostics_from_the_pi_old_pass():
    n = 16
    cfg = _cfg(kl_coef=0.0)
    batch = random_batch(rows=8, seq=6, seed=4)
    opt = optax.sgd(0.0)
    update = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY, diagnostics_n=n))
    _, m = update(create_train_state(toy_params(), opt), batch, jax.random.PRNGKey(0))
    logits = toy_logits(toy_params(), batch.input_tokens, batch.positions) / cfg.temperature
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    mask = batch.loss_mask
    expect_u = (p ** 2 * (1 - p) ** n).sum(-1)[mask].mean()
    expect_p2 = (p ** 2).sum(-1)[mask].mean()
    assert float(m["mass_balance/unsampled_second_moment"]) == pytest.approx(expect_u, rel=1e-4)
    assert float(m["mass_balance/sum_p2"]) == pytest.approx(expect_p2, rel=1e-4)


def _packed_batch(rows=2, seq=32, seed=5):
    """Packed rows: segments of several lengths per row, per-token advantages, padding at the end."""
    b = random_batch(rows=rows, seq=seq, seed=seed)
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, seq), np.int32)
    seg[0, :9], seg[0, 9:21], seg[0, 21:30] = 1, 2, 3
    seg[1, :25] = 1
    pos = np.zeros_like(seg)
    for r in range(rows):
        for s in range(1, seg[r].max() + 1):
            idx = np.flatnonzero(seg[r] == s)
            pos[r, idx] = np.arange(len(idx))
    return b.replace(segment_ids=seg, positions=pos, loss_mask=b.loss_mask & (seg > 0),
                     advantages=rng.normal(size=(rows, seq)).astype(np.float32) * (seg > 0))


def _tiny_model(**kw):
    from brorl_jax.models import ModelConfig
    return ModelConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                       attention_bias=True, qk_norm=False, tie_word_embeddings=True,
                       max_position_embeddings=64, bos_token_id=None, eos_token_ids=(1,), **kw)


def test_packed_update_with_the_flash_kernel_equals_the_reference_update(monkeypatch):
    """attention_impl="flash" with the Pallas kernel (interpreted on CPU, 16-token tiles, so the
    causal block skipping and segments crossing tiles are exercised) and the "dots" remat policy
    gives the reference attention's loss and gradient (under "full" remat) on packed rows."""
    import functools

    from brorl_jax.models import init_params, transformer
    from brorl_jax.parallel.attention import packed_attention_on_mesh
    ref_mc = _tiny_model()
    params = jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, init_params(ref_mc, jax.random.PRNGKey(1)))
    batch = _packed_batch()
    cfg = _cfg(kl_coef=0.0, micro_batch_size=2)
    sgd = optax.sgd(1.0)
    state = create_train_state(params, sgd, with_reference=False)
    ref_state, ref_m = jax.jit(make_update_step(ref_mc, cfg, sgd, remat_policy="full"))(state, batch, None)
    monkeypatch.setattr(transformer, "packed_attention_on_mesh",
                        functools.partial(packed_attention_on_mesh, impl="pallas", block=16))
    flash_mc = _tiny_model(attention_impl="flash")
    # the kernel under the "dots" policy against the reference under "full": both changes at once
    new, m = jax.jit(make_update_step(flash_mc, cfg, sgd, remat_policy="dots"))(state, batch, None)
    assert float(m["loss"]) == pytest.approx(float(ref_m["loss"]), rel=1e-5, abs=1e-7)
    for a, b, p in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref_state.params),
                       jax.tree.leaves(params)):
        np.testing.assert_allclose(p - a, p - b, rtol=1e-4, atol=1e-6)   # the gradients
    assert max(float(jnp.abs(p - a).max()) for p, a in
               zip(jax.tree.leaves(params), jax.tree.leaves(new.params))) > 1e-3


def test_pi_old_folded_into_the_gradient_pass_equals_the_separate_pass(monkeypatch):
    """One mini-batch, one epoch: the update takes pi_old from its own gradient pass; the result
    equals running the separate pi_old pass. With two mini-batches the pass runs."""
    from brorl_jax.algo import update as update_mod
    cfg = _cfg(kl_coef=0.0)
    assert update_mod.pi_old_in_gradient_pass(cfg)
    assert not update_mod.pi_old_in_gradient_pass(_cfg(ppo_mini_batches=2))
    assert not update_mod.pi_old_in_gradient_pass(_cfg(ppo_epochs=2))
    assert not update_mod.pi_old_in_gradient_pass(_cfg(recompute_old_logprobs=False))
    assert not update_mod.pi_old_in_gradient_pass(cfg, diagnostics_n=16)
    _folded_equals_separate(monkeypatch, cfg, "pi_old_in_gradient_pass", seed=6)


def _folded_equals_separate(monkeypatch, cfg, rule: str, seed: int):
    """The update with the pi_old fold `rule` (a brorl_jax.algo.update function) equals the
    one with the rule off (the pi_old pass over every row): metrics and params after a step."""
    from brorl_jax.algo import update as update_mod
    batch = random_batch(rows=8, seq=6, seed=seed)
    opt = make_optimizer(optimizer_config(lr=1e-2))
    state = create_train_state(toy_params(), opt, with_reference=False)
    folded, m_folded = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))(state, batch, None)
    monkeypatch.setattr(update_mod, rule, lambda cfg, n=None: False)
    separate, m_sep = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))(state, batch, None)
    for k in ("loss", "pg_loss", "ratio_mean", "clip_frac", "tis_weight_mean", "optimizer_steps"):
        assert float(m_folded[k]) == pytest.approx(float(m_sep[k]), rel=1e-5, abs=1e-7), k
    for a, b in zip(jax.tree.leaves(folded.params), jax.tree.leaves(separate.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    return m_folded


def test_first_mini_batch_pi_old_from_its_gradient_pass_equals_the_separate_pass(monkeypatch):
    """Several mini-batches, one epoch: the pi_old pass skips the first mini-batch's rows (its
    optimizer step runs at the step-start params too) and that mini-batch takes its own
    log-prob; the result equals the pass over every row. Not with several epochs."""
    from brorl_jax.algo import update as update_mod
    cfg = _cfg(kl_coef=0.0, ppo_mini_batches=2)
    assert update_mod.first_pi_old_in_gradient_pass(cfg)
    assert not update_mod.first_pi_old_in_gradient_pass(_cfg(kl_coef=0.0))      # all folded
    assert not update_mod.first_pi_old_in_gradient_pass(_cfg(ppo_mini_batches=2, ppo_epochs=2))
    assert not update_mod.first_pi_old_in_gradient_pass(
        _cfg(ppo_mini_batches=2, recompute_old_logprobs=False))
    assert not update_mod.first_pi_old_in_gradient_pass(cfg, diagnostics_n=16)
    rows_seen = []
    real_make = update_mod.make_logprob_fn

    def spy_make(*a, **kw):
        fn = real_make(*a, **kw)

        def logprobs(params, batch):
            rows_seen.append(batch.input_tokens.shape[0])
            return fn(params, batch)
        return logprobs
    monkeypatch.setattr(update_mod, "make_logprob_fn", spy_make)
    m = _folded_equals_separate(monkeypatch, cfg, "first_pi_old_in_gradient_pass", seed=7)
    assert rows_seen == [4, 8]                 # the pass over the second mini-batch only, then all
    assert float(m["optimizer_steps"]) == 2


def test_remat_policy_from_the_memory_plan():
    from brorl_jax.algo.update import plan_remat_policy, remat_saved_bytes
    from brorl_jax.models import ModelConfig
    qwen = ModelConfig(model_type="qwen2", vocab_size=151_936, hidden_size=1536,
                       intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128, rope_theta=1e6, rope_scaling=None,
                       rms_norm_eps=1e-6, attention_bias=True, qk_norm=False,
                       tie_word_embeddings=True, max_position_embeddings=32768,
                       bos_token_id=None, eos_token_ids=(1,), dtype="bfloat16")
    n = 1_543_714_304
    # 4096 tokens: the projections' outputs (5.3 GB) fit an 80 GB H100 beside the state
    assert remat_saved_bytes(qwen, 4096, "dots") == 4096 * 28 * (1536 * 3 + 1536 + 512 + 2 * 8960) * 2
    assert plan_remat_policy(qwen, 4096, n, 80 * 2**30) == "dots"
    # with flash attention everything a layer keeps fits too (17 GB with the XLA MLP, as on a
    # TPU): no remat
    import pallas_kernels as pk
    flash = qwen.replace(attention_impl="flash")
    with pk.compile_target("tpu"):
        assert 17e9 < remat_saved_bytes(flash, 4096, "none") < 17.1e9
        assert plan_remat_policy(flash, 4096, n, 80 * 2**30) == "none"
        assert plan_remat_policy(flash, 4 * 4096, n, 80 * 2**30) == "dots"
    # traced for a GPU, the fused SwiGLU kernels keep what the XLA MLP's "dots" keeps
    with pk.compile_target("cuda"):
        assert remat_saved_bytes(qwen, 4096, "dots") == 4096 * 28 * (
            1536 * 3 + 1536 + 512 + 2 * 8960) * 2
        assert plan_remat_policy(qwen, 4096, n, 80 * 2**30) == "dots"
        # flash attention, fused MLP: no remat up to 8k tokens; dots at 16k (30.8 GB of room)
        flash = qwen.replace(attention_impl="flash")
        assert plan_remat_policy(flash, 8192, n, 80 * 2**30) == "none"
        assert plan_remat_policy(flash, 16384, n, 80 * 2**30) == "dots"
    # 64 rows of 16k tokens do not: full remat
    assert plan_remat_policy(qwen, 64 * 16384, n, 80 * 2**30) == "full"
    assert plan_remat_policy(qwen, 4096, n, None) == "full"          # unknown memory (CPU)


@pytest.mark.parametrize("mlp_impl", ["auto", "reference", "qwen3_moe", "qwen2_moe"])
def test_no_remat_estimate_is_what_autodiff_keeps_on_the_gpu_path(mlp_impl):
    """remat_saved_bytes(..., "none") per token and layer equals the activations jax's saved
    residuals list for an un-rematerialised forward traced for cuda (flash attention; the fused
    MLP kernels or the XLA MLP; a mixture of experts with q/k norms, one with a shared expert and
    q/k/v biases): the slope over layers and
    tokens, so per-layer constants (weights, norm scales) drop out; for the mixture of experts
    "dots" too."""
    from jax._src.ad_checkpoint import saved_residuals

    import pallas_kernels as pk
    from brorl_jax.algo.update import remat_saved_bytes
    from brorl_jax.models import ModelConfig, forward, init_params

    moe = dict(model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32) if mlp_impl == "qwen3_moe" else {}
    if mlp_impl == "qwen2_moe":     # q/k/v biases, no q/k norms, a shared expert of width 48
        moe = dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=48)

    def cfg_for(layers):
        fields = dict(model_type="qwen2", vocab_size=64, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-6,
                      attention_bias=True, qk_norm=False, tie_word_embeddings=False,
                      max_position_embeddings=128, bos_token_id=None, eos_token_ids=(0,),
                      dtype="bfloat16", param_dtype="bfloat16", attention_impl="flash",
                      mlp_impl="auto" if moe else mlp_impl)
        return ModelConfig(**dict(fields, **moe))

    def kept(layers, seq, remat="none"):
        cfg = cfg_for(layers)
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
        tokens, seg = jnp.zeros((2, seq), jnp.int32), jnp.ones((2, seq), jnp.int32)
        loss = lambda p: forward(p, cfg, tokens, segment_ids=seg, return_hidden=True,
                                 remat=remat).astype(jnp.float32).sum()
        with pk.compile_target("cuda"):
            res = saved_residuals(loss, params)
        return sum(a.size * a.dtype.itemsize for a, why in res if "argument" not in why)

    slope = (kept(2, 64) - kept(1, 64)) - (kept(2, 32) - kept(1, 32))    # 1 layer, 64 tokens
    with pk.compile_target("cuda"):
        assert remat_saved_bytes(cfg_for(1), 64, "none") == slope
    if moe:
        slope = (kept(2, 64, "dots") - kept(1, 64, "dots")) - (kept(2, 32, "dots")
                                                                - kept(1, 32, "dots"))
        assert remat_saved_bytes(cfg_for(1), 64, "dots") == slope
    with pytest.raises(ValueError, match="flash"):
        remat_saved_bytes(cfg_for(1).replace(attention_impl="reference"), 64, "none")


def test_the_clip_norm_is_grad_norm_itself(monkeypatch):
    """optax's clip_by_global_norm takes its norm over the very arrays grad_norm is computed from
    (no zeroed copy of the gradients in between), so the compiled step computes the global norm
    once: a second norm over a second gradient tree was 2 % of the update's memory traffic at
    8 x 2048 on an H100 (bench/_roofline_update.py). Fails when the gradients are replaced
    (e.g. jnp.where(finite, g, 0)) before the optimizer."""
    calls = []
    real_norm = optax.tree.norm

    def spy(tree, *a, **kw):
        calls.append([id(x) for x in jax.tree.leaves(tree)])
        return real_norm(tree, *a, **kw)

    monkeypatch.setattr(optax.tree, "norm", spy)
    cfg = _cfg(ppo_mini_batches=2, micro_batch_size=4)
    opt = make_optimizer(optimizer_config(grad_clip=1.0))
    state = create_train_state(toy_params(), opt)
    jax.make_jaxpr(make_update_step(None, cfg, opt, policy=TOY_POLICY))(
        state, random_batch(rows=8), jax.random.PRNGKey(0))
    assert len(calls) == 2, calls          # grad_norm, then the clip's
    assert calls[0] == calls[1]
