"""Large-N rollout engine: each prompt is prefilled once, its N continuations share its KV cache.

BroRL (arXiv 2510.01180, Sec. 4) scales the number of rollouts per prompt N to 512. Engines that
repeat the prompt N times prefill it N times and keep N copies of its KV cache; here "one prompt,
N continuations" is the primary shape:

* prefill: the G prompts (right-padded to a bucketed length P) run once ->
  prefix KV ``[L, G, P, Hkv, Dh]`` and the last-position logits ``[G, V]``;
* decode: each of the G*N samples keeps only its own generated KV, suffix KV
  ``[L, G, N, S, Hkv, Dh]``; attention reads the shared prefix plus the sample's own suffix and
  merges the two exactly by log-sum-exp (``pallas_kernels.decode_attention``).

KV memory is O(G*P + G*N*S) instead of O(G*N*(P+S)). The decode loop is one ``lax.while_loop``
(stops when every sample has emitted a stop token or the budget is reached), with no host round
trip per token; the suffix KV buffers are donated and reused across chunks. When the G*N samples do
not fit ``memory_budget_bytes``, the N samples of each prompt are split into chunks that all reuse
the same prefill.

Randomness: sample ``i = g * N + n`` (prompt g, rollout n) at step t draws its uniform from
``fold_in(fold_in(PRNGKey(seed), i), t)``, so results do not depend on chunking or batching.

Log-probs: ``logprobs[g, n, t] = log_softmax(logits / T)[token]`` over the full vocabulary, i.e.
the temperature-scaled distribution *before* top-k/top-p filtering (what the trainer recomputes for
the truncated importance-sampling ratio, BroRL Sec. 3.1); for greedy (T = 0) ``log_softmax(logits)``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brorl_jax.models import ModelConfig, embed, final_norm, layer_finish, layer_qkv
from brorl_jax.models import lm_logits
from brorl_jax.models.transformer import dtype_of
from pallas_kernels.decode_attention import resolve_impl as _resolve_attention_impl
from pallas_kernels.decode_attention import shared_prefix_decode_attention
from pallas_kernels.sampling import resolve_impl as _resolve_sampling_impl
from pallas_kernels.sampling import sample_tokens

# Attention-score bytes allowed per prefill call ([Gb, H, P, P] f32); larger prompt batches are
# prefilled in several calls of the same shape.
_PREFILL_SCORE_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """Rollouts of G prompts x N samples, S = max_new_tokens (numpy arrays).

    tokens int32[G, N, S]: generated ids, ``pad_id`` (0) past ``lengths``.
    logprobs float32[G, N, S]: sampling-time ``log_softmax(logits / T)[token]`` (0 past lengths).
    lengths int32[G, N]: generated tokens per sample, the stop token included.
    finished bool[G, N]: a stop token was generated. truncated bool[G, N]: hit max_new_tokens
    without a stop token (exactly one of finished/truncated is True).
    mask bool[G, N, S]: ``t < lengths``.  prompt_lengths int32[G].
    num_chunks: how many decode chunks the N samples were split into (memory budget).
    stats: timings and padded shapes for logging/benchmarks: prefill_seconds, decode_seconds,
      decode_forward_rows (sum over loop iterations of the rows run through the model),
      padded_num_prompts, padded_prompt_len, samples_per_chunk.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    mask: np.ndarray
    prompt_lengths: np.ndarray
    num_chunks: int = 1
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def rollouts_per_prompt(self) -> int:
        return self.tokens.shape[1]


# ----------------------------------------------------------------------------------------------
# Shapes, validation, memory model
# ----------------------------------------------------------------------------------------------


def bucket_prompt_length(length: int) -> int:
    """Padded prompt length: the next power of two up to 64, then the next multiple of 64.

    Keeps the number of distinct compiled shapes small while wasting < 64 positions on long prompts.
    """
    if length <= 64:
        return max(8, 1 << (length - 1).bit_length())
    return -(-length // 64) * 64


def bucket_num_prompts(num_prompts: int) -> int:
    """Padded prompt batch: the next power of two."""
    return 1 << (num_prompts - 1).bit_length()


def _itemsize(cfg: ModelConfig) -> int:
    return jnp.dtype(dtype_of(cfg.dtype)).itemsize


def kv_bytes(cfg: ModelConfig, num_sequences: int, length: int) -> int:
    """Bytes of a K+V cache for ``num_sequences`` sequences of ``length`` positions, all layers."""
    return (2 * cfg.num_hidden_layers * num_sequences * length * cfg.num_key_value_heads
            * cfg.head_dim * _itemsize(cfg))


def decode_bytes_per_sample(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> int:
    """Working memory of one sample in the decode loop: its suffix KV, its logits row and the
    sampling temporaries (~4 f32 rows of V), its outputs, activations and attention scores."""
    s = max_new_tokens
    activations = 4 * (4 * cfg.hidden_size + 3 * cfg.intermediate_size
                       + 4 * cfg.num_attention_heads * cfg.head_dim)
    scores = 4 * 2 * cfg.num_attention_heads * (prompt_len + s)
    return kv_bytes(cfg, 1, s) + 4 * 4 * cfg.vocab_size + 9 * s + activations + scores


def decode_fixed_bytes(cfg: ModelConfig, num_prompts: int, prompt_len: int) -> int:
    """Memory shared by all samples: the prompts' KV and their last-position logits."""
    return kv_bytes(cfg, num_prompts, prompt_len) + 4 * num_prompts * cfg.vocab_size


def plan_chunks(
    cfg: ModelConfig,
    num_prompts: int,
    prompt_len: int,
    rollouts_per_prompt: int,
    max_new_tokens: int,
    memory_budget_bytes: int | None,
) -> tuple[int, int]:
    """(num_chunks, samples_per_chunk) such that one chunk's decode memory fits the budget.

    Chunks are equal-sized (the last may hold a few discarded extra samples) so every chunk uses
    the same compiled loop. The budget covers the rollout working memory (prompt KV, per-sample
    KV, logits, activations), not the parameters.
    """
    n = rollouts_per_prompt
    if memory_budget_bytes is None:
        return 1, n
    fixed = decode_fixed_bytes(cfg, num_prompts, prompt_len)
    per_sample = decode_bytes_per_sample(cfg, prompt_len, max_new_tokens) * num_prompts
    fit = (memory_budget_bytes - fixed) // per_sample
    if fit < 1:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes} is too small: the prompt KV needs {fixed} "
            f"bytes and one sample per prompt {per_sample} more; pass at least {fixed + per_sample} "
            "or fewer/shorter prompts or a smaller max_new_tokens"
        )
    if fit >= n:
        return 1, n
    num_chunks = -(-n // fit)
    return num_chunks, -(-n // num_chunks)


def validate_inputs(
    cfg: ModelConfig, prompts: Any, rollouts_per_prompt: int, max_new_tokens: int,
    temperature: float, top_p: float, top_k: int,
) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError("prompts must be a list of token-id lists (tokenize the text first)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    if not isinstance(rollouts_per_prompt, (int, np.integer)) or rollouts_per_prompt <= 0:
        raise ValueError(f"rollouts_per_prompt must be a positive int, got {rollouts_per_prompt!r}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not (temperature >= 0.0) or math.isinf(temperature):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    out = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{i}] is empty or not a flat list of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(
                f"prompts[{i}] has token ids outside [0, vocab_size={cfg.vocab_size})"
            )
        if ids.size + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompts[{i}] has {ids.size} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model context max_position_embeddings={cfg.max_position_embeddings}; "
                "truncate the prompt or lower max_new_tokens"
            )
        out.append([int(t) for t in ids])
    return out




def resolve_eos_ids(model: Any, eos_ids: Sequence[int] | None) -> tuple[int, ...]:
    """Stop tokens: ``eos_ids`` if given, else the model's generation config, else its config."""
    if eos_ids is not None:
        return tuple(sorted({int(e) for e in eos_ids}))
    ids = tuple(getattr(model, "generation_eos_ids", ()) or ()) or tuple(model.config.eos_token_ids)
    return tuple(sorted({int(e) for e in ids}))


def pad_prompts(prompts: list[list[int]], num_rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``tokens int32[num_rows, length]`` and ``lengths int32[num_rows]``.

    Rows past ``len(prompts)`` are one-token dummy prompts (their samples are discarded)."""
    tokens = np.zeros((num_rows, length), np.int32)
    lengths = np.ones((num_rows,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    return tokens, lengths


# ----------------------------------------------------------------------------------------------
# Prefill (once per prompt)
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


# un-jitted forms are public so brorl_jax.parallel can jit them with explicit shardings
prefill_prompts = jax.jit(prefill_prompts_fn, static_argnums=(1,))


def prefill_in_batches(
    params: dict, cfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`prefill_prompts` over prompt micro-batches (power of two) that bound the
    [Gb, H, P, P] attention scores to ~256 MiB; concatenated on the prompt axis."""
    g, p = tokens.shape
    per_prompt = 4 * cfg.num_attention_heads * p * p
    gb = max(1, min(g, _PREFILL_SCORE_BYTES // max(per_prompt, 1)))
    gb = 1 << (gb.bit_length() - 1)  # g is a power of two, so gb divides it
    if gb == g:
        return prefill_prompts(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    parts = [
        prefill_prompts(params, cfg, jnp.asarray(tokens[i : i + gb]), jnp.asarray(lengths[i : i + gb]))
        for i in range(0, g, gb)
    ]
    return (jnp.concatenate([pt[0] for pt in parts], axis=1),
            jnp.concatenate([pt[1] for pt in parts], axis=1),
            jnp.concatenate([pt[2] for pt in parts], axis=0))


# ----------------------------------------------------------------------------------------------
# Sampling step shared with the naive engine
# ----------------------------------------------------------------------------------------------


def sample_step(
    logits: jax.Array, sample_keys: jax.Array, step: jax.Array, *, temperature: float,
    top_k: int, top_p: float, impl: str,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per sample: ``logits f32[B, V]``, ``sample_keys [B, 2]`` (one key per
    sample, ``fold_in(seed_key, sample_index)``), ``step`` int -> (tokens int32[B], logp f32[B])."""
    if temperature == 0.0:
        uniforms = jnp.zeros(logits.shape[:1], jnp.float32)  # unused by greedy
    else:
        uniforms = jax.vmap(
            lambda k: jax.random.uniform(jax.random.fold_in(k, step), (), jnp.float32)
        )(sample_keys)
    return sample_tokens(logits, uniforms, temperature=temperature, top_k=top_k, top_p=top_p,
                         impl=impl)


def sample_keys_for(seed_key: jax.Array, sample_ids: jax.Array) -> jax.Array:
    """Per-sample key streams: ``fold_in(seed_key, global sample index)`` -> keys [B, 2]."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(sample_ids.reshape(-1))


# ----------------------------------------------------------------------------------------------
# Decode loop (one compiled while_loop per chunk of samples)
# ----------------------------------------------------------------------------------------------


def decode_chunk_fn(
    params: dict,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prompt_lengths: jax.Array,
    first_logits: jax.Array,
    sample_ids: jax.Array,
    live: jax.Array,
    seed_key: jax.Array,
    suffix_k: jax.Array,
    suffix_v: jax.Array,
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_ids: tuple[int, ...],
    attention_impl: str,
    sampling_impl: str,
) -> tuple[dict, jax.Array, jax.Array]:
    """Generate ``n`` continuations of each of G prefilled prompts.

    Args:
      prefix_k, prefix_v: [L, G, P, Hkv, Dh] prompt KV (shared by the n samples of a prompt).
      prompt_lengths: int32[G]. first_logits: f32[G, V] (prefill's last-position logits).
      sample_ids: int32[G, n] global sample indices (RNG streams). live: bool[G] (False = padding
        prompt: its samples start finished, so they never keep the loop alive).
      seed_key: PRNG key data uint32[2].
      suffix_k, suffix_v: [L, G, n, S, Hkv, Dh] donated scratch for the samples' own KV.

    Returns:
      (outputs dict of tokens/logprobs [G, n, S], lengths/finished [G, n]; suffix_k; suffix_v)
      The suffix buffers come back so the next chunk can reuse (donate) them.
    """
    num_layers, g, n, s = suffix_k.shape[:4]
    h, dh = cfg.num_attention_heads, cfg.head_dim
    b = g * n
    keys = sample_keys_for(seed_key, sample_ids)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    sample = functools.partial(sample_step, temperature=temperature, top_k=top_k, top_p=top_p,
                               impl=sampling_impl)

    # token 0 comes from the prefill logits: shared over n, drawn independently per sample
    logits0 = jnp.broadcast_to(first_logits[:, None, :], (g, n, first_logits.shape[-1]))
    tok0, logp0 = sample(logits0.reshape(b, -1), keys, jnp.int32(0))
    tok0, logp0 = tok0.reshape(g, n), logp0.reshape(g, n)
    done0 = jnp.isin(tok0, eos) | ~live[:, None]
    tokens = jnp.zeros((g, n, s), jnp.int32).at[:, :, 0].set(tok0)
    logprobs = jnp.zeros((g, n, s), jnp.float32).at[:, :, 0].set(logp0)
    state = dict(t=jnp.int32(0), tokens=tokens, logprobs=logprobs, cur=tok0,
                 lengths=jnp.ones((g, n), jnp.int32), done=done0, finished=jnp.isin(tok0, eos),
                 suffix_k=suffix_k, suffix_v=suffix_v)

    def cond(st):
        return (st["t"] + 1 < s) & ~jnp.all(st["done"])

    def body(st):
        t = st["t"]
        # the token at output index t sits at position len + t and owns suffix slot t
        positions = (prompt_lengths[:, None] + t).repeat(n, axis=1).reshape(b, 1)
        suffix_len = jnp.full((g, n), t + 1, jnp.int32)

        def layer(carry, xs):
            x, sk_all, sv_all = carry
            layer_params, pk, pv, idx = xs
            q, k, v = layer_qkv(layer_params, cfg, x, positions)
            start = (idx, 0, 0, t, 0, 0)
            sk_all = jax.lax.dynamic_update_slice(
                sk_all, k.reshape(1, g, n, 1, *k.shape[2:]).astype(sk_all.dtype), start)
            sv_all = jax.lax.dynamic_update_slice(
                sv_all, v.reshape(1, g, n, 1, *v.shape[2:]).astype(sv_all.dtype), start)
            attn = shared_prefix_decode_attention(
                q.reshape(g, n, h, dh), pk, pv, prompt_lengths, sk_all[idx], sv_all[idx],
                suffix_len, impl=attention_impl,
            )
            x = layer_finish(layer_params, cfg, x, attn.reshape(b, 1, h, dh).astype(x.dtype))
            return (x, sk_all, sv_all), None

        x0 = embed(params, cfg, st["cur"].reshape(b, 1))
        (x, sk_all, sv_all), _ = jax.lax.scan(
            layer, (x0, st["suffix_k"], st["suffix_v"]),
            (params["layers"], prefix_k, prefix_v, jnp.arange(num_layers)),
        )
        logits = lm_logits(params, cfg, final_norm(params, cfg, x))[:, 0]
        tok, logp = sample(logits, keys, t + 1)
        tok, logp = tok.reshape(g, n), logp.reshape(g, n)
        active = ~st["done"]
        tok = jnp.where(active, tok, 0)
        is_eos = jnp.isin(tok, eos) & active
        return dict(
            t=t + 1,
            tokens=st["tokens"].at[:, :, t + 1].set(tok),
            logprobs=st["logprobs"].at[:, :, t + 1].set(jnp.where(active, logp, 0.0)),
            cur=tok,
            lengths=st["lengths"] + active.astype(jnp.int32),
            done=st["done"] | is_eos,
            finished=st["finished"] | is_eos,
            suffix_k=sk_all,
            suffix_v=sv_all,
        )

    st = jax.lax.while_loop(cond, body, state)
    out = dict(tokens=st["tokens"], logprobs=st["logprobs"], lengths=st["lengths"],
               finished=st["finished"], steps=st["t"] + 1)
    return out, st["suffix_k"], st["suffix_v"]


decode_chunk = jax.jit(
    decode_chunk_fn,
    static_argnames=("cfg", "max_new_tokens", "temperature", "top_k", "top_p", "eos_ids",
                     "attention_impl", "sampling_impl"),
    donate_argnames=("suffix_k", "suffix_v"),
)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def finalize(
    tokens: np.ndarray, logprobs: np.ndarray, lengths: np.ndarray, finished: np.ndarray,
    prompt_lengths: np.ndarray, num_chunks: int,
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
        num_chunks=num_chunks,
    )


def generate(
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
    memory_budget_bytes: int | None = None,
    params: dict | None = None,
    impl: str = "auto",
    mesh: Any = None,
) -> RolloutResult:
    """Sample ``rollouts_per_prompt`` continuations of each prompt, prefilling each prompt once.

    Args:
      model: a ``brorl_jax.models.Model`` (``from_pretrained``): its config, params and stop ids.
      prompts: G token-id lists of any (non-zero) lengths.
      rollouts_per_prompt: N samples per prompt. max_new_tokens: S, the response budget.
      temperature: 0 = greedy. top_p in (0, 1], top_k >= 0 (0 = off): HF order, top-k then top-p.
      seed: RNG seed; sample ``g * N + n`` has its own stream, independent of chunking.
      eos_ids: stop tokens (default: the model's generation config, then its config).
      memory_budget_bytes: bound on the decode working memory; N is split into chunks that share
        the prefill when G*N samples do not fit (see :func:`plan_chunks`).
      params: overrides ``model.params`` (the trainer's current policy).
      impl: kernels: "auto" (Pallas on GPU/TPU, jnp reference on CPU), "pallas" or "reference".
      mesh: a ``jax.sharding.Mesh`` (brorl_jax.parallel.make_mesh): run on it, each prompt's KV
        replicated over the sample axes and its N samples split over them
        (``brorl_jax.parallel.sharded.sharded_generate``; same tokens for a seed as without).

    Returns:
      :class:`RolloutResult` with tokens/logprobs [G, N, S], lengths/finished/truncated [G, N].
    """
    if mesh is not None:
        from brorl_jax.parallel.sharded import sharded_generate
        return sharded_generate(
            model, prompts, mesh=mesh, rollouts_per_prompt=rollouts_per_prompt,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, eos_ids=eos_ids, memory_budget_bytes=memory_budget_bytes, params=params,
            impl=impl)
    cfg: ModelConfig = model.config
    prompts = validate_inputs(cfg, prompts, rollouts_per_prompt, max_new_tokens, temperature, top_p, top_k)
    params = model.params if params is None else params
    eos = resolve_eos_ids(model, eos_ids)
    attention_impl, sampling_impl = _resolve_attention_impl(impl), _resolve_sampling_impl(impl)
    g_real, n_real, s = len(prompts), int(rollouts_per_prompt), int(max_new_tokens)
    g = bucket_num_prompts(g_real)
    p = bucket_prompt_length(max(len(x) for x in prompts))
    tokens, lengths = pad_prompts(prompts, g, p)

    t0 = time.perf_counter()
    prefix_k, prefix_v, first_logits = prefill_in_batches(params, cfg, tokens, lengths)
    first_logits.block_until_ready()
    t1 = time.perf_counter()
    num_chunks, n = plan_chunks(cfg, g, p, n_real, s, memory_budget_bytes)
    shape = (cfg.num_hidden_layers, g, n, s, cfg.num_key_value_heads, cfg.head_dim)
    suffix_k = jnp.zeros(shape, dtype_of(cfg.dtype))
    suffix_v = jnp.zeros(shape, dtype_of(cfg.dtype))
    seed_key = jax.random.PRNGKey(seed)
    live = jnp.asarray(np.arange(g) < g_real)
    prompt_lengths = jnp.asarray(lengths)
    outs = []
    for c in range(num_chunks):
        ids = np.arange(g)[:, None] * n_real + c * n + np.arange(n)[None, :]
        out, suffix_k, suffix_v = decode_chunk(
            params, prefix_k, prefix_v, prompt_lengths, first_logits,
            jnp.asarray(ids, jnp.int32), live, seed_key, suffix_k, suffix_v,
            cfg=cfg, max_new_tokens=s, temperature=float(temperature), top_k=int(top_k),
            top_p=float(top_p), eos_ids=eos, attention_impl=attention_impl,
            sampling_impl=sampling_impl,
        )
        outs.append(jax.device_get(out))
    t2 = time.perf_counter()
    cat = {k: np.concatenate([o[k] for o in outs], axis=1)[:g_real, :n_real]
           for k in ("tokens", "logprobs", "lengths", "finished")}
    result = finalize(cat["tokens"], cat["logprobs"], cat["lengths"], cat["finished"],
                      lengths[:g_real], num_chunks)
    result.stats.update(
        prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
        decode_forward_rows=int(sum((int(o["steps"]) - 1) * g * n for o in outs)),
        padded_num_prompts=g, padded_prompt_len=p, samples_per_chunk=n,
    )
    return result
