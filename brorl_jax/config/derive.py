"""What the rest of the code builds from a config: the typed RunConfig of a ConfigDict with
overrides by key name (tests, notebooks, experiments), the update's UpdateConfig, the learning
rate and the optimizer's OptimizerConfig."""
from __future__ import annotations

import math

import ml_collections

from brorl_jax.config.checks import default_config, validate
from brorl_jax.config.schema import RunConfig, UpdateConfig

# The section an override given by bare key name goes to: the first of these that has the key
# (`temperature` is rollout.temperature, `remat` model.remat, `seed` train.seed).
OVERRIDE_ORDER = ("algo", "rollout", "model", "optim", "train", "rewards", "data", "eval", "sft",
                  "mesh")


def as_run_config(cfg: ml_collections.ConfigDict | RunConfig | None) -> RunConfig:
    """`cfg` as a validated RunConfig (default_config() when None); a RunConfig as it is."""
    if isinstance(cfg, RunConfig):
        return cfg
    return validate(default_config() if cfg is None else cfg)


def make_config(cfg: ml_collections.ConfigDict | RunConfig | None = None,
                *, first: str = "algo", **overrides) -> RunConfig:
    """The validated RunConfig of `cfg` (default: the schema's defaults) with `overrides` by key
    name, each set in the first section of OVERRIDE_ORDER (after `first`) that has the key."""
    if not overrides:
        return as_run_config(cfg)
    if cfg is None:
        cfg = default_config()
    cfg = cfg.copy_and_resolve_references()
    order = (first,) + tuple(s for s in OVERRIDE_ORDER if s != first)
    for name, value in overrides.items():
        # a name no section has goes to `first`, where validate names it (with the nearest key)
        cfg[next((s for s in order if name in cfg[s]), first)][name] = value
    return validate(cfg)


def update_config(cfg: ml_collections.ConfigDict | RunConfig | None = None,
                  **overrides) -> UpdateConfig:
    """The update's UpdateConfig (RunConfig.update) of `cfg` with `overrides` by key name,
    validated like a config file (make_config)."""
    return make_config(cfg, **overrides).update


def derived_learning_rate(cfg) -> tuple[float, str]:
    """The learning rate a run uses and a sentence saying how it was derived.

    BroRL scales the learning rate by sqrt(B_new / B_0) when it enlarges the batch [BroRL 4.2.1].
    The paper does not say whether B counts prompts or samples; we count samples (prompts x N),
    which makes BroRL's 128 x 512 batch 8x ProRL's 512 x 16 and the LR x sqrt(8) = 2.83.
    """
    cfg = as_run_config(cfg)
    if cfg.optim.lr > 0:
        return cfg.optim.lr, f"lr = {cfg.optim.lr:g} (set explicitly by optim.lr)"
    base = cfg.optim.base_lr
    if not cfg.optim.scale_lr_with_batch:
        return base, f"lr = optim.base_lr = {base:g} (batch scaling off)"
    from brorl_jax.algo import scaled_learning_rate
    b = cfg.update_rows
    lr = scaled_learning_rate(base, cfg.optim.base_batch, b)
    return lr, (f"lr = base_lr {base:g} x sqrt({b} / {cfg.optim.base_batch}) = "
                f"{base:g} x {math.sqrt(b / cfg.optim.base_batch):.4g} = {lr:.4g}")


def optimizer_config(cfg: ml_collections.ConfigDict | RunConfig | None = None, **overrides):
    """The optimizer's OptimizerConfig from a run config: the learning rate by the sqrt batch
    rule (derived_learning_rate), warm-up and decay converted from RL steps to optimizer updates
    (RunConfig.updates_per_step). `overrides` by optim.* key name."""
    from brorl_jax.algo import OptimizerConfig
    cfg = make_config(cfg, first="optim", **overrides)
    return OptimizerConfig.from_run_config(cfg, derived_learning_rate(cfg)[0])

