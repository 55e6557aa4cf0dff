"""The expert-parallel rollout, run inside _expert_parallel_worker.py's 8-device process.

A MeshRuntime on mesh expert=4 x tensor=2 (mesh.expert = 4) against a LocalRuntime, both with
algo.routing_replay="rollout": the rollout copy of the params (Runtime.rollout_params) and the
rollout Engine's samples. On the mesh each device holds E/4 experts of every layer
(parallel.expert_parallel.rollout_param_specs) and the decode program exchanges the tokens
(all-to-alls); the tokens, log-probs and recorded routing must equal one device's.
"""
from __future__ import annotations

import numpy as np
import optax

from brorl_jax.train.runtime import LocalRuntime, MeshRuntime
from configs import tiny

GEN = dict(rollouts_per_prompt=8, max_new_tokens=8, temperature=1.0, seed=3)


def rollout_checks(mc, params, rng) -> dict:
    """{"ref/roll_*", "mesh/roll_*", ...}: samples of both runtimes, the experts' layout in the
    mesh runtime's rollout copy and the all-to-alls of its lowered decode program."""
    cfg = tiny.get_config()
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, 1, 4, 2
    cfg.algo.routing_replay = "rollout"
    kw = dict(diagnostics_n=None, paused_engine_bytes=0)
    opt = optax.sgd(0.1)
    prompts = [list(rng.integers(4, mc.vocab_size, n)) for n in (5, 7, 3)]
    out = {}
    for tag, rt in (("ref", LocalRuntime(cfg, mc, opt, **kw)),
                    ("mesh", MeshRuntime(cfg, mc, opt, **kw))):
        rparams = rt.rollout_params(params)
        engine = rt.rollout_engine(mc)
        roll = engine.generate(rparams, prompts, **GEN)
        out.update({f"{tag}/roll_tokens": roll.tokens, f"{tag}/roll_logprobs": roll.logprobs,
                    f"{tag}/roll_routing": roll.routing, f"{tag}/roll_lengths": roll.lengths})
    gate = rparams["layers"][0]["moe"]["gate_proj"]
    out["mesh/roll_gate_spec"] = str(gate.sharding.spec)
    out["mesh/roll_gate_shard_shape"] = gate.addressable_shards[0].data.shape
    out["mesh/roll_router_spec"] = str(rparams["layers"][0]["moe"]["router"].sharding.spec)
    fn, args = engine.decode_program(rparams, prompt_len=8, max_new_tokens=8, slots=8,
                                     rollouts_per_prompt=GEN["rollouts_per_prompt"])
    out["mesh/roll_decode_all_to_alls"] = fn.trace(*args).lower().as_text().count("all_to_all")
    return {k: np.asarray(v) for k, v in out.items()}
