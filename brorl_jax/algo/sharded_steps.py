"""The update and log-prob steps compiled for a device mesh (explicit in/out shardings, donated
state). The math is algo.make_update_step / algo.make_logprob_fn; only the placement differs,
which is why the tests compare every sharded result with the single-device one.

Placement (logical names -> mesh axes in brorl_jax.parallel.rules.LOGICAL_AXES): params, Adam
mu/nu and the reference params by PARAM_RULES (FSDP over `fsdp`, heads / MLP / vocabulary over
`tensor`; LoRA adapters like their projections, Adam's moments like the adapters); batch rows
over ("data", "fsdp"); every micro-batch's rows and hidden states are constrained to the same
split (sharded_policy_fns), so each device runs its own rows of every micro-batch. Log-probs
with the lm_head's vocabulary over `tensor` run under shard_map (parallel/vocab_parallel.py).
With an `expert` axis > 1 (mesh.expert) the rows go over it too, the experts of a MoE model are
split over it and the steps are traced under the mesh, so the MoE blocks exchange tokens
(parallel/expert_parallel.py, `traced_on`).
Every builder takes arrays or jax.ShapeDtypeStructs (ahead-of-time compilation without
allocating: bench/plan_memory.py).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from brorl_jax.algo.batch import TokenRows, UpdateBatch
from brorl_jax.algo.routing_replay import routed
from brorl_jax.algo.update import (
    PolicyFns,
    TrainState,
    create_train_state,
    make_logprob_fn,
    make_update_step,
    model_policy_fns,
    split_attention_arg,
)
from brorl_jax.models import lora
from brorl_jax.models.chunked_attention import forward_hidden
from brorl_jax.models.moe import may_run_kernel
from brorl_jax.parallel import rules as R
from brorl_jax.parallel.sharded import _replicated, constrain_rows, row_constraint
from brorl_jax.parallel.vocab_parallel import sharded_fused_logprob, vocab_parallel_logprob


def sharded_policy_fns(model_cfg, mesh: Mesh, axes: str | dict = "default", *,
                       attention: str = "plain", q_chunk: int = 512) -> PolicyFns:
    """PolicyFns for algo.make_update_step / make_logprob_fn that keep every micro-batch split
    over the batch axes: the update slices micro-batches out of the mini-batch with a lax.scan,
    and without these constraints XLA may gather a micro-batch onto every device.

    attention: "plain" (the model's reference [B, H, T, T] attention, via transformer.forward) or
    "chunked" (models/chunked_attention.py, bounded score memory for long contexts)."""
    if attention not in ("plain", "chunked"):
        raise ValueError(f"attention must be 'plain' or 'chunked', got {attention!r}")
    base = model_policy_fns(model_cfg)
    fix = functools.partial(constrain_rows, mesh=mesh, axes=axes)

    def hidden(params, tokens, positions, attention_mask, remat, **routing):
        # attention_mask: a padding mask, or segment ids for packed rows (PolicyFns); routing:
        # a MoE batch's replayed experts (algo/routing_replay.py) and/or aux=True (the
        # load-balancing loss beside the hidden, algo/moe_losses.py), plain attention only
        if routing and attention == "chunked":
            raise ValueError("routing replay and the MoE load-balancing loss run with the plain "
                             "attention of the sharded step")
        tokens = fix(tokens)
        positions = None if positions is None else fix(positions)
        mask = None if attention_mask is None else fix(attention_mask)
        if attention == "chunked":
            pad_mask, segments = split_attention_arg(mask)
            h = forward_hidden(params, model_cfg, tokens, positions=positions,
                               attention_mask=pad_mask, segment_ids=segments, remat=remat,
                               q_chunk=q_chunk, constrain=fix)
        else:
            h = base.hidden(params, tokens, positions, mask, remat, **routing)
            if routing.get("aux"):
                return fix(h[0]), h[1]
        return fix(h)

    return PolicyFns(hidden=hidden, lm_head=base.lm_head)


def _logprob_hooks(mesh: Mesh, axes, logprob: str) -> dict:
    """make_update_step / make_logprob_fn keyword arguments for `logprob`:
    "shard_map" = per-device fused log-prob (vocab split over tensor) + row constraints;
    "algo" = the unsharded-code path (pallas_kernels.fused_logprob under plain jit)."""
    if logprob == "algo":
        return {}
    if logprob != "shard_map":
        raise ValueError(f"logprob must be 'shard_map' or 'algo', got {logprob!r}")
    token_axes = R.logical_to_spec(R.ARRAY_AXES["rows"], R.for_mesh(axes, mesh))[0]
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes or ())
    return {"logprob_fn": sharded_fused_logprob(mesh, token_axes=token_axes),
            "shard_rows": row_constraint(mesh, axes)}


def traced_on(mesh: Mesh, fn, model_cfg=None):
    """`fn` traced with `mesh` as the ambient mesh when its expert axis is > 1, so that the
    mixture-of-experts blocks exchange tokens over it (parallel/expert_parallel.py), or when
    ``model_cfg``'s experts run a Pallas kernel on the platform traced for (moe_impl "grouped"
    on a Hopper GPU or a TPU: the block then runs it per device under shard_map, GSPMD cannot
    split it); otherwise `fn` itself (no ambient mesh: the programs are those of a mesh without
    expert parallelism, as before)."""
    kernel = model_cfg is not None and may_run_kernel(model_cfg)
    if R.expert_axis_size(mesh) == 1 and not kernel:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


# -------------------------------------------------------------------------------------------------
# Shardings of the training state and batches
# -------------------------------------------------------------------------------------------------
def train_state_shardings(state: TrainState, mesh: Mesh, rules: str | Sequence = "default",
                          *, check_divisible: bool = False) -> TrainState:
    """NamedShardings for a TrainState (arrays or ShapeDtypeStructs): params and ref_params by
    the rules, optimizer moments like their params (under LoRA like the adapters, which are all
    they hold), counters replicated. lora_merged (host values) has none: the update and the
    layout see the state without it (algo.adapters.detach_merged)."""
    p_sh = R.param_shardings(state.params, mesh, rules, check_divisible=check_divisible)
    return TrainState(step=_replicated(mesh), params=p_sh,
                      opt_state=R.state_shardings(state.opt_state, lora.trainable(p_sh), mesh),
                      ref_params=None if state.ref_params is None else p_sh)


def abstract_train_state(params: Any, optimizer, *, with_reference: bool = True) -> TrainState:
    """TrainState of ShapeDtypeStructs (jax.eval_shape: nothing is allocated)."""
    return jax.eval_shape(
        lambda p: create_train_state(p, optimizer, with_reference=with_reference), params)


# -------------------------------------------------------------------------------------------------
# Update and log-prob steps
# -------------------------------------------------------------------------------------------------
def make_sharded_update(model_cfg, algo_cfg, optimizer, mesh: Mesh, state: TrainState,
                        batch: UpdateBatch, *, rules: str | Sequence = "default",
                        axes: str | dict = "default", attention: str = "plain",
                        q_chunk: int = 512, logprob: str = "shard_map", donate: bool = True,
                        **update_kwargs):
    """algo.make_update_step compiled for `mesh`.

    state, batch: arrays or ShapeDtypeStructs with the shapes of the real ones.
    logprob: "shard_map" (default) passes the per-device fused log-prob and the row constraints
      to the update (its logprob_fn / shard_rows hooks); "algo" leaves them out.
    update_kwargs: passed to make_update_step (e.g. diagnostics_n).
    -> (update(state, batch, rng) -> (state, metrics), shardings dict with "state" and "batch"
    (an UpdateBatch of NamedShardings)).
    The state is donated (its buffers are reused for the new state); metrics are replicated.
    `rng` must be a key array (jax.random.key / PRNGKey), replicated."""
    policy = sharded_policy_fns(model_cfg, mesh, axes, attention=attention, q_chunk=q_chunk)
    update = make_update_step(model_cfg, algo_cfg, optimizer, policy=policy,
                              **_logprob_hooks(mesh, axes, logprob), **update_kwargs)
    state_sh = train_state_shardings(state, mesh, rules)
    batch_sh = R.batch_shardings(batch, mesh, axes)
    repl = _replicated(mesh)
    fn = jax.jit(traced_on(mesh, update, model_cfg), in_shardings=(state_sh, batch_sh, repl),
                 out_shardings=(state_sh, repl), donate_argnums=(0,) if donate else ())
    return fn, {"state": state_sh, "batch": batch_sh}


def make_sharded_logprob(model_cfg, algo_cfg, mesh: Mesh, params: Any,
                         batch: UpdateBatch | TokenRows, *,
                         rules: str | Sequence = "default", axes: str | dict = "default",
                         micro_batch_size: int | None = None, with_stats: bool = False,
                         attention: str = "plain", q_chunk: int = 512,
                         logprob: str = "shard_map"):
    """algo.make_logprob_fn compiled for `mesh` (reference / pi_old log-probs); `logprob` as in
    make_sharded_update (with_stats uses the kernel's stats path, without the shard_map hook).
    batch: the (abstract) batch the compiled function will take, an UpdateBatch or a TokenRows.

    -> (logprobs(params, batch) -> (logp [B, T], entropy [B, T], stats), shardings dict)."""
    policy = sharded_policy_fns(model_cfg, mesh, axes, attention=attention, q_chunk=q_chunk)
    fn = make_logprob_fn(algo_cfg=algo_cfg, policy=policy, micro_batch_size=micro_batch_size,
                         with_stats=with_stats, **_logprob_hooks(mesh, axes, logprob))
    params_sh = R.param_shardings(params, mesh, rules)
    batch_sh = R.batch_shardings(batch, mesh, axes)
    tok_sh = batch_sh.input_tokens
    stats_sh = {"sum_p2": tok_sh} if with_stats else {}
    jitted = jax.jit(traced_on(mesh, fn, model_cfg), in_shardings=(params_sh, batch_sh),
                     out_shardings=(tok_sh, tok_sh, stats_sh))
    return jitted, {"params": params_sh, "batch": batch_sh}


def make_vocab_parallel_logprob(model_cfg, mesh: Mesh, params: Any,
                                batch: UpdateBatch | TokenRows, *,
                                temperature: float = 1.0, micro_batch_size: int | None = None,
                                rules: str | Sequence = "default", axes: str | dict = "default",
                                attention: str = "plain", q_chunk: int = 512,
                                block_t: int = 1024):
    """Log-probs whose fused log-softmax runs with the vocabulary split over `tensor`
    (vocab_parallel.vocab_parallel_logprob under shard_map), micro-batched with lax.map.

    -> (logprobs(params, batch) -> (logp [B, T], entropy [B, T]), shardings dict).
    Differentiable wrt params (jax.grad through it gives the unsharded reference's gradients)."""
    policy = sharded_policy_fns(model_cfg, mesh, axes, attention=attention, q_chunk=q_chunk)
    token_axes = R.logical_to_spec(R.ARRAY_AXES["rows"], R.for_mesh(axes, mesh))[0]
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes or ())

    def logprobs(params, batch):
        inputs = batch.token_rows()
        rows, t = inputs.input_tokens.shape
        micro = min(micro_batch_size or rows, rows)
        if rows % micro:
            raise ValueError(f"batch rows {rows} not divisible by micro_batch_size={micro}")
        parts = jax.tree.map(lambda x: x.reshape((rows // micro, micro) + x.shape[1:]), inputs)

        def one(mb: TokenRows):
            h = policy.hidden(params, mb.input_tokens, mb.positions, mb.attention_arg(), False,
                              **routed(mb))
            w = policy.lm_head(params).astype(h.dtype)
            logp, ent = vocab_parallel_logprob(
                h.reshape(micro * t, -1), w, mb.targets.reshape(micro * t), mesh=mesh,
                token_axes=token_axes, temperature=temperature, block_t=block_t)
            return logp.reshape(micro, t), ent.reshape(micro, t)

        logp, ent = jax.lax.map(one, parts)
        return logp.reshape(rows, t), ent.reshape(rows, t)

    params_sh = R.param_shardings(params, mesh, rules)
    batch_sh = R.batch_shardings(batch, mesh, axes)
    tok_sh = batch_sh.input_tokens
    jitted = jax.jit(traced_on(mesh, logprobs, model_cfg), in_shardings=(params_sh, batch_sh),
                     out_shardings=(tok_sh, tok_sh))
    return jitted, {"params": params_sh, "batch": batch_sh}


