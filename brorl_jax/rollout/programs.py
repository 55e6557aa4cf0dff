"""The rollout's device programs, written for one device (engine.py runs them under shard_map).

State (per device; ``K`` pool entries, ``B`` slots, ``Nd`` samples of each prompt on this device,
``S`` = max_new_tokens, ``Sc`` its rounded own-KV length):

  pool   prefix_k/v [L, K, Hkv, P, Dh]  the prompts' KV, stored once, shared by their slots
         plen, gid [K]                  prompt length and global prompt index (-1: free entry)
         queue [K, Nd], qlen, qnext [K] the entry's pending samples (in order) and how many were
                                        handed to slots
         done [K]                       samples of the entry finished on this device
         res_tok, res_logp [K+1, Nd, S] results, written as tokens are sampled (entry K takes the
         res_len, res_fin [K+1, Nd]     writes of empty slots: every scatter is in bounds, so XLA
                                        updates in place instead of copying the array per step)
  slots  entry, sample, t, cur [B]      pool entry (-1: empty), sample index, index of the current
                                        token, current token
         used [B]                       the slot has held a sample (a new one is a refill)
         row [B]                        the slot's row in the own-KV store
         sk, sv [L, Bs, Hkv, Sc, Dh]    the own-KV store (Bs = the planned slots; a compacted
                                        batch of B < Bs slots keeps its KV rows in place)
  stats  steps, live, assigned, refills (scalars)

A sample's token 0 is drawn at admission from the prompt's last prefill logits; its step-t token
(t >= 1) is drawn in a decode step. Sample ``n`` of prompt ``g`` uses the uniforms of
``fold_in(fold_in(PRNGKey(seed), g * N + n), t)`` wherever and whenever it runs, so the result does
not depend on the slot count, the budget, the device or the order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from brorl_jax.models import ModelConfig, embed, final_norm, layer_finish, layer_qkv, lm_logits
from brorl_jax.models.transformer import dtype_of
from brorl_jax.rollout.plan import FIRST_TOKEN_ROWS, slot_buckets
from pallas_kernels import _backend
from pallas_kernels.decode_attention import slot_decode_attention
from pallas_kernels.sampling import sample_tokens


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static configuration of the compiled programs (hashable: a jit static argument)."""
    cfg: ModelConfig
    prompt_len: int            # P, bucketed
    max_new_tokens: int        # S
    cache_len: int             # Sc >= S
    pool: int                  # K
    share: int                 # Nd
    rollouts_per_prompt: int   # N
    temperature: float
    top_k: int
    top_p: float
    attention_impl: str        # resolved: "reference" | "pallas"
    sampling_impl: str
    lockstep: bool
    min_slots: int
    axes: tuple[str, ...]      # mesh axes the devices span (collectives)


# ----------------------------------------------------------------------------------------------
# Prefill and sampling (shared with the naive engine)
# ----------------------------------------------------------------------------------------------


def prefill_prompts_fn(
    params: dict, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prefill right-padded prompts once.

    tokens int32[G, P], lengths int32[G] -> (prefix_k, prefix_v [L, G, P, Hkv, Dh] compute dtype,
    last_logits f32[G, V] = logits at position lengths-1). Padding keys are masked; the KV at
    padding positions is garbage and masked again in decode by ``lengths``.
    """
    g, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (g, p))
    valid = positions < lengths[:, None]
    allowed = (jnp.tril(jnp.ones((p, p), bool))[None] & valid[:, None, :])[:, None]  # [G,1,P,P]

    def layer(x, layer_params):
        q, k, v = layer_qkv(layer_params, cfg, x, positions)
        # XLA's fused attention (GQA-aware, f32 softmax): same math as models.attention, ~1.5x
        # faster on CPU for long prompts because it avoids the explicit head-group reshapes
        attn = jax.nn.dot_product_attention(q, k, v, mask=allowed, implementation="xla")
        return layer_finish(layer_params, cfg, x, attn.astype(x.dtype)), (k, v)

    x, (prefix_k, prefix_v) = jax.lax.scan(layer, embed(params, cfg, tokens), params["layers"])
    x_last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [G, 1, D]
    logits = lm_logits(params, cfg, final_norm(params, cfg, x_last))[:, 0]
    return prefix_k, prefix_v, logits


def sample_step(
    logits: jax.Array, sample_keys: jax.Array, step: jax.Array, *, temperature: float,
    top_k: int, top_p: float, impl: str,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per sample: ``logits f32[B, V]``, ``sample_keys [B, 2]`` (one key per
    sample, ``fold_in(seed_key, sample_index)``), ``step`` int or int[B] -> (tokens int32[B],
    logp f32[B])."""
    if temperature == 0.0:
        uniforms = jnp.zeros(logits.shape[:1], jnp.float32)  # unused by greedy
    else:
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), logits.shape[:1])
        uniforms = jax.vmap(
            lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (), jnp.float32)
        )(sample_keys, steps)
    return sample_tokens(logits, uniforms, temperature=temperature, top_k=top_k, top_p=top_p,
                         impl=impl)


def sample_keys_for(seed_key: jax.Array, sample_ids: jax.Array) -> jax.Array:
    """Per-sample key streams: ``fold_in(seed_key, global sample index)`` -> keys [B, 2]."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(sample_ids.reshape(-1))


def _sampler(spec: Spec):
    return functools.partial(sample_step, temperature=spec.temperature, top_k=spec.top_k,
                             top_p=spec.top_p, impl=spec.sampling_impl)


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


def init_pool(spec: Spec) -> dict:
    c, k, nd, s = spec.cfg, spec.pool, spec.share, spec.max_new_tokens
    kv = (c.num_hidden_layers, k, c.num_key_value_heads, spec.prompt_len, c.head_dim)
    dt = dtype_of(c.dtype)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return dict(prefix_k=jnp.zeros(kv, dt), prefix_v=jnp.zeros(kv, dt), plen=jnp.ones((k,), jnp.int32),
                gid=jnp.full((k,), -1, jnp.int32), queue=i32((k, nd)), qlen=i32((k,)),
                qnext=i32((k,)), done=i32((k,)), res_tok=i32((k + 1, nd, s)),
                res_logp=jnp.zeros((k + 1, nd, s), jnp.float32), res_len=i32((k + 1, nd)),
                res_fin=jnp.zeros((k + 1, nd), bool))


def init_slots(spec: Spec, num_slots: int) -> dict:
    c = spec.cfg
    kv = (c.num_hidden_layers, num_slots, c.num_key_value_heads, spec.cache_len, c.head_dim)
    dt = kv_store_dtype(c)
    i32 = functools.partial(jnp.zeros, (num_slots,), jnp.int32)
    return dict(entry=jnp.full((num_slots,), -1, jnp.int32), sample=i32(), t=i32(), cur=i32(),
                used=jnp.zeros((num_slots,), bool), row=jnp.arange(num_slots, dtype=jnp.int32),
                sk=jnp.zeros(kv, dt), sv=jnp.zeros(kv, dt))


def init_stats() -> dict:
    z = jnp.zeros((), jnp.int32)
    return dict(steps=z, live=z, assigned=z, refills=z)


# ----------------------------------------------------------------------------------------------
# Admission: prefill prompts into free pool entries and draw their samples' first tokens
# ----------------------------------------------------------------------------------------------


def admit(params, pool, tokens, lengths, entries, gids, stop, seed_key, *, spec: Spec, dev):
    """Prefill ``tokens int32[Ga, P]`` (``lengths [Ga]``) into pool ``entries [Ga]`` as global
    prompts ``gids [Ga]`` (-1: a padding row, dropped); draw token 0 of this device's share of
    each prompt's samples; queue the samples that did not stop at token 0."""
    c, k, nd, n, s = spec.cfg, spec.pool, spec.share, spec.rollouts_per_prompt, spec.max_new_tokens
    ga = tokens.shape[0]
    pk, pv, logits = prefill_prompts_fn(params, c, tokens, lengths)
    real = gids >= 0
    # padding rows repeat row 0 (same entry, same values): every scatter below stays in bounds
    src = jnp.where(real, jnp.arange(ga), 0)
    dest = entries[src]
    heads_major = lambda x: x.transpose(0, 1, 3, 2, 4).astype(pool["prefix_k"].dtype)
    # token 0 of samples j of this device (global sample index gid * N + dev * Nd + j)
    n_glob = dev * nd + jnp.arange(nd, dtype=jnp.int32)
    in_share = (n_glob < n)[None, :] & real[:, None]                       # [Ga, Nd]
    ids = jnp.maximum(gids, 0)[:, None] * n + n_glob[None, :]
    rows = min(nd, FIRST_TOKEN_ROWS)
    nd_pad = -(-nd // rows) * rows
    ids_p = jnp.pad(ids, ((0, 0), (0, nd_pad - nd))).reshape(ga * nd_pad // rows, rows)
    which = jnp.repeat(jnp.arange(ga), nd_pad // rows)

    def draw(args):
        g_row, sid = args
        row = jnp.broadcast_to(logits[g_row], (rows, logits.shape[-1]))
        return _sampler(spec)(row, sample_keys_for(seed_key, sid), jnp.int32(0))

    tok0, logp0 = jax.lax.map(draw, (which, ids_p))
    tok0 = tok0.reshape(ga, nd_pad)[:, :nd]
    logp0 = logp0.reshape(ga, nd_pad)[:, :nd]
    is_stop = stop[tok0]
    complete = in_share & (is_stop | (s == 1))
    pending = in_share & ~complete
    queue = jnp.argsort(~pending, axis=1, stable=True).astype(jnp.int32)
    res_tok = jnp.zeros((ga, nd, s), jnp.int32).at[:, :, 0].set(jnp.where(in_share, tok0, 0))
    res_logp = jnp.zeros((ga, nd, s), jnp.float32).at[:, :, 0].set(jnp.where(in_share, logp0, 0))
    inb = "promise_in_bounds"
    put = lambda name, v: pool[name].at[dest].set(v[src], mode=inb)
    return dict(
        pool,
        prefix_k=pool["prefix_k"].at[:, dest].set(heads_major(pk)[:, src], mode=inb),
        prefix_v=pool["prefix_v"].at[:, dest].set(heads_major(pv)[:, src], mode=inb),
        plen=put("plen", lengths.astype(jnp.int32)), gid=put("gid", gids.astype(jnp.int32)),
        queue=put("queue", queue), qlen=put("qlen", jnp.sum(pending, axis=1, dtype=jnp.int32)),
        qnext=put("qnext", jnp.zeros((ga,), jnp.int32)),
        done=put("done", jnp.sum(complete, axis=1, dtype=jnp.int32)),
        res_tok=put("res_tok", res_tok), res_logp=put("res_logp", res_logp),
        res_len=put("res_len", complete.astype(jnp.int32)),
        res_fin=put("res_fin", complete & is_stop),
    )


def release(pool, free):
    """Mark pool entries ``free bool[K]`` as empty (their group was handed out)."""
    return dict(pool, gid=jnp.where(free, -1, pool["gid"]))


# ----------------------------------------------------------------------------------------------
# Decode: one while_loop of decode steps, refilling finished slots on device
# ----------------------------------------------------------------------------------------------


def summary(pool, slots, spec: Spec, stats_steps=0) -> dict:
    """Replicated progress numbers (over all devices): complete groups, pending and live samples."""
    psum = lambda x: jax.lax.psum(x, spec.axes)
    pmax = lambda x: jax.lax.pmax(x, spec.axes)
    done_all = psum(pool["done"])
    complete = (pool["gid"] >= 0) & (done_all >= spec.rollouts_per_prompt)
    pending = jnp.sum(jnp.where(pool["gid"] >= 0, pool["qlen"] - pool["qnext"], 0))
    live = jnp.sum(slots["entry"] >= 0)
    return dict(complete=complete, pending=psum(pending), live=pmax(live),
                live_total=psum(live), steps=pmax(stats_steps))


def shrink_target(num_slots: int, spec: Spec) -> int | None:
    """The next smaller slot bucket (None: none, or the schedule does not compact)."""
    if spec.lockstep:
        return None
    buckets = slot_buckets(num_slots, min(spec.min_slots, num_slots))
    return buckets[1] if len(buckets) > 1 else None


def _refill(pool, slots, spec: Spec, allow):
    """Free slots take the next pending samples, oldest prompt first (so a slot whose prompt still
    has pending samples takes one of them: that prompt is the oldest with any)."""
    k = spec.pool
    gid, qlen, qnext = pool["gid"], pool["qlen"], pool["qnext"]
    free = slots["entry"] < 0
    pend = jnp.where(gid >= 0, qlen - qnext, 0)
    order = jnp.argsort(jnp.where(gid >= 0, gid, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)
    cum = jnp.cumsum(pend[order])
    start = cum - pend[order]
    rank = jnp.cumsum(free.astype(jnp.int32)) - 1
    take = free & allow & (rank < cum[-1])
    j = jnp.clip(jnp.searchsorted(cum, rank, side="right"), 0, k - 1)
    e = order[j]
    pos = jnp.clip(qnext[e] + rank - start[j], 0, spec.share - 1)
    n_new = pool["queue"][e, pos]
    slots = dict(
        slots,
        entry=jnp.where(take, e, slots["entry"]),
        sample=jnp.where(take, n_new, slots["sample"]),
        t=jnp.where(take, 0, slots["t"]),
        cur=jnp.where(take, pool["res_tok"][e, n_new, 0], slots["cur"]),
        used=slots["used"] | take,
    )
    qnext = qnext + jnp.zeros((k,), jnp.int32).at[jnp.where(take, e, k)].add(1, mode="drop")
    return dict(pool, qnext=qnext), slots, take


def kv_store_dtype(cfg: ModelConfig):
    """dtype of the own-KV store: the compute dtype, except bfloat16 on CPU, kept as uint16 bit
    patterns (XLA's CPU backend computes a bfloat16 scatter in float32, converting the whole store
    per layer and step; the attention reads the blocks back as bfloat16)."""
    dt = jnp.dtype(dtype_of(cfg.dtype))
    return jnp.dtype(jnp.uint16) if dt == jnp.bfloat16 and _backend.backend() == "cpu" else dt


def _write_kv(store, layer, rows, t, values):
    """store[layer, rows[b], :, t[b], :] = values[b]: one scatter, in place. In bounds by
    construction (``promise_in_bounds``: a bounds-checked scatter costs a pass over the store)."""
    if store.dtype == jnp.uint16:
        values = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return store.at[layer, rows, :, t, :].set(values.astype(store.dtype),
                                              mode="promise_in_bounds")


def _forward(params, pool, slots, active, spec: Spec):
    """One decode step of every slot: logits f32[B, V]; writes each slot's K/V at its position."""
    c = spec.cfg
    b = slots["entry"].shape[0]
    h, dh = c.num_attention_heads, c.head_dim
    entry = jnp.maximum(slots["entry"], 0)
    t = jnp.minimum(slots["t"], spec.cache_len - 1)
    positions = (pool["plen"][entry] + slots["t"])[:, None]
    prefix_index = jnp.where(active, slots["entry"], -1)
    own_len = jnp.where(active, slots["t"] + 1, 0)
    rows = slots["row"]

    def layer(carry, xs):
        x, sk, sv = carry
        layer_params, li = xs
        q, k_new, v_new = layer_qkv(layer_params, c, x, positions)
        sk = _write_kv(sk, li, rows, t, k_new[:, 0])
        sv = _write_kv(sv, li, rows, t, v_new[:, 0])
        attn = slot_decode_attention(q[:, 0], pool["prefix_k"], pool["prefix_v"], pool["plen"],
                                     prefix_index, sk, sv, own_len, suffix_rows=rows, layer=li,
                                     impl=spec.attention_impl)
        x = layer_finish(layer_params, c, x, attn.reshape(b, 1, h, dh).astype(x.dtype))
        return (x, sk, sv), None

    x0 = embed(params, c, slots["cur"][:, None])
    (x, sk, sv), _ = jax.lax.scan(
        layer, (x0, slots["sk"], slots["sv"]),
        (params["layers"], jnp.arange(c.num_hidden_layers, dtype=jnp.int32)))
    logits = lm_logits(params, c, final_norm(params, c, x))[:, 0]
    return logits, dict(slots, sk=sk, sv=sv)


def decode_step(params, pool, slots, stats, stop, seed_key, *, spec: Spec, dev):
    """Refill free slots, run one decode step of every slot, record the sampled tokens and free
    the slots whose sample stopped or reached max_new_tokens."""
    k, nd, n, s = spec.pool, spec.share, spec.rollouts_per_prompt, spec.max_new_tokens
    was_used = slots["used"]
    allow = jnp.all(slots["entry"] < 0) if spec.lockstep else jnp.bool_(True)
    pool, slots, take = _refill(pool, slots, spec, allow)
    active = slots["entry"] >= 0
    logits, slots = _forward(params, pool, slots, active, spec)
    entry = jnp.maximum(slots["entry"], 0)
    sid = jnp.maximum(pool["gid"][entry], 0) * n + dev * nd + slots["sample"]
    tok, logp = _sampler(spec)(logits, sample_keys_for(seed_key, sid), slots["t"] + 1)
    t_out = slots["t"] + 1                                   # index of the new token
    inb = "promise_in_bounds"                               # see the state notes above
    at = jnp.where(active, entry, k)                         # inactive slots write to entry K
    t_at = jnp.minimum(t_out, s - 1)
    res_tok = pool["res_tok"].at[at, slots["sample"], t_at].set(tok, mode=inb)
    res_logp = pool["res_logp"].at[at, slots["sample"], t_at].set(logp, mode=inb)
    is_stop = stop[tok]
    finish = active & (is_stop | (t_out + 1 >= s))
    fin_at = jnp.where(finish, entry, k)
    pool = dict(
        pool, res_tok=res_tok, res_logp=res_logp,
        res_len=pool["res_len"].at[fin_at, slots["sample"]].set(t_out + 1, mode=inb),
        res_fin=pool["res_fin"].at[fin_at, slots["sample"]].set(is_stop, mode=inb),
        done=pool["done"] + jnp.zeros((k + 1,), jnp.int32).at[fin_at].add(1, mode=inb)[:k],
    )
    slots = dict(slots, entry=jnp.where(finish, -1, slots["entry"]),
                 t=jnp.where(active, t_out, slots["t"]), cur=jnp.where(active, tok, slots["cur"]))
    stats = dict(steps=stats["steps"] + 1,
                 live=stats["live"] + jnp.sum(active, dtype=jnp.int32),
                 assigned=stats["assigned"] + jnp.sum(take, dtype=jnp.int32),
                 refills=stats["refills"] + jnp.sum(take & was_used, dtype=jnp.int32))
    return pool, slots, stats


def decode(params, pool, slots, stats, stop, seed_key, final, *, spec: Spec, dev):
    """Decode steps until a group completes, the tail can shrink to the next slot bucket
    (``final``: no prompt is left to admit, nothing pending, live slots fit), or nothing is left.

    Returns (pool, slots, stats, summary)."""
    num_slots = slots["entry"].shape[0]
    target = shrink_target(num_slots, spec)

    def stop_now(pool, slots):
        sm = summary(pool, slots, spec)
        halt = jnp.any(sm["complete"]) | ((sm["live"] == 0) & (sm["pending"] == 0))
        if target is not None:
            halt |= final & (sm["pending"] == 0) & (sm["live"] <= target)
        return halt

    def body(carry):
        return decode_step(params, *carry, stop, seed_key, spec=spec, dev=dev)

    pool, slots, stats = jax.lax.while_loop(lambda c: ~stop_now(c[0], c[1]), body,
                                            (pool, slots, stats))
    return pool, slots, stats, summary(pool, slots, spec, stats["steps"])


def compact(slots, *, num_slots: int):
    """Keep ``num_slots`` slots, the live ones first. ``slots`` without the KV store: the KV
    stays where it is, the kept slots carry their ``row`` in it."""
    keep = jnp.argsort(slots["entry"] < 0, stable=True)[:num_slots]
    return {name: v[keep] for name, v in slots.items()}


def fetch(pool, entry):
    """One entry's results (this device's share): tokens, log-probs [Nd, S], lengths, finished."""
    return (pool["res_tok"][entry], pool["res_logp"][entry], pool["res_len"][entry],
            pool["res_fin"][entry])
