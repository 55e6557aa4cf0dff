"""The naive large-N rollout: repeat each prompt N times (what Tunix's sampler and transformers'
``num_return_sequences`` do), prefill G*N rows and keep G*N full KV caches of P + S positions.

It exists as the baseline for ``bench/rollout.py`` and as an independent check of the
continuous-batching engine in the tests: same sampling, same per-sample RNG streams (sample
``g * N + n``), but a plain per-row KV cache and ``brorl_jax.models.attention`` instead of the slot
decode attention over shared prompts and paged own KV.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brorl_jax.models import (
    ModelConfig,
    attention,
    embed,
    final_norm,
    layer_finish,
    layer_qkv,
    lm_logits,
)
from brorl_jax.rollout.plan import (
    PREFILL_SCORE_BYTES,
    bucket_num_prompts,
    bucket_prompt_length,
    pad_prompts,
    resolve_eos_ids,
)
from brorl_jax.rollout.programs import prefill_prompts_fn, sample_keys_for, sample_step
from brorl_jax.rollout.types import RolloutResult, validate_inputs
from pallas_kernels.sampling import resolve_impl as _resolve_sampling_impl

prefill_prompts = jax.jit(prefill_prompts_fn, static_argnums=(1,))


def prefill_in_batches(
    params: dict, cfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`prefill_prompts` over prompt micro-batches (power of two) that bound the
    [Gb, H, P, P] attention scores; concatenated on the prompt axis."""
    g, p = tokens.shape
    per_prompt = 4 * cfg.num_attention_heads * p * p
    gb = max(1, min(g, PREFILL_SCORE_BYTES // max(per_prompt, 1)))
    gb = 1 << (gb.bit_length() - 1)  # g is a power of two, so gb divides it
    parts = [
        prefill_prompts(params, cfg, jnp.asarray(tokens[i : i + gb]), jnp.asarray(lengths[i : i + gb]))
        for i in range(0, g, gb)
    ]
    if len(parts) == 1:
        return parts[0]
    return (jnp.concatenate([pt[0] for pt in parts], axis=1),
            jnp.concatenate([pt[1] for pt in parts], axis=1),
            jnp.concatenate([pt[2] for pt in parts], axis=0))


def finalize(
    tokens: np.ndarray, logprobs: np.ndarray, lengths: np.ndarray, finished: np.ndarray,
    prompt_lengths: np.ndarray,
) -> RolloutResult:
    """Mask everything past each sample's length (pad id 0, log-prob 0) and build the result."""
    s = tokens.shape[-1]
    mask = np.arange(s) < lengths[..., None]
    return RolloutResult(
        tokens=np.where(mask, tokens, 0).astype(np.int32),
        logprobs=np.where(mask, logprobs, 0.0).astype(np.float32),
        lengths=lengths.astype(np.int32),
        finished=finished.astype(bool),
        truncated=~finished.astype(bool),
        mask=mask,
        prompt_lengths=prompt_lengths.astype(np.int32),
    )


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "max_new_tokens", "temperature", "top_k", "top_p", "eos_ids",
                     "sampling_impl"),
    donate_argnames=("cache_k", "cache_v"),
)
def decode_repeated(
    params: dict, prompt_lengths: jax.Array, first_logits: jax.Array, sample_ids: jax.Array,
    live: jax.Array, seed_key: jax.Array, cache_k: jax.Array, cache_v: jax.Array, *,
    cfg: ModelConfig, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
    eos_ids: tuple[int, ...], sampling_impl: str,
) -> tuple[dict, jax.Array, jax.Array]:
    """Decode B = G*N independent rows. cache_k/v [L, B, P + S, Hkv, Dh] hold each row's own copy
    of its prompt KV in slots [0, P) and its generated KV from slot P on."""
    num_layers, b, total, _, _ = cache_k.shape
    s = max_new_tokens
    p = total - s
    keys = sample_keys_for(seed_key, sample_ids)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    sample = functools.partial(sample_step, temperature=temperature, top_k=top_k, top_p=top_p,
                               impl=sampling_impl)
    tok0, logp0 = sample(first_logits, keys, jnp.int32(0))
    done0 = jnp.isin(tok0, eos) | ~live
    state = dict(t=jnp.int32(0), tokens=jnp.zeros((b, s), jnp.int32).at[:, 0].set(tok0),
                 logprobs=jnp.zeros((b, s), jnp.float32).at[:, 0].set(logp0), cur=tok0,
                 lengths=jnp.ones((b,), jnp.int32), done=done0, finished=jnp.isin(tok0, eos),
                 cache_k=cache_k, cache_v=cache_v)
    slots = jnp.arange(total)

    def body(st):
        t = st["t"]
        positions = (prompt_lengths + t)[:, None]
        allowed = ((slots[None, :] < prompt_lengths[:, None])
                   | ((slots[None, :] >= p) & (slots[None, :] <= p + t)))[:, None, :]

        def layer(carry, xs):
            x, ck, cv = carry
            layer_params, idx = xs
            q, k, v = layer_qkv(layer_params, cfg, x, positions)
            ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (idx, 0, p + t, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (idx, 0, p + t, 0, 0))
            x = layer_finish(layer_params, cfg, x, attention(q, ck[idx], cv[idx], allowed))
            return (x, ck, cv), None

        (x, ck, cv), _ = jax.lax.scan(
            layer, (embed(params, cfg, st["cur"][:, None]), st["cache_k"], st["cache_v"]),
            (params["layers"], jnp.arange(num_layers)),
        )
        logits = lm_logits(params, cfg, final_norm(params, cfg, x))[:, 0]
        tok, logp = sample(logits, keys, t + 1)
        active = ~st["done"]
        tok = jnp.where(active, tok, 0)
        is_eos = jnp.isin(tok, eos) & active
        return dict(t=t + 1, tokens=st["tokens"].at[:, t + 1].set(tok),
                    logprobs=st["logprobs"].at[:, t + 1].set(jnp.where(active, logp, 0.0)),
                    cur=tok, lengths=st["lengths"] + active.astype(jnp.int32),
                    done=st["done"] | is_eos, finished=st["finished"] | is_eos,
                    cache_k=ck, cache_v=cv)

    st = jax.lax.while_loop(lambda st: (st["t"] + 1 < s) & ~jnp.all(st["done"]), body, state)
    out = dict(tokens=st["tokens"], logprobs=st["logprobs"], lengths=st["lengths"],
               finished=st["finished"], steps=st["t"] + 1)
    return out, st["cache_k"], st["cache_v"]  # returned so the donated caches alias the loop state


def generate_naive(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    rollouts_per_prompt: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    params: dict | None = None,
    impl: str = "auto",
) -> RolloutResult:
    """Same contract and same RNG streams as :func:`brorl_jax.rollout.generate`, computed the
    naive way: every prompt repeated N times, prefilled N times, N private KV caches."""
    cfg: ModelConfig = model.config
    prompts = validate_inputs(cfg, prompts, rollouts_per_prompt, max_new_tokens, temperature, top_p, top_k)
    params = model.params if params is None else params
    eos = resolve_eos_ids(model, eos_ids)
    g_real, n, s = len(prompts), int(rollouts_per_prompt), int(max_new_tokens)
    repeated = [pr for pr in prompts for _ in range(n)]
    b = bucket_num_prompts(len(repeated))
    p = bucket_prompt_length(max(len(x) for x in prompts))
    tokens, lengths = pad_prompts(repeated, b, p)
    t0 = time.perf_counter()
    prefix_k, prefix_v, first_logits = prefill_in_batches(params, cfg, tokens, lengths)
    first_logits.block_until_ready()
    t1 = time.perf_counter()
    pad = ((0, 0), (0, 0), (0, s), (0, 0), (0, 0))
    cache_k, cache_v = jnp.pad(prefix_k, pad), jnp.pad(prefix_v, pad)
    del prefix_k, prefix_v
    out, _, _ = decode_repeated(
        params, jnp.asarray(lengths), first_logits, jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(np.arange(b) < len(repeated)), jax.random.PRNGKey(seed), cache_k, cache_v,
        cfg=cfg, max_new_tokens=s, temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p), eos_ids=eos, sampling_impl=_resolve_sampling_impl(impl),
    )
    out = jax.device_get(out)
    t2 = time.perf_counter()
    r = g_real * n
    shape = (g_real, n)
    result = finalize(out["tokens"][:r].reshape(*shape, s), out["logprobs"][:r].reshape(*shape, s),
                      out["lengths"][:r].reshape(shape), out["finished"][:r].reshape(shape),
                      np.asarray([len(x) for x in prompts], np.int32))
    result.stats.update(prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
                        decode_forward_rows=(int(out["steps"]) - 1) * b,
                        padded_num_prompts=b, padded_prompt_len=p)
    return result
