"""Subprocess body for test_moe_sharded.py: a mixture-of-experts forward on 8 simulated devices.

Usage: python _moe_worker.py OUT.npz LAYOUT   (LAYOUT like "data=2,fsdp=2,tensor=2")
XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported (the test
sets it). From the same inputs the script computes, on a tiny qwen3_moe model, the logits and
each layer's routing on one device (plain jax.jit) and on the mesh (the params placed by
parallel/rules.py, the rows split over data x fsdp) and saves both; the assertions live in the
test. (The update's gradient through the MoE block is checked on one device in
tests/algo/test_update.py and tests/models/test_moe.py; compiling it twice more here would
cost the suite about 20 s.)
"""
from __future__ import annotations

import sys

import jax
import numpy as np
from testutil import small_model_config

from brorl_jax.models import forward, init_params
from brorl_jax.parallel import rules
from brorl_jax.parallel.mesh import make_mesh


def main(out_path: str, layout: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg = small_model_config(model_type="qwen3_moe", qk_norm=True, attention_bias=False,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True)
    # N(0, 0.08) weights (init_params' x 4: decided routers, no near-ties for the float order
    # to flip), unit norm scales; drawn in numpy from the shapes (init_params compiles for 6 s)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (0.08 * rng.standard_normal(s.shape) if len(s.shape) >= 2
                   else np.ones(s.shape)).astype(np.float32),
        jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, cfg.vocab_size)
    fwd = lambda p, t: forward(p, cfg, t, return_routing=True)
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}
    mesh = make_mesh({a: sizes.get(a, 1) for a in ("data", "fsdp", "tensor")})
    param_sh = rules.param_shardings(params, mesh)
    rows = jax.sharding.NamedSharding(mesh, rules.logical_to_spec(rules.ARRAY_AXES["tokens"]))
    placed = jax.device_put(params, param_sh)
    out = {}
    for tag, fn, args in (("ref", jax.jit(fwd), (params, tokens)),
                          ("mesh", jax.jit(fwd, in_shardings=(param_sh, rows)),
                           (placed, jax.device_put(tokens, rows)))):
        out[f"{tag}/logits"], out[f"{tag}/routing"] = map(np.asarray, fn(*args))
    for name in ("gate_proj", "down_proj"):
        shard = placed["layers"]["moe"][name].addressable_shards[0]
        out[f"mesh/{name}_shard_shape"] = np.asarray(shard.data.shape)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
