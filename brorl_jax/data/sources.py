"""Where prompt records come from: the one place that turns a dataset spec into records.

Specs:
  "train.jsonl"                                   -> records.load_jsonl
  "train.parquet" (or .pq)                        -> records.load_parquet (veRL layout accepted)
  "reasoning_gym:basic_arithmetic,chain_sum"      -> reasoning_gym_source, equal weights
  "reasoning_gym:basic_arithmetic=3,chain_sum=1"  -> weighted; `size` prompts in total, generated
                                                     with `seed` (and the generators' kwargs)
  a list of those                                 -> concatenated, reports merged
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from brorl_jax.data.reasoning_gym_source import reasoning_gym_source
from brorl_jax.data.records import DataReport, load_jsonl, load_parquet
from brorl_jax.errors import ConfigError, DataError

REASONING_GYM_PREFIX = "reasoning_gym:"


def load_dataset(spec: str | os.PathLike | Sequence[str | os.PathLike], *,
                 fields: Mapping[str, str] | None = None, data_source: str | None = None,
                 size: int = 1000, seed: int = 0,
                 reasoning_gym_kwargs: Mapping | None = None) -> tuple[list[dict], DataReport]:
    """Loads prompts from a spec (module docstring). `fields` and `data_source` apply to files,
    `size`, `seed` and `reasoning_gym_kwargs` to generated sources. Returns (records, report)."""
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if not spec:
            raise ValueError("load_dataset got an empty list of specs.")
        records, report = [], DataReport()
        for one in spec:
            r, rep = load_dataset(one, fields=fields, data_source=data_source, size=size,
                                  seed=seed, reasoning_gym_kwargs=reasoning_gym_kwargs)
            records += r
            report = report.merge(rep)
        return records, report
    text = os.fspath(spec)
    if text.startswith(REASONING_GYM_PREFIX):
        report = DataReport()
        records = reasoning_gym_source(text[len(REASONING_GYM_PREFIX):], size=size, seed=seed,
                                       report=report, **dict(reasoning_gym_kwargs or {}))
        return records, report
    lower = text.lower()
    if lower.endswith(".jsonl"):
        return load_jsonl(text, fields=fields, data_source=data_source)
    if lower.endswith((".parquet", ".pq")):
        return load_parquet(text, fields=fields, data_source=data_source)
    raise ValueError(f"load_dataset: cannot tell the format of {text!r}. Use a .jsonl or "
                     ".parquet file, or 'reasoning_gym:task1,task2' (optionally task=weight).")


def _prompt_key(record: dict) -> str:
    return record["prompt"] if "prompt" in record else json.dumps(record.get("prompt_messages"))


def load_train_and_eval(data_cfg, on_report=None
                        ) -> tuple[list[dict], list[dict], list[DataReport]]:
    """The training and held-out records of a run config's `data` section, and the load reports
    (each also passed to `on_report` as soon as its source has loaded, so a later failure does
    not hide the rows an earlier source skipped).

    data.eval given: loaded from it. Otherwise a generated source draws the held-out set with
    another seed (questions that also occur in training are removed from training), and a file is
    split: its first min(data.eval_size, 10%) rows are held out."""
    if not data_cfg.train:
        raise ConfigError("config key 'data.train' is empty; give a JSONL/Parquet path or "
                          "'reasoning_gym:<task>'.")
    kwargs = json.loads(data_cfg.reasoning_gym_kwargs or "{}")
    fields = json.loads(data_cfg.get("fields", "{}") or "{}")

    def load(key, size, seed):
        spec = data_cfg[key]
        try:
            records, report = load_dataset(spec, size=size, seed=seed, fields=fields,
                                           data_source=data_cfg.default_source or None,
                                           reasoning_gym_kwargs=kwargs)
        except DataError:
            raise                       # already names the file
        except ValueError as e:         # a reasoning_gym task name or generator setting
            raise DataError(f"config key 'data.{key}' = {spec!r}: {e}") from e
        if on_report is not None:
            on_report(report)
        return records, report

    train, train_report = load("train", data_cfg.train_size, data_cfg.seed)
    reports = [train_report]
    if data_cfg.eval:
        held_out, report = load("eval", data_cfg.eval_size, data_cfg.seed + 1)
        reports.append(report)
    elif data_cfg.train.startswith(REASONING_GYM_PREFIX):
        held_out, report = load("train", data_cfg.eval_size, data_cfg.seed + 10_007)
        reports.append(report)
        # a generated question may repeat across seeds: keep held-out questions out of training
        seen = {_prompt_key(r) for r in held_out}
        train = [r for r in train if _prompt_key(r) not in seen]
    else:
        n = min(data_cfg.eval_size, len(train) // 10)
        held_out, train = train[:n], train[n:]
    return train, held_out, reports


def check_overlap(train: list[dict], held_out: list[dict], log=print) -> dict:
    """Counts what makes a held-out score or a training set mean less than it seems: held-out
    rows whose prompt is also a training prompt (the held-out score is then partly a training
    score), and rows repeating an earlier prompt of their own set. Logs one warning line per
    non-zero count; returns the counts as metrics (data/...), logged with the first metrics row."""
    train_keys = [_prompt_key(r) for r in train]
    eval_keys = [_prompt_key(r) for r in held_out]
    in_train = set(train_keys)
    overlap = sum(k in in_train for k in eval_keys)
    out = {"data/eval_in_train": overlap,
           "data/train_repeated_rows": len(train_keys) - len(in_train),
           "data/eval_repeated_rows": len(eval_keys) - len(set(eval_keys))}

    def where(records, keys):
        first, seen = None, set()
        for r, k in zip(records, keys):
            if k in seen:
                first = r
                break
            seen.add(k)
        return f" (first: {first.get('source')} row {first.get('row')})" if first else ""

    if overlap:
        example = next(r for r, k in zip(held_out, eval_keys) if k in in_train)
        log(f"[data] warning: {overlap} of {len(held_out)} held-out prompts are also training "
            f"prompts (first: {example.get('source')} row {example.get('row')}); the held-out "
            "score is then partly a training score. Give data.eval prompts disjoint from "
            "data.train (or leave data.eval empty to hold out part of data.train).")
    for name, records, keys, n in (("training", train, train_keys,
                                    out["data/train_repeated_rows"]),
                                   ("held-out", held_out, eval_keys,
                                    out["data/eval_repeated_rows"])):
        if n:
            generated = all(str(r.get("source", "")).startswith(REASONING_GYM_PREFIX[:-1])
                            for r in records)
            log(f"[data] {'note' if generated else 'warning'}: {n} of {len(records)} {name} "
                f"rows repeat an earlier prompt{where(records, keys)}; repeated prompts weigh "
                f"more in {'training' if name == 'training' else 'the held-out score'}"
                + (" (a generated set, drawn with replacement)." if generated else "."))
    return out
