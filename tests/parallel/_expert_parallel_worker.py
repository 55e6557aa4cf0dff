"""Subprocess body for test_expert_parallel.py: expert parallelism on 8 simulated CPU devices.

Usage: python _expert_parallel_worker.py OUT.npz
XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported (the test
sets it). A tiny qwen3_moe model (8 experts, top-2) on a mesh expert=4 x tensor=2: the experts
split over `expert` (rules.EXPERT_PARALLEL), their width over `tensor`, the tokens exchanged
(parallel/expert_parallel.py).
From the same inputs the script computes on one device (plain jax.jit) and on the mesh: the
logits and routing of a forward with the model's own routing, and one layer's block with
replayed routing (random expert ids, as algo.routing_replay="rollout" hands the update): its
output and gradients (one program per side, the mesh one through algo.sharded_steps.traced_on);
then one full RL update step, algo.make_update_step on one device against
algo.sharded_steps.make_sharded_update on the same mesh (full_update). It saves both sides, the
sharding of the experts, and how many all-to-alls of expert ids each compiled mesh program
holds; and the expert-parallel rollout against one device's (_expert_rollout.py). The assertions
live in the test.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _expert_rollout import rollout_checks
from _sharded_worker import update_batch
from jax.sharding import NamedSharding, PartitionSpec as P
from testutil import small_model_config

from brorl_jax.algo import create_train_state, make_update_step, sharded_steps as algo_sharded
from brorl_jax.config import update_config
from brorl_jax.models import forward, init_params
from brorl_jax.models.moe import SparseMoeBlock
from brorl_jax.parallel import rules, sharded
from brorl_jax.parallel.mesh import make_mesh

ROWS, SEQ, EXPERTS, TOP_K = 8, 16, 8, 2
UPDATE_LR = 0.5       # SGD: steps of 2.6e-5 (the router) to 0.13 (embedding, lm_head)


def replayed(cfg, rng, lead) -> np.ndarray:
    """Random top-k expert ids (distinct per token), as a rollout's record would be."""
    return np.argsort(rng.random((*lead, cfg.num_experts)), axis=-1)[..., :TOP_K].astype(
        np.int32)


def id_exchanges(compiled) -> int:
    """The all-to-alls of int32 expert ids under a shard_map in a compiled program: the
    exchange's signature (XLA's own resharding moves float activations with all-to-alls too, and
    in the update the int routing batch between splits, none of them under a shard_map)."""
    return sum("all-to-all(" in line and "s32[" in line.split("all-to-all(")[0]
               and "shard_map/all_to_all" in line for line in compiled.as_text().splitlines())


def main(out_path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg = small_model_config(model_type="qwen3_moe", qk_norm=True, attention_bias=False,
                             num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                             moe_intermediate_size=32, norm_topk_prob=True)
    rng = np.random.default_rng(0)
    # N(0, 0.08) weights: decided routers (no near-ties for the float order to flip), drawn in
    # numpy from the shapes (init_params compiles for seconds)
    params = jax.tree.map(
        lambda s: (0.08 * rng.standard_normal(s.shape) if len(s.shape) >= 2
                   else np.ones(s.shape)).astype(np.float32),
        jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
    tokens = rng.integers(4, cfg.vocab_size, (ROWS, SEQ)).astype(np.int32)
    moe = jax.tree.map(lambda a: a[0], params["layers"]["moe"])        # layer 0's block
    h = rng.normal(size=(ROWS * SEQ, cfg.hidden_size)).astype(np.float32)
    replay = replayed(cfg, rng, (ROWS * SEQ,))
    weights = rng.normal(size=h.shape).astype(np.float32)

    def step(p, t, m, x, r, w):
        """The model's logits and routing (its own), and one layer's block with replayed
        routing: its output and the gradients of a loss through it (the update's backward)."""
        logits, own = forward(p, cfg, t, return_routing=True)
        block = lambda q, y: SparseMoeBlock(cfg).apply({"params": q}, y, r)[0]
        loss = lambda q, y: (jnp.sum(block(q, y) * w), block(q, y))
        grads, out = jax.grad(loss, argnums=(0, 1), has_aux=True)(m, x)
        return logits, own, out, grads

    names = ("logits", "routing", "replayed_out", "grads")
    args = (params, tokens, moe, h, replay, weights)
    out = dict(zip((f"ref/{n}" for n in names), jax.jit(step)(*args)))
    mesh = make_mesh({"expert": 4, "tensor": 2})
    param_sh = rules.param_shardings(params, mesh)
    split = rules.logical_to_spec(rules.ARRAY_AXES["rows"], rules.for_mesh("default", mesh))
    rows = NamedSharding(mesh, P(*split, None))
    moe_sh = {k: NamedSharding(mesh, P(None if k == "router" else "expert")) for k in moe}
    mesh_step = jax.jit(algo_sharded.traced_on(mesh, step),
                        in_shardings=(param_sh, rows, moe_sh, rows, rows, rows))
    args = (sharded.place(params, param_sh),
            *jax.device_put(args[1:], (rows, moe_sh) + (rows,) * 3))
    compiled = mesh_step.lower(*args).compile()
    out["mesh/id_exchanges"] = id_exchanges(compiled)     # the model's layer, the block
    out.update(zip((f"mesh/{n}" for n in names), compiled(*args)))
    out["mesh/gate_proj_spec"] = str(param_sh["layers"]["moe"]["gate_proj"].spec)
    out["mesh/gate_proj_shard_shape"] = (
        args[0]["layers"]["moe"]["gate_proj"].addressable_shards[0].data.shape)
    flat = {}
    for k, v in out.items():
        if k.endswith("/grads"):
            for path, leaf in jax.tree_util.tree_flatten_with_path(v)[0]:
                flat[k + jax.tree_util.keystr(path)] = leaf
        else:
            flat[k] = v
    flat.update(full_update(cfg, params, mesh, rng))
    flat.update(rollout_checks(cfg, params, rng))       # _expert_rollout.py
    flat.update(capacity_checks(cfg, moe, h, mesh, (moe_sh, rows)))
    np.savez(out_path, **{k: np.asarray(v) for k, v in flat.items()})


def capacity_checks(cfg, moe, h, mesh, shardings) -> dict:
    """One MoE block on the mesh with mesh.expert_capacity_factor = 1 (C = n K / 4 rows to each
    destination: some dropped) against the dense reference whose dropped choices' gates are 0,
    the drops found as parallel/expert_parallel._dispatch makes them: per device (its n tokens,
    the expert axis's share), the n K rows sorted by expert stably, each destination's first C
    rows kept."""
    from brorl_jax.models.moe import experts_dense, route
    from brorl_jax.parallel.expert_parallel import capacity
    out = {}
    for factor in (0.0, 1.0):
        c = dataclasses.replace(cfg, expert_capacity_factor=factor)
        block = lambda q, y, c=c: SparseMoeBlock(c).apply({"params": q}, y)
        fn = jax.jit(algo_sharded.traced_on(mesh, block), in_shardings=shardings)
        out[f"capacity/{factor}/out"], ids = fn(moe, h)
    logits = jnp.einsum("nd,de->ne", h, moe["router"])
    ids, gates = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    ids = np.asarray(ids)
    p, n = 4, h.shape[0] // 4                               # the expert axis splits the tokens
    el, k = cfg.num_experts // p, cfg.num_experts_per_tok
    cap = capacity(n, k, p, 1.0)
    kept = np.zeros(ids.shape, bool)
    for d in range(p):
        flat = ids[d * n:(d + 1) * n].reshape(-1)
        order = np.argsort(flat, kind="stable")
        dest = flat[order] // el
        slot = np.arange(n * k) - np.searchsorted(dest, dest)     # rank within its destination
        keep = np.zeros(n * k, bool)
        keep[order] = slot < cap
        kept[d * n:(d + 1) * n] = keep.reshape(n, k)
    weights = (moe["gate_proj"], moe["up_proj"], moe["down_proj"])
    out["capacity/kept_frac"] = kept.mean()
    out["capacity/ref_dropped"] = experts_dense(h, ids, gates * kept, *weights)
    out["capacity/ref_exact"] = experts_dense(h, ids, gates, *weights)
    return out


def full_update(cfg, params, mesh, rng) -> dict:
    """One RL update step (algo.make_update_step: the pi_old pass, two PPO mini-batches, the
    loss with its KL term, SGD) from the same state (reference params in it) and an UpdateBatch
    carrying int8 routing (algo.routing_replay="rollout"), on one device and through
    make_sharded_update on `mesh`: the loss, grad norm, KL and params after the step of each, the
    params before, and the compiled mesh update's int32 all-to-alls."""
    algo_cfg = update_config(ppo_mini_batches=2, micro_batch_size=4, kl_coef=0.1)
    optimizer = optax.sgd(UPDATE_LR)
    batch = update_batch(ROWS, SEQ, cfg.vocab_size, seed=2)
    batch = batch.replace(routing=replayed(cfg, rng, (ROWS, SEQ, cfg.num_hidden_layers)).astype(
        np.int8))
    key = jax.random.PRNGKey(7)
    state0 = create_train_state(params, optimizer)
    ref_state, ref_metrics = jax.jit(make_update_step(cfg, algo_cfg, optimizer))(state0, batch,
                                                                                  key)
    fn, sh = algo_sharded.make_sharded_update(cfg, algo_cfg, optimizer, mesh, state0, batch)
    # from host copies: the mesh update donates its state
    args = (sharded.place(jax.device_get(state0), sh["state"]), sharded.place(batch, sh["batch"]),
            key)
    compiled = fn.lower(*args).compile()
    new_state, metrics = compiled(*args)
    out = {"update/mesh/id_exchanges": id_exchanges(compiled)}
    for tag, st, m in (("ref", ref_state, ref_metrics), ("mesh", new_state, metrics)):
        out[f"update/{tag}/loss"], out[f"update/{tag}/grad_norm"] = m["loss"], m["grad_norm"]
        out[f"update/{tag}/kl"] = m["kl"]
        for path, leaf in jax.tree_util.tree_flatten_with_path(st.params)[0]:
            out[f"update/{tag}/params" + jax.tree_util.keystr(path)] = leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        out["update/before/params" + jax.tree_util.keystr(path)] = leaf
    return out


if __name__ == "__main__":
    main(sys.argv[1])
