"""Verifiers registered by name, selected per data source.

A record's data_source picks its verifier (as veRL's data_source does), so one dataset can mix
task families. Resolution order for a data_source `ds`:
  1. reward_map[ds]                      (config: {"gsm8k": "math", "apps": "code", ...})
  2. reward_map[family], family = the part of ds before the first "/"
  3. ds itself when a verifier has that name ("math", "code")
  4. the family when a verifier has that name ("reasoning_gym/<task>" -> "reasoning_gym")

Verifiers run in spawned worker processes, so they are registered as picklable module-level
functions or as "package.module:function" import paths (resolved in the worker).
Instruction following ("ifeval") and science ("stem") are meant to be registered here the same
way when they are added (docs/rewards.md, "Adding a verifier").
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

from brorl_jax.rewards.types import RewardFn


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn | str          # callable, or "package.module:function"
    preload: tuple[str, ...] = ()   # modules a worker imports at start (before taking items)


REWARDS: dict[str, RewardSpec] = {}


def register_reward(name: str, fn: RewardFn | str, *, preload: tuple[str, ...] = (),
                    replace: bool = False) -> RewardSpec:
    """Registers a verifier under `name` (services created afterwards can use it)."""
    if not name or "/" in name:
        raise ValueError(f"reward name must be non-empty and contain no '/', got {name!r}")
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"reward import path must look like 'package.module:function', "
                             f"got {fn!r}")
    elif not callable(fn):
        raise ValueError(f"reward {name!r}: fn must be callable or an import path")
    if name in REWARDS and not replace:
        raise ValueError(f"reward {name!r} is already registered; pass replace=True to override")
    spec = RewardSpec(name, fn, tuple(preload))
    REWARDS[name] = spec
    return spec


def load_reward_fn(spec: RewardSpec) -> Callable:
    if callable(spec.fn):
        return spec.fn
    module, _, attr = spec.fn.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_reward_name(data_source: str, reward_map: Mapping[str, str] | None = None,
                        registry: Mapping[str, RewardSpec] | None = None) -> str:
    """The verifier name for a record's data_source (see the module docstring)."""
    registry = REWARDS if registry is None else registry
    reward_map = reward_map or {}
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"record data_source must be a non-empty string, got {data_source!r}")
    family = data_source.split("/", 1)[0]
    for name in (reward_map.get(data_source), reward_map.get(family)):
        if name is not None:
            if name not in registry:
                raise ValueError(f"reward_map sends {data_source!r} to {name!r}, which is not "
                                 f"registered (registered: {sorted(registry)})")
            return name
    for name in (data_source, family):
        if name in registry:
            return name
    raise ValueError(f"no verifier for data_source {data_source!r}: add it to reward_map "
                     f"(e.g. {{{data_source!r}: 'math'}}) or register a verifier with that "
                     f"name (registered: {sorted(registry)})")


register_reward("math", "brorl_jax.rewards.math_reward:math_reward",
                preload=("math_verify", "brorl_jax.rewards.math_reward"))
register_reward("code", "brorl_jax.rewards.code_reward:code_reward",
                preload=("brorl_jax.rewards.code_reward",))
register_reward("reasoning_gym", "brorl_jax.rewards.reasoning_gym_reward:reasoning_gym_reward",
                preload=("reasoning_gym", "brorl_jax.rewards.reasoning_gym_reward"))
register_reward("final_number", "brorl_jax.rewards.final_number_reward:final_number_reward",
                preload=("brorl_jax.rewards.final_number_reward",))
