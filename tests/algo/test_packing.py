"""Sequence packing (algo.batch, docs/algo.md "Sequence packing"): the packed layout holds the
padded layout's tokens; log-probs, entropy, every loss variant and aggregation, KL, TIS, the
mass-balance diagnostics and the full update step give the same values on packed rows (float32,
1e-5) on mixed lengths with empty responses and an invalid group; row counts are bucketed so
steps in one bucket do not recompile."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TOY_POLICY, VOCAB, toy_logits, toy_params
from testutil import tiny_model_config

from brorl_jax.algo import (
    assemble_update_batch,
    create_train_state,
    get_loss_agg,
    make_logprob_fn,
    make_update_step,
    policy_loss,
)
from brorl_jax.algo.batch import (
    bucket_rows,
    first_fit_decreasing,
    pad_packed_rows,
    unpack_to_padded,
)
from brorl_jax.algo.losses import segment_token_counts
from brorl_jax.config import update_config

G, N, S = 4, 4, 8
PROMPT_LENS = (1, 3, 5, 2)
WIDTH = max(PROMPT_LENS) + S


def mixed_rollouts(seed=0, max_len=S):
    """G x N rollouts: response lengths 0..max_len (an empty response and a full one), group 2
    invalid (dynamic-sampling padding)."""
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(4, VOCAB, size=n))) for n in PROMPT_LENS]
    tokens = rng.integers(4, VOCAB, (G, N, S))
    lens = rng.integers(0, max_len + 1, (G, N))
    lens[0, 0], lens[1, 2] = 0, max_len
    mask = np.arange(S)[None, None, :] < lens[..., None]
    logprobs = (np.log(1 / VOCAB) + 0.3 * rng.normal(size=(G, N, S))).astype(np.float32)
    adv = rng.normal(size=(G, N)).astype(np.float32)
    valid = np.array([True, True, False, True])
    return prompts, tokens * mask, logprobs * mask, mask, adv, valid


def both_layouts(seed=0, mini_batches=2, **kw):
    args = mixed_rollouts(seed)
    return (assemble_update_batch(*args, seq_len=WIDTH, pack=False),
            assemble_update_batch(*args, seq_len=WIDTH, mini_batches=mini_batches, **kw))


def to_packed(packed, padded_values):
    """Padded-layout per-token values [G*N, T] -> the packed rows' [R, T] (0 on padding)."""
    seq, pos = packed.sequence_index, packed.positions
    return np.where(seq >= 0, np.asarray(padded_values)[np.maximum(seq, 0), pos], 0).astype(
        np.asarray(padded_values).dtype)


def tiny_model():
    from brorl_jax.models import init_params
    mc = tiny_model_config(vocab_size=VOCAB, tie_word_embeddings=True)
    # larger weights than the init so attention is far from uniform (a leak would show)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, init_params(mc, jax.random.PRNGKey(0)))
    return mc, params


# ------------------------------------------------------------------------------------ the packer

def test_bucket_rows_bounded_shapes_and_waste():
    assert [bucket_rows(r) for r in range(1, 17)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14,
                                                      14, 16, 16]
    assert bucket_rows(0) == 1 and bucket_rows(5, multiple=4) == 8 and bucket_rows(33, 2) == 40
    values = {bucket_rows(r) for r in range(1, 4097)}
    assert len(values) <= 4 * 12 + 4              # 4 shapes per doubling
    for r in range(1, 4097):
        b = bucket_rows(r)
        assert r <= b <= 1.25 * r + 1 and bucket_rows(b) == b


def test_first_fit_decreasing_fits_and_is_first_fit():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 200)
    bins = first_fit_decreasing(lengths, 32)
    load = np.bincount(bins, weights=lengths)
    assert load.max() <= 32 and set(bins) == set(range(bins.max() + 1))
    assert bins.max() + 1 <= np.ceil(lengths.sum() / 32) * 11 / 9 + 1     # FFD bound
    # hand case, in decreasing order: 6 opens bin 0, 5 opens bin 1, 4 fits bin 0 (first fit),
    # 3 and 2 fill bin 1
    np.testing.assert_array_equal(first_fit_decreasing([3, 6, 5, 4, 2], 10), [1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([11], 10)


def test_packed_layout_hand_case():
    """Two prompts x two responses; the empty response is left out; FFD puts the longest first."""
    batch = assemble_update_batch(
        [[7, 8], [9]], np.array([[[1, 2, 3], [4, 0, 0]], [[5, 6, 0], [0, 0, 0]]]),
        -np.arange(1, 13, dtype=np.float32).reshape(2, 2, 3),
        np.array([[[1, 1, 1], [1, 0, 0]], [[1, 1, 0], [0, 0, 0]]], bool),
        np.array([[0.5, -0.5], [1.0, 2.0]]), seq_len=8, mini_batches=1)
    # sequences: 0 = [7 8 1 2 3] (5), 1 = [7 8 4] (3), 2 = [9 5 6] (3), 3 = empty response
    np.testing.assert_array_equal(batch.input_tokens, [[7, 8, 1, 2, 3, 7, 8, 4],
                                                          [9, 5, 6, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 2],
                                                         [1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 4, 0, 1, 2],
                                                       [0, 1, 2, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.targets, [[8, 1, 2, 3, 0, 8, 4, 0],
                                                     [5, 6, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 1, 1, 0, 0, 1, 0],
                                                       [1, 1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.old_logprobs, [[0, -1, -2, -3, 0, 0, -4, 0],
                                                          [-7, -8, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.advantages, [[.5] * 5 + [-.5] * 3, [1.] * 3 + [0.] * 5])
    np.testing.assert_array_equal(batch.sequence_index, [[0] * 5 + [1] * 3, [2] * 3 + [-1] * 5])
    np.testing.assert_array_equal(batch.pack_units, [4])


def test_packed_rows_hold_the_padded_tokens():
    padded, packed = both_layouts()
    assert packed.input_tokens.shape[1] == WIDTH
    assert packed.input_tokens.shape[0] < padded.input_tokens.shape[0]
    real = unpack_to_padded(packed, np.ones(packed.loss_mask.shape, bool), G * N)
    lm = padded.loss_mask
    assert packed.loss_mask.sum() == lm.sum() and (real | ~lm).all()
    for k in ("input_tokens", "targets", "old_logprobs", "loss_mask"):
        back = unpack_to_padded(packed, getattr(packed, k), G * N)
        np.testing.assert_array_equal(back[lm], getattr(padded, k)[lm], err_msg=k)
    np.testing.assert_array_equal(unpack_to_padded(packed, packed.input_tokens, G * N)[real],
                                  padded.input_tokens[real])
    adv = unpack_to_padded(packed, packed.advantages, G * N)
    np.testing.assert_array_equal(adv[lm], np.broadcast_to(padded.advantages[:, None], lm.shape)[lm])
    # unit u holds only sequences of the padded layout's mini-batch u, in rows [u R/2, (u+1) R/2)
    rows = packed.input_tokens.shape[0] // 2
    for u in range(2):
        seq = packed.sequence_index[u * rows:(u + 1) * rows]
        assert set(seq[seq >= 0]) <= set(range(u * G * N // 2, (u + 1) * G * N // 2))


def test_row_multiple_min_rows_and_pad_packed_rows():
    _, packed = both_layouts(row_multiple=3, min_rows=7)
    units = len(packed.pack_units)
    assert packed.input_tokens.shape[0] == units * 9          # bucket(7) = 7 -> multiple of 3
    grown = pad_packed_rows(packed, 12)
    assert grown.input_tokens.shape == (units * 12, WIDTH)
    for u in range(units):
        np.testing.assert_array_equal(grown.segment_ids[u * 12:u * 12 + 9],
                                      packed.segment_ids[u * 9:(u + 1) * 9])
        assert not grown.loss_mask[u * 12 + 9:(u + 1) * 12].any()
    assert (grown.sequence_index[9:12] == -1).all()


def test_assemble_groups_packs_ragged_groups_like_its_padded_rows():
    """The loop's entry (groups of any size, a fixed row budget): pack=True holds the padded
    rows' tokens, sequence_index = the padded row, units over the row budget."""
    from brorl_jax.algo import Group, assemble_groups
    rng = np.random.default_rng(4)
    groups = []
    for n, plen in ((3, 2), (5, 4)):
        lens = rng.integers(0, S + 1, n)
        mask = np.arange(S)[None] < lens[:, None]
        groups.append(Group(prompt_ids=list(map(int, rng.integers(4, VOCAB, plen))),
                            tokens=rng.integers(4, VOCAB, (n, S)) * mask,
                            logprobs=(-3 + rng.normal(size=(n, S))).astype(np.float32) * mask,
                            mask=mask, lengths=lens, rewards=np.zeros(n), shaped=np.zeros(n)))
    adv = [rng.normal(size=g.n).astype(np.float32) for g in groups]
    padded = assemble_groups(groups, adv, rows=12, seq_len=WIDTH)
    packed = assemble_groups(groups, adv, rows=12, seq_len=WIDTH, pack=True, mini_batches=2)
    np.testing.assert_array_equal(packed.pack_units, [6, 6])
    lm = padded.loss_mask
    assert packed.loss_mask.sum() == lm.sum() > 0
    for k in ("input_tokens", "targets", "old_logprobs", "loss_mask"):
        np.testing.assert_array_equal(unpack_to_padded(packed, getattr(packed, k), 12)[lm],
                                      getattr(padded, k)[lm], err_msg=k)
    adv_back = unpack_to_padded(packed, packed.advantages, 12)
    np.testing.assert_array_equal(adv_back[lm], np.broadcast_to(padded.advantages[:, None], lm.shape)[lm])


# --------------------------------------------------------------------- losses on packed rows

def test_segment_token_counts():
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3]])
    mask = jnp.array([[0, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0]], bool)
    counts, first = segment_token_counts(mask, seg)
    np.testing.assert_array_equal(counts, [[2, 2, 2, 1, 1, 0], [1, 2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(first, [[1, 0, 0, 1, 0, 1], [1, 1, 0, 0, 1, 0]])


VARIANTS = list(itertools.product(["token_mean", "seq_mean_token_mean"], ["k1", "k2", "k3"],
                                  ["ice_pop", "truncate", "off"]))


@pytest.mark.parametrize("agg,kl,tis", VARIANTS)
def test_every_loss_variant_same_on_packed_rows(agg, kl, tis):
    """policy_loss with the aggregation weights of each layout: same loss, same metric sums, same
    per-token gradient."""
    cfg = update_config(loss_agg=agg, kl_estimator=kl, tis_mode=tis, entropy_coef=0.01, kl_coef=0.3,
                     kl_clamp=0.5)
    padded, packed = both_layouts(seed=VARIANTS.index((agg, kl, tis)))
    rng = np.random.default_rng(1)
    shape = padded.loss_mask.shape
    base = np.log(1 / VOCAB)
    x = {k: (base + s * rng.normal(size=shape)).astype(np.float32)
         for k, s in (("logp", 0.4), ("old", 0.4), ("rollout", 0.6), ("ref", 0.4))}
    x["entropy"] = (2 + rng.random(shape)).astype(np.float32)

    def run(batch, values, segments):
        def loss_of(logp):
            return policy_loss(logp, values["entropy"], old_logp=values["old"],
                               rollout_logp=values["rollout"], ref_logp=values["ref"],
                               advantages=batch.advantages, loss_mask=batch.loss_mask,
                               agg_weights=get_loss_agg(agg)(jnp.asarray(batch.loss_mask),
                                                             segments), cfg=cfg)
        (loss, sums), grad = jax.value_and_grad(loss_of, has_aux=True)(values["logp"])
        return float(loss), {k: float(v) for k, v in sums.items()}, np.asarray(grad)

    l_pad, s_pad, g_pad = run(padded, x, None)
    l_pk, s_pk, g_pk = run(packed, {k: to_packed(packed, v) for k, v in x.items()},
                           jnp.asarray(packed.segment_ids))
    assert l_pk == pytest.approx(l_pad, rel=1e-5, abs=1e-7)
    for k in s_pad:
        assert s_pk[k] == pytest.approx(s_pad[k], rel=1e-5, abs=1e-6), k
    np.testing.assert_allclose(to_packed(packed, g_pad), g_pk, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------- the model, log-probs, update

@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_logprobs_entropy_and_stats_same_on_packed_rows(model, impl):
    """The fused log-prob (Pallas kernel, interpreted on CPU, and its chunked twin) on packed rows."""
    mc, params = model
    padded, packed = both_layouts()
    cfg = update_config(temperature=0.8, micro_batch_size=4, logprob_impl=impl)
    fn = jax.jit(make_logprob_fn(mc, cfg, with_stats=True))
    lm = padded.loss_mask
    (a_lp, a_ent, a_st), (b_lp, b_ent, b_st) = fn(params, padded), fn(params, packed)
    assert b_lp.shape == packed.loss_mask.shape
    for a, b in ((a_lp, b_lp), (a_ent, b_ent), (a_st["sum_p2"], b_st["sum_p2"])):
        np.testing.assert_allclose(unpack_to_padded(packed, b, G * N)[lm], np.asarray(a)[lm],
                                   rtol=1e-5, atol=1e-5)


METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high",
           "ratio_mean", "tis_dropped_frac", "tis_weight_mean", "grad_norm", "grad_var", "finite",
           "skipped", "n_tokens", "optimizer_steps", "mass_balance/unsampled_second_moment",
           "mass_balance/sum_p2")


@pytest.mark.parametrize("agg,policy", [("token_mean", "transformer"),
                                        ("seq_mean_token_mean", "toy")])
def test_update_step_same_on_packed_rows(model, agg, policy):
    """The full step (pi_old pass, 2 PPO mini-batches, KL to a different reference, TIS,
    entropy bonus, mass-balance diagnostics): new params and every metric, with the tiny
    transformer (attention over packed rows) or the toy policy (per token, faster to compile).
    One micro-batch per mini-batch in both layouts, so grad_var (nan) is compared too; packed
    micro-batch splits are checked in the next test."""
    mc, params = model if policy == "transformer" else (None, toy_params())
    pol = None if policy == "transformer" else TOY_POLICY
    padded, packed = both_layouts(seed=3)
    base = dict(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=2, kl_coef=0.05,
                entropy_coef=0.01, temperature=0.9, loss_agg=agg, remat=False)
    cfg_pad = update_config(micro_batch_size=G * N // 2, **base)
    cfg_pk = update_config(micro_batch_tokens=100 * WIDTH, **base)
    ref_params = jax.tree.map(lambda x: 0.9 * x, params)
    padded, packed = (batch.replace(ref_logprobs=np.asarray(
        jax.jit(make_logprob_fn(mc, cfg, policy=pol))(ref_params, batch)[0]))
        for batch, cfg in ((padded, cfg_pad), (packed, cfg_pk)))
    sgd = optax.sgd(0.5)
    out = []
    for batch, cfg in ((padded, cfg_pad), (packed, cfg_pk)):
        step = jax.jit(make_update_step(mc, cfg, sgd, policy=pol, diagnostics_n=N))
        out.append(step(create_train_state(params, sgd), batch, jax.random.PRNGKey(0)))
    (s_pad, m_pad), (s_pk, m_pk) = out
    assert float(m_pad["n_tokens"]) == padded.loss_mask.sum() > 0
    for k in METRICS:
        np.testing.assert_allclose(float(m_pk[k]), float(m_pad[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    assert float(m_pad["kl"]) > 0 and float(m_pad["tis_dropped_frac"]) > 0
    # the SGD step (new - old params), to 5e-5 of its largest entry in each leaf: float32
    # summation order (the padded layout alone, micro_batch_size 8 vs 2, differs by 1.8e-5 here)
    for a, b, p in zip(jax.tree.leaves(s_pk.params), jax.tree.leaves(s_pad.params),
                       jax.tree.leaves(params)):
        step_pad, step_pk = np.asarray(b - p), np.asarray(a - p)
        assert np.abs(step_pad).max() > 0
        np.testing.assert_allclose(step_pk, step_pad, rtol=0, atol=5e-5 * np.abs(step_pad).max())


def test_packed_micro_batches_by_tokens_do_not_change_the_update():
    """micro_batch_tokens of one row and of three rows (mini-batches padded with empty rows to
    whole micro-batches) give the same params (toy policy); grad_var on packed micro-batches
    equals the brute-force estimate from independent per-micro-batch gradients."""
    _, packed = both_layouts(seed=5)
    sgd = optax.sgd(1.0)
    results = []
    for rows in (1, 3):
        cfg = update_config(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=2,
                         micro_batch_tokens=rows * WIDTH, kl_coef=0.0, loss_agg="seq_mean_token_mean")
        step = jax.jit(make_update_step(None, cfg, sgd, policy=TOY_POLICY))
        results.append(step(create_train_state(toy_params(), sgd), packed, jax.random.PRNGKey(0)))
    (s1, m1), (s3, m3) = results
    assert packed.input_tokens.shape[0] // 2 % 3 != 0          # the padding path is taken
    assert float(m3["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(s3.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # grad_var with one-row micro-batches on the first mini-batch (unit 0's rows)
    rows = packed.input_tokens.shape[0] // 2
    first = jax.tree.map(lambda v: v[:rows], packed.replace(pack_units=None))
    cfg = update_config(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=1,
                        micro_batch_tokens=WIDTH, kl_coef=0.0, entropy_coef=0.0,
                        tis_mode="ice_pop", tis_high=5.0)      # the brute force below: ICE-POP
    _, m = jax.jit(make_update_step(None, cfg, sgd, policy=TOY_POLICY))(
        create_train_state(toy_params(), sgd), first, jax.random.PRNGKey(0))
    tokens, targets = jnp.asarray(first.input_tokens), jnp.asarray(first.targets)
    mask = jnp.asarray(first.loss_mask, jnp.float32)

    def logp_of(p):
        logits = toy_logits(p, tokens, jnp.asarray(first.positions))
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]

    old = logp_of(toy_params())
    k = jnp.exp(old - first.old_logprobs)
    w_is = jnp.where((k >= 0.5) & (k <= 5.0), k, 0.0)
    adv = jnp.asarray(first.advantages)

    @jax.jit
    def row_grad(p, r):
        def loss(p):
            ratio = jnp.exp(logp_of(p) - old)
            surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
            sel = (jnp.arange(rows) == r)[:, None]
            return jnp.sum(-w_is * surr * mask * sel) / jnp.sum(mask)
        return jax.grad(loss)(p)

    grads = [row_grad(toy_params(), r) for r in range(rows)]
    flat = np.stack([rows * np.concatenate([np.ravel(g[k]) for k in sorted(g)]) for g in grads])
    brute = np.sum((flat - flat.mean(0)) ** 2) / (rows - 1) / rows
    assert brute > 0 and float(m["grad_var"]) == pytest.approx(brute, rel=1e-3)


def test_no_recompilation_while_packed_rows_stay_in_one_bucket():
    cfg = update_config(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=2,
                     micro_batch_tokens=2 * WIDTH)
    opt = optax.adam(1e-3)
    step = jax.jit(make_update_step(None, cfg, opt, policy=TOY_POLICY))
    logp = jax.jit(make_logprob_fn(algo_cfg=cfg, policy=TOY_POLICY))
    state = create_train_state(toy_params(), opt)
    rows = {}
    for seed in range(6):
        batch = assemble_update_batch(*mixed_rollouts(seed), seq_len=WIDTH, mini_batches=2)
        rows.setdefault(batch.input_tokens.shape[0], []).append(seed)
        batch = batch.replace(ref_logprobs=np.asarray(logp(state.params, batch)[0]))
        state, m = step(state, batch, jax.random.PRNGKey(seed))
        assert float(m["finite"]) == 1.0
    assert sum(len(v) for v in rows.values()) == 6 and max(len(v) for v in rows.values()) > 1
    assert step._cache_size() == len(rows) and logp._cache_size() == len(rows)
    # short responses fall into a smaller bucket: one more shape, not one per step
    short = assemble_update_batch(*mixed_rollouts(0, max_len=1), seq_len=WIDTH, mini_batches=2)
    assert short.input_tokens.shape[0] not in rows


def test_packed_batch_errors_name_the_fix():
    cfg = update_config(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=4)
    step = make_update_step(None, cfg, optax.sgd(1.0), policy=TOY_POLICY)
    state = create_train_state(toy_params(), optax.sgd(1.0))
    _, packed = both_layouts(mini_batches=2)
    with pytest.raises(ValueError, match="mini_batches=algo.ppo_mini_batches"):
        step(state, packed, None)
    small = update_config(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=2,
                       micro_batch_tokens=WIDTH - 1)
    with pytest.raises(ValueError, match="micro_batch_tokens' = 12 is less than one row of 13"):
        make_update_step(None, small, optax.sgd(1.0), policy=TOY_POLICY)(state, packed, None)
    with pytest.raises(ValueError, match="mini_batches=3 must be >= 1 and divide"):
        assemble_update_batch(*mixed_rollouts(), seq_len=WIDTH, mini_batches=3)
    bad = packed.replace(advantages=packed.advantages[:, 0])
    with pytest.raises(ValueError, match="per-token advantages"):
        make_update_step(None, update_config(ppo_mini_batches=2), optax.sgd(1.0),
                         policy=TOY_POLICY)(state, bad, None)
