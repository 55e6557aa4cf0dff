"""A run remembers its config: `workdir/brorl_config.json` holds the resolved config, and a resume
compares the new config with it before anything expensive happens. (The name is the run's own:
a Hugging Face export writes `config.json`. Work directories from before the rename hold
`config.json`; a resume still reads it when it is a brorl config, and saves the new name.)

Which keys may change between the start of a run and a resume is decided in ONE table,
CHANGE_POLICY, with a reason per key or section (an exact key overrides its section):

  * refused: keys that change shapes or the meaning of the history (N, prompts per step, the
    model, the advantage, KL, the learning rate and what derives it, the data and its order, the
    sampling distribution, the evaluation protocol...). Resuming with one of these changed would
    silently mix two experiments in one metrics file and one checkpoint lineage.
  * allowed: how long to train, how often to evaluate/log/checkpoint, how the same computation
    is laid out or implemented (mesh, remat, kernels, micro-batching), scoring throughput.
    Allowed changes are logged and appended to `workdir/config_changes.jsonl`.

A refused change stops the run with the keys, their old and new values, the reason, and the two
ways out: a new --workdir, or `--allow_config_change=KEY[,KEY...]` (a key or a section name) to
override deliberately (also logged and recorded). Keys unknown to the table are refused.
"""
from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence

import ml_collections

from brorl_jax.config import (
    ConfigError,
    _flatten,
    default_config,
    derived_learning_rate,
    unknown_key_message,
)
from brorl_jax.workdir.layout import set_aside

CONFIG_FILE = "brorl_config.json"
LEGACY_CONFIG_FILE = "config.json"       # the name before Hugging Face exports could collide
CHANGES_FILE = "config_changes.jsonl"

ALLOWED, REFUSED = True, False
# key or section -> (may change on resume, why). Exact keys first, then the section.
CHANGE_POLICY: dict[str, tuple[bool, str]] = {
    # sections
    "model": (REFUSED, "the policy being trained (its weights, dtypes)"),
    "data": (REFUSED, "the prompts and their order: the saved data-iterator position indexes "
                      "this dataset"),
    "rollout": (REFUSED, "the sampling distribution and the group shapes the update sees"),
    "algo": (REFUSED, "the update's objective and batch shapes"),
    "optim": (REFUSED, "the learning rate (and what derives it) and the optimizer state"),
    "rewards": (REFUSED, "what the rewards mean"),
    "sft": (ALLOWED, "the warm start ran before the first checkpoint; a resume does not rerun it"),
    "eval": (REFUSED, "the eval/ curve would mix two measurement protocols"),
    "train": (REFUSED, "the run's schedule"),
    "mesh": (ALLOWED, "how the same computation is laid out on devices; the checkpoint is "
                      "restored into the new layout"),
    # keys that differ from their section
    "name": (ALLOWED, "a label"),
    "model.remat": (ALLOWED, "recomputation in the backward pass: same gradients"),
    "model.attention_impl": (ALLOWED, "an implementation of the same attention"),
    "model.mlp_impl": (ALLOWED, "an implementation of the same MLP"),
    "rollout.impl": (ALLOWED, "an implementation of the same sampler"),
    "rollout.memory_budget_gb": (ALLOWED, "decode slots and KV pages for the same samples"),
    "algo.micro_batch_size": (ALLOWED, "gradient accumulation granularity: same update"),
    "algo.micro_batch_tokens": (ALLOWED, "gradient accumulation granularity: same update"),
    "algo.pack_sequences": (ALLOWED, "row layout of the same update"),
    "algo.logprob_impl": (ALLOWED, "an implementation of the same log-probabilities"),
    "rewards.num_workers": (ALLOWED, "scoring throughput"),
    "rewards.recycle_after": (ALLOWED, "scoring worker lifetime"),
    "rewards.timeout_s": (ALLOWED, "an operational limit (only items that hit it score "
                                   "differently; watch verifier/*/timeout_frac)"),
    "rewards.batch_deadline_s": (ALLOWED, "an operational limit (watch "
                                          "verifier/*/deadline_frac)"),
    "eval.every": (ALLOWED, "evaluation cadence"),
    "train.steps": (ALLOWED, "how far to train; the history so far is unchanged"),
    "train.sample_budget": (ALLOWED, "how far to train, in generated samples"),
    "train.checkpoint_every": (ALLOWED, "checkpoint cadence"),
    "train.keep_checkpoints": (ALLOWED, "checkpoint retention"),
    "train.log_every": (ALLOWED, "logging"),
    "train.plots": (ALLOWED, "logging"),
    "train.tensorboard": (ALLOWED, "logging"),
    "train.loggers": (ALLOWED, "logging"),
    "train.mass_balance_diagnostics": (ALLOWED, "extra diagnostic metrics only"),
    "train.max_skipped_steps": (ALLOWED, "when a run that is not learning stops"),
    "train.seed": (REFUSED, "every random draw of step s derives from (seed, s)"),
}


def policy(key: str) -> tuple[bool, str]:
    """(allowed, reason) for a change of `key` on resume."""
    if key in CHANGE_POLICY:
        return CHANGE_POLICY[key]
    section = key.split(".", 1)[0]
    return CHANGE_POLICY.get(section, (REFUSED, "not classified; refused to be safe"))


# The base model's files (its weights aside) that shape what a run trains and what its exports
# ship: a fresh start records their hashes in BASE_MODEL_FILE; evaluate and export check them.
# tokenizer_config.json and special_tokens_map.json are left out: every writer (transformers'
# save_pretrained, ours) serialises them differently for the same tokenizer, so a warm start saved
# from the base would differ from it.
BASE_MODEL_FILE = "base_model.json"
BASE_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                    "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _base_hashes(model_dir: str) -> dict[str, str]:
    import hashlib
    out = {}
    for name in BASE_MODEL_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


# WORKDIR/base_model/: a copy of the base model's config and tokenizer files (no weights), so
# that evaluate and export of a full fine-tuning run still work once model.path is gone (its
# checkpoints hold every weight; cli.run_config puts the copy in model.path's place).
BASE_COPY_DIR = "base_model"
BASE_COPY_FILES = BASE_MODEL_FILES + ("tokenizer_config.json", "special_tokens_map.json",
                                      "added_tokens.json")


def record_base_model(workdir: str, model_dir: str) -> None:
    """At a fresh start: the hashes of the base model's files (BASE_MODEL_FILES) in
    WORKDIR/base_model.json, and a copy of its config and tokenizer files in
    WORKDIR/base_model/. A model that is not a directory (a .gguf file, a built-in name) is not
    recorded."""
    if not os.path.isdir(model_dir):
        return
    path = os.path.join(workdir, BASE_MODEL_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"path": os.path.abspath(model_dir), "files": _base_hashes(model_dir)}, f,
                  indent=1)
    os.replace(path + ".tmp", path)
    _copy_base_files(model_dir, os.path.join(workdir, BASE_COPY_DIR))


def _copy_base_files(model_dir: str, dest: str) -> None:
    import shutil

    from brorl_jax.models.hf import NO_WEIGHTS_MARKER
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in BASE_COPY_FILES:
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, NO_WEIGHTS_MARKER), "w") as f:
        json.dump({"copied_from": os.path.abspath(model_dir),
                   "why": "the config and tokenizer of this run's base model, without weights: "
                          "evaluate and export of the run read it when model.path is gone"}, f,
                  indent=1)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def stand_in_base(workdir: str, model_path: str) -> str | None:
    """The run's copy of its base model (BASE_COPY_DIR) when the config's model.path is a
    directory that is gone and the copy exists; None otherwise."""
    copy = os.path.join(workdir, BASE_COPY_DIR)
    gone = bool(model_path) and not model_path.startswith("builtin:") and \
        not os.path.exists(os.path.expanduser(model_path))
    return copy if gone and os.path.isdir(copy) else None


def check_base_model(workdir: str, model_dir: str) -> None:
    """Raises ConfigError when a file of the base model at `model_dir` differs from the one the
    run started with (its prompts would be built, and an export would ship files, the run did not
    train with). Nothing to check for a run that recorded none."""
    try:
        with open(os.path.join(workdir, BASE_MODEL_FILE)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return
    if not os.path.isdir(model_dir):
        return
    now = _base_hashes(model_dir)
    changed = [name for name, digest in recorded.get("files", {}).items()
               if now.get(name) != digest]
    if changed:
        raise ConfigError(f"config key 'model.path' = {model_dir!r}: {', '.join(changed)} "
                          f"differ(s) from the base model the run started with "
                          f"({recorded.get('path')}, hashes in {BASE_MODEL_FILE}); prompts and "
                          "exported files would not be the run's. Point model.path at the run's "
                          "base model.")


def save(cfg: ml_collections.ConfigDict, workdir: str) -> str:
    """Writes the resolved config to workdir/brorl_config.json (atomically); returns the path."""
    path = os.path.join(workdir, CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(cfg.to_json(indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def _saved_path(workdir: str) -> str | None:
    """The run's saved config: brorl_config.json, else (a run from before the rename) a
    config.json that is a brorl config (a Hugging Face config.json is not)."""
    path = os.path.join(workdir, CONFIG_FILE)
    if os.path.exists(path):
        return path
    legacy = os.path.join(workdir, LEGACY_CONFIG_FILE)
    try:
        with open(legacy) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(saved, dict) and {"rollout", "algo", "train"} <= set(saved):
        return legacy
    return None


def load(workdir: str) -> ml_collections.ConfigDict | None:
    """The saved config of a run; None when the run predates saved configs."""
    path = _saved_path(workdir)
    if path is None:
        return None
    try:
        with open(path) as f:
            return ml_collections.ConfigDict(json.load(f))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); it records the config this run started "
                          "with. Restore it, or move it away to resume without the check.") from e


def as_config(workdir: str) -> ml_collections.ConfigDict | None:
    """The run's saved config as a config to run with (evaluate, export): today's defaults with
    every key the run recorded (a key the schema dropped since is left out); None when the run
    saved none."""
    saved = load(workdir)
    if saved is None:
        return None
    cfg = default_config()
    known = _flatten(cfg)
    for key, value in _flatten(saved).items():
        if key in known:
            section, _, name = key.rpartition(".")
            (cfg[section] if section else cfg)[name] = value
    return cfg


# What shapes a checkpoint's tree: the model, whether it holds a reference model, its optimizer.
CHECKPOINT_SHAPE_KEYS = ("model.", "algo.kl_coef", "optim.name")


def differences(cfg, workdir: str, keys: Sequence[str] = CHECKPOINT_SHAPE_KEYS) -> list[str]:
    """'key: saved -> given' for each key starting with one of `keys` where `cfg` differs from
    the run's saved config (CHECKPOINT_SHAPE_KEYS: what shapes a checkpoint)."""
    saved = load(workdir)
    if saved is None:
        return []
    refused, accepted = compare(saved, cfg.to_config_dict() if hasattr(cfg, "to_config_dict")
                                else cfg)
    return [f"{key}: {old!r} -> {new!r}" for key, old, new, *_ in refused + accepted
            if key.startswith(tuple(keys))]


def check_allow_list(allow: Iterable[str]) -> list[str]:
    """The --allow_config_change entries, each a config key or a section; ConfigError otherwise."""
    schema = _flatten(default_config())
    sections = {k.split(".", 1)[0] for k in schema}
    out = []
    for item in allow:
        item = item.strip()
        if not item:
            continue
        if item not in schema and item not in sections:
            raise ConfigError(f"--allow_config_change: {unknown_key_message(item)}")
        out.append(item)
    return out


def _allowed_by(key: str, allow: Sequence[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


def compare(saved: ml_collections.ConfigDict, cfg: ml_collections.ConfigDict,
            allow: Sequence[str] = ()) -> tuple[list[tuple], list[tuple]]:
    """(refused, accepted) changes between a saved config and `cfg`; each entry is
    (key, old, new, reason, how) with how in {"harmless", "override"}."""
    saved, current = _flatten(saved), _flatten(cfg)
    refused, accepted = [], []
    for key in sorted(set(saved) | set(current)):
        if key not in saved or key not in current:
            continue          # a key added to / removed from the schema since: nothing to compare
        old, new = saved[key], current[key]
        if old == new or (isinstance(old, float) and isinstance(new, (int, float))
                          and float(new) == old):
            continue
        ok, reason = policy(key)
        if ok:
            accepted.append((key, old, new, reason, "harmless"))
        elif _allowed_by(key, allow):
            accepted.append((key, old, new, reason, "override"))
        else:
            refused.append((key, old, new, reason, ""))
    return refused, accepted


def check_resume(cfg: ml_collections.ConfigDict, workdir: str, allow: Sequence[str] = ()
                 ) -> list[tuple]:
    """Before a resume: raises ConfigError when a refused key changed; returns the accepted
    changes (to log and record once the run has resumed)."""
    saved = load(workdir)
    if saved is None:
        return []
    refused, accepted = compare(saved, cfg, allow)
    if refused:
        lines = [f"{k}: {o!r} -> {n!r} ({why})" for k, o, n, why, _ in refused]
        old_lr, new_lr = _lr_or_none(saved), _lr_or_none(cfg)
        if old_lr is not None and new_lr is not None and old_lr != new_lr:
            lines.append(f"(the derived learning rate would change: {old_lr:.4g} -> {new_lr:.4g})")
        keys = ",".join(k for k, *_ in refused)
        raise ConfigError(
            f"{workdir} holds a run started with a different config; resuming it would mix two "
            "experiments in one history:\n  " + "\n  ".join(lines) +
            f"\nStart a new run with another --workdir, or resume deliberately with "
            f"--allow_config_change={keys} (recorded in {CONFIG_FILE} and {CHANGES_FILE}).")
    return accepted


def _lr_or_none(cfg) -> float | None:
    try:
        return derived_learning_rate(cfg)[0]
    except Exception:  # noqa: BLE001 - an old config missing keys: no derived value to show
        return None


def record(cfg: ml_collections.ConfigDict, workdir: str, *, resumed_from: int | None,
           accepted: Sequence[tuple] = ()) -> list[str]:
    """After the start: saves the config (a fresh start sets an earlier run's brorl_config.json
    aside as brorl_config.json.N, and a legacy config.json as config.json.N); on resume appends
    the accepted changes to config_changes.jsonl. Returns
    the log lines."""
    lines = []
    path = os.path.join(workdir, CONFIG_FILE)
    if resumed_from is None:
        legacy = _saved_path(workdir)
        for old in (set_aside(path),
                    set_aside(legacy) if legacy and legacy != path else None):
            if old:
                lines.append(f"[config] fresh start: the earlier run's config kept as {old}")
    elif accepted:
        with open(os.path.join(workdir, CHANGES_FILE), "a") as f:
            f.write(json.dumps({
                "time": datetime.datetime.now().isoformat(timespec="seconds"),
                "resumed_from_step": resumed_from,
                "changes": {k: {"old": o, "new": n, "how": how} for k, o, n, _, how in accepted},
            }) + "\n")
        for k, o, n, why, how in accepted:
            tag = "override (--allow_config_change)" if how == "override" else "allowed"
            lines.append(f"[config] {k}: {o!r} -> {n!r}, {tag}: {why}")
    elif _saved_path(workdir) is None:
        lines.append(f"[config] no {CONFIG_FILE} in {workdir} (a run from before configs were "
                     "saved); saving the current config")
    elif not os.path.exists(path):
        lines.append(f"[config] {LEGACY_CONFIG_FILE} of a run from before the rename read; "
                     f"the config is now saved as {CONFIG_FILE}")
    save(cfg, workdir)
    return lines
