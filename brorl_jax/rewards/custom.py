"""Reward functions from a file, veRL's convention (config rewards.custom = "path/file.py:fn").

The function keeps veRL's signature and return values, so a veRL `compute_score` file runs as is:

  compute_score(data_source, solution_str, ground_truth, extra_info=None, **custom_kwargs)
      -> float | int | bool | {"score": float, <other fields>...}

and, with rewards.custom_batched = True, veRL's batched form (BatchRewardManager):

  compute_score(data_sources, solution_strs, ground_truths, extra_infos, **custom_kwargs)
      -> list of the above, one per item

It is called with keyword arguments, as veRL calls it. The score is the reward as is (any finite
number: veRL's math_dapo gives -1 / 1); the other numeric fields of a dict are logged per data
source (`reward_extra/<source>/<field>`, their mean over the step). The file is imported by
path in the scoring worker processes only, never in the trainer (the door check runs in a
worker too). It scores the data sources matching rewards.custom_sources (comma-separated
shell patterns, default "*": every source); rewards.map entries for a source win over it.

A function that raises, returns something that is not a number (or a dict without a numeric
"score"), returns NaN, or runs past rewards.timeout_s (per item; a batched chunk:
rewards.custom_batch_timeout_s) scores 0 with a "verifier error: ..." / "timeout ..." reason,
counted per data source by rewards/health.py; a source on which every sample fails stops the
run with the first reason. Before the model loads, `door_check` tries it on the first training
row (file, function, signature, one call) and stops with the reason if that fails.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from brorl_jax.rewards.registry import CUSTOM_NAME, REWARDS, register_reward
from brorl_jax.rewards.types import FLOAT32_MAX, RewardResult, UnboundedRewardResult

NAME = CUSTOM_NAME   # the verifier name data sources are mapped to
SINGLE = "brorl_jax.rewards.custom:custom_reward"
BATCHED = "brorl_jax.rewards.custom:custom_reward_batch"
_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class CustomRewardError(ValueError):
    """The reward file or function cannot be used as configured (message says why and how)."""


def parse_spec(value: str) -> tuple[str, str]:
    """("path/file.py", "fn") from "path/file.py:fn"; the function defaults to compute_score
    (veRL's default name) when the value is only a path."""
    path, sep, fn = value.rpartition(":")
    if not sep or not path.endswith(".py"):
        path, fn = value, "compute_score"
    if not path.endswith(".py"):
        raise CustomRewardError(f"rewards.custom = {value!r} must look like 'path/to/file.py:fn' "
                                "(a Python file and a function in it)")
    if not fn.isidentifier():
        raise CustomRewardError(f"rewards.custom = {value!r}: {fn!r} is not a function name")
    return path, fn


def check_file(value: str) -> str:
    """The absolute path of the reward file; CustomRewardError when it is not a file. Cheap
    (nothing imported): the config's validation calls it."""
    path, _ = parse_spec(value)
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise CustomRewardError(f"rewards.custom = {value!r}: no file {full} (the path is read "
                                f"from the directory main runs in, {os.getcwd()})")
    return full


_LOADED: dict[tuple[str, str, bool], Any] = {}   # per worker process: the file is imported once


def load_function(path: str, function: str, batched: bool = False):
    """Imports `path` as a module and returns its `function`, checking that veRL's keyword
    arguments bind to it. Runs in a scoring worker."""
    key = (path, function, batched)
    if key in _LOADED:
        return _LOADED[key]
    if not os.path.isfile(path):
        raise CustomRewardError(f"reward file {path} does not exist")
    name = "brorl_jax_custom_reward_" + str(abs(hash(path)))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(path)
    if directory not in sys.path:       # a reward file importing its sibling modules (veRL too)
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise CustomRewardError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, function, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_") and
                         getattr(v, "__module__", None) == name)
        raise CustomRewardError(f"{path} has no function {function!r} (functions defined "
                                f"there: {', '.join(defined) or 'none'})")
    args = _BATCH_ARGS if batched else _ARGS
    try:
        inspect.signature(fn).bind(**{a: None for a in args})
    except TypeError as e:
        form = "batched " if batched else ""
        raise CustomRewardError(
            f"{path}:{function} does not take veRL's {form}reward arguments "
            f"({', '.join(args)}) as keywords: {e}"
            + ("; set rewards.custom_batched=False for the one-item form" if batched else
               "; for lists in, list out set rewards.custom_batched=True")) from None
    except ValueError:
        pass   # no signature to inspect (a builtin): the call will tell
    _LOADED[key] = fn
    return fn


def to_result(value: Any) -> RewardResult:
    """A function's return value as a verdict; TypeError/ValueError for anything else."""
    extra = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys: {sorted(value)[:8]})")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        if hasattr(value, "item") and getattr(value, "size", 2) == 1:   # numpy / torch scalar
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise TypeError(f"returned {type(value).__name__} {str(value)[:60]!r}, expected "
                            "a number or a dict with a numeric 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    if abs(score) > FLOAT32_MAX:
        raise ValueError(f"returned {score:g}, beyond float32 (|score| <= {FLOAT32_MAX:.4g}), "
                         "the dtype the update computes in: rescale the reward")
    return UnboundedRewardResult(score, "custom", {"extra": extra} if extra else {})


def custom_reward(record: Mapping[str, Any], completion: str, *, path: str, function: str,
                  kwargs: Mapping[str, Any] | None = None,
                  time_budget_s: float | None = None) -> RewardResult:
    """One item through the user's compute_score (a verifier like the built-in ones)."""
    fn = load_function(path, function)
    value = fn(data_source=record.get("data_source"), solution_str=completion,
               ground_truth=record.get("ground_truth"), extra_info=record.get("extra_info"),
               **dict(kwargs or {}))
    return to_result(value)


def custom_reward_batch(records: Sequence[Mapping[str, Any]], completions: Sequence[str], *,
                        path: str, function: str, kwargs: Mapping[str, Any] | None = None,
                        time_budget_s: float | None = None) -> list[RewardResult]:
    """A chunk through the user's batched compute_score; an item whose value is not a number
    fails alone, a raise fails the chunk."""
    fn = load_function(path, function, batched=True)
    values = fn(data_sources=[r.get("data_source") for r in records],
                solution_strs=list(completions),
                ground_truths=[r.get("ground_truth") for r in records],
                extra_infos=[r.get("extra_info") for r in records], **dict(kwargs or {}))
    values = list(values) if not isinstance(values, (str, bytes, Mapping)) else values
    if not isinstance(values, list) or len(values) != len(records):
        raise TypeError(f"batched {function} returned {type(values).__name__}"
                        + (f" of length {len(values)}" if isinstance(values, list) else "")
                        + f" for {len(records)} items, expected a list of that length")
    out = []
    for v in values:
        try:
            out.append(to_result(v))
        except (TypeError, ValueError) as e:
            out.append(RewardResult(0.0, f"verifier error: {function} {e}"[:500]))
    return out


def _sources(cfg_rewards) -> list[str]:
    patterns = [p.strip() for p in str(cfg_rewards.custom_sources).split(",") if p.strip()]
    return patterns or ["*"]


def setup(cfg_rewards, reward_map: Mapping[str, str]) -> tuple[dict, dict]:
    """(reward_map, reward_options) for the scoring service and check_records, with the
    custom function registered as the verifier NAME when rewards.custom is set (the file is
    not imported here). rewards.map entries keep precedence over rewards.custom_sources."""
    merged = dict(reward_map)
    if not cfg_rewards.custom:
        return merged, {}
    full = check_file(cfg_rewards.custom)
    _, function = parse_spec(cfg_rewards.custom)
    batched = bool(cfg_rewards.custom_batched)
    register_reward(NAME, BATCHED if batched else SINGLE, replace=True, batched=batched,
                    batch_size=int(cfg_rewards.custom_batch_size),
                    concurrency=int(cfg_rewards.custom_concurrency),
                    batch_timeout_s=float(cfg_rewards.custom_batch_timeout_s))
    for pattern in _sources(cfg_rewards):
        merged.setdefault(pattern, NAME)
    kwargs = json.loads(cfg_rewards.custom_kwargs or "{}")
    return merged, {NAME: {"path": full, "function": function, "kwargs": kwargs}}


def door_check(cfg_rewards, reward_map: Mapping[str, str], reward_options: Mapping[str, dict],
               records: Sequence[Mapping[str, Any]]) -> str | None:
    """Before the model loads: one call of the custom function, in a scoring worker, on the
    first record it scores (its ground truth as the solution). Raises CustomRewardError with
    the reason when the file, the function, its signature or the call fails. Returns a line
    for the run's log (None when rewards.custom is unset or it scores no record)."""
    if not cfg_rewards.custom:
        return None
    from brorl_jax.rewards.registry import resolve_reward_name
    from brorl_jax.rewards.service import ScoringService

    def scored_here(record) -> bool:
        try:
            return resolve_reward_name(str(record.get("data_source")), reward_map) == NAME
        except ValueError:      # no verifier at all: check_records reports it
            return False

    first = next((r for r in records if scored_here(r)), None)
    if first is None:
        raise CustomRewardError(
            f"rewards.custom = {cfg_rewards.custom!r} scores no record: no data source matches "
            f"rewards.custom_sources = {cfg_rewards.custom_sources!r} (data sources: "
            f"{sorted({str(r.get('data_source')) for r in records})[:8]})")
    timeout = float(cfg_rewards.custom_batch_timeout_s if cfg_rewards.custom_batched
                    else cfg_rewards.timeout_s)
    with ScoringService(num_workers=1, timeout_s=timeout, rewards=[NAME],
                        reward_map={k: v for k, v in reward_map.items() if v == NAME},
                        reward_options=reward_options) as service:
        result = service.score_batch([first], [str(first.get("ground_truth"))])[0]
    where = (f"the first row it scores (data_source {first.get('data_source')!r}"
             + (f", {first['source']} row {first['row']}" if "source" in first else "") + ")")
    if result.reason != "custom":
        raise CustomRewardError(f"rewards.custom = {cfg_rewards.custom!r} failed on {where}: "
                                f"{result.reason}")
    return (f"[rewards] rewards.custom {cfg_rewards.custom} scores "
            f"{', '.join(_sources(cfg_rewards))}; its call on {where} gave {result.score:g}")


def is_registered() -> bool:
    return NAME in REWARDS
