"""Subprocess body for test_lora_sharded.py: LoRA through the runtimes on 8 simulated CPU devices.

Usage: python _lora_worker.py OUT.npz WORKDIR
From the same LoRA train state (non-zero B, so A's gradient is not zero either) and batch, one
device (train.runtime.LocalRuntime) and a data=2 x fsdp=2 x tensor=2 mesh (MeshRuntime) each run
what the RL step runs: an update with the KL term on (the reference log-probs of the base), the
reset that merges (algo.adapters.maybe_reset, then Runtime.relayout), a second update against
the merged base, and the rollout's copy (the merge in rollout_layout). The mesh state then goes
after the reset goes through a checkpoint save and the loop's restore (checkpoint_template of place_state,
from_checkpoint, relayout). Everything is saved; the assertions live in the test.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
from _sharded_worker import update_batch
from testutil import tiny_model_config

from brorl_jax.algo import adapters, make_optimizer
from brorl_jax.config import optimizer_config, update_config
from brorl_jax.models import init_params, lora
from brorl_jax.train.runtime import LocalRuntime, MeshRuntime
from brorl_jax.workdir.checkpoint import Checkpointer
from configs import tiny

ROWS, SEQ = 16, 12


def random_params(mc) -> dict:
    """Base params of init_params' shapes, drawn in numpy (init_params compiles for seconds):
    norm scales near 1, every other leaf N(0, 0.3^2)."""
    rng = np.random.default_rng(0)
    draw = lambda path, s: ((1.0 + 0.1 * rng.normal(size=s.shape)) if "scale" in
                            jax.tree_util.keystr(path) else 0.3 * rng.normal(size=s.shape))
    return jax.tree_util.tree_map_with_path(
        lambda p, s: draw(p, s).astype(s.dtype),
        jax.eval_shape(lambda: init_params(mc, jax.random.key(0))))


def flat(tree, prefix: str) -> dict:
    return {prefix + jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def specs(tree, prefix: str) -> dict:
    return {prefix + jax.tree_util.keystr(p): np.asarray(str(x.sharding.spec))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main(out_path: str, workdir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    mc = tiny_model_config(num_hidden_layers=1, lora_rank=2, lora_alpha=4.0,
                           lora_targets=tuple(lora.TARGETS))
    cfg = tiny.get_config()
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2, 2
    # ICE-POP without dual-clip, as _sharded_worker.py; a reset after every update
    algo_cfg = update_config(cfg, ppo_mini_batches=2, micro_batch_size=4, kl_coef=0.05,
                             tis_mode="ice_pop", tis_high=5.0, dual_clip_c=0.0, ref_reset_every=1)
    opt = make_optimizer(optimizer_config(lr=1e-2))
    base = random_params(mc)
    state0 = adapters.lora_train_state(base, mc, opt, seed=3)
    b_key = jax.random.key(1)
    moved = jax.tree.map(lambda x: x, state0.params[lora.KEY])
    for i, t in enumerate(moved):
        moved[t] = dict(moved[t], b=0.3 * jax.random.normal(jax.random.fold_in(b_key, i),
                                                            moved[t]["b"].shape))
    state0 = jax.device_get(state0.replace(params=lora.with_adapters(lora.base_params(
        state0.params), moved)))
    batch = update_batch(ROWS, SEQ, mc.vocab_size)
    rngs = [jax.random.key(7), jax.random.key(8)]
    kw = dict(diagnostics_n=None, paused_engine_bytes=0)
    runtimes = {"one": LocalRuntime(cfg, mc, opt, **kw), "mesh": MeshRuntime(cfg, mc, opt, **kw)}
    out = {}
    for tag, rt in runtimes.items():
        state = rt.place_state(state0)
        state, m1 = rt.update(algo_cfg, state, batch, rngs[0])
        out.update(flat({"params": state.params[lora.KEY], "opt": state.opt_state}, f"{tag}/1/"))
        out[f"{tag}/1/loss"] = np.asarray(m1["loss"])
        if tag == "mesh":
            out.update(specs(state.params[lora.KEY], "spec/"))
            out.update(specs(state.opt_state, "opt_spec/"))
        state, reset = adapters.maybe_reset(state, algo_cfg, opt, mc, seed=3)
        assert reset
        state = rt.relayout(state)
        out.update(flat({"base": lora.base_params(state.params), "params": state.params[lora.KEY],
                         "merged": state.lora_merged}, f"{tag}/reset/"))
        if tag == "mesh":
            out.update(specs(state.params, "reset_spec/"))
            out.update(checkpoint_round_trip(rt, state, state0, algo_cfg, base, mc, workdir))
        state, m2 = rt.update(algo_cfg, state, batch, rngs[1])
        out[f"{tag}/2/loss"] = np.asarray(m2["loss"])
        out[f"{tag}/2/kl"] = np.asarray(m2["kl"])
        out.update(flat(state.params[lora.KEY], f"{tag}/2/"))
        out.update(flat(rt.rollout_params(state.params), f"{tag}/rollout/"))
    np.savez(out_path, **out)


def checkpoint_round_trip(rt, state, state0, algo_cfg, base, mc, workdir) -> dict:
    """The mesh state after its reset (step 1, one merge) saved (checkpoint_view) and restored
    as train/loop.py does."""
    ckpt = Checkpointer(workdir, async_save=False, log=lambda m: None)
    ckpt.save(1, adapters.checkpoint_view(state), {"counters": {}})
    ckpt.wait()
    template = adapters.checkpoint_template(rt.place_state(state0), algo_cfg)
    step, saved, _ = ckpt.restore_latest(template)
    ckpt.close()
    restored = rt.relayout(adapters.from_checkpoint(saved, base, mc, rt.place_params))
    out = flat(restored, "restored/")
    out.update(flat(state, "saved/"))
    out.update(specs(restored.params, "restored_spec/"))
    out.update(specs(state.params, "saved_spec/"))
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
