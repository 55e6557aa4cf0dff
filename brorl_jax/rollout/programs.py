"""The rollout's device programs, written for one device (engine.py runs them under shard_map).

State (per device): four ``flax.struct`` dataclasses, :class:`Pool` (the prompts' KV, queues and
results), :class:`Slots` (what each decode slot holds), :class:`KV` (the page pool of the slots' own
KV) and :class:`Stats` (device counters), their shapes in their docstrings. They are pytrees: the
engine's jitted programs take them, donate them and return them replaced.

Compacting the slots (tail) gathers only the small per-slot arrays: the pages stay in place.
A slot writing the first position of a page takes a free page (older samples first). One that
finds none waits a step (its token t is redrawn from the same key when it runs: nothing
changes); if every live sample waits, the youngest that holds pages is restarted from its token 0
and gives its pages back (its tokens come out the same). Without a memory budget there is a page
for every position of every slot, and nothing ever waits.

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
from flax import struct

from brorl_jax.models import ModelConfig, embed, final_norm, layer_finish, layer_qkv, lm_logits
from brorl_jax.models.transformer import dtype_of, layer_finish_routed
from brorl_jax.rollout.layout import (  # noqa: F401  (rollout_layout: the engine's, the runtime's)
    _as_store,
    _write_kv,
    in_rollout_layout,
    kv_store_dtype,
    layer_list,
    rollout_layout,
)
from brorl_jax.rollout.plan import FIRST_TOKEN_ROWS, slot_buckets
from brorl_jax.rollout.routing import init_route
from pallas_kernels.decode_attention import (
    KVScales,
    quantize_kv,
    slot_decode_attention,
)
from pallas_kernels.sampling import sample_tokens


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static configuration of the compiled programs (hashable: a jit static argument)."""
    cfg: ModelConfig
    prompt_len: int            # P, bucketed
    max_new_tokens: int        # S
    page_size: int             # ps
    max_pages: int             # MP
    num_pages: int             # NP
    pool: int                  # K
    share: int                 # Nd
    n: int                     # N, samples per prompt
    temperature: float
    top_k: int
    top_p: float
    attention_impl: str        # resolved: "reference" | "pallas"
    sampling_impl: str
    lockstep: bool
    min_slots: int
    axes: tuple[str, ...]      # mesh axes the devices span (collectives); () on one device
    check_every: int = 1       # decode steps between two stop checks (plan.default_check_every)
    record_routing: bool = False   # MoE: record each token's experts (rollout/routing.py)


# ----------------------------------------------------------------------------------------------
# Prefill and sampling (shared with the naive engine)
# ----------------------------------------------------------------------------------------------


def prefill_prompts_fn(
    params: dict, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
    record_routing: bool = False,
) -> tuple[jax.Array, ...]:
    """Prefill right-padded prompts once.

    tokens int32[G, P], lengths int32[G] -> (prefix_k, prefix_v [L, G, P, Hkv, Dh] compute dtype,
    last_logits f32[G, V] = logits at position lengths-1). Padding keys are masked; the KV at
    padding positions is garbage and masked again in decode by ``lengths``. ``record_routing``
    (MoE): a fourth result, the experts each prompt token went to, int32[L, G, P, K].
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
        if record_routing:
            x, ids = layer_finish_routed(layer_params, cfg, x, attn.astype(x.dtype))
            return x, (k, v, ids)
        return layer_finish(layer_params, cfg, x, attn.astype(x.dtype)), (k, v)

    if isinstance(params["layers"], (tuple, list)):   # the rollout layout: layer by layer
        x, kvs = embed(params, cfg, tokens), []
        for layer_params in params["layers"]:
            x, kv = layer(x, layer_params)
            kvs.append(kv)
        stacked = tuple(jnp.stack([kv[i] for kv in kvs]) for i in range(len(kvs[0])))
    else:
        x, stacked = jax.lax.scan(layer, embed(params, cfg, tokens), params["layers"])
    x_last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [G, 1, D]
    logits = lm_logits(params, cfg, final_norm(params, cfg, x_last))[:, 0]
    return (*stacked[:2], logits, *stacked[2:])


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
# State (per device). Sizes: K pool entries (Spec.pool), B slots (the current slot bucket), Nd
# samples of each prompt on this device (Spec.share), S = max_new_tokens, P the bucketed prompt
# length, NP pages (Spec.num_pages) of ps positions (Spec.page_size), MP = S / ps pages per slot
# at most (Spec.max_pages); L layers, Hkv KV heads, Dh head dim of the model.
# ----------------------------------------------------------------------------------------------


@struct.dataclass
class Pool:
    """The prompt pool: ``K`` entries, each a prompt's KV stored once and shared by its slots, the
    entry's pending samples and its samples' results (written as tokens are sampled).

    Shapes:
      prefix_k, prefix_v: ``[L, K, Hkv, P, Dh]`` compute dtype, the prompts' KV (head-major);
        under an fp8 KV cache e4m3 (``kv_store_dtype``) with scales prefix_ks / prefix_vs.
      plen: ``int32[K]`` prompt length (1 in a free entry).
      gid: ``int32[K]`` global prompt index (-1: free entry).
      queue: ``int32[K, Nd]`` the entry's pending samples, in order.
      qlen, qnext: ``int32[K]`` how many samples are queued / were handed to slots.
      done: ``int32[K]`` samples of the entry finished on this device.
      res_tok: ``int32[K+1, Nd, S]`` sampled tokens; res_logp: ``f32[K+1, Nd, S]`` their
        log-probs; res_len: ``int32[K+1, Nd]`` lengths; res_fin: ``bool[K+1, Nd]`` stopped on a
        stop token. Entry K takes the writes of empty slots: every scatter is in bounds, so XLA
        updates in place instead of copying the array per step.
    """
    prefix_k: jax.Array
    prefix_v: jax.Array
    plen: jax.Array
    gid: jax.Array
    queue: jax.Array
    qlen: jax.Array
    qnext: jax.Array
    done: jax.Array
    res_tok: jax.Array
    res_logp: jax.Array
    res_len: jax.Array
    res_fin: jax.Array
    # an fp8 KV cache (cfg.kv_precision): the float32 scales of prefix_k/v, [L, K, Hkv, P]
    prefix_ks: jax.Array | None = None
    prefix_vs: jax.Array | None = None
    # Spec.record_routing (rollout/routing.py): the experts of each prompt token [K, P, L, Kx]
    # and of each response token read by a decode step [K+1, Nd, S, L, Kx] (Kx experts per
    # token, routing.route_dtype); else None
    prefix_route: jax.Array | None = None
    res_route: jax.Array | None = None


@struct.dataclass
class Slots:
    """The ``B`` decode slots, one sample each.

    Shapes:
      entry: ``int32[B]`` the slot's pool entry (-1: empty slot).
      sample: ``int32[B]`` the sample's index among the entry's Nd on this device.
      t: ``int32[B]`` index of the current token; cur: ``int32[B]`` the current token.
      used: ``bool[B]`` the slot has held a sample (a new one is a refill).
      table: ``int32[B, MP]`` the slot's pages: own position s is in page ``table[b, s // ps]``.
    """
    entry: jax.Array
    sample: jax.Array
    t: jax.Array
    cur: jax.Array
    used: jax.Array
    table: jax.Array


@struct.dataclass
class KV:
    """The page pool of the slots' own KV and its free-page stack.

    Shapes:
      pages_k, pages_v: ``[L, NP+1, Hkv, ps, Dh]`` (``kv_store_dtype``); page NP takes the writes
        of idle slots.
      free: ``int32[NP+1]`` a stack of free pages, ``free[:top]``; top: ``int32[]``.
      ks, vs: under an fp8 KV cache the float32 scales of pages_k/v, ``[L, NP+1, Hkv, ps]``
        (one per position and KV head, written with the token); else None.
    """
    pages_k: jax.Array
    pages_v: jax.Array
    free: jax.Array
    top: jax.Array
    ks: jax.Array | None = None
    vs: jax.Array | None = None


@struct.dataclass
class Stats:
    """Device counters of one rollout call, each ``int32[]`` (summed over decode steps): steps,
    live (slots that decoded), assigned (samples handed to slots), refills (of a slot that had held
    a sample), stalls (slots that waited for a page), restarts (samples started over)."""
    steps: jax.Array
    live: jax.Array
    assigned: jax.Array
    refills: jax.Array
    stalls: jax.Array
    restarts: jax.Array


def init_pool(spec: Spec) -> Pool:
    c, k, nd, s = spec.cfg, spec.pool, spec.share, spec.max_new_tokens
    kv = (c.num_hidden_layers, k, c.num_key_value_heads, spec.prompt_len, c.head_dim)
    fp8 = c.kv_precision == "fp8"
    dt = kv_store_dtype(c, spec.attention_impl) if fp8 else dtype_of(c.dtype)
    scale = (lambda: jnp.zeros(kv[:-1], jnp.float32)) if fp8 else (lambda: None)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return Pool(prefix_k=jnp.zeros(kv, dt), prefix_v=jnp.zeros(kv, dt),
                prefix_ks=scale(), prefix_vs=scale(), plen=jnp.ones((k,), jnp.int32),
                gid=jnp.full((k,), -1, jnp.int32), queue=i32((k, nd)), qlen=i32((k,)),
                qnext=i32((k,)), done=i32((k,)), res_tok=i32((k + 1, nd, s)),
                res_logp=jnp.zeros((k + 1, nd, s), jnp.float32), res_len=i32((k + 1, nd)),
                res_fin=jnp.zeros((k + 1, nd), bool), **init_route(spec))


def init_slots(spec: Spec, num_slots: int) -> Slots:
    i32 = functools.partial(jnp.zeros, (num_slots,), jnp.int32)
    return Slots(entry=jnp.full((num_slots,), -1, jnp.int32), sample=i32(), t=i32(), cur=i32(),
                 used=jnp.zeros((num_slots,), bool),
                 table=jnp.zeros((num_slots, spec.max_pages), jnp.int32))


def init_kv(spec: Spec) -> KV:
    c = spec.cfg
    shape = (c.num_hidden_layers, spec.num_pages + 1, c.num_key_value_heads, spec.page_size,
             c.head_dim)
    dt = kv_store_dtype(c, spec.attention_impl)
    scale = (lambda: jnp.zeros(shape[:-1], jnp.float32)) if c.kv_precision == "fp8" else \
        (lambda: None)
    return KV(pages_k=jnp.zeros(shape, dt), pages_v=jnp.zeros(shape, dt), ks=scale(), vs=scale(),
              free=jnp.arange(spec.num_pages + 1, dtype=jnp.int32),
              top=jnp.asarray(spec.num_pages, jnp.int32))


def init_stats() -> Stats:
    z = jnp.zeros((), jnp.int32)
    return Stats(steps=z, live=z, assigned=z, refills=z, stalls=z, restarts=z)


# ----------------------------------------------------------------------------------------------
# Admission: prefill prompts into free pool entries and draw their samples' first tokens
# ----------------------------------------------------------------------------------------------


def admit(params, pool: Pool, tokens, lengths, entries, gids, stop, seed_key, *, spec: Spec,
          dev) -> Pool:
    """Prefill ``tokens int32[Ga, P]`` (``lengths [Ga]``) into pool ``entries [Ga]`` as global
    prompts ``gids [Ga]`` (-1: a padding row, dropped); draw token 0 of this device's share of
    each prompt's samples; queue the samples that did not stop at token 0."""
    c, nd, n, s = spec.cfg, spec.share, spec.n, spec.max_new_tokens
    ga = tokens.shape[0]
    pk, pv, logits, *prompt_route = prefill_prompts_fn(params, c, tokens, lengths,
                                                       spec.record_routing)
    real = gids >= 0
    # padding rows repeat row 0 (same entry, same values): every scatter below stays in bounds
    src = jnp.where(real, jnp.arange(ga), 0)
    dest = entries[src]
    heads_major = lambda x: x.transpose(0, 1, 3, 2, 4)
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
    put = lambda name, v: getattr(pool, name).at[dest].set(v[src], mode=inb)
    prompt_kv = {}
    for name, x in (("k", pk), ("v", pv)):
        x = heads_major(x)[:, src]
        if pool.prefix_ks is not None:        # an fp8 cache: e4m3 values and their scales
            x, sc = quantize_kv(x)
            prompt_kv[f"prefix_{name}s"] = getattr(pool, f"prefix_{name}s").at[:, dest].set(
                sc, mode=inb)
        store = getattr(pool, f"prefix_{name}")
        prompt_kv[f"prefix_{name}"] = store.at[:, dest].set(_as_store(x, store.dtype), mode=inb)
    if prompt_route:    # [L, Ga, P, Kx] -> the entries' [P, L, Kx]
        route = prompt_route[0].transpose(1, 2, 0, 3)[src].astype(pool.prefix_route.dtype)
        prompt_kv["prefix_route"] = pool.prefix_route.at[dest].set(route, mode=inb)
    return pool.replace(
        **prompt_kv,
        plen=put("plen", lengths.astype(jnp.int32)), gid=put("gid", gids.astype(jnp.int32)),
        queue=put("queue", queue), qlen=put("qlen", jnp.sum(pending, axis=1, dtype=jnp.int32)),
        qnext=put("qnext", jnp.zeros((ga,), jnp.int32)),
        done=put("done", jnp.sum(complete, axis=1, dtype=jnp.int32)),
        res_tok=put("res_tok", res_tok), res_logp=put("res_logp", res_logp),
        res_len=put("res_len", complete.astype(jnp.int32)),
        res_fin=put("res_fin", complete & is_stop),
    )


def release(pool: Pool, free) -> Pool:
    """Mark pool entries ``free bool[K]`` as empty (their group was handed out)."""
    return pool.replace(gid=jnp.where(free, -1, pool.gid))


# ----------------------------------------------------------------------------------------------
# Decode: one while_loop of decode steps, refilling finished slots on device
# ----------------------------------------------------------------------------------------------


def summary(pool: Pool, slots: Slots, spec: Spec, stats_steps=0) -> dict:
    """Replicated progress numbers (over all devices): complete groups, pending and live samples."""
    # over the devices of a mesh (under shard_map); one device: the values themselves
    psum = (lambda x: jax.lax.psum(x, spec.axes)) if spec.axes else (lambda x: x)
    pmax = (lambda x: jax.lax.pmax(x, spec.axes)) if spec.axes else (lambda x: x)
    done_all = psum(pool.done)
    complete = (pool.gid >= 0) & (done_all >= spec.n)
    pending = jnp.sum(jnp.where(pool.gid >= 0, pool.qlen - pool.qnext, 0))
    live = jnp.sum(slots.entry >= 0)
    return dict(complete=complete, pending=psum(pending), live=pmax(live),
                live_total=psum(live), steps=pmax(stats_steps))


def shrink_target(num_slots: int, spec: Spec) -> int | None:
    """The next smaller slot bucket (None: none, or the schedule does not compact)."""
    if spec.lockstep:
        return None
    buckets = slot_buckets(num_slots, min(spec.min_slots, num_slots))
    return buckets[1] if len(buckets) > 1 else None


def _refill(pool: Pool, slots: Slots, spec: Spec, allow, cap):
    """Free slots take the next pending samples, oldest prompt first (so a slot whose prompt still
    has pending samples takes one of them: that prompt is the oldest with any); at most ``cap``
    of them (free pages beyond one per live sample)."""
    k = spec.pool
    gid, qlen, qnext = pool.gid, pool.qlen, pool.qnext
    free = slots.entry < 0
    pend = jnp.where(gid >= 0, qlen - qnext, 0)
    order = jnp.argsort(jnp.where(gid >= 0, gid, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)
    cum = jnp.cumsum(pend[order])
    start = cum - pend[order]
    rank = jnp.cumsum(free.astype(jnp.int32)) - 1
    take = free & allow & (rank < jnp.minimum(cum[-1], cap))
    j = jnp.clip(jnp.searchsorted(cum, rank, side="right"), 0, k - 1)
    e = order[j]
    pos = jnp.clip(qnext[e] + rank - start[j], 0, spec.share - 1)
    n_new = pool.queue[e, pos]
    slots = slots.replace(
        entry=jnp.where(take, e, slots.entry),
        sample=jnp.where(take, n_new, slots.sample),
        t=jnp.where(take, 0, slots.t),
        cur=jnp.where(take, pool.res_tok[e, n_new, 0], slots.cur),
        used=slots.used | take,
    )
    qnext = qnext + jnp.zeros((k,), jnp.int32).at[jnp.where(take, e, k)].add(1, mode="drop")
    return pool.replace(qnext=qnext), slots, take


def _forward(params, pool: Pool, slots: Slots, kv: KV, go, spec: Spec):
    """One decode step of every slot: (logits f32[B, V], kv, the experts of the slots' tokens
    int32[B, L, Kx] under Spec.record_routing else None). Slots in ``go`` write their K/V at their
    position (the others into the write-off page) and attend; the rest compute unused rows."""
    c = spec.cfg
    b = slots.entry.shape[0]
    h, dh, ps = c.num_attention_heads, c.head_dim, spec.page_size
    entry = jnp.maximum(slots.entry, 0)
    t = slots.t
    positions = (pool.plen[entry] + t)[:, None]
    prefix_index = jnp.where(go, slots.entry, -1)
    own_len = jnp.where(go, t + 1, 0)
    col = jnp.minimum(t // ps, spec.max_pages - 1)
    page = jnp.where(go, slots.table[jnp.arange(b), col], spec.num_pages)
    offset = jnp.where(go, t % ps, 0)

    # Layer by layer, each layer's weights read in place from its own buffers (the rollout
    # layout); the KV pools are one buffer each, updated in place at (layer, page, offset).
    x, gk, gv, ks, vs = embed(params, c, slots.cur[:, None]), kv.pages_k, kv.pages_v, kv.ks, kv.vs
    routes = []     # Spec.record_routing: each layer's experts of the slots' tokens [B, Kx]
    for li, layer_params in enumerate(layer_list(params, c)):
        q, k_new, v_new = layer_qkv(layer_params, c, x, positions)
        gk, ks = _write_kv(gk, ks, li, page, offset, k_new[:, 0])
        gv, vs = _write_kv(gv, vs, li, page, offset, v_new[:, 0])
        scales = None if ks is None else KVScales(pool.prefix_ks, pool.prefix_vs, ks, vs)
        attn = slot_decode_attention(q[:, 0], pool.prefix_k, pool.prefix_v, pool.plen,
                                     prefix_index, gk, gv, slots.table, own_len, layer=li,
                                     impl=spec.attention_impl, kv_scales=scales)
        attn = attn.reshape(b, 1, h, dh).astype(x.dtype)
        if spec.record_routing:
            x, ids = layer_finish_routed(layer_params, c, x, attn)
            routes.append(ids[:, 0])
        else:
            x = layer_finish(layer_params, c, x, attn)
    logits = lm_logits(params, c, final_norm(params, c, x))[:, 0]
    route = jnp.stack(routes, axis=1) if routes else None                   # [B, L, Kx]
    return logits, kv.replace(pages_k=gk, pages_v=gv, ks=ks, vs=vs), route


def _push_pages(kv: KV, table, counts, spec: Spec) -> KV:
    """Give back ``table[b, :counts[b]]`` of every slot b (counts 0 for the others)."""
    b, mp = table.shape
    offsets = jnp.cumsum(counts) - counts
    j = jnp.arange(mp)[None, :]
    dest = jnp.where(j < counts[:, None], kv.top + offsets[:, None] + j, spec.num_pages)
    free = kv.free.at[dest.reshape(-1)].set(table.reshape(-1), mode="promise_in_bounds")
    return kv.replace(free=free, top=kv.top + jnp.sum(counts))


def _take_pages(slots: Slots, kv: KV, active, spec: Spec):
    """A slot about to write the first position of a page takes a free one, older samples
    first. Returns (slots, kv, stalled)."""
    b = slots.entry.shape[0]
    t = slots.t
    need = active & (t % spec.page_size == 0)
    order = jnp.argsort(jnp.where(need, -t, jnp.iinfo(jnp.int32).max), stable=True)
    rank = jnp.zeros((b,), jnp.int32).at[order].set(jnp.arange(b, dtype=jnp.int32))
    got = need & (rank < kv.top)
    page = kv.free[jnp.clip(kv.top - 1 - rank, 0, spec.num_pages)]
    col = jnp.minimum(t // spec.page_size, spec.max_pages - 1)
    rows = jnp.arange(b)
    table = slots.table.at[rows, col].set(jnp.where(got, page, slots.table[rows, col]))
    kv = kv.replace(top=kv.top - jnp.sum(got, dtype=jnp.int32))
    return slots.replace(table=table), kv, need & ~got


def _restart_youngest(pool: Pool, slots: Slots, kv: KV, stuck, spec: Spec):
    """When every live sample waits for a page: the youngest one holding pages starts over from
    its token 0 and gives its pages back (its draws are keyed by step: same tokens again)."""
    t = slots.t
    holds = (slots.entry >= 0) & (t > 0)
    victim = jnp.argmin(jnp.where(holds, t, jnp.iinfo(jnp.int32).max))
    hit = stuck & (jnp.arange(t.shape[0]) == victim)
    kv = _push_pages(kv, slots.table, jnp.where(hit, t // spec.page_size, 0), spec)
    entry = jnp.maximum(slots.entry, 0)
    first = pool.res_tok[entry, slots.sample, 0]
    slots = slots.replace(t=jnp.where(hit, 0, t), cur=jnp.where(hit, first, slots.cur))
    return slots, kv


def decode_step(params, pool: Pool, slots: Slots, kv: KV, stats: Stats, stop, seed_key, *,
                spec: Spec, dev) -> tuple[Pool, Slots, KV, Stats]:
    """Refill free slots, give pages to the slots that need one, run one decode step of every
    slot, record the sampled tokens and free the slots (and pages) of the samples that stopped or
    reached max_new_tokens."""
    k, nd, n, s = spec.pool, spec.share, spec.n, spec.max_new_tokens
    was_used = slots.used
    live0 = jnp.sum(slots.entry >= 0, dtype=jnp.int32)
    allow = jnp.all(slots.entry < 0) if spec.lockstep else jnp.bool_(True)
    pool, slots, take = _refill(pool, slots, spec, allow, jnp.maximum(kv.top - live0, 0))
    active = slots.entry >= 0
    slots, kv, stalled = _take_pages(slots, kv, active, spec)
    go = active & ~stalled
    stuck = jnp.any(active) & ~jnp.any(go)
    slots, kv = _restart_youngest(pool, slots, kv, stuck, spec)
    logits, kv, route = _forward(params, pool, slots, kv, go, spec)
    entry = jnp.maximum(slots.entry, 0)
    sid = jnp.maximum(pool.gid[entry], 0) * n + dev * nd + slots.sample
    tok, logp = _sampler(spec)(logits, sample_keys_for(seed_key, sid), slots.t + 1)
    t_out = slots.t + 1                                   # index of the new token
    inb = "promise_in_bounds"                               # see the state notes above
    at = jnp.where(go, entry, k)                             # idle slots write to entry K
    t_at = jnp.minimum(t_out, s - 1)
    res_tok = pool.res_tok.at[at, slots.sample, t_at].set(tok, mode=inb)
    res_logp = pool.res_logp.at[at, slots.sample, t_at].set(logp, mode=inb)
    if route is not None:   # the experts of the input token t (not the drawn t + 1)
        pool = pool.replace(res_route=pool.res_route.at[at, slots.sample, slots.t].set(
            route.astype(pool.res_route.dtype), mode=inb))
    is_stop = stop[tok]
    finish = go & (is_stop | (t_out + 1 >= s))
    fin_at = jnp.where(finish, entry, k)
    pool = pool.replace(
        res_tok=res_tok, res_logp=res_logp,
        res_len=pool.res_len.at[fin_at, slots.sample].set(t_out + 1, mode=inb),
        res_fin=pool.res_fin.at[fin_at, slots.sample].set(is_stop, mode=inb),
        done=pool.done + jnp.zeros((k + 1,), jnp.int32).at[fin_at].add(1, mode=inb)[:k],
    )
    # pages of positions 0..t of a finished sample go back
    kv = _push_pages(kv, slots.table,
                     jnp.where(finish, slots.t // spec.page_size + 1, 0), spec)
    slots = slots.replace(entry=jnp.where(finish, -1, slots.entry),
                          t=jnp.where(go, t_out, slots.t), cur=jnp.where(go, tok, slots.cur))
    stats = Stats(steps=stats.steps + 1,
                  live=stats.live + jnp.sum(go, dtype=jnp.int32),
                  assigned=stats.assigned + jnp.sum(take, dtype=jnp.int32),
                  refills=stats.refills + jnp.sum(take & was_used, dtype=jnp.int32),
                  stalls=stats.stalls + jnp.sum(stalled, dtype=jnp.int32),
                  restarts=stats.restarts + stuck.astype(jnp.int32))
    return pool, slots, kv, stats


def decode(params, pool: Pool, slots: Slots, kv: KV, stats: Stats, stop, seed_key, final, *,
           spec: Spec, dev):
    """Decode steps until a group completes, the tail can shrink to the next slot bucket
    (``final``: no prompt is left to admit, nothing pending, live slots fit), or nothing is left;
    the stop is checked every ``spec.check_every`` steps.

    Returns (pool, slots, kv, stats, summary)."""
    num_slots = slots.entry.shape[0]
    target = shrink_target(num_slots, spec)

    def stop_now(pool, slots):
        sm = summary(pool, slots, spec)
        halt = jnp.any(sm["complete"]) | ((sm["live"] == 0) & (sm["pending"] == 0))
        if target is not None:
            halt |= final & (sm["pending"] == 0) & (sm["live"] <= target)
        return halt

    def step(_, carry):
        return decode_step(params, *carry, stop, seed_key, spec=spec, dev=dev)

    def body(carry):
        # check_every steps between two stop checks: a loop of known trip count (no host round
        # trip per token on GPU, no cross-device reduction per token on a mesh). Steps past a
        # stop are harmless: every draw is keyed by (sample, token index), so the samples are
        # the same; a complete group's slots have moved on to pending samples.
        if spec.check_every == 1:
            return step(0, carry)
        return jax.lax.fori_loop(0, spec.check_every, step, carry)

    pool, slots, kv, stats = jax.lax.while_loop(lambda c: ~stop_now(c[0], c[1]), body,
                                                (pool, slots, kv, stats))
    return pool, slots, kv, stats, summary(pool, slots, spec, stats.steps)


def compact(slots: Slots, *, num_slots: int) -> Slots:
    """Keep ``num_slots`` slots, the live ones first, with their page tables (the pages stay)."""
    keep = jnp.argsort(slots.entry < 0, stable=True)[:num_slots]
    return jax.tree.map(lambda v: v[keep], slots)


def fetch(pool: Pool, entry):
    """One entry's results (this device's share): tokens, log-probs [Nd, S], lengths, finished;
    under Spec.record_routing also the response routing [Nd, S, L, Kx] and the prompt's
    [P, L, Kx]."""
    out = (pool.res_tok[entry], pool.res_logp[entry], pool.res_len[entry], pool.res_fin[entry])
    if pool.res_route is None:
        return out
    return (*out, pool.res_route[entry], pool.prefix_route[entry])
