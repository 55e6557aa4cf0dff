"""The configuration schema: every key a run understands, its type, its paper default, and checks.

Configs in `configs/` start from `default_config()` and override values; `validate()` runs at
start-up and stops the run with a message that names the key and what is allowed when a key is
unknown (usually a typo), has the wrong type, or is inconsistent with another key.

Defaults follow the BroRL paper and its ProRLv2 recipe (see the README's configuration table);
values the paper does not state are marked "not stated" with the choice made.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any

import ml_collections

from brorl_jax.config.schema import SECTIONS, RunConfig, Section
from brorl_jax.errors import ConfigError


def default_config() -> ml_collections.ConfigDict:
    """The full schema with the paper's defaults (BroRL: N=512, 128 prompts per step), as the
    ml_collections.ConfigDict config files start from (the defaults live in schema.py)."""
    return RunConfig().to_config_dict()


def choices() -> dict[str, tuple[str, ...]]:
    """Every key whose value is a name, and the names allowed: read from the registries that
    implement them (adding an estimator, filter or verifier there adds it here)."""
    from brorl_jax import algo
    from brorl_jax.algo import policies, routing_replay
    from brorl_jax.models.config import ATTENTION_IMPLS, MLP_IMPLS, MOE_IMPLS, ROLLOUT_PRECISIONS
    from brorl_jax.parallel.rules import PARAM_RULES
    from pallas_kernels.fused_logprob import IMPLS as LOGPROB_IMPLS
    from pallas_kernels.sampling import IMPLS as ROLLOUT_IMPLS
    return {
        "model.dtype": ("float32", "bfloat16"),
        "model.param_dtype": ("float32", "bfloat16"),
        "model.attention_impl": ATTENTION_IMPLS,
        "model.mlp_impl": MLP_IMPLS,
        "model.moe_impl": MOE_IMPLS,
        "rollout.impl": ROLLOUT_IMPLS,
        "rollout.select_rule": policies.SELECT_RULES,
        "rollout.weight_dtype": ROLLOUT_PRECISIONS,
        "rollout.kv_dtype": ROLLOUT_PRECISIONS,
        "algo.advantage": tuple(algo.ADVANTAGES),
        "algo.dynamic_sampling_rule": tuple(algo.GROUP_FILTERS),
        "algo.dynamic_sampling_cap_policy": algo.CAP_POLICIES,
        "algo.loss_agg": tuple(algo.LOSS_AGG),
        "algo.kl_estimator": tuple(algo.KL_ESTIMATORS),
        "algo.tis_mode": tuple(algo.TIS_MODES),
        "algo.logprob_impl": LOGPROB_IMPLS,
        "algo.advantage_normalizer": tuple(policies.ADVANTAGE_NORMALIZERS),
        "algo.routing_replay": routing_replay.MODES,
        "optim.name": algo.OPTIMIZERS,
        "optim.schedule": algo.SCHEDULES,
        "mesh.rules": tuple(PARAM_RULES),
    }


def _ranges() -> dict[str, tuple[str, str]]:
    """Key -> (range, note) of every schema field with a single-key range (schema.setting)."""
    return {f"{name}.{f.name}": (f.metadata["range"], f.metadata["note"])
            for name, section in SECTIONS.items() for f in dataclasses.fields(section)
            if f.metadata.get("range")}


# Float keys where an infinite value means something (no clipping); every other float key must
# be finite, and no float key may be NaN (validate). Read from the schema (finite=False).
INFINITE_OK = tuple(f"{name}.{f.name}" for name, section in SECTIONS.items()
                    for f in dataclasses.fields(section) if not f.metadata.get("finite", True))
# Integer keys are counts, sizes, steps and seeds that end up in int32 arrays and loop bounds:
# each must fit in int32, and so must the token counts they multiply into (validate).
INT32_MAX = 2**31 - 1
# JSON-object keys and what their values must be (checked by validate, read by json_option).
JSON_OBJECT_KEYS = ("data.reasoning_gym_kwargs", "data.fields", "rewards.map",
                    "rewards.custom_kwargs")
DATA_SPEC_SUFFIXES = (".jsonl", ".parquet", ".pq")


def verifier_names() -> tuple[str, ...]:
    """The verifiers a data source can be mapped to (rewards.map): the rewards registry."""
    from brorl_jax.rewards.registry import REWARDS
    return tuple(sorted(REWARDS))


def unknown_key_message(key: str) -> str:
    """'unknown config key ...' with the closest schema key: validate() and the command line."""
    near = difflib.get_close_matches(key, list(_flatten(default_config())), n=1)
    hint = f" Did you mean '{near[0]}'?" if near else ""
    return f"unknown config key '{key}'.{hint}"


def json_option(cfg: ml_collections.ConfigDict, key: str) -> dict:
    """The parsed value of a JSON-object key (JSON_OBJECT_KEYS) of a validated config."""
    text = _get(cfg, key)
    return json.loads(text) if text.strip() else {}


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of a ConfigDict or a RunConfig."""
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, (ml_collections.ConfigDict, Section)):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def _typed(cfg) -> RunConfig:
    """The RunConfig of a config whose keys and types are the schema's."""
    return RunConfig(name=cfg["name"], **{
        name: section(**{f.name: cfg[name][f.name] for f in dataclasses.fields(section)})
        for name, section in SECTIONS.items()})


def _expand_paths(run: RunConfig) -> RunConfig:
    """A leading ~ of every path key (schema: setting(path=True)) expanded, as a shell would."""
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            value = getattr(run[name], f.name)
            if f.metadata["path"] and value.startswith("~"):
                run = run.replace(name, **{f.name: os.path.expanduser(value)})
    return run


def validate(cfg: ml_collections.ConfigDict | RunConfig) -> RunConfig:
    """Checks `cfg` (a config file's ConfigDict with its --config.KEY=VALUE overrides, or a
    RunConfig) against the schema; returns the typed RunConfig or raises ConfigError.

    Raises on: a key the schema does not have (with the closest known key), a value whose type
    differs from the schema's (ints are accepted where floats are expected), a value outside its
    allowed set or range, and inconsistent combinations. This is the only validation of the
    algorithm's settings: UpdateConfig is derived from a validated config (RunConfig.update).
    """
    schema = _flatten(default_config())
    given = _flatten(cfg)
    _raise_if(_type_errors(schema, given))
    run = _expand_paths(_typed(cfg))
    # nan / inf / huge values would make the range checks below misleading
    _raise_if(_validate_numbers(schema, given, run))
    errors = []
    for key, allowed in choices().items():
        if _get(run, key) not in allowed:
            errors.append(f"config key '{key}' is {_get(run, key)!r}; allowed: "
                          + ", ".join(repr(a) for a in allowed) + ".")
    errors += _range_errors(run)
    errors += _validate_rules(run)
    errors += _validate_options(run)
    errors += _validate_io_keys(run)
    _raise_if(errors)
    return run


def _raise_if(errors: list[str]) -> None:
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _type_errors(schema: dict, given: dict) -> list[str]:
    """Unknown keys (with the closest known one), values of another type, missing keys."""
    errors = []
    for key, value in given.items():
        if key not in schema:
            errors.append(unknown_key_message(key))
            continue
        want = type(schema[key])
        ok = isinstance(value, want) or (want is float and isinstance(value, int)
                                         and not isinstance(value, bool))
        if want is int and isinstance(value, bool):
            ok = False
        if not ok:
            errors.append(f"config key '{key}' must be {want.__name__}, got "
                          f"{type(value).__name__} {value!r}.")
    missing = [k for k in schema if k not in given]
    if missing:
        errors.append("config is missing keys " + ", ".join(sorted(missing)) +
                      "; start configs from brorl_jax.config.default_config().")
    return errors


def _validate_rules(cfg: RunConfig) -> list[str]:
    """Checks that tie keys together (or allow a value outside a plain range)."""
    errors = []
    a, r = cfg.algo, cfg.rollout
    if a.dual_clip_c != 0 and not a.dual_clip_c > 1.0:
        errors.append(f"config key 'algo.dual_clip_c' must be 0 (off) or > 1, got "
                      f"{a.dual_clip_c}.")
    if a.tis_mode != "off" and not 0.0 <= a.tis_low < 1.0 < a.tis_high:
        errors.append(f"config keys 'algo.tis_low'/'algo.tis_high' must satisfy "
                      f"0 <= tis_low < 1 < tis_high, got {a.tis_low}, {a.tis_high}.")
    low = [f"rollout.{k}='fp8'" for k in ("weight_dtype", "kv_dtype") if r[k] == "fp8"]
    if low and (a.tis_mode == "off" or not a.recompute_old_logprobs):
        errors.append(f"{' and '.join(low)} samples from a policy other than the one trained: it "
                      "needs the truncated importance-sampling correction, which "
                      + ("'algo.tis_mode'='off'" if a.tis_mode == "off" else
                         "'algo.recompute_old_logprobs'=False") + " turns off. Set "
                      "algo.tis_mode='ice_pop' or 'truncate' (and recompute_old_logprobs=True), "
                      "or keep the rollout in 'bf16' (docs/rollout.md, 'FP8 rollouts').")
    if r.rollouts_per_prompt < 2:
        errors.append("config key 'rollout.rollouts_per_prompt' must be >= 2: the group "
                      "baselines of every advantage estimator need several responses per prompt.")
    samples = cfg.update_rows
    if samples <= 0 or a.ppo_mini_batches <= 0 or a.micro_batch_size <= 0:
        pass                                   # already reported as a range error
    elif samples % a.ppo_mini_batches:
        errors.append(f"algo.prompts_per_step * rollout.rollouts_per_prompt = {samples} samples "
                      f"must divide into 'algo.ppo_mini_batches'={a.ppo_mini_batches} equal "
                      "mini-batches.")
    elif (samples // a.ppo_mini_batches) % min(a.micro_batch_size, samples // a.ppo_mini_batches):
        errors.append(f"each PPO mini-batch has {samples // a.ppo_mini_batches} samples, which "
                      f"'algo.micro_batch_size'={a.micro_batch_size} does not divide; pick a "
                      "divisor.")
    if cfg.model.attention_impl == "cudnn" and cfg.model.dtype == "float32":
        errors.append("config key 'model.attention_impl'='cudnn' needs a 16-bit compute dtype "
                      "(cuDNN flash attention takes fp16/bf16 only); set model.dtype='bfloat16' "
                      "or use attention_impl='xla'.")
    errors += _lora_errors(cfg)
    if cfg.eval.max_new_tokens != -1 and cfg.eval.max_new_tokens <= 0:
        errors.append("config key 'eval.max_new_tokens' must be > 0 or -1 (= "
                      f"rollout.max_new_tokens), got {cfg.eval.max_new_tokens}.")
    for axis in ("data", "fsdp", "tensor"):
        v = cfg.mesh[axis]
        if v == 0 or v < -1:
            errors.append(f"config key 'mesh.{axis}' must be a positive size or -1 (the rest), "
                          f"got {v}.")
    if sum(cfg.mesh[ax] == -1 for ax in ("data", "fsdp", "tensor")) > 1:
        errors.append("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1.")
    if not cfg.name.strip() or cfg.name in (".", "..") or "/" in cfg.name or os.sep in cfg.name:
        errors.append(f"config key 'name' = {cfg.name!r}: a run's name is its directory under "
                      "runs/ (runs/<name>); give a non-empty name without '/' (not '.' or '..'), "
                      "or choose the directory with --workdir=PATH.")
    return errors


def _lora_errors(cfg: RunConfig) -> list[str]:
    """model.lora_targets names known projections (the rank against the model's dimensions is
    checked once its config.json is read: train/door.py)."""
    from brorl_jax.models.lora import parse_targets
    try:
        parse_targets(cfg.model.lora_targets)
    except ValueError as e:
        return [f"config key 'model.lora_targets' = {cfg.model.lora_targets!r}: {e}."]
    if cfg.model.lora_rank > 0 and cfg.sft.steps > 0:
        return ["config key 'model.lora_rank' > 0 with 'sft.steps' > 0: the supervised warm "
                "start trains every weight, and a LoRA run reloads its base from model.path; "
                "warm-start and save a model first, or set sft.steps=0."]
    return []


def _in_range(value, spec: str) -> bool:
    """Whether `value` is within a schema range: "> 0", ">= 1.0", "[0, 1)", "(0, 1]"."""
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        above = value >= lo if spec[0] == "[" else value > lo
        below = value <= hi if spec[-1] == "]" else value < hi
        return above and below
    op, bound = spec.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def _range_errors(cfg) -> list[str]:
    """Each key outside the range its schema field declares (schema.setting)."""
    errors = []
    for key, (spec, note) in _ranges().items():
        value = _get(cfg, key)
        if not _in_range(value, spec):
            where = f"in {spec}" if spec[0] in "[(" else spec
            errors.append(f"config key '{key}' must be {where}{note}, got {value!r}.")
    return errors


def _validate_numbers(schema: dict, given: dict, run: RunConfig) -> list[str]:
    """Every float finite (NaN nowhere; inf only in INFINITE_OK), every int within int32, and the
    token counts of one generation round and one update within int32 (they are int32 arrays and
    sums on device)."""
    errors = []
    for key, value in given.items():
        want = type(schema.get(key))
        if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):
                errors.append(f"config key '{key}' is nan; give a number.")
            elif math.isinf(value) and key not in INFINITE_OK:
                errors.append(f"config key '{key}' must be finite, got {value}.")
            elif math.isfinite(value) and abs(value) > 1e30:
                errors.append(f"config key '{key}' = {value:g} is out of range (|value| <= 1e30).")
        elif want is int and isinstance(value, int) and not isinstance(value, bool):
            if not -INT32_MAX <= value <= INT32_MAX:
                errors.append(f"config key '{key}' = {value} does not fit in int32 (|value| <= "
                              f"{INT32_MAX}); counts, sizes and seeds are int32 on device.")
    if errors:
        return errors
    n, prompts, seq = run.rollout.rollouts_per_prompt, run.algo.prompts_per_step, run.seq_len
    mult = run.algo.generation_batch_multiplier
    if min(n, prompts, seq) > 0 and mult >= 1.0:
        tokens = run.round_prompts * n * seq
        if tokens > INT32_MAX:
            errors.append(
                f"one generation round holds ceil(algo.prompts_per_step {prompts} x "
                f"algo.generation_batch_multiplier {mult:g}) x rollout.rollouts_per_prompt {n} x "
                f"(data.max_prompt_len + rollout.max_new_tokens = {seq}) = {tokens:,} tokens, "
                f"more than int32 counts ({INT32_MAX:,}); lower rollout.rollouts_per_prompt, "
                "algo.prompts_per_step or the lengths.")
    return errors


def check_mesh(cfg: ml_collections.ConfigDict, num_devices: int,
               num_processes: int = 1) -> None:
    """ConfigError unless mesh.data x mesh.fsdp x mesh.tensor (-1 = the rest) uses exactly the
    devices JAX sees less mesh.rollout_devices (the rollout's own, when disaggregated: an equal
    share of every process's devices); on one device too (where the mesh is otherwise unused)."""
    from brorl_jax.parallel.mesh import AXES, mesh_shape
    rollout = int(cfg.mesh.get("rollout_devices", 0))
    if rollout:
        if rollout % num_processes:
            raise ConfigError(f"config key 'mesh.rollout_devices'={rollout} does not split over "
                              f"the {num_processes} processes: each process decodes on its own "
                              f"first mesh.rollout_devices / {num_processes} devices; make it a "
                              f"multiple of {num_processes} (or 0: colocated).")
        if rollout >= num_devices:
            raise ConfigError(f"config key 'mesh.rollout_devices'={rollout} leaves none of the "
                              f"{num_devices} device{'s' if num_devices != 1 else ''} JAX sees "
                              f"to train on; set it below {num_devices} (or 0: colocated).")
    train = num_devices - rollout
    sizes = {a: int(cfg.mesh.get(a, 1)) for a in AXES}
    try:
        mesh_shape(sizes, train)
    except ValueError as e:     # mesh.expert named when set (parallel/expert_parallel.py)
        given = ", ".join(f"mesh.{a}={v}" for a, v in sizes.items() if a != "expert" or v != 1)
        seen = (f"the {num_devices} device{'s' if num_devices != 1 else ''} JAX sees" if not
                rollout else f"the {train} training devices ({num_devices} JAX sees less "
                f"mesh.rollout_devices={rollout})")
        raise ConfigError(f"config keys {given} do not match {seen} ({e}). Set the sizes so "
                          "their product is the device count, or one of them to -1 (the rest; "
                          "the default is mesh.data=-1, mesh.fsdp=1, mesh.tensor=1).") from None


def check_update_split(cfg: RunConfig, split: int, num_processes: int) -> None:
    """ConfigError unless the update batch splits over the mesh's batch axes (data x fsdp x
    expert = `split` devices) and algo.prompts_per_step over the processes (train/runtime.py)."""
    rows, expert = cfg.update_rows, cfg.mesh.expert
    if rows % split:
        raise ConfigError(
            f"the update batch (algo.prompts_per_step x rollout.rollouts_per_prompt = {rows} "
            f"rows) does not split over the mesh's data x fsdp{' x expert' if expert > 1 else ''}"
            f" = {split} devices; make it a multiple of {split} or change mesh.data / mesh.fsdp"
            f"{' / mesh.expert' if expert > 1 else ''}.")
    if num_processes > 1 and cfg.algo.prompts_per_step % num_processes:
        raise ConfigError(
            f"algo.prompts_per_step={cfg.algo.prompts_per_step} must be a multiple of the "
            f"{num_processes} processes: each process fills an equal share of the "
            "update batch with its own prompts.")


def _validate_io_keys(cfg: ml_collections.ConfigDict) -> list[str]:
    """Keys that used to fail only when first used: JSON objects, data specs, optimizer
    constants, the data source -> verifier map."""
    errors = []
    parsed = {}
    for key in JSON_OBJECT_KEYS:
        text = _get(cfg, key)
        try:
            value = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            errors.append(f"config key '{key}' must be a JSON object, e.g. '{{\"a\": 1}}'; "
                          f"{e.msg} at column {e.colno} of {text!r}.")
            continue
        if not isinstance(value, dict):
            errors.append(f"config key '{key}' must be a JSON object ({{...}}), got {text!r}.")
            continue
        parsed[key] = value
    if "data.fields" in parsed:
        from brorl_jax.data.records import DEFAULT_FIELDS
        for name, column in parsed["data.fields"].items():
            if name not in DEFAULT_FIELDS:
                errors.append(f"config key 'data.fields' names {name!r}; the fields are "
                              f"{', '.join(sorted(DEFAULT_FIELDS))} (each mapped to a column).")
            elif not isinstance(column, str) or not column:
                errors.append(f"config key 'data.fields': {name!r} must map to a column name, "
                              f"got {column!r}.")
    errors += _validate_custom_reward(cfg)
    if "rewards.map" in parsed:
        names = verifier_names() + (("custom",) if cfg.rewards.custom else ())
        for source, verifier in parsed["rewards.map"].items():
            if not source or verifier not in names:
                errors.append(f"config key 'rewards.map' sends {source!r} to {verifier!r}; "
                              f"verifiers: {', '.join(names)}.")
    for key in ("data.train", "data.eval"):
        spec = _get(cfg, key)
        if not spec or spec.startswith("reasoning_gym:"):
            continue
        if any(c in spec for c in "*?[,"):
            errors.append(f"config key '{key}' = {spec!r}: one file per key; globs and lists "
                          "are not expanded. Join the files into one (e.g. cat a.jsonl b.jsonl "
                          "> all.jsonl) and give its path.")
        elif not spec.lower().endswith(DATA_SPEC_SUFFIXES):
            errors.append(f"config key '{key}' = {spec!r}: give a .jsonl or .parquet file or "
                          "'reasoning_gym:task1,task2'.")
    return errors


def _validate_custom_reward(cfg: ml_collections.ConfigDict) -> list[str]:
    """rewards.custom: the file exists (nothing is imported here; the door check in a worker
    does that, rewards/custom.py). train.loggers is checked by workdir/logger.check_config."""
    if not cfg.rewards.custom:
        return []
    from brorl_jax.rewards.custom import CustomRewardError, check_file
    try:
        check_file(cfg.rewards.custom)
    except CustomRewardError as e:
        return [f"config key {e}."]
    return []


def _validate_options(cfg: ml_collections.ConfigDict) -> list[str]:
    """Checks of the opt-in options that are not in the paper (brorl_jax/algo/policies.py)."""
    from brorl_jax.algo.policies import parse_adaptive_n, parse_temperature_schedule
    errors = []
    a, r = cfg.algo, cfg.rollout
    try:
        parse_temperature_schedule(r.temperature_schedule)
    except ValueError as e:
        errors.append(str(e))
    try:
        buckets, _ = parse_adaptive_n(r.adaptive_n_buckets, r.adaptive_n_thresholds)
    except ValueError as e:
        errors.append(str(e))
        buckets = ()
    rows = cfg.update_rows
    if r.adaptive_n and buckets:
        if min(buckets) < 2:
            errors.append(f"config key 'rollout.adaptive_n_buckets' = {r.adaptive_n_buckets!r}: "
                          "every N must be >= 2 (the group baseline needs two samples).")
        if max(buckets) > rows:
            errors.append(f"config key 'rollout.adaptive_n_buckets' = {r.adaptive_n_buckets!r}: "
                          f"the largest N ({max(buckets)}) must fit the update batch of "
                          f"algo.prompts_per_step * rollout.rollouts_per_prompt = {rows} rows.")
        if cfg.train.mass_balance_diagnostics:
            errors.append("train.mass_balance_diagnostics needs one N for all prompts; turn off "
                          "rollout.adaptive_n or the diagnostics.")
    if r.knapsack:
        errors += _knapsack_errors(cfg)
    if not a.reward_clip_low < a.reward_clip_high:
        errors.append(f"config keys 'algo.reward_clip_low' < 'algo.reward_clip_high' required, "
                      f"got {a.reward_clip_low}, {a.reward_clip_high} (-inf, inf = no clipping).")
    if a.advantage_normalizer == "ema" and a.advantage != "reinforce_pp_baseline":
        errors.append("config key 'algo.advantage_normalizer'='ema' replaces the batch whitening "
                      "of algo.advantage='reinforce_pp_baseline'; got algo.advantage="
                      f"{a.advantage!r}.")
    if a.max_staleness > 0 and not a.stream_rounds:
        errors.append(f"config key 'algo.max_staleness'={a.max_staleness} carries samples "
                      "across steps, which only the stream does; set algo.stream_rounds=True "
                      "or algo.max_staleness=0.")
    if a.max_staleness > 0 and (a.tis_mode == "off" or not a.recompute_old_logprobs):
        errors.append(f"config key 'algo.max_staleness'={a.max_staleness} trains on samples of "
                      "older weights, corrected per token by the truncated IS weight "
                      "pi_old / behaviour; it needs algo.tis_mode != 'off' and "
                      "algo.recompute_old_logprobs=True (or algo.max_staleness=0).")
    if a.decode_during_update < -1:
        errors.append(f"config key 'algo.decode_during_update' must be -1 (until the update is "
                      f"done, when disaggregated) or a count >= 0, got {a.decode_during_update}.")
    if a.decode_during_update > 0 and a.max_staleness == 0:
        errors.append(f"config key 'algo.decode_during_update'={a.decode_during_update} decodes "
                      "the carried samples while the update runs, and nothing is carried at "
                      "algo.max_staleness=0; set algo.max_staleness >= 1 (with "
                      "algo.stream_rounds=True) or algo.decode_during_update to -1 or 0.")
    if a.stream_rounds and r.adaptive_n:
        errors.append("config key 'algo.stream_rounds'=True decodes one N for every prompt; "
                      "turn off rollout.adaptive_n or algo.stream_rounds.")
    return errors


def describe() -> str:
    """Every config key with its default, and the allowed names where a key picks from a
    registry: what `--help` shows below the flags."""
    allowed = choices()
    lines = ["Config keys (override with --config.KEY=VALUE):"]
    for key, value in _flatten(default_config()).items():
        line = f"  {key} = {value!r}"
        if key in allowed:
            line += "   (" + " | ".join(allowed[key]) + ")"
        elif key == "rewards.map":
            line += "   (data_source -> " + " | ".join(verifier_names()) + ")"
        lines.append(line)
    return "\n".join(lines)


def _knapsack_errors(cfg: ml_collections.ConfigDict) -> list[str]:
    """rollout.knapsack's settings (algo/policies.py KnapsackN) and what it cannot combine with."""
    a, r, errors = cfg.algo, cfg.rollout, []
    k = "config key 'rollout.knapsack'=True"
    if r.knapsack_probe > r.rollouts_per_prompt:
        errors.append(f"{k}: rollout.knapsack_probe ({r.knapsack_probe}) must be at most "
                      f"rollout.rollouts_per_prompt ({r.rollouts_per_prompt}), the round's "
                      "samples per prompt that the probe is part of.")
    if not r.knapsack_probe <= r.knapsack_max_n <= cfg.update_rows:
        errors.append(f"{k}: rollout.knapsack_max_n ({r.knapsack_max_n}) must lie between "
                      f"rollout.knapsack_probe ({r.knapsack_probe}) and the update batch of "
                      f"algo.prompts_per_step * rollout.rollouts_per_prompt = {cfg.update_rows} "
                      "rows.")
    for key, on in (("rollout.adaptive_n", r.adaptive_n), ("algo.stream_rounds", a.stream_rounds),
                    ("train.mass_balance_diagnostics", cfg.train.mass_balance_diagnostics),
                    ("rollout.overgenerate_factor (> 1)", r.overgenerate_factor > 1.0)):
        if on:
            errors.append(f"{k} chooses the samples per prompt in generation rounds of its own; "
                          f"turn off {key} or rollout.knapsack.")
    return errors
