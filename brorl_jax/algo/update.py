"""The jitted RL update step: PPO mini-batches, micro-batched gradient accumulation, fused
log-probs, KL to the reference, NaN guard, reference resets (BroRL §3.1, ProRLv2).

One call of `update(state, batch, rng)`:
  1. pi_old: the step-start trainer log-probs of every response token (a no-grad, micro-batched
     pass), unless recompute_old_logprobs=False (then the rollout log-probs are pi_old). With
     one mini-batch and one epoch that pass is redundant and folded into the gradient pass
     (pi_old_in_gradient_pass).
  2. for each of ppo_epochs x ppo_mini_batches mini-batches (a lax.scan): the gradient of the
     policy_loss (losses.py) summed over micro-batches by a lax.scan, every micro-batch's
     transformer forward rematerialised per layer (the policy from the memory plan:
     plan_remat_policy), so peak memory is set by micro_batch_size and
     not by the number of rollouts N; then the optax step, skipped if loss or gradients are
     non-finite (params and optimizer state kept; metrics["skipped"] counts skipped steps).
Log-probs come from pallas_kernels.fused_logprob on the final hidden states: the [tokens, V]
logits are never materialised.

Both batch layouts of algo.batch work: padded rows, or packed rows (several sequences per row,
segment ids; docs/algo.md "Sequence packing"). Micro-batches hold algo.micro_batch_tokens //
row width rows (or micro_batch_size rows when it is 0).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from brorl_jax.algo import moe_losses
from brorl_jax.algo.batch import TokenRows, UpdateBatch
from brorl_jax.algo.losses import METRIC_SUMS, get_loss_agg, policy_loss, step_metrics
from brorl_jax.algo.routing_replay import replay_args, routed
from brorl_jax.config.schema import UpdateConfig
from brorl_jax.models import lora
from pallas_kernels import fused_logprob, fused_logprob_stats


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (RL steps done); params / ref_params: model param trees (ref_params None
    when no KL is used, and under LoRA, where the reference is the base); opt_state: the optax
    state (of the adapters alone under LoRA); lora_merged: under LoRA, the adapters merged into
    the base so far, oldest first (algo/adapters.py), else None."""
    step: jax.Array
    params: Any
    opt_state: Any
    ref_params: Any
    lora_merged: Any = None


def create_train_state(params, optimizer: optax.GradientTransformation, *, with_reference: bool = True) -> TrainState:
    ref = jax.tree.map(jnp.copy, params) if with_reference else None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(lora.trainable(params)), ref_params=ref)


def reset_reference(state: TrainState, optimizer: optax.GradientTransformation | None = None, *,
                    reset_optimizer: bool = False) -> TrainState:
    """pi_ref <- current policy (ProRL's periodic reference reset). With reset_optimizer=True the
    optimizer state is re-initialised as ProRL v1 did; ProRLv2 keeps it (False)."""
    new = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    if reset_optimizer:
        if optimizer is None:
            raise ValueError("reset_reference(reset_optimizer=True) needs the optimizer to re-initialise its state")
        new = new.replace(opt_state=optimizer.init(state.params))
    return new


def maybe_reset_reference(state: TrainState, cfg: UpdateConfig,
                          optimizer: optax.GradientTransformation | None = None) -> tuple[TrainState, bool]:
    """After an update: reset pi_ref every cfg.ref_reset_every RL steps (host-side check on
    state.step, the RL steps done). Without a KL term there is no reference to reset. (Under
    LoRA there is no ref_params: algo.adapters.maybe_reset merges instead.)"""
    step = int(state.step)
    if (cfg.ref_reset_every > 0 and cfg.kl_coef > 0 and state.ref_params is not None
            and step > 0 and step % cfg.ref_reset_every == 0):
        return reset_reference(state, optimizer, reset_optimizer=cfg.reset_optimizer_on_ref_reset), True
    return state, False


class PolicyFns(NamedTuple):
    """How the update reaches a model: hidden(params, tokens, positions, attention_mask, remat) ->
    final normed hidden [B, T, D]; lm_head(params) -> [D, V]. attention_mask is None, a bool
    padding mask [B, T], or, for packed rows, the int32 segment ids [B, T] (0 = padding; a
    token attends only within its segment)."""
    hidden: Callable[..., jax.Array]
    lm_head: Callable[[Any], jax.Array]


def model_policy_fns(model_cfg) -> PolicyFns:
    """PolicyFns for brorl_jax.models (the transformer's pure functions)."""
    from brorl_jax.models import transformer

    def hidden(params, tokens, positions, attention_mask, remat, routing=None, aux=False):
        # routing int[B, T, L, K] (a batch's, algo/routing_replay.py) -> forward's [L, B, T, K];
        # aux: (hidden, the MoE load-balancing loss of this forward) (algo/moe_losses.py)
        mask, segments = split_attention_arg(attention_mask)
        out = transformer.forward(params, model_cfg, tokens, positions=positions,
                                  attention_mask=mask, segment_ids=segments, return_hidden=True,
                                  remat=remat, return_router_logits=aux, **replay_args(routing))
        return moe_losses.forward_aux(out, model_cfg, tokens, mask, segments) if aux else out

    return PolicyFns(hidden=hidden, lm_head=lambda params: transformer.lm_head_matrix(params, model_cfg))


def split_attention_arg(attention_mask):
    """PolicyFns' attention argument -> (padding mask or None, segment ids or None)."""
    if attention_mask is not None and jnp.issubdtype(attention_mask.dtype, jnp.integer):
        return None, attention_mask
    return attention_mask, None


def _resolve_policy(model_cfg, policy: PolicyFns | None) -> PolicyFns:
    if policy is not None:
        return policy
    if model_cfg is None:
        raise ValueError("give model_cfg (a brorl_jax.models.ModelConfig) or policy=PolicyFns(...)")
    return model_policy_fns(model_cfg)


def _token_logprobs(policy: PolicyFns, params, mb: TokenRows | UpdateBatch, cfg: UpdateConfig, *,
                    remat: bool, stats: bool = False, logprob_fn=None, router_aux: bool = False):
    """Micro-batch rows -> (logp [b, T], entropy [b, T], sum_p2 [b, T] or None; with router_aux
    instead the MoE load-balancing loss of the forward, algo/moe_losses.py).

    logprob_fn(hidden[T, D], lm_head[D, V], targets[T], *, temperature, impl) replaces
    pallas_kernels.fused_logprob when given (e.g. the vocab-parallel shard_map version)."""
    tokens = mb.input_tokens
    b, t = tokens.shape
    h = policy.hidden(params, tokens, mb.positions, mb.attention_arg(), remat, **routed(mb),
                      **({"aux": True} if router_aux else {}))
    h, aux = h if router_aux else (h, None)
    w = policy.lm_head(params).astype(h.dtype)
    h2, tg = h.reshape(b * t, h.shape[-1]), mb.targets.reshape(b * t)
    if stats:
        out = fused_logprob_stats(h2, w, tg, temperature=cfg.temperature, impl=cfg.logprob_impl)
        return (out["logp"].reshape(b, t), out["entropy"].reshape(b, t), out["sum_p2"].reshape(b, t))
    logp, ent = (logprob_fn or fused_logprob)(h2, w, tg, temperature=cfg.temperature, impl=cfg.logprob_impl)
    return logp.reshape(b, t), ent.reshape(b, t), aux


def first_pi_old_in_gradient_pass(cfg: UpdateConfig, diagnostics_n: int | None = None) -> bool:
    """True when the pi_old pass can skip the first mini-batch's rows: with several mini-batches
    and one epoch, the first optimizer step also runs at the step-start params, so its pi_old
    is its own gradient pass's log-prob (stop_gradient), as in pi_old_in_gradient_pass; the
    later mini-batches run after an optimizer step and need the pass. Saves 1 / ppo_mini_batches
    of the pass (configs/brorl.py: a quarter)."""
    return bool(cfg.recompute_old_logprobs and cfg.ppo_mini_batches > 1 and cfg.ppo_epochs == 1
                and diagnostics_n is None)


def pi_old_in_gradient_pass(cfg: UpdateConfig, diagnostics_n: int | None = None) -> bool:
    """True when the separate pi_old pass is redundant: with one PPO mini-batch and one epoch the
    only optimizer step runs at the step-start params, so pi_old is, token for token, the
    log-prob the gradient pass computes itself (same params, same tokens, same model): the
    update takes stop_gradient of it instead of running a second forward. The rollout's own
    log-probs are NOT substituted: they come from another program (KV-cache decode, its dtype
    and kernels), so they stay the TIS behaviour policy, and pi_old only when
    recompute_old_logprobs=False. The pass still runs when the mass-balance diagnostics ride on
    it (diagnostics_n)."""
    return bool(cfg.recompute_old_logprobs and cfg.ppo_mini_batches == 1 and cfg.ppo_epochs == 1
                and diagnostics_n is None)


def remat_saved_bytes(model_cfg, tokens: int, policy: str) -> int:
    """Activation bytes a micro-batch of `tokens` keeps for the backward pass under a remat
    policy (models.transformer.REMAT_POLICIES), in the compute dtype unless stated:

    * "full": every layer's input;
    * "dots": also every projection's output (q, k, v, o, gate, up, down; with the fused MLP
      kernels of pallas_kernels.swiglu_mlp gate and up are saved by name);
    * "none" (flash attention only: another attention keeps [T, T] probabilities): what
      autodiff keeps of an un-rematerialised layer, as the traced program lists it (tested
      against jax's saved residuals, an upper bound of what XLA keeps): both norms' float32
      input, normalised and scaled outputs and two float32 scalars; q after RoPE and its
      float32 cos/sin; K and V repeated to the query heads, the attention output (twice: the
      kernel's and o_proj's view) and its float32 log-sum-exp; gate and up (fused kernels)
      or gate, up, silu's three residuals and the product (XLA); with q/k norms (qwen3) their
      float32 inputs, two float32 scalars per head and normalised outputs; a mixture of
      experts' MLP as _mlp_saved_bytes lists it.

    Whether the fused MLP kernels run is decided for the platform traced for."""
    from brorl_jax.models.transformer import dtype_of
    c = model_cfg
    dtype = jnp.dtype(dtype_of(c.dtype))
    item = dtype.itemsize
    d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    if policy == "full":
        per_token_bytes = d * item
    elif policy == "dots":
        per_token_bytes = ((d + h * dh + 2 * hkv * dh + d) * item
                           + _mlp_saved_bytes(c, tokens, policy, dtype))
    elif policy == "none":
        if c.attention_impl != "flash":
            raise ValueError(f"remat_saved_bytes: policy 'none' is planned for attention_impl="
                             f"'flash' only, not {c.attention_impl!r} (its [T, T] "
                             "probabilities are not counted)")
        qk_norms = (4 + item) * (h + hkv) * dh + 8 * (h + hkv) if c.qk_norm else 0
        per_token_bytes = ((8 + 4 * item) * d + 16 + 5 * item * h * dh + 8 * dh + 4 * h
                           + qk_norms + _mlp_saved_bytes(c, tokens, policy, dtype))
    else:
        raise ValueError(f"remat policy {policy!r}; one of ('full', 'dots', 'none')")
    return int(tokens) * c.num_hidden_layers * per_token_bytes


def _mlp_saved_bytes(c, tokens: int, policy: str, dtype) -> int:
    """Per-token bytes the MLP keeps for the backward under "dots" or "none" (remat_saved_bytes)."""
    from pallas_kernels import swiglu_mlp
    d, item = c.hidden_size, dtype.itemsize
    if c.is_moe:
        e, k, i = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        s = c.shared_expert_intermediate_size    # Qwen2-MoE's shared expert: as a dense MLP's
        if policy == "dots":    # the router's float32 logits (the grouped GEMMs are no dots)
            return 4 * e + ((d + 2 * s) * item + 4 if s else 0)   # + the shared expert's dots
        # softmax's exp and two float32 scalars, the top-k gates and ids, the K gathered rows
        # and their ids, gate, up, silu's three residuals and the product of each chosen
        # expert, the ids putting rows back, the K float32 expert outputs (models/moe.py)
        return (4 * e + 8 + 16 * k + k * d * (item + 4) + 6 * k * i * item
                + (6 * s * item + 4 * d + 8 if s else 0))   # the shared expert's, its f32 sum
    i = c.intermediate_size
    if policy == "dots":        # down's output, gate's and up's
        return (d + 2 * i) * item
    fused = swiglu_mlp.resolve_impl(c.mlp_impl, (int(tokens), d), (d, i), dtype) == "pallas"
    return (2 if fused else 6) * item * i


# Parameter-sized float32 buffers the update holds besides activations: params, Adam's two
# moments, the gradient accumulator and one micro-batch's gradient; plus a compute-dtype copy.
_STATE_F32_COPIES = 5
# Fraction of device memory the plan leaves for XLA's workspace, the log-prob kernel and the
# transient per-layer buffers of the backward pass.
_REMAT_HEADROOM = 0.25


def train_state_bytes(model_cfg, n_params: int) -> int:
    """Device memory of the update's state besides activations (one device): _STATE_F32_COPIES
    parameter-sized float32 buffers and a compute-dtype copy of the parameters; under LoRA
    (n_params: the base's) the base in the compute dtype and those buffers for the adapters."""
    from brorl_jax.models.transformer import dtype_of
    item = jnp.dtype(dtype_of(model_cfg.dtype)).itemsize
    if lora.enabled(model_cfg):
        return n_params * item + lora.adapter_count(model_cfg) * (4 * _STATE_F32_COPIES + item)
    return n_params * (4 * _STATE_F32_COPIES + item)


def plan_remat_policy(model_cfg, tokens: int, n_params: int, device_bytes: int | None) -> str:
    """The remat policy the memory plan picks for a micro-batch of `tokens`, the first whose
    saved activations fit beside the training state with _REMAT_HEADROOM of the device left:
    "none" (nothing recomputed; with flash attention only), "dots" (no recomputed matmuls: the
    backward reruns only norms, RoPE, attention and, without the fused MLP kernels, SwiGLU),
    else "full" (one extra forward per micro-batch). Unknown device memory (CPU): "full"."""
    if device_bytes is None or model_cfg is None:
        return "full"
    room = device_bytes * (1 - _REMAT_HEADROOM) - train_state_bytes(model_cfg, n_params)
    candidates = ("none", "dots") if model_cfg.attention_impl == "flash" else ("dots",)
    for policy in candidates:
        if remat_saved_bytes(model_cfg, tokens, policy) <= room:
            return policy
    return "full"


def device_memory_bytes() -> int | None:
    """Memory of the first local device (GPU/TPU allocator limit), None where unknown (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # pragma: no cover - backends without memory_stats
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def micro_batch_rows(cfg: UpdateConfig, seq_len: int) -> int:
    """Rows per micro-batch: algo.micro_batch_tokens // seq_len (a row is never split), or
    algo.micro_batch_size rows when micro_batch_tokens is 0."""
    if cfg.micro_batch_tokens <= 0:
        return cfg.micro_batch_size
    if cfg.micro_batch_tokens < seq_len:
        raise ValueError(f"'algo.micro_batch_tokens' = {cfg.micro_batch_tokens} is less than one "
                         f"row of {seq_len} tokens; set it to at least {seq_len} (rows are never "
                         "split)")
    return cfg.micro_batch_tokens // seq_len


def _micro_name(cfg: UpdateConfig) -> str:
    return (f"algo.micro_batch_tokens={cfg.micro_batch_tokens}" if cfg.micro_batch_tokens > 0
            else f"algo.micro_batch_size={cfg.micro_batch_size}")


def _check_batch(batch: UpdateBatch, cfg: UpdateConfig) -> tuple[int, int, int]:
    """-> (rows, mini-batch rows, micro-batch rows). A packed batch's mini-batches are padded to
    whole micro-batches in the step; a padded batch's must divide."""
    if not isinstance(batch, UpdateBatch):
        raise TypeError(f"the update takes an algo.batch.UpdateBatch, not {type(batch).__name__}")
    rows, seq = batch.check_shapes()
    packed = batch.packed
    if packed and batch.pack_units is not None and len(batch.pack_units) % cfg.ppo_mini_batches:
        raise ValueError(f"the packed batch has {len(batch.pack_units)} packing units, not a "
                         f"multiple of algo.ppo_mini_batches={cfg.ppo_mini_batches}: pass "
                         f"mini_batches=algo.ppo_mini_batches to assemble_update_batch")
    if rows % cfg.ppo_mini_batches:
        raise ValueError(f"batch rows {rows} not divisible by algo.ppo_mini_batches={cfg.ppo_mini_batches}")
    mini = rows // cfg.ppo_mini_batches
    micro = min(micro_batch_rows(cfg, seq), mini)
    if not packed and mini % micro:
        raise ValueError(f"mini-batch rows {mini} (= {rows} / ppo_mini_batches) not divisible by "
                         f"{micro} rows per micro-batch ({_micro_name(cfg)})")
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("algo.kl_coef > 0 but the update batch has no ref_logprobs: fill it "
                         "with make_logprob_fn on the reference params")
    return rows, mini, micro


@flax.struct.dataclass
class _Rows:
    """The update's rows as the loss reads them: the batch (without its host-side fields), pi_old
    float32[R, T] (the step-start log-probs) and, per mini-batch, the loss aggregation weights
    float32[R, T] (LOSS_AGG over the whole mini-batch)."""
    batch: UpdateBatch
    pi_old: jax.Array
    agg_weights: jax.Array | None = None
    aux_shares: jax.Array | None = None    # moe_losses.token_shares with the MoE aux loss on


def _split(tree, n: int, shard_rows=None):
    """Leading dim R -> [n, R / n, ...] for every leaf; shard_rows (a sharding constraint under a
    mesh) keeps the rows of each part spread over the batch devices after the reshape."""
    out = jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), tree)
    return shard_rows(out) if shard_rows is not None else out


def _pad_rows(tree, axis: int, multiple: int):
    """Pads axis `axis` of every leaf with zero rows to a multiple of `multiple` (for packed
    rows: segment 0, no loss tokens, so the padding adds nothing to any sum)."""
    def one(x):
        extra = (-x.shape[axis]) % multiple
        if not extra:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)
    return jax.tree.map(one, tree)


def make_logprob_fn(model_cfg=None, algo_cfg: UpdateConfig | None = None, *, policy: PolicyFns | None = None,
                    micro_batch_size: int | None = None, with_stats: bool = False,
                    unsampled_n: int | None = None, logprob_fn=None, shard_rows=None):
    """-> logprobs(params, batch) -> (logp [B, T], entropy [B, T], stats dict); batch: an
    UpdateBatch or a TokenRows (only the fields a forward pass reads are used).

    No gradient; micro-batched with lax.map so memory does not grow with B. stats holds
    "sum_p2" [B, T] (sum_v p_v^2) when with_stats, and "sum_p2_unsampled" [B, T]
    (sum_v p_v^2 (1 - p_v)^n, BroRL Lemma 2's expected unsampled second moment at n =
    unsampled_n) when unsampled_n is given, both from the same pass over the vocabulary. Used for
    the reference log-probs, pi_old and diagnostics. Jit it yourself.
    logprob_fn / shard_rows: see make_update_step."""
    if algo_cfg is None:
        raise ValueError("make_logprob_fn needs algo_cfg (brorl_jax.config.update_config(...))")
    cfg = algo_cfg
    pol = _resolve_policy(model_cfg, policy)

    def logprobs(params, batch):
        inputs = batch.token_rows()
        rows, seq = inputs.input_tokens.shape
        micro = min(micro_batch_size or micro_batch_rows(cfg, seq), rows)
        packed = inputs.segment_ids is not None
        if rows % micro and not packed:
            raise ValueError(f"batch rows {rows} not divisible by micro_batch_size={micro}")
        if packed:      # whole micro-batches: empty rows at the end, cut off again below
            inputs = _pad_rows(inputs, 0, micro)
        parts = _split(inputs, inputs.input_tokens.shape[0] // micro, shard_rows)

        def one(mb: TokenRows):
            if unsampled_n is not None:
                tokens = mb.input_tokens
                b, t = tokens.shape
                h = pol.hidden(params, tokens, mb.positions, mb.attention_arg(), False,
                               **routed(mb))
                w = pol.lm_head(params).astype(h.dtype)
                out = fused_logprob_stats(h.reshape(b * t, -1), w, mb.targets.reshape(-1),
                                          temperature=cfg.temperature, impl=cfg.logprob_impl,
                                          unsampled_n=int(unsampled_n))
                shape = lambda x: x.reshape(b, t)
                return (shape(out["logp"]), shape(out["entropy"]), shape(out["sum_p2"]),
                        shape(out["sum_p2_unsampled"][:, 0]))
            logp, ent, p2 = _token_logprobs(pol, params, mb, cfg, remat=False, stats=with_stats,
                                            logprob_fn=logprob_fn)
            zero = jnp.zeros_like(logp)
            return logp, ent, (p2 if with_stats else zero), zero

        logp, ent, p2, u2 = lax.map(one, parts)
        if shard_rows is not None:   # keep the stacked [n_micro, micro, T] outputs row-sharded
            logp, ent, p2, u2 = shard_rows((logp, ent, p2, u2))
        merge = lambda x: lax.stop_gradient(x.reshape((-1,) + x.shape[2:])[:rows])
        stats = {}
        if with_stats or unsampled_n is not None:
            stats["sum_p2"] = merge(p2)
        if unsampled_n is not None:
            stats["sum_p2_unsampled"] = merge(u2)
        return merge(logp), merge(ent), stats

    return logprobs


def make_update_step(model_cfg, algo_cfg: UpdateConfig, optimizer: optax.GradientTransformation, *,
                     policy: PolicyFns | None = None, logprob_fn=None, shard_rows=None,
                     diagnostics_n: int | None = None, remat_policy: str | None = None,
                     device_bytes: int | None = None):
    """-> update(state, batch, rng) -> (state, metrics). Pure; jit it (donate state if you like).

    batch: an algo.batch.UpdateBatch in either layout: padded (rows =
    prompts_per_step * N; padded rows have an all-False loss_mask) or packed (segment ids,
    per-token advantages; its mini-batches are padded with empty rows to whole micro-batches).
    metrics (scalars): loss, pg_loss, kl, entropy, clip_frac, clip_frac_low,
    clip_frac_high, dual_clip_frac, ratio_mean, tis_dropped_frac, tis_weight_mean, grad_norm, grad_var, finite,
    skipped, n_tokens, optimizer_steps (+ mass_balance/* with diagnostics_n).

    grad_var estimates the trace of the covariance of the mini-batch gradient from the spread of
    its M micro-batch gradients g_i (sum_i g_i = G): each M g_i is an unbiased estimate of G, so
    Var = (M^2 sum_i |g_i|^2 - M |G|^2) / (M (M - 1)) (nan when M = 1). Not in the paper: the
    BroRL write-ups claim the gradient variance at N=16 is several times that at N=512.

    logprob_fn: replaces pallas_kernels.fused_logprob (same signature), e.g. the vocab-parallel
    shard_map version of brorl_jax.parallel. shard_rows: applied to every batch split (a sharding
    constraint keeping rows on the batch devices under a mesh); default identity.
    diagnostics_n: when given, the pi_old pass also returns BroRL's mass-balance statistics from
    the same pass over the vocabulary: the expected unsampled second moment sum_v p^2 (1-p)^n at
    n = diagnostics_n (Lemma 2) and sum_v p^2, averaged over response tokens.
    remat_policy: with algo.remat, what a layer keeps for the backward (models.transformer.
    REMAT_POLICIES); None = plan_remat_policy for the micro-batch's tokens and `device_bytes`
    (None = this process's first device; "full" where unknown).
    With one mini-batch and one epoch the pi_old pass is folded into the gradient pass
    (pi_old_in_gradient_pass).
    """
    cfg = algo_cfg
    pol = _resolve_policy(model_cfg, policy)
    old_fn = make_logprob_fn(algo_cfg=cfg, policy=pol, logprob_fn=logprob_fn, shard_rows=shard_rows,
                             unsampled_n=diagnostics_n)
    use_ref = cfg.kl_coef > 0
    inline_old = pi_old_in_gradient_pass(cfg, diagnostics_n)
    first_inline = first_pi_old_in_gradient_pass(cfg, diagnostics_n)

    def micro_loss(params, rows: _Rows, remat, first):
        mb = rows.batch
        logp, ent, aux = _token_logprobs(pol, params, mb, cfg, remat=remat, logprob_fn=logprob_fn,
                                         router_aux=moe_losses.enabled(cfg))
        if inline_old:
            old = lax.stop_gradient(logp)
        elif first_inline:      # the first mini-batch's pi_old is its own log-prob
            old = jnp.where(first, lax.stop_gradient(logp), rows.pi_old)
        else:
            old = rows.pi_old
        out = policy_loss(logp, ent, old_logp=old, rollout_logp=mb.old_logprobs,
                          ref_logp=mb.ref_logprobs if use_ref else None,
                          advantages=mb.advantages, loss_mask=mb.loss_mask,
                          agg_weights=rows.agg_weights, cfg=cfg)
        return out if aux is None else moe_losses.add_aux_loss(*out, aux, rows.aux_shares, cfg)

    minibatch_step = functools.partial(
        _minibatch_step, lora.value_and_grad(micro_loss), optimizer,
        get_loss_agg(cfg.loss_agg), shard_rows, aux_on=moe_losses.enabled(cfg))

    def update(state: TrainState, batch: UpdateBatch, rng: jax.Array | None = None):
        rows, mini, micro_rows = _check_batch(batch, cfg)
        packed = batch.packed
        # the host-side fields (sequence_index, pack_units) stay out of the device computation
        batch = batch.replace(sequence_index=None, pack_units=None)
        pi_old, diag = _pi_old(old_fn, state.params, batch, cfg, rows, inline_old=inline_old,
                               first_inline=first_inline, diagnostics_n=diagnostics_n)
        # (unused by micro_loss when inline_old: it takes stop_gradient of its own log-probs)
        data = _Rows(batch=batch,
                     pi_old=pi_old if cfg.recompute_old_logprobs else batch.old_logprobs)
        minis = _epoch_minibatches(data, cfg, rng, rows, micro_rows, packed, shard_rows)
        remat = _resolve_remat(cfg, model_cfg, state.params, micro_rows * batch.input_tokens.shape[1],
                               remat_policy, device_bytes)
        n_minis = jax.tree.leaves(minis)[0].shape[0]
        (params, opt_state), m = lax.scan(functools.partial(minibatch_step, micro_rows, remat),
                                          (state.params, state.opt_state),
                                          (minis, jnp.arange(n_minis)))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, dict(step_metrics(m, cfg), **diag, **moe_losses.aux_metrics(m))

    return update


def _resolve_remat(cfg: UpdateConfig, model_cfg, params, micro_tokens: int, remat_policy: str | None,
                   device_bytes: int | None):
    """The remat argument of the gradient pass: False without algo.remat, else the given policy
    or the memory plan's (plan_remat_policy) for a micro-batch of `micro_tokens`."""
    if not cfg.remat:
        return False
    if remat_policy is not None:
        return remat_policy
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    mem = device_bytes if device_bytes is not None else device_memory_bytes()
    return plan_remat_policy(model_cfg, micro_tokens, n_params, mem)


def _pi_old(old_fn, params, batch: UpdateBatch, cfg: UpdateConfig, rows: int, *, inline_old: bool,
            first_inline: bool, diagnostics_n: int | None):
    """-> (pi_old float32[R, T], mass-balance diagnostics): the step-start log-probs of the
    batch's targets (zeros for the rows the gradient pass supplies itself; the rollout's
    log-probs when nothing is recomputed)."""
    diag = {}
    pi_old = batch.old_logprobs
    if inline_old:     # folded into the gradient pass (pi_old_in_gradient_pass)
        pass
    elif first_inline:  # not for the first mini-batch's rows (first_pi_old_in_gradient_pass)
        head = rows // cfg.ppo_mini_batches
        rest, _, _ = old_fn(params, jax.tree.map(lambda x: x[head:], batch.token_rows()))
        pi_old = jnp.concatenate([jnp.zeros_like(pi_old[:head]), rest], axis=0)
    elif cfg.recompute_old_logprobs or diagnostics_n is not None:
        pi_old, _, stats = old_fn(params, batch)
        if diagnostics_n is not None:
            mask = batch.loss_mask.astype(jnp.float32)
            denom = jnp.maximum(mask.sum(), 1.0)
            diag = {"mass_balance/unsampled_second_moment":
                    (stats["sum_p2_unsampled"] * mask).sum() / denom,
                    "mass_balance/sum_p2": (stats["sum_p2"] * mask).sum() / denom}
    return pi_old, diag


def _epoch_minibatches(data: _Rows, cfg: UpdateConfig, rng, rows: int, micro_rows: int,
                       packed: bool, shard_rows):
    """Every epoch's PPO mini-batches stacked: leaves [ppo_epochs * M, R / M (+ padding), ...].
    Rows are reshuffled between epochs (the first keeps prompt groups together); a packed
    mini-batch gets empty rows at its end up to whole micro-batches."""
    epochs = []
    for epoch in range(cfg.ppo_epochs):
        order = data
        if rng is not None and cfg.ppo_epochs > 1 and epoch > 0:
            perm = jax.random.permutation(jax.random.fold_in(rng, epoch), rows)
            order = jax.tree.map(lambda x: x[perm], data)
        if packed:
            split = _pad_rows(_split(order, cfg.ppo_mini_batches), 1, micro_rows)
            epochs.append(shard_rows(split) if shard_rows is not None else split)
        else:
            epochs.append(_split(order, cfg.ppo_mini_batches, shard_rows))
    if len(epochs) == 1:
        return epochs[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *epochs)


def _minibatch_step(grad_fn, optimizer, agg, shard_rows, micro_rows, remat, carry, xs, *,
                    aux_on=False):
    """One PPO mini-batch (a lax.scan step): the gradient summed over its micro-batches, then the
    optax step, dropped when the loss or the gradient is not finite."""
    params, opt_state = carry
    train = lora.trainable(params)      # the gradients' tree: the adapters alone under LoRA
    mb, index = xs
    first = index == 0
    mb = mb.replace(agg_weights=agg(mb.batch.loss_mask, mb.batch.segment_ids),
                    aux_shares=moe_losses.token_shares(mb.batch) if aux_on else None)
    n_micro = mb.batch.input_tokens.shape[0] // micro_rows
    micro = _split(mb, n_micro, shard_rows)

    if n_micro == 1:
        # one micro-batch: its gradient is the mini-batch's (no float32 accumulator to
        # zero, add and re-read; one norm below)
        (loss, sums), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro), remat, first)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train)
        grad_norm = optax.tree.norm(grads)
        grad_var = jnp.float32(jnp.nan)
    else:
        def accumulate(acc, x):
            g_acc, l_acc, s_acc, sq_acc = acc
            (loss, sums), g = grad_fn(params, x, remat, first)
            return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss,
                    {k: s_acc[k] + sums[k] for k in s_acc},
                    sq_acc + jnp.square(optax.tree.norm(g))), None

        zeros_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), train)
        zeros_s = {k: jnp.zeros((), jnp.float32) for k in moe_losses.sum_keys(METRIC_SUMS, aux_on)}
        zero = jnp.zeros((), jnp.float32)
        (grads, loss, sums, sq), _ = lax.scan(accumulate, (zeros_g, zero, zeros_s, zero), micro)
        total_sq = jnp.square(optax.tree.norm(grads))
        grad_var = (n_micro ** 2 * sq - n_micro * total_sq) / (n_micro * (n_micro - 1))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train)
        grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A non-finite step's update is computed and then dropped by `keep` (params and
    # optimizer state stay as they were), so the gradients go in as they are: the global
    # norm that optax's clip takes is then `grad_norm` itself (XLA computes it once), where
    # zeroing them first made it a second pass over a second tree (2 % of the update's
    # memory traffic at 8 x 2048 on an H100: bench/_roofline_update.py).
    updates, new_opt = optimizer.update(grads, opt_state, train)
    new_train = optax.apply_updates(train, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    params = lora.with_trainable(params, keep(new_train, train))
    opt_state = keep(new_opt, opt_state)
    metrics = dict(sums, loss=loss, grad_norm=grad_norm, grad_var=grad_var,
                   finite=finite.astype(jnp.float32))
    return (params, opt_state), metrics


