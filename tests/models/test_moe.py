"""The mixture-of-experts block (brorl_jax/models/moe.py): the grouped GEMM against its dense
reference, the router's top-k and gates, Qwen2-MoE's shared expert, and the routing hook of
forward() (routing replay). Parity with transformers' Qwen3-MoE and Qwen2-MoE is in
test_hf_checkpoint.py (logits, save and reload) and tests/rollout/test_hf_greedy.py (greedy
generation)."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testutil import hf_config, transformers
from testutil import tiny_model_config

import pallas_kernels as pk
from brorl_jax.models import ModelConfig, forward, init_params, layer_finish, layer_finish_routed
from brorl_jax.models.moe import SparseMoeBlock, experts_dense, experts_ragged, route
from brorl_jax.models.transformer import layer_loop_form

N, D, E, K, I = 10, 16, 4, 2, 8     # tokens, hidden, experts, top-k, expert width


def _inputs(seed: int = 0):
    """Hidden rows, router logits (expert 3 never chosen: an empty group) and expert weights."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (N, D))
    logits = jax.random.normal(ks[1], (N, E)).at[:, 3].set(-30.0)
    weights = [0.3 * jax.random.normal(ks[2], (E, D, I)),
               0.3 * jax.random.normal(ks[3], (E, D, I)),
               0.3 * jax.random.normal(ks[4], (E, I, D))]
    return x, logits, weights


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_is_the_top_k_of_the_softmax_and_replay_keeps_the_routers_gates(norm_topk_prob):
    _, logits, _ = _inputs()
    probs = np.asarray(jax.nn.softmax(logits, -1))
    ids, gates = route(logits, K, norm_topk_prob)
    want_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    want = np.take_along_axis(probs, want_ids, -1)
    if norm_topk_prob:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(gates, want, rtol=1e-6)
    # replay: other experts (ranked 2nd to K+1st), gates the router's probabilities there
    replay = np.argsort(-probs, axis=-1, kind="stable")[:, 1:K + 1].astype(np.int32)
    ids, gates = route(logits, K, norm_topk_prob, routing=jnp.asarray(replay))
    want = np.take_along_axis(probs, replay, -1)
    if norm_topk_prob:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, replay)
    np.testing.assert_allclose(gates, want, rtol=1e-5)
    # the router learns through the replayed gates
    grad = jax.grad(lambda lg: route(lg, K, norm_topk_prob, jnp.asarray(replay))[1][:, 0].sum())
    assert float(jnp.abs(grad(logits)).max()) > 1e-3
    with pytest.raises(ValueError, match="routing shape"):
        route(logits, K, norm_topk_prob, routing=jnp.asarray(replay[:, :1]))


def test_grouped_gemm_equals_the_dense_reference_values_and_gradients():
    x, logits, weights = _inputs(1)

    def loss(fn, x, logits, weights):
        ids, gates = route(logits, K, True)
        out = fn(x, ids, gates, *weights)
        return jnp.sum(out * jnp.cos(out)), out

    (_, want), want_grads = jax.jit(jax.value_and_grad(
        functools.partial(loss, experts_dense), (0, 1, 2), has_aux=True))(x, logits, weights)
    (_, got), got_grads = jax.jit(jax.value_and_grad(
        functools.partial(loss, experts_ragged), (0, 1, 2), has_aux=True))(x, logits, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(got_grads[1]).max()) > 1e-3            # the router's gradient
    np.testing.assert_array_equal(got_grads[2][0][3], 0.0)       # the unused expert's
    # the expert each token went to really is the one applied: one expert, gate 1
    ids = np.asarray(jnp.argmax(logits, -1))[:, None]
    one = np.asarray(experts_ragged(x, jnp.asarray(ids), jnp.ones((N, 1)), *weights))
    w_g, w_u, w_d = (np.asarray(w)[ids[:, 0]] for w in weights)     # each token's expert
    xn = np.asarray(x)
    g, u = np.einsum("nd,ndi->ni", xn, w_g), np.einsum("nd,ndi->ni", xn, w_u)
    want = np.einsum("ni,nid->nd", g / (1 + np.exp(-g)) * u, w_d)
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)


def _moe_config(**changes) -> ModelConfig:
    return tiny_model_config(**dict(dict(
        model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True), **changes))


def test_forward_returns_its_routing_and_replaying_it_changes_nothing():
    cfg = _moe_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert params["layers"]["moe"]["gate_proj"].shape == (2, E, 32, I)
    assert params["layers"]["moe"]["router"].shape == (2, 32, E)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, cfg.vocab_size)
    fwd = jax.jit(functools.partial(forward, cfg=cfg, return_routing=True))
    logits, routing = fwd(params, tokens=tokens)
    assert routing.shape == (2, 2, 7, K) and routing.dtype == jnp.int32
    replayed, used = fwd(params, tokens=tokens, routing=routing)
    np.testing.assert_array_equal(used, routing)
    np.testing.assert_array_equal(replayed, logits)
    other = (routing + 1) % E                     # every token to other experts: other logits
    replayed, used = fwd(params, tokens=tokens, routing=other)
    np.testing.assert_array_equal(used, other)
    assert float(jnp.abs(replayed - logits).max()) > 1e-4
    with pk.compile_target("cuda"):               # the GPU/TPU form: layer by layer, unrolled
        assert layer_loop_form() == "unrolled"
        unrolled, used = fwd(params, tokens=tokens, routing=other)
    np.testing.assert_array_equal(used, other)
    np.testing.assert_allclose(unrolled, replayed, atol=1e-5)


def test_forward_gives_router_logits_whose_top_k_is_its_routing():
    """return_router_logits (the load-balancing loss, algo/moe_losses.py): each layer's float32
    router logits, in the scan and the unrolled form; the output is unchanged."""
    cfg = _moe_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, cfg.vocab_size)
    fwd = jax.jit(functools.partial(forward, cfg=cfg, return_routing=True,
                                    return_router_logits=True))
    for form in (contextlib.nullcontext(), pk.compile_target("cuda")):   # scan, unrolled
        with form:
            out, ids, logits = fwd(params, tokens=tokens)
        assert logits.shape == (2, 2, 7, E) and logits.dtype == jnp.float32
        np.testing.assert_array_equal(jax.lax.top_k(logits, K)[1], ids)
        np.testing.assert_allclose(out, forward(params, cfg, tokens), atol=1e-5)


def test_the_decode_loops_layer_functions_take_and_give_the_routing():
    cfg = _moe_config()
    layer = jax.tree.map(lambda p: p[0], init_params(cfg, jax.random.PRNGKey(0))["layers"])
    x, attn = jax.random.normal(jax.random.PRNGKey(2), (2, 2, 3, 32))
    attn = attn.reshape(2, 3, 4, 8)

    @jax.jit
    def run(layer, x, attn):
        out, ids = layer_finish_routed(layer, cfg, x, attn)
        return (out, ids, layer_finish(layer, cfg, x, attn),
                layer_finish_routed(layer, cfg, x, attn, ids)[0],
                layer_finish_routed(layer, cfg, x, attn, (ids + 1) % E)[0])

    out, ids, plain, replayed, other = run(layer, x, attn)
    assert ids.shape == (2, 3, K)
    np.testing.assert_array_equal(plain, out)
    np.testing.assert_array_equal(replayed, out)
    assert float(jnp.abs(other - out).max()) > 1e-4


def test_routing_is_refused_for_a_dense_model():
    cfg = tiny_model_config()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="has no experts"):   # when traced
        jax.eval_shape(lambda p, t: forward(p, cfg, t, return_routing=True), params,
                       jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="model_type='qwen2' is dense"):
        tiny_model_config(num_experts=4)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        _moe_config(num_experts_per_tok=5)


def test_qwen3_moe_config_round_trips_and_dense_layers_among_sparse_are_refused():
    hf = hf_config("qwen3_moe").to_dict()
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.is_moe and cfg.qk_norm and cfg.norm_topk_prob and cfg.router_aux_loss_coef == 0.001
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    for bad in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ValueError, match="every layer must be sparse"):
            ModelConfig.from_hf_config({**hf, **bad}, source="m/config.json")
    with pytest.raises(ValueError, match="'moe_intermediate_size' is missing"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items() if k != "moe_intermediate_size"})


def test_qwen2_moe_config_round_trips_and_dense_layers_among_sparse_are_refused():
    hf = hf_config("qwen2_moe").to_dict()
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.mlp_width) == (8, 2, 32, 48, 2 * 32 + 48)
    assert cfg.is_moe and cfg.attention_bias and not cfg.o_proj_bias  # q/k/v biases only
    assert not (cfg.qk_norm or cfg.norm_topk_prob) and cfg.router_aux_loss_coef == 0.001
    back = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(back) == cfg
    assert ModelConfig.from_hf_config(transformers.AutoConfig.for_model(**back).to_dict()) == cfg
    assert not ModelConfig.from_hf_config({**hf, "qkv_bias": False}).attention_bias
    for bad in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ValueError, match="m/config.json: mlp_only_layers=.*every layer must "
                                             "be sparse"):
            ModelConfig.from_hf_config({**hf, **bad}, source="m/config.json")
    with pytest.raises(ValueError, match="'shared_expert_intermediate_size' is missing"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items()
                                    if k != "shared_expert_intermediate_size"})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=48 for model_type="
                                         "'qwen3_moe'"):
        _moe_config(shared_expert_intermediate_size=48)


def test_the_shared_expert_adds_its_gated_mlp_and_leaves_the_routing_alone():
    """Qwen2-MoE's block = the routed experts (the same block without the shared expert, same
    ids) + sigmoid(h w) * down(silu(gate(h)) * up(h)) (numpy); replaying its ids changes
    nothing."""
    s = 12
    cfg = _moe_config(model_type="qwen2_moe", qk_norm=False, attention_bias=True,
                      norm_topk_prob=False, shared_expert_intermediate_size=s)
    x = jax.random.normal(jax.random.PRNGKey(3), (N, D))
    params = jax.tree.map(lambda p: 10 * p,       # N(0, 0.2): a shared term far above noise
                          SparseMoeBlock(cfg).init(jax.random.PRNGKey(4), x)["params"])
    assert {k: v.shape for k, v in params.items() if k.startswith("shared")} == {
        "shared_gate_proj": (D, s), "shared_up_proj": (D, s), "shared_down_proj": (s, D),
        "shared_expert_gate": (D, 1)}
    plain = cfg.replace(model_type="qwen3_moe", shared_expert_intermediate_size=0)

    @jax.jit      # one compile
    def run(params, x):
        out, ids = SparseMoeBlock(cfg).apply({"params": params}, x)
        routed = {k: v for k, v in params.items() if not k.startswith("shared")}
        return (out, ids, SparseMoeBlock(plain).apply({"params": routed}, x),
                SparseMoeBlock(cfg).apply({"params": params}, x, ids))

    out, ids, (base, base_ids), (replayed, used) = run(params, x)
    np.testing.assert_array_equal(ids, base_ids)
    xn, p = np.asarray(x, np.float64), {k: np.asarray(v, np.float64) for k, v in params.items()}
    g, u = xn @ p["shared_gate_proj"], xn @ p["shared_up_proj"]
    shared = (g / (1 + np.exp(-g)) * u) @ p["shared_down_proj"]
    shared = shared / (1 + np.exp(-(xn @ p["shared_expert_gate"])))
    assert np.abs(shared).max() > 0.1
    np.testing.assert_allclose(out, np.asarray(base) + shared, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(used, ids)
    np.testing.assert_array_equal(replayed, out)


# Qwen/Qwen3-30B-A3B's config.json as the Hub ships it (written out: nothing is downloaded).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_qwen3_30b_a3b_loads_as_config_and_the_plans_count_every_expert():
    """The parameter count the door's memory plans read (hf.param_shapes) holds all 128
    experts of every layer: the model card's 30.5B, by hand from the shapes."""
    from brorl_jax.models.hf import param_shapes
    from brorl_jax.rollout.plan import rollout_params_bytes
    cfg = ModelConfig.from_hf_config(QWEN3_30B_A3B, dtype="bfloat16")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_width) == (128, 8, 8 * 768)
    n = sum(int(x.size) for x in jax.tree.leaves(param_shapes(cfg)))
    d, v, layers, e, i = 2048, 151936, 48, 128, 768
    attention = 2 * d * 32 * 128 + 2 * d * 4 * 128 + 2 * 128 + 2 * d   # q, o; k, v; norms
    assert n == 2 * v * d + d + layers * (attention + d * e + 3 * e * d * i) == 30_532_122_624
    assert rollout_params_bytes(cfg, n) == 2 * n
