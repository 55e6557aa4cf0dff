"""Placement helpers on a mesh: replicate, split rows over the batch axes, put host trees on
devices (one or several processes). The step builders that use them live beside their steps:
brorl_jax.algo.sharded (update, log-probs) and brorl_jax.rollout (generation).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from brorl_jax.parallel import rules as R


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _rows_sharding(mesh: Mesh, ndim: int, axes: str | dict = "default") -> NamedSharding:
    spec = R.logical_to_spec(R.ARRAY_AXES["rows"], axes)
    return NamedSharding(mesh, P(*(tuple(spec) + (None,) * (ndim - 1))))


def constrain_rows(x: jax.Array, mesh: Mesh, axes: str | dict = "default") -> jax.Array:
    """with_sharding_constraint: x's leading (row) axis over the batch axes, the rest replicated
    (axes that do not divide the rows are dropped)."""
    s = _rows_sharding(mesh, x.ndim, axes)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, R.fit_spec(s.spec, x.shape, mesh)))


def row_constraint(mesh: Mesh, axes: str | dict = "default"):
    """The update's `shard_rows` hook: after a split [R] -> [n, R / n], keep the second (row)
    axis over the batch axes (the reshape alone would put the split on the scanned axis, which
    XLA then gathers)."""
    spec = R.logical_to_spec(R.ARRAY_AXES["rows"], axes)

    def one(x):
        want = P(None, *(tuple(spec) + (None,) * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, R.fit_spec(want, x.shape, mesh)))

    return lambda tree: jax.tree.map(one, tree)


def place(tree: Any, shardings: Any) -> Any:
    """device_put every leaf with its sharding (single-controller; multi-host: rules +
    distributed.global_batch). The result may share buffers with device-resident inputs, so a
    step that donates it also deletes them: place host (numpy) copies when the inputs are kept.

    With several processes every process passes the same full value and keeps only the shards
    of its own devices (jax.make_array_from_callback)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        if s.is_fully_addressable:
            return jax.device_put(x, s)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


# -------------------------------------------------------------------------------------------------
# Rollout: prefill once per prompt, N samples spread over the data axis
# -------------------------------------------------------------------------------------------------
def rollout_shardings(model_cfg, mesh: Mesh, params: Any, *, num_prompts: int, prompt_len: int,
                      samples: int, max_new_tokens: int, rules: str | Sequence = "rollout",
                      axes: str | dict = "rollout", check_divisible: bool = False) -> dict:
    """Shardings of every array of the rollout's prefill and decode (rules.ARRAY_AXES names)."""
    c = model_cfg
    g, p, n, s = num_prompts, prompt_len, samples, max_new_tokens
    arr = functools.partial(R.array_sharding, mesh=mesh, axes=axes,
                            check_divisible=check_divisible)
    suffix = arr("suffix_kv", (c.num_hidden_layers, g, n, s, c.num_key_value_heads, c.head_dim))
    toks = arr("sample_tokens", (g, n, s))
    rows = arr("sample_rows", (g, n))
    return {
        "params": R.param_shardings(params, mesh, rules, check_divisible=check_divisible),
        "prompt_tokens": arr("prompt_tokens", (g, p)),
        "prompt_rows": arr("prompt_rows", (g,)),
        "prefix_kv": arr("prefix_kv", (c.num_hidden_layers, g, p, c.num_key_value_heads,
                                       c.head_dim)),
        "prompt_logits": arr("prompt_logits", (g, c.vocab_size)),
        "suffix_kv": suffix,
        "sample_rows": rows,
        "decode_out": {"tokens": toks, "logprobs": toks, "lengths": rows, "finished": rows,
                       "steps": _replicated(mesh)},
        "replicated": _replicated(mesh),
    }


def make_sharded_prefill(model_cfg, shardings: dict):
    """engine.prefill_prompts compiled with the rollout shardings:
    (params, tokens [G, P], lengths [G]) -> (prefix_k, prefix_v, last_logits)."""
    from brorl_jax.rollout import engine
    sh = shardings
    fn = functools.partial(engine.prefill_prompts_fn, cfg=model_cfg)
    return jax.jit(lambda params, tokens, lengths: fn(params, tokens=tokens, lengths=lengths),
                   in_shardings=(sh["params"], sh["prompt_tokens"], sh["prompt_rows"]),
                   out_shardings=(sh["prefix_kv"], sh["prefix_kv"], sh["prompt_logits"]))


def make_sharded_decode(model_cfg, shardings: dict, *, max_new_tokens: int, temperature: float,
                        top_k: int, top_p: float, eos_ids: tuple[int, ...], impl: str = "auto",
                        donate: bool = True):
    """engine.decode_chunk (the whole decode while_loop of one chunk) compiled with the rollout
    shardings; the suffix KV buffers (args 8, 9) are donated and returned for the next chunk."""
    from brorl_jax.rollout import engine
    from pallas_kernels.decode_attention import resolve_impl as attention_impl
    from pallas_kernels.sampling import resolve_impl as sampling_impl
    sh = shardings
    fn = functools.partial(
        engine.decode_chunk_fn, cfg=model_cfg, max_new_tokens=int(max_new_tokens),
        temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
        eos_ids=tuple(eos_ids), attention_impl=attention_impl(impl),
        sampling_impl=sampling_impl(impl))
    repl = sh["replicated"]
    return jax.jit(
        fn,
        in_shardings=(sh["params"], sh["prefix_kv"], sh["prefix_kv"], sh["prompt_rows"],
                      sh["prompt_logits"], sh["sample_rows"], sh["prompt_rows"], repl,
                      sh["suffix_kv"], sh["suffix_kv"]),
        out_shardings=(sh["decode_out"], sh["suffix_kv"], sh["suffix_kv"]),
        donate_argnums=(8, 9) if donate else ())


def round_chunk_to_mesh(num_chunks: int, samples_per_chunk: int, rollouts_per_prompt: int,
                        mesh: Mesh, axes: str | dict = "rollout") -> tuple[int, int]:
    """Rounds the engine's samples-per-chunk (from its memory budget) down to a multiple of the
    devices the samples are split over, so every chunk divides evenly (more, smaller chunks)."""
    want = R.logical_table(axes).get("samples")
    names = want if isinstance(want, tuple) else (want,) if want else ()
    split = 1
    for a in names:
        split *= mesh.shape[a]
    if num_chunks == 1 or samples_per_chunk <= split or samples_per_chunk % split == 0:
        return num_chunks, samples_per_chunk
    n = samples_per_chunk // split * split
    return -(-rollouts_per_prompt // n), n


def _to_host(tree):
    if jax.process_count() > 1 and not all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


_ROLLOUT_CACHE: dict = {}


def sharded_generate(model: Any, prompts: Sequence[Sequence[int]], *, mesh: Mesh,
                     rollouts_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                     eos_ids: Sequence[int] | None = None, memory_budget_bytes: int | None = None,
                     params: dict | None = None, impl: str = "auto",
                     rules: str | Sequence = "rollout", axes: str | dict = "rollout"):
    """rollout.generate on a mesh: same arguments, same RolloutResult, same tokens for a seed
    (each sample's random stream is keyed by its global index, not by where it runs).

    The prompts are prefilled once; each prompt's KV is replicated over the sample axes while its
    N samples (and their own KV) are split over them. Memory chunking as in generate."""
    from brorl_jax.rollout import engine
    cfg = model.config
    prompts = engine.validate_inputs(cfg, prompts, rollouts_per_prompt, max_new_tokens, temperature,
                               top_p, top_k)
    params = model.params if params is None else params
    eos = engine.resolve_eos_ids(model, eos_ids)
    g_real, n_real, s = len(prompts), int(rollouts_per_prompt), int(max_new_tokens)
    g = engine.bucket_num_prompts(g_real)
    p = engine.bucket_prompt_length(max(len(x) for x in prompts))
    tokens, lengths = engine.pad_prompts(prompts, g, p)
    num_chunks, n = engine.plan_chunks(cfg, g, p, n_real, s, memory_budget_bytes)
    num_chunks, n = round_chunk_to_mesh(num_chunks, n, n_real, mesh, axes)
    key = (cfg, mesh, g, p, n, s, str(rules), str(axes), jax.tree.structure(params))
    if key not in _ROLLOUT_CACHE:      # the loop calls this every step: compile once per shape
        sh = rollout_shardings(cfg, mesh, params, num_prompts=g, prompt_len=p, samples=n,
                               max_new_tokens=s, rules=rules, axes=axes)
        _ROLLOUT_CACHE[key] = (sh, make_sharded_prefill(cfg, sh), {})
    sh, prefill, decoders = _ROLLOUT_CACHE[key]
    params = place(params, sh["params"])
    t0 = time.perf_counter()
    lengths_dev = place(lengths, sh["prompt_rows"])
    prefix_k, prefix_v, first_logits = prefill(params, place(tokens, sh["prompt_tokens"]),
                                               lengths_dev)
    jax.block_until_ready(first_logits)
    t1 = time.perf_counter()
    dkey = (float(temperature), int(top_k), float(top_p), tuple(eos), impl)
    if dkey not in decoders:
        decoders[dkey] = make_sharded_decode(cfg, sh, max_new_tokens=s, temperature=temperature,
                                             top_k=top_k, top_p=top_p, eos_ids=eos, impl=impl)
    decode = decoders[dkey]
    shape = (cfg.num_hidden_layers, g, n, s, cfg.num_key_value_heads, cfg.head_dim)
    dt = engine.dtype_of(cfg.dtype)
    if "zeros" not in decoders:
        decoders["zeros"] = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sh["suffix_kv"])
    zeros = decoders["zeros"]
    suffix_k, suffix_v = zeros(), zeros()
    seed_key = jax.random.PRNGKey(seed)
    live = place(np.arange(g) < g_real, sh["prompt_rows"])
    seed_key = place(np.asarray(seed_key), sh["replicated"])
    outs = []
    for c in range(num_chunks):
        ids = (np.arange(g)[:, None] * n_real + c * n + np.arange(n)[None, :]).astype(np.int32)
        out, suffix_k, suffix_v = decode(params, prefix_k, prefix_v, lengths_dev, first_logits,
                                         place(ids, sh["sample_rows"]), live, seed_key,
                                         suffix_k, suffix_v)
        outs.append(_to_host(out))
    t2 = time.perf_counter()
    cat = {k: np.concatenate([o[k] for o in outs], axis=1)[:g_real, :n_real]
           for k in ("tokens", "logprobs", "lengths", "finished")}
    result = engine.finalize(cat["tokens"], cat["logprobs"], cat["lengths"], cat["finished"],
                             lengths[:g_real], num_chunks)
    result.stats.update(prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
                        padded_num_prompts=g, padded_prompt_len=p, samples_per_chunk=n)
    return result
