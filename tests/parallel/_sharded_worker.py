"""Subprocess body for test_sharded_steps.py: runs on 8 simulated CPU devices.

Usage: python _sharded_worker.py OUT.npz LAYOUT[;LAYOUT...]
with LAYOUT like "data=2,fsdp=2,tensor=2".
XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported (the test sets
it in the subprocess environment). For each layout the script computes, with the same inputs,
the single-device results (plain jax.jit of the unsharded steps) and the sharded ones, and saves
both; the assertions live in the test.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from testutil import small_model_config

from brorl_jax.algo import (
    UpdateBatch,
    create_train_state,
    make_logprob_fn,
    make_update_step,
    sharded_steps as algo_sharded,
)
from brorl_jax.config import update_config
from brorl_jax.models import Model, ModelConfig, init_params
from brorl_jax.parallel import sharded
from brorl_jax.parallel.mesh import make_mesh
from brorl_jax.parallel.vocab_parallel import sharded_fused_logprob, vocab_parallel_logprob
from brorl_jax.rollout import Engine, generate, rollout_bytes
from pallas_kernels.fused_logprob.reference import fused_logprob_reference

EOS = 3


def tiny_config() -> ModelConfig:
    return small_model_config(eos_token_ids=(EOS,))


def update_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (rows, seq)).astype(np.int32)
    mask = np.zeros((rows, seq), bool)
    for r in range(rows):                      # response tokens after a 4-token prompt
        mask[r, 3:3 + rng.integers(2, seq - 3)] = True
    return UpdateBatch(
        input_tokens=tokens,
        positions=np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        loss_mask=mask,
        targets=np.roll(tokens, -1, axis=1),
        old_logprobs=(np.log(1 / vocab) + 0.2 * rng.normal(size=(rows, seq))).astype(np.float32),
        ref_logprobs=(np.log(1 / vocab) + 0.2 * rng.normal(size=(rows, seq))).astype(np.float32),
        advantages=rng.normal(size=rows).astype(np.float32),
    )


def main(out_path: str, layouts: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg = tiny_config()
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x,
                          init_params(cfg, jax.random.PRNGKey(0)))
    # ICE-POP without dual-clip: see tests/parallel/_multiprocess_common.py (Adam's first step
    # turns a layout's float noise on a ~1e-8 gradient into a visible difference otherwise)
    algo_cfg = update_config(ppo_mini_batches=2, micro_batch_size=8, kl_coef=1e-3, tis_mode="ice_pop",
                           tis_high=5.0, dual_clip_c=0.0)
    optimizer = optax.adamw(1e-2)
    batch = update_batch(16, 16, cfg.vocab_size)
    rng = jax.random.PRNGKey(7)
    model = Model(cfg, params, None, (EOS,))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    gen_kw = dict(rollouts_per_prompt=8, max_new_tokens=8, temperature=1.0, seed=3)
    # mixed lengths (a stop set) and a budget of 2 slots per device: refills on every device
    stops = [EOS] + list(range(100, 140))
    tail_kw = dict(rollouts_per_prompt=12, max_new_tokens=10, temperature=1.0, seed=5,
                   eos_ids=stops, memory_budget_bytes=8 * rollout_bytes(cfg, 2, 8, 12, 10, 2,
                                                                         num_devices=8))

    # Single-device references (default device, no mesh).
    state0 = create_train_state(params, optimizer)
    update = jax.jit(make_update_step(cfg, algo_cfg, optimizer))
    ref_state, ref_metrics = update(state0, batch, rng)
    logp_fn = jax.jit(make_logprob_fn(cfg, algo_cfg, micro_batch_size=8))
    ref_logp, ref_ent, _ = logp_fn(params, batch)
    ref_roll = generate(model, prompts, **gen_kw)
    ref_tail = Engine(cfg).generate(params, prompts, **tail_kw)
    out = {"ref/logp": np.asarray(ref_logp), "ref/entropy": np.asarray(ref_ent),
           "ref/loss": np.asarray(ref_metrics["loss"]),
           "ref/grad_norm": np.asarray(ref_metrics["grad_norm"]),
           "ref/tokens": ref_roll.tokens, "ref/rollout_logprobs": ref_roll.logprobs,
           "ref/lengths": ref_roll.lengths, "ref/tail_tokens": ref_tail.tokens,
           "ref/tail_logprobs": ref_tail.logprobs, "ref/tail_lengths": ref_tail.lengths}
    for path, leaf in jax.tree_util.tree_flatten_with_path(ref_state.params)[0]:
        out["ref/params/" + jax.tree_util.keystr(path)] = np.asarray(leaf)

    r = np.random.default_rng(1)
    vp_inputs = tuple(jnp.asarray(x) for x in (
        r.normal(size=(32, 16)).astype(np.float32), r.normal(size=(16, 64)).astype(np.float32),
        r.integers(0, 64, 32).astype(np.int32), r.normal(size=32).astype(np.float32),
        r.normal(size=32).astype(np.float32)))

    def vp_loss(fn):
        def loss(h, w):
            logp, ent = fn(h, w)
            return jnp.sum(logp * vp_inputs[3]) + jnp.sum(ent * vp_inputs[4])
        return loss

    ref_vp = lambda h, w: fused_logprob_reference(h, w, vp_inputs[2], temperature=0.7)
    vals, grads = jax.value_and_grad(vp_loss(ref_vp), argnums=(0, 1))(*vp_inputs[:2])
    out["ref/vp_loss"] = np.asarray(vals)
    out["ref/vp_dhidden"], out["ref/vp_dlm_head"] = map(np.asarray, grads)

    for layout in layouts.split(";"):
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}
        sizes = {a: sizes.get(a, 1) for a in ("data", "fsdp", "tensor")}
        mesh = make_mesh(sizes)
        tag = layout
        # update: donated state, sharded batch
        fn, sh = algo_sharded.make_sharded_update(cfg, algo_cfg, optimizer, mesh, state0, batch)
        # from host copies: device_put may reuse the single-device buffers, which donation deletes
        st = sharded.place(jax.device_get(create_train_state(params, optimizer)), sh["state"])
        new_state, metrics = fn(st, sharded.place(batch, sh["batch"]), rng)
        out[f"{tag}/loss"] = np.asarray(metrics["loss"])
        out[f"{tag}/grad_norm"] = np.asarray(metrics["grad_norm"])
        for path, leaf in jax.tree_util.tree_flatten_with_path(new_state.params)[0]:
            out[f"{tag}/params/" + jax.tree_util.keystr(path)] = np.asarray(leaf)
        q = new_state.params["layers"]["q_proj"]["kernel"]
        out[f"{tag}/q_proj_spec"] = np.asarray(str(q.sharding.spec))
        out[f"{tag}/q_proj_shard_shape"] = np.asarray(q.addressable_shards[0].data.shape)
        # log-probs: through the update's hooks (default), plain GSPMD ("algo"), and the
        # standalone vocab-parallel step
        lfn, lsh = algo_sharded.make_sharded_logprob(cfg, algo_cfg, mesh, params, batch,
                                                micro_batch_size=8)
        logp, ent, _ = lfn(sharded.place(params, lsh["params"]), sharded.place(batch, lsh["batch"]))
        out[f"{tag}/logp"], out[f"{tag}/entropy"] = np.asarray(logp), np.asarray(ent)
        gfn, _ = algo_sharded.make_sharded_logprob(cfg, algo_cfg, mesh, params, batch,
                                              micro_batch_size=8, logprob="algo")
        glogp, gent, _ = gfn(sharded.place(params, lsh["params"]),
                             sharded.place(batch, lsh["batch"]))
        out[f"{tag}/gspmd_logp"], out[f"{tag}/gspmd_entropy"] = np.asarray(glogp), np.asarray(gent)
        vfn, vsh = algo_sharded.make_vocab_parallel_logprob(cfg, mesh, params, batch,
                                                      micro_batch_size=8, block_t=32)
        vlogp, vent = vfn(sharded.place(params, vsh["params"]), sharded.place(batch, vsh["batch"]))
        out[f"{tag}/vp_logp"], out[f"{tag}/vp_entropy"] = np.asarray(vlogp), np.asarray(vent)
        # vocab-parallel value and gradients vs the naive unsharded reference
        hv, wv, yv, gl, ge = vp_inputs
        vp = lambda h, w: vocab_parallel_logprob(h, w, yv, mesh=mesh, temperature=0.7, block_t=8)
        vals, grads = jax.jit(jax.value_and_grad(vp_loss(vp), argnums=(0, 1)))(hv, wv)
        out[f"{tag}/vp_loss"] = np.asarray(vals)
        out[f"{tag}/vp_dhidden"], out[f"{tag}/vp_dlm_head"] = map(np.asarray, grads)
        out[f"{tag}/vp_dlm_head_spec"] = np.asarray(str(grads[1].sharding.spec))
        sf = sharded_fused_logprob(mesh)
        vals, grads = jax.jit(jax.value_and_grad(vp_loss(
            lambda h, w: sf(h, w, yv, temperature=0.7, impl="chunked")), argnums=(0, 1)))(hv, wv)
        out[f"{tag}/sf_loss"] = np.asarray(vals)
        out[f"{tag}/sf_dhidden"], out[f"{tag}/sf_dlm_head"] = map(np.asarray, grads)
        # rollout: an Engine on the mesh (shard_map; each device decodes its share of samples)
        engine = Engine(cfg, mesh=mesh)
        roll = engine.generate(params, prompts, eos_ids=[EOS], **gen_kw)
        out[f"{tag}/tokens"], out[f"{tag}/rollout_logprobs"] = roll.tokens, roll.logprobs
        out[f"{tag}/lengths"] = roll.lengths
        # the public entry: rollout.generate(mesh=...)
        out[f"{tag}/tokens_via_generate"] = generate(model, prompts, mesh=mesh, **gen_kw).tokens
        tail = engine.generate(params, prompts, **tail_kw)
        out[f"{tag}/tail_tokens"], out[f"{tag}/tail_logprobs"] = tail.tokens, tail.logprobs
        out[f"{tag}/tail_lengths"] = tail.lengths
        out[f"{tag}/tail_refills"] = np.asarray(tail.stats["refills"])
        out[f"{tag}/tail_slots_per_device"] = np.asarray(tail.stats["slots_per_device"])
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
