"""Subprocess body for test_packed_sharded.py: the packed update on 8 simulated CPU devices.

Usage: python _packed_worker.py OUT.npz LAYOUT[;LAYOUT...]   (LAYOUT like "data=8" or
"data=2,fsdp=2,tensor=2:chunked" for the query-chunked attention path).

The batch is packed per data shard, as two processes would do it: each half of the prompt groups
is packed on its own (one packing unit each), the halves are padded to a common row count
(pad_packed_rows) and concatenated. Saved: one-device results of the same packed batch and of the
padded layout, and the sharded results per layout; the assertions live in the test.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from _sharded_worker import tiny_config

from brorl_jax.algo import (
    UpdateBatch,
    assemble_update_batch,
    create_train_state,
    make_logprob_fn,
    make_update_step,
    sharded_steps as algo_sharded,
)
from brorl_jax.algo.batch import pad_packed_rows, unpack_to_padded
from brorl_jax.config import update_config
from brorl_jax.models import init_params
from brorl_jax.parallel import sharded
from brorl_jax.parallel.mesh import make_mesh

G, N, S, PROMPT = 4, 16, 12, 4
WIDTH = PROMPT + S


def rollouts(vocab: int):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, vocab, PROMPT - (g % 2)))) for g in range(G)]
    lens = np.minimum(rng.geometric(1 / 4, (G, N)), S)
    lens[0, 0] = 0                                         # an empty response
    mask = np.arange(S)[None, None] < lens[..., None]
    tokens = rng.integers(4, vocab, (G, N, S)) * mask
    logprobs = (np.log(1 / vocab) + 0.2 * rng.normal(size=(G, N, S))).astype(np.float32) * mask
    adv = rng.normal(size=(G, N)).astype(np.float32)
    valid = np.array([True, True, True, False])            # dynamic-sampling padding group
    return prompts, tokens, logprobs, mask, adv, valid


def per_shard_packed(args, shards: int = 2) -> UpdateBatch:
    """Each shard (process) packs its own groups; common rows per unit; concatenated."""
    prompts, tokens, logprobs, mask, adv, valid = args
    per = G // shards
    parts = [assemble_update_batch(prompts[i * per:(i + 1) * per], tokens[i * per:(i + 1) * per],
                                   logprobs[i * per:(i + 1) * per], mask[i * per:(i + 1) * per],
                                   adv[i * per:(i + 1) * per], valid[i * per:(i + 1) * per],
                                   seq_len=WIDTH, mini_batches=1, row_multiple=8)
             for i in range(shards)]
    rows = max(p.input_tokens.shape[0] for p in parts)
    parts = [pad_packed_rows(p, rows) for p in parts]
    parts = [p.replace(sequence_index=np.where(p.sequence_index >= 0,       # global sequence numbers
                                               p.sequence_index + i * per * N, -1))
             for i, p in enumerate(parts)]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def main(out_path: str, layouts: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg = tiny_config()
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, init_params(cfg, jax.random.PRNGKey(0)))
    ref_params = jax.tree.map(lambda x: 0.95 * x, params)
    args = rollouts(cfg.vocab_size)
    packed = per_shard_packed(args)
    padded = assemble_update_batch(*args, seq_len=WIDTH, pack=False)
    base = dict(rollouts_per_prompt=N, prompts_per_step=G, ppo_mini_batches=2, kl_coef=1e-2,
                loss_agg="seq_mean_token_mean")
    cfg_pk = update_config(micro_batch_tokens=8 * WIDTH, **base)
    cfg_pad = update_config(micro_batch_size=8, **base)
    optimizer = optax.sgd(0.5)
    rng = jax.random.PRNGKey(7)
    out = {"packed_rows": np.asarray(packed.input_tokens.shape[0]),
           "padded_rows": np.asarray(padded.input_tokens.shape[0]),
           "loss_tokens": np.asarray(padded.loss_mask.sum())}

    def save(tag, state, metrics):
        for k in ("loss", "pg_loss", "kl", "entropy", "n_tokens", "grad_norm"):
            out[f"{tag}/{k}"] = np.asarray(metrics[k])
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
            out[f"{tag}/params/" + jax.tree_util.keystr(path)] = np.asarray(leaf)

    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        out["init/params/" + jax.tree_util.keystr(path)] = np.asarray(leaf)
    # one device: the padded layout and the packed batch
    for tag, batch, acfg in (("padded", padded, cfg_pad), ("one", packed, cfg_pk)):
        ref_lp = np.asarray(jax.jit(make_logprob_fn(cfg, acfg))(ref_params, batch)[0])
        state, metrics = jax.jit(make_update_step(cfg, acfg, optimizer))(
            create_train_state(params, optimizer), batch.replace(ref_logprobs=ref_lp), rng)
        save(tag, state, metrics)
        if tag == "one":
            out["one/ref_logprobs"] = unpack_to_padded(packed, ref_lp, G * N)

    for layout in layouts.split(";"):
        spec, _, attention = layout.partition(":")
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        mesh = make_mesh({a: sizes.get(a, 1) for a in ("data", "fsdp", "tensor")})
        attention = attention or "plain"
        inputs = packed
        lfn, lsh = algo_sharded.make_sharded_logprob(cfg, cfg_pk, mesh, params, inputs, attention=attention)
        ref_lp, _, _ = lfn(sharded.place(ref_params, lsh["params"]), sharded.place(inputs, lsh["batch"]))
        out[f"{layout}/ref_logprobs"] = unpack_to_padded(packed, np.asarray(ref_lp), G * N)
        batch = packed.replace(ref_logprobs=np.asarray(ref_lp))
        state0 = create_train_state(params, optimizer)
        fn, sh = algo_sharded.make_sharded_update(cfg, cfg_pk, optimizer, mesh, state0, batch,
                                             attention=attention)
        st = sharded.place(jax.device_get(state0), sh["state"])
        state, metrics = fn(st, sharded.place(batch, sh["batch"]), rng)
        save(layout, state, metrics)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
