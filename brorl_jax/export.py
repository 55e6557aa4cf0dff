"""Export a training checkpoint to a Hugging Face directory (config, safetensors, tokenizer).

  python -m brorl_jax.export --workdir=DIR [--step=S] --out=HF_DIR [--overwrite] [--format=hf]

--format=hf (default): the model, a LoRA run's adapters merged into it. --format=peft (LoRA runs,
model.lora_rank > 0): a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
for peft.PeftModel.from_pretrained on the base model (model.path); adapters merged at reference
resets are part of it (models/peft_io.py).

The run's own config (DIR/brorl_config.json) builds the model unless --config is given
(cli.run_config); --config.KEY overrides apply on top.

The result loads with transformers' AutoModelForCausalLM and with brorl_jax.models.from_pretrained.

Nothing is overwritten by accident (docs/reliability.md): `--out` may not be a run's work
directory or lie inside one (the run's records and an export would share a directory), may not
be a file, and may not be a non-empty directory unless `--overwrite` (which replaces it). The
export is written into a temporary directory beside `--out` and renamed into place at the end,
so an interrupted export leaves no half-written model. The work directory is only read.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from brorl_jax import cli
from brorl_jax.errors import WorkdirError

FORMATS = ("hf", "peft")
FLAGS = [cli.Flag("string", "workdir", None, "The run's work directory.", required=True),
         cli.Flag("integer", "step", None, "Checkpoint step (default: the latest)."),
         cli.Flag("string", "out", None, "Output Hugging Face directory (new or empty).",
                  required=True),
         cli.Flag("bool", "overwrite", False, "Replace a non-empty --out directory."),
         cli.Flag("string", "format", "hf", "hf: the (merged) model; peft: a LoRA run's "
                  "adapters as a PEFT adapter directory.")]

# What marks a directory as a run's work directory (any of these): its records.
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "brorl_config.json", ".brorl_lock",
               "config_changes.jsonl")


def _is_run_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in RUN_MARKERS)


def check_out(out: str, workdir: str, overwrite: bool = False, base_model: str | None = None
              ) -> None:
    """Raises WorkdirError (before anything is loaded) when writing `out` could overwrite a
    run's records, the base model it starts from (`base_model`: model.path), a file, or a
    non-empty directory without --overwrite."""
    if not out:
        raise WorkdirError("--out is required.")
    real_out = os.path.realpath(out)
    real_work = os.path.realpath(workdir)
    if base_model:
        real_base = os.path.realpath(base_model)
        if real_out == real_base or real_out.startswith(real_base + os.sep) or \
                real_base.startswith(real_out + os.sep):
            raise WorkdirError(f"--out {out!r} is or holds the run's base model (model.path = "
                               f"{base_model!r}), which the run's restores read; export "
                               "elsewhere, e.g. a new directory beside the work directory.")
    if real_out == real_work or real_out.startswith(real_work + os.sep):
        raise WorkdirError(f"--out {out!r} is inside the run's work directory {workdir!r}; an "
                           "export there would sit among (and could replace) the run's records. "
                           f"Give --out a directory outside it, e.g. {real_work + '_hf'!r}.")
    probe = real_out
    while probe != os.path.dirname(probe):
        if _is_run_dir(probe):
            raise WorkdirError(f"--out {out!r} is inside the work directory of a run ({probe!r}); "
                               "give --out a directory outside any run's work directory.")
        probe = os.path.dirname(probe)
    if os.path.exists(out) and not os.path.isdir(out):
        raise WorkdirError(f"--out {out!r} is a file; give a directory (new or empty).")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise WorkdirError(f"--out {out!r} is not empty ({len(os.listdir(out))} entries, e.g. "
                           f"{sorted(os.listdir(out))[0]!r}); give a new or empty directory, or "
                           "--overwrite to replace it.")


def write_atomically(out: str, write, overwrite: bool = False) -> None:
    """Calls write(tmp_dir) on a temporary directory beside `out`, then renames it to `out`
    (a replaced directory is removed only once the new one is in place)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.export-",
                           dir=parent)
    old = None
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        if os.path.isdir(out) and os.listdir(out):
            if not overwrite:       # appeared while we were writing
                raise WorkdirError(f"--out {out!r} was filled while the export ran; nothing "
                                   "was replaced. Export again into a new directory.")
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.old-",
                                   dir=parent)
            os.replace(out, os.path.join(old, "out"))
        elif os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def export(cfg, workdir: str, out: str, step: int | None = None, overwrite: bool = False,
           format: str = "hf") -> int:
    """Writes checkpoint `step` (default: the newest that restores) of `workdir` to `out` as a
    Hugging Face model (format "hf") or a PEFT adapter directory ("peft"); the work directory is
    only read (a missing one is an error, never created)."""
    from brorl_jax import models
    from brorl_jax.config import validate
    from brorl_jax.train.context import base_model_dir
    from brorl_jax.train.loop import restore_checkpoint, restore_params
    from brorl_jax.workdir.layout import require_existing
    cfg = validate(cfg)
    if format not in FORMATS:
        raise WorkdirError(f"--format={format!r}; use one of {', '.join(FORMATS)}.")
    if format == "peft" and cfg.model.lora_rank == 0:
        raise WorkdirError("--format=peft exports LoRA adapters, and this run has none "
                           "(model.lora_rank = 0); use --format=hf.")
    require_existing(workdir)
    check_out(out, workdir, overwrite, base_model=base_model_dir(cfg))
    if format == "peft":
        model, saved, step = restore_checkpoint(cfg, workdir, step)
        sets = [*saved.lora_merged, saved.params[models.lora.KEY]]
    else:
        model, params, step = restore_params(cfg, workdir, step)

    def write(tmp: str) -> None:
        if format == "peft":
            models.peft_io.save_peft(sets, model.config, tmp, os.path.abspath(base_model_dir(cfg)))
        else:
            merged = models.lora.merge_lora(params, model.config)
            models.save_pretrained(model.with_params(merged), tmp)
        cli.raise_if_signalled()        # a SIGTERM whose raise was lost: nothing is put in place

    write_atomically(out, write, overwrite)
    return step


def main(values: dict) -> int:
    step = export(cli.run_config(values, values["workdir"]), values["workdir"], values["out"],
                  values["step"], values["overwrite"], values["format"])
    print(f"exported step {step} of {values['workdir']} to {values['out']}")
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS)
