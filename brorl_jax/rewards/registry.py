"""Verifiers registered by name, selected per data source.

A record's data_source picks its verifier (as veRL's data_source does), so one dataset can mix
task families. Resolution order for a data_source `ds`:
  1. reward_map[ds]                      (config rewards.map: {"gsm8k": "math", "apps": "code"})
  2. reward_map[family], family = the part of ds before the first "/"
  3. the first shell pattern of reward_map that matches ds ("numina_*")
  4. the same three steps in DEFAULT_REWARD_MAP: veRL's common data_source names
  5. ds itself when a verifier has that name ("math", "code")
  6. the family when a verifier has that name ("reasoning_gym/<task>" -> "reasoning_gym")
Names veRL scores with a verifier that has no counterpart here (NO_VERIFIER) are refused by
name, with the fix, unless reward_map maps them.

A verifier may come with a ground-truth check (`RewardSpec.check`): it runs on every record of
the run's data when it loads, so a ground truth the verifier can never match (an unparseable
math answer, malformed code tests) is reported with its file and row instead of scoring every
answer 0.

Verifiers run in spawned worker processes, so they are registered as picklable module-level
functions or as "package.module:function" import paths (resolved in the worker).
Instruction following ("ifeval") and science ("stem") are meant to be registered here the same
way when they are added (docs/rewards.md, "Adding a verifier").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from collections.abc import Callable, Mapping

from brorl_jax.rewards.types import RewardFn


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn | str          # callable, or "package.module:function"
    preload: tuple[str, ...] = ()   # modules a worker imports at start (before taking items)
    # "package.module:function" taking a ground truth; raises ValueError when this verifier can
    # never score it (run on the data at load time, in the trainer process). None: no check.
    check: str | None = None
    # True: fn takes lists (records, completions) and returns a list of RewardResult; the
    # service sends it chunks of `batch_size` items, at most `concurrency` chunks at once, each
    # under `batch_timeout_s` (rewards.custom_batched; for model judges and remote services).
    batched: bool = False
    batch_size: int = 64
    concurrency: int = 1
    batch_timeout_s: float = 60.0


# The verifier name of a user's reward function (rewards.custom; rewards/custom.py registers it).
CUSTOM_NAME = "custom"
REWARDS: dict[str, RewardSpec] = {}

# veRL's data_source names (verl/utils/reward_score default_compute_score) and our verifier for
# each: GSM8K's ground truth is the final number (veRL extracts it after "####"); MATH, DAPO,
# AIME and the NuminaMath subsets are math answers checked by equivalence; the code contest sets
# carry APPS-style {"inputs", "outputs"[, "fn_name"]} tests.
DEFAULT_REWARD_MAP: dict[str, str] = {
    "openai/gsm8k": "final_number",
    "gsm8k": "final_number",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    "aime*": "math",
    "numina_*": "math",
    "codecontests": "code",
    "apps": "code",
    "codeforces": "code",
    "taco": "code",
}
# veRL data sources scored by a verifier that has no counterpart here: refused by name.
NO_VERIFIER: dict[str, str] = {
    "hiyouga/geometry3k": "veRL scores it with geo3k, an image-geometry task",
    "searchR1_*": "veRL scores it by exact match against retrieved-QA answers (search_r1)",
}


def register_reward(name: str, fn: RewardFn | str, *, preload: tuple[str, ...] = (),
                    check: str | None = None, replace: bool = False, batched: bool = False,
                    batch_size: int = 64, concurrency: int = 1,
                    batch_timeout_s: float = 60.0) -> RewardSpec:
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
    if batched and (batch_size < 1 or concurrency < 1 or not batch_timeout_s > 0):
        raise ValueError(f"reward {name!r}: batch_size and concurrency must be >= 1 and "
                         f"batch_timeout_s > 0, got {batch_size}, {concurrency}, "
                         f"{batch_timeout_s}")
    spec = RewardSpec(name, fn, tuple(preload), check, batched, batch_size, concurrency,
                      float(batch_timeout_s))
    REWARDS[name] = spec
    return spec


def load_reward_fn(spec: RewardSpec) -> Callable:
    if callable(spec.fn):
        return spec.fn
    module, _, attr = spec.fn.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_check_fn(spec: RewardSpec) -> Callable | None:
    if spec.check is None:
        return None
    module, _, attr = spec.check.partition(":")
    return getattr(importlib.import_module(module), attr)


def _lookup(mapping: Mapping[str, str], data_source: str) -> str | None:
    """mapping[ds], else mapping[family], else the first shell pattern key matching ds."""
    family = data_source.split("/", 1)[0]
    for key in (data_source, family):
        if key in mapping:
            return mapping[key]
    for key, value in mapping.items():
        if any(c in key for c in "*?[") and fnmatch.fnmatchcase(data_source, key):
            return value
    return None


def resolve_reward_name(data_source: str, reward_map: Mapping[str, str] | None = None,
                        registry: Mapping[str, RewardSpec] | None = None) -> str:
    """The verifier name for a record's data_source (see the module docstring)."""
    registry = REWARDS if registry is None else registry
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"record data_source must be a non-empty string, got {data_source!r}")
    name = _lookup(reward_map or {}, data_source)
    if name is not None:
        if name not in registry:
            raise ValueError(f"reward_map sends {data_source!r} to {name!r}, which is not "
                             f"registered (registered: {sorted(registry)})")
        return name
    name = _lookup(DEFAULT_REWARD_MAP, data_source)
    if name is not None and name in registry:
        return name
    family = data_source.split("/", 1)[0]
    for name in (data_source, family):
        if name in registry:
            return name
    why = _lookup(NO_VERIFIER, data_source)
    why = f" ({why}, which has no counterpart here)" if why else ""
    raise ValueError(f"no verifier for data_source {data_source!r}{why}: map it to one of "
                     f"{sorted(registry)} with reward_map, from the command line "
                     f"--config.rewards.map='{{\"{data_source}\": \"math\"}}', or register a "
                     "verifier with that name (docs/rewards.md)")


register_reward("math", "brorl_jax.rewards.math_reward:math_reward",
                preload=("math_verify", "brorl_jax.rewards.math_reward"),
                check="brorl_jax.rewards.math_reward:check_ground_truth")
register_reward("code", "brorl_jax.rewards.code_reward:code_reward",
                preload=("brorl_jax.rewards.code_reward",),
                check="brorl_jax.rewards.code_reward:check_ground_truth")
register_reward("reasoning_gym", "brorl_jax.rewards.reasoning_gym_reward:reasoning_gym_reward",
                preload=("reasoning_gym", "brorl_jax.rewards.reasoning_gym_reward"))
register_reward("final_number", "brorl_jax.rewards.final_number_reward:final_number_reward",
                preload=("brorl_jax.rewards.final_number_reward",),
                check="brorl_jax.rewards.final_number_reward:check_ground_truth")
