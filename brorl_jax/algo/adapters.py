"""LoRA in the RL step: the train state, the reference, the reset that merges, and what a
checkpoint holds (model.lora_rank > 0; the adapters themselves are models/lora.py).

    state = lora_train_state(params, model_cfg, optimizer, seed)   # base frozen, fresh adapters
    reference_params(state)          # the base with adapters off (no second copy)
    maybe_reset(state, cfg, optimizer, model_cfg, seed)   # a reset: under LoRA, a merge
    checkpoint_view(state) / checkpoint_template(state, cfg) / from_checkpoint(saved, base, mcfg)

The train state's params are {<base, compute dtype>, "lora": adapters (float32)}; its optimizer
state is the adapters' alone (no float32 master copy and no AdamW moments for the base); its
ref_params is None: the KL reference is the base, evaluated with the adapters off.

A reference reset (algo.ref_reset_every, ProRLv2) merges the adapters into the base, so the
reference becomes the merged policy, and starts fresh adapters (B = 0, a new A drawn from
(train.seed, merge count)) with a fresh optimizer state: the policy is unchanged by the reset.
The merged adapters are kept on the host (TrainState.lora_merged, oldest first, numpy; the
merge count is their number; the jitted update does not see them: detach_merged). A checkpoint
holds the adapters, their optimizer state and that list, not the base; a resume reloads the
base from model.path and merges the list into it again in order, with the same jitted merge,
so the base is bit-identical to the one the run had.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from brorl_jax.algo.update import TrainState, maybe_reset_reference
from brorl_jax.config.schema import UpdateConfig
from brorl_jax.models import lora
from brorl_jax.models.transformer import compute_dtype_params
from brorl_jax.parallel import sharded


def uses_lora(state: TrainState) -> bool:
    return lora.KEY in state.params


def adapter_rng(seed: int, merges: int) -> jax.Array:
    """The key of the adapters started after `merges` merges (0: the run's first)."""
    return jax.random.fold_in(jax.random.key(seed), merges)


def lora_train_state(params, model_cfg, optimizer, seed: int) -> TrainState:
    """Step 0 under LoRA: the base in the compute dtype, fresh adapters, their optimizer state."""
    base = compute_dtype_params(lora.base_params(params), model_cfg)
    adapters = lora.init_lora(model_cfg, adapter_rng(seed, 0))
    return TrainState(step=jnp.zeros((), jnp.int32), params=lora.with_adapters(base, adapters),
                      opt_state=optimizer.init(adapters), ref_params=None, lora_merged=())


def reference_params(state: TrainState):
    """The KL reference's params: ref_params, or under LoRA the base (adapters off)."""
    if state.ref_params is None and uses_lora(state):
        return lora.base_params(state.params)
    return state.ref_params


@functools.partial(jax.jit, static_argnums=1)
def _merge(params, model_cfg):
    return lora.merge_lora(params, model_cfg)


def merges_by(step: int, cfg: UpdateConfig) -> int:
    """Merges done after `step` RL steps (a reset follows every ref_reset_every-th update when
    the KL term is on: maybe_reset_reference)."""
    if cfg.ref_reset_every > 0 and cfg.kl_coef > 0:
        return step // cfg.ref_reset_every
    return 0


def maybe_merge(state: TrainState, cfg: UpdateConfig, optimizer, model_cfg, seed: int
                ) -> tuple[TrainState, bool]:
    """maybe_reset_reference under LoRA: at a reset step, the adapters merged into the base and
    fresh ones (and their optimizer state) started."""
    step = int(state.step)
    if merges_by(step, cfg) == len(state.lora_merged):
        return state, False
    adapters = state.params[lora.KEY]
    base = _merge(state.params, model_cfg)
    merged = tuple(state.lora_merged) + (sharded.to_host(adapters),)    # kept on the host
    fresh = lora.init_lora(model_cfg, adapter_rng(seed, len(merged)))
    return state.replace(params=lora.with_adapters(base, fresh), opt_state=optimizer.init(fresh),
                         lora_merged=merged), True


def maybe_reset(state: TrainState, cfg: UpdateConfig, optimizer, model_cfg, seed: int
                ) -> tuple[TrainState, bool]:
    """The step's reference reset: maybe_merge under LoRA, else update.maybe_reset_reference."""
    if uses_lora(state):
        return maybe_merge(state, cfg, optimizer, model_cfg, seed)
    return maybe_reset_reference(state, cfg, optimizer)


def checkpoint_view(state: TrainState) -> TrainState:
    """What a checkpoint holds of `state`: under LoRA the base is left out (model.path has it)."""
    if not uses_lora(state):
        return state
    return state.replace(params={lora.KEY: state.params[lora.KEY]})


def checkpoint_template(state: TrainState, cfg: UpdateConfig):
    """The restore template of checkpoint_view: `state`'s view, or under LoRA a function of the
    checkpoint's step (its list of merged adapters has merges_by(step) entries)."""
    view = checkpoint_view(state)
    if not uses_lora(state):
        return view
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), view.params[lora.KEY])
    return lambda step: view.replace(lora_merged=(shapes,) * merges_by(step, cfg))


def from_checkpoint(saved: TrainState, base_params, model_cfg, place=None) -> TrainState:
    """The train state of a restored checkpoint_view: the base (model.path's params) in the
    compute dtype with the saved merged adapters merged again, in order; unchanged without
    LoRA. place(params): lays the params out as the update holds them (Runtime.place_params)
    before each merge, so the merge runs the program the run's resets ran (on a mesh its
    sharded float sums; bit-identical resume)."""
    if not uses_lora(saved):
        return saved
    place = place or (lambda p: p)
    base = compute_dtype_params(lora.base_params(base_params), model_cfg)
    for adapters in saved.lora_merged:
        base = _merge(place(lora.with_adapters(base, adapters)), model_cfg)
    return saved.replace(params=lora.with_adapters(base, saved.params[lora.KEY]),
                         lora_merged=tuple(sharded.to_host(saved.lora_merged)))


def detach_merged(state: TrainState):
    """(the merged adapters, the state without them): the jitted update never sees them (they
    change length at every merge, which would recompile it, and stay on the host)."""
    if state.lora_merged is None:
        return None, state
    return state.lora_merged, state.replace(lora_merged=None)


def attach_merged(state: TrainState, merged) -> TrainState:
    return state if merged is None else state.replace(lora_merged=merged)
