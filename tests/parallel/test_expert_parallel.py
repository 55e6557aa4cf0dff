"""Expert parallelism (parallel/expert_parallel.py, mesh.expert): the layout it resolves, and on 8
simulated CPU devices (mesh expert=4 x tensor=2, a tiny qwen3_moe with 8 experts top-2; the
subprocess is _expert_parallel_worker.py) the forward, the replayed-routing block and its
gradients, and one full update step (make_sharded_update with routing replayed) against one
device."""
from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from parallel_testutil import run_script
from testutil import tiny_model_config

from brorl_jax.config import ConfigError, default_config, validate
from brorl_jax.parallel import rules as R
from brorl_jax.parallel.expert_parallel import (
    capacity,
    exchange_bytes,
    expert_parallel_specs,
    expert_width_axis,
    rollout_param_specs,
)
from brorl_jax.train.door import check_expert_mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def test_expert_axis_of_one_leaves_the_tables_alone_and_above_one_splits_experts_and_rows():
    plain = AbstractMesh((2, 4, 1, 1), MESH_AXES)
    assert R.for_mesh("default", plain) == "default"
    assert expert_parallel_specs(plain, 64, 8) is None
    ep = AbstractMesh((2, 1, 4, 1), MESH_AXES)
    table = R.for_mesh("default", ep)
    assert table["batch"] == ("data", "fsdp", "expert") and table["experts"] == ("expert", "fsdp")
    assert R.logical_to_spec(("layers", "experts", "embed", "expert_mlp"), table) == P(
        None, ("expert", "fsdp"), None, "tensor")
    assert expert_parallel_specs(ep, 64, 8) == expert_parallel_specs(ep, 8, 8) == ("data",
                                                                                   "expert")
    # the tokens must split over the expert axis (4 split over data only), the experts too;
    # else the block runs as on one device
    assert expert_parallel_specs(ep, 4, 8) is None and expert_parallel_specs(ep, 64, 6) is None
    # each expert's width stays over tensor inside the exchange when tensor divides it
    assert expert_width_axis(ep, 32) is None
    ep_tp = AbstractMesh((1, 1, 4, 2), MESH_AXES)
    assert expert_width_axis(ep_tp, 32) == "tensor" and expert_width_axis(ep_tp, 33) is None


def test_exchange_bytes_count_the_exact_capacity_buffer():
    # 4 devices, 16 tokens x top-2 each: C = 32 rows of 64 floats, 3 of the 4 slices leave
    assert exchange_bytes(16, 2, 64, 4, 4) == 3 * 32 * 64 * 4
    assert exchange_bytes(16, 2, 64, 1, 4) == 0
    # a capacity factor c: C = ceil(c x 32 / 4) rows a destination, never above the exact 32
    assert capacity(16, 2, 4, 1.0) == 8 and capacity(16, 2, 4, 1.5) == 12
    assert capacity(16, 2, 4, 0.0) == capacity(16, 2, 4, 100.0) == 32
    assert exchange_bytes(16, 2, 64, 4, 4, capacity_factor=1.0) == 3 * 8 * 64 * 4


def test_the_rollout_copy_holds_the_devices_experts():
    """rollout.plan.rollout_params_bytes under expert parallelism (what the door counts):
    Qwen3-30B-A3B's bf16 copy, 56.9 GiB whole, 9.6 GiB with 16 of its 128 experts a device."""
    import jax

    from brorl_jax.models import init_params
    from brorl_jax.rollout.plan import rollout_params_bytes
    from configs import brorl_64gpu
    mc = brorl_64gpu.qwen3_30b_a3b(param_dtype="bfloat16", dtype="bfloat16")
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        lambda: init_params(mc, jax.random.PRNGKey(0)))))
    whole, split = rollout_params_bytes(mc, n), rollout_params_bytes(mc, n, 8)
    experts = mc.num_hidden_layers * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size
    assert whole == 2 * n and whole - split == 2 * experts * 7 // 8
    assert round(whole / 2**30, 1) == 56.9 and round(split / 2**30, 1) == 9.6
    assert rollout_params_bytes(mc, n, 3) == whole                # 3 does not divide 128
    assert rollout_params_bytes(tiny_model_config(), 1000, 8) == 4000      # dense, float32


def test_an_expert_axis_needs_experts_that_split_over_it():
    cfg = default_config()
    cfg.mesh.expert = 4
    run = validate(cfg)
    moe = dict(model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts_per_tok=2,
               moe_intermediate_size=16, norm_topk_prob=True)
    check_expert_mesh(run, tiny_model_config(num_experts=8, **moe))
    with pytest.raises(ConfigError, match=r"'mesh.expert'=4 does not divide the model's 6 "):
        check_expert_mesh(run, tiny_model_config(num_experts=6, **moe))
    with pytest.raises(ConfigError, match=r"'mesh.expert'=4 splits .* model_type='qwen2' has "):
        check_expert_mesh(run, tiny_model_config())
    check_expert_mesh(validate(default_config()), tiny_model_config())     # off: fine
    cfg.mesh.expert = 0
    with pytest.raises(ConfigError, match=r"'mesh.expert' must be > 0"):
        validate(cfg)


def test_the_rollout_splits_the_routed_experts_only():
    """A rollout layer's params (one dict a layer) whose hidden size and shared-expert width
    equal the number of experts (32): only the routed experts' [E, ...] leaves go over `expert`;
    Qwen2-MoE's shared expert and the router stay whole."""
    import jax

    from brorl_jax.models import init_params
    cfg = tiny_model_config(model_type="qwen2_moe", num_experts=32, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=32)
    assert cfg.hidden_size == 32
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), jax.eval_shape(
        lambda: init_params(cfg, jax.random.PRNGKey(0)))["layers"])
    specs = rollout_param_specs(layer, cfg.num_experts)["moe"]
    assert {k for k, s in specs.items() if s == P("expert")} == {"gate_proj", "up_proj",
                                                                  "down_proj"}
    assert len(specs) == 8 and all(specs[k] == P() for k in specs if k.startswith("shared"))


@pytest.mark.slow     # four compiles on 8 devices (about 20 s)
def test_expert_parallel_forward_replay_gradients_and_update_equal_one_device(tmp_path):
    out = tmp_path / "ep.npz"
    run_script("_expert_parallel_worker.py", [str(out)], num_devices=8)
    r = dict(np.load(out))
    assert r["mesh/id_exchanges"] >= 2       # the tokens were exchanged (the layers, the block)
    assert str(r["mesh/gate_proj_spec"]) == str(P(None, ("expert", "fsdp"), None, "tensor"))
    assert tuple(r["mesh/gate_proj_shard_shape"]) == (2, 2, 64, 16)    # [L, E/4, D, I/2]
    np.testing.assert_array_equal(r["mesh/routing"], r["ref/routing"])
    assert len(np.unique(r["ref/routing"])) == 8                 # every expert is used
    np.testing.assert_allclose(r["mesh/logits"], r["ref/logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["mesh/replayed_out"], r["ref/replayed_out"], rtol=1e-5,
                               atol=1e-6)
    grads = sorted(k for k in r if k.startswith("ref/grads"))
    assert len(grads) == 5                 # router, gate/up/down experts, the block's input
    for k in grads:
        np.testing.assert_allclose(r["mesh" + k[3:]], r[k], rtol=1e-5, atol=1e-5, err_msg=k)
        assert np.abs(r[k]).max() > 0.1, k                     # a gradient that can differ
    # one full RL update (make_sharded_update: pi_old pass, 2 PPO mini-batches, KL term, SGD,
    # int8 routing replayed) against make_update_step on one device
    # the update exchanged tokens (measured 3: the pi_old pass, the gradient pass's forward and
    # its backward's rematerialised one; 0 with make_sharded_update not traced on the mesh)
    assert r["update/mesh/id_exchanges"] >= 2
    for name in ("loss", "grad_norm", "kl"):     # measured: rel. 1.3e-7 at most
        np.testing.assert_allclose(r[f"update/mesh/{name}"], r[f"update/ref/{name}"], rtol=1e-6,
                                   err_msg=name)
    assert r["update/ref/kl"] > 0.01                             # the KL term is in the loss
    params = sorted(k[len("update/ref/"):] for k in r if k.startswith("update/ref/params"))
    assert len(params) == 15                         # every leaf of the model, the experts too
    for k in params:
        # measured: 8.2e-8 at most (the embedding's, a few float32 ulps of its entries)
        np.testing.assert_allclose(r[f"update/mesh/{k}"], r[f"update/ref/{k}"], rtol=0,
                                   atol=1e-6, err_msg=k)
        # each leaf's step exceeds the tolerance, so a wrong gradient anywhere is seen (the
        # smallest, the router's, is 2.6e-5; the embedding's and lm_head's 0.12)
        assert np.abs(r[f"update/ref/{k}"] - r[f"update/before/{k}"]).max() > 1e-5, k
    # the rollout, expert parallel (MeshRuntime on the same mesh, _expert_rollout.py): each
    # device holds 2 of the 8 experts of every layer and the decode program exchanges tokens;
    # samples, their log-probs and the recorded routing equal one device's (measured 9.5e-7)
    assert str(r["mesh/roll_gate_spec"]) == str(P("expert"))
    assert tuple(r["mesh/roll_gate_shard_shape"]) == (2, 64, 32)          # [E/4, D, I]
    assert str(r["mesh/roll_router_spec"]) == str(P())
    assert r["mesh/roll_decode_all_to_alls"] >= 3 * 2                # ids, rows, back; 2 layers
    for k in ("tokens", "lengths", "routing"):
        np.testing.assert_array_equal(r[f"mesh/roll_{k}"], r[f"ref/roll_{k}"], err_msg=k)
    assert len(np.unique(r["ref/roll_routing"])) == 8                # every expert is used
    np.testing.assert_allclose(r["mesh/roll_logprobs"], r["ref/roll_logprobs"], atol=1e-5)
    # mesh.expert_capacity_factor: exact (0) keeps every row; 1.0 drops the rows past each
    # destination's C = n K / 4 and equals the reference without their gates
    assert 0.5 < r["capacity/kept_frac"] < 1.0                        # some rows were dropped
    np.testing.assert_allclose(r["capacity/0.0/out"], r["capacity/ref_exact"], atol=1e-5)
    np.testing.assert_allclose(r["capacity/1.0/out"], r["capacity/ref_dropped"], atol=1e-5)
    assert np.abs(r["capacity/1.0/out"] - r["capacity/ref_exact"]).max() > 1e-2
