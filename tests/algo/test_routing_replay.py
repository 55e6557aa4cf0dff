"""Rollout routing replay (R3, algo/routing_replay.py, rollout/routing.py) on a tiny Qwen3-MoE:
the rollout records the experts its forward chose; the update replays them; the door refuses the
setting on a dense model. The bf16-rollout-vs-f32-update table is bench/moe_replay.py's."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testutil import tiny_model_config  # noqa: E402

from brorl_jax import algo  # noqa: E402
from brorl_jax.algo import moe_losses, routing_metrics, routing_replay  # noqa: E402
from brorl_jax.algo.batch import assemble_groups  # noqa: E402
from brorl_jax.config import ConfigError, default_config, update_config, validate  # noqa: E402
from brorl_jax.models import forward, init_params  # noqa: E402
from brorl_jax.rollout import Engine  # noqa: E402
from brorl_jax.train.door import check_routing_replay  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
N, S = 3, 6


def _moe(**changes):
    return tiny_model_config(**dict(dict(
        model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True), **changes))


@pytest.fixture(scope="module")
def moe():
    cfg = _moe()
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _groups(res):
    """The rollout's groups as the trainer keeps them (algo.Group, routing carried)."""
    return [algo.Group(prompt_ids=p, tokens=res.tokens[g], logprobs=res.logprobs[g],
                       mask=res.mask[g], lengths=res.lengths[g], rewards=np.zeros(N, np.float32),
                       shaped=np.zeros(N, np.float32), routing=res.routing[g],
                       prompt_routing=res.prompt_routing[g]) for g, p in enumerate(PROMPTS)]


def _own_routing(params, cfg, batch):
    seg = batch.segment_ids
    _, ids = forward(params, cfg, jnp.asarray(batch.input_tokens),
                     positions=jnp.asarray(batch.positions),
                     segment_ids=None if seg is None else jnp.asarray(seg),
                     return_hidden=True, return_routing=True)
    return np.moveaxis(np.asarray(ids), 0, 2)                          # [R, T, L, K]


def test_recorded_routing_is_the_forwards_own_and_lands_on_the_batchs_tokens(moe):
    cfg, params = moe
    res = Engine(cfg, record_routing=True).generate(
        params, PROMPTS, rollouts_per_prompt=N, max_new_tokens=S, temperature=1.0, seed=1)
    assert res.routing.shape == (2, N, S, 2, 2) and res.routing.dtype == np.int8
    for g, p in enumerate(PROMPTS):
        for n in range(N):
            length = int(res.lengths[g, n])
            seq = jnp.asarray([p + list(res.tokens[g, n, :length])])
            _, ids = forward(params, cfg, seq, return_routing=True)
            own = np.asarray(ids)[:, 0].transpose(1, 0, 2)             # [T, L, K]
            np.testing.assert_array_equal(res.prompt_routing[g], own[:len(p)])
            np.testing.assert_array_equal(res.routing[g, n, :length - 1],
                                          own[len(p):len(p) + length - 1])
            assert not res.routing[g, n, length - 1:].any()   # the last token is no input
    # the batch's routing, packed and padded, is the forward's own at every loss position
    advs = [np.ones(N, np.float32)] * 2
    for pack in (True, False):
        batch = assemble_groups(_groups(res), advs, rows=2 * N, seq_len=16, pack=pack,
                                mini_batches=1)
        batch = routing_replay.attach_routing(batch, _groups(res), 2 * N)
        assert batch.routing.shape == batch.input_tokens.shape + (2, 2)
        batch.check_shapes()
        loss = np.asarray(batch.loss_mask)
        assert loss.sum() > 0
        np.testing.assert_array_equal(batch.routing[loss], _own_routing(params, cfg, batch)[loss])


def test_replay_brings_the_f32_update_to_the_bf16_rollouts_logprobs():
    """The issue's setting: the rollout runs bf16, the update f32, so some tokens route
    differently; with the rollout's routing replayed the update's log-probs are closer."""
    wide = dict(num_experts=64, num_experts_per_tok=8)     # many experts: near ties
    cfg, bf16 = _moe(**wide), _moe(dtype="bfloat16", **wide)
    params = init_params(cfg, jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map_with_path(      # experts that matter: x3 their weights
        lambda path, x: 3 * x if "proj" in str(path) and "moe" in str(path) else x, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 64, size=(2, N, S)).astype(np.int32)
    seqs = [[p + list(tokens[g, n]) for n in range(N)] for g, p in enumerate(PROMPTS)]
    groups = []
    for g, p in enumerate(PROMPTS):
        x = jnp.asarray(seqs[g])
        logits, ids = forward(params, bf16, x, return_routing=True)     # "the rollout"
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        lp = np.take_along_axis(np.asarray(lp)[:, len(p) - 1:-1], tokens[g][..., None], -1)[..., 0]
        ids = np.moveaxis(np.asarray(ids), 0, 2).astype(np.int8)         # [N, T, L, K]
        groups.append(algo.Group(
            prompt_ids=p, tokens=tokens[g], logprobs=lp, mask=np.ones((N, S), bool),
            lengths=np.full(N, S), rewards=np.zeros(N, np.float32),
            shaped=np.zeros(N, np.float32), routing=ids[:, len(p):], prompt_routing=ids[0, :len(p)]))
    batch = assemble_groups(groups, [np.ones(N, np.float32)] * 2, rows=2 * N, seq_len=16,
                            pack=True, mini_batches=1)
    batch = routing_replay.attach_routing(batch, groups, 2 * N)
    acfg = update_config(default_config())
    m = routing_metrics.routing_metrics(cfg, acfg, params, batch)
    assert m["moe/routing_mismatch_frac"] > 0          # bf16 and f32 do route differently here
    assert m["moe/logprob_gap_mean"] < 0.7 * m["moe/logprob_gap_mean_noreplay"]
    off = routing_metrics.routing_metrics(cfg, acfg, params, batch.replace(routing=None))
    assert off["moe/logprob_gap_mean"] == off["moe/logprob_gap_mean_noreplay"]
    # the load-balancing loss (algo/moe_losses.py) of the sample's own routing, either way
    rows, _, _ = routing_metrics.sample_rows(batch)
    _, logits = forward(params, cfg, jnp.asarray(rows.input_tokens),
                        positions=jnp.asarray(rows.positions),
                        segment_ids=jnp.asarray(rows.segment_ids), return_router_logits=True)
    aux = moe_losses.load_balancing_loss(logits, 8, rows.segment_ids > 0)
    assert m["moe/aux_loss"] == off["moe/aux_loss"] == pytest.approx(float(aux), rel=1e-6)
    assert routing_metrics.routing_metrics(tiny_model_config(), acfg, params, batch) == {}


def test_routing_replay_is_refused_on_a_dense_model():
    cfg = default_config()
    cfg.algo.routing_replay = "rollout"
    run = validate(cfg)
    with pytest.raises(ConfigError, match="'algo.routing_replay' = 'rollout'.*no experts"):
        check_routing_replay(run, tiny_model_config())
    check_routing_replay(run, _moe())                                    # a MoE model: fine
    cfg.algo.routing_replay = "always"
    with pytest.raises(ConfigError, match="algo.routing_replay"):
        validate(cfg)
    with pytest.raises(ValueError, match="no experts"):
        Engine(tiny_model_config(), record_routing=True)
