"""Standalone evaluation: pass@k and mean@k on the held-out prompts of a config.

  python -m brorl_jax.evaluate --config=configs/NAME.py --workdir=DIR [--step=S]
  python -m brorl_jax.evaluate --config=configs/NAME.py --config.model.path=HF_DIR   (no workdir)

Defaults are the paper's evaluation settings (temperature 0.6, top-p 0.95, 16 samples per
prompt, pass@1 as their mean) unless the config's eval section says otherwise. The work
directory is only read: a missing one is an error (never created), nothing in it is changed.
"""
from __future__ import annotations

import json
import shutil
import tempfile

from brorl_jax import cli

FLAGS = [cli.Flag("string", "workdir", None, "Evaluate this run's checkpoint (else the model at "
                  "config.model.path)."),
         cli.Flag("integer", "step", None, "Checkpoint step (default: the latest).")]


def evaluate(cfg, workdir: str | None = None, step: int | None = None) -> dict:
    from brorl_jax.config import validate
    from brorl_jax.errors import CheckpointError
    from brorl_jax.train.loop import Trainer, restore_params
    from brorl_jax.train.workdir import has_checkpoints, require_existing
    validate(cfg)
    if workdir:                          # before anything expensive; never created
        require_existing(workdir)
        if not has_checkpoints(workdir):
            raise CheckpointError(f"no complete checkpoint in {workdir}/checkpoints; train "
                                  "first.")
    scratch = tempfile.mkdtemp(prefix="brorl_eval_")
    try:
        trainer = Trainer(cfg, scratch)
        try:
            params = trainer.model.params
            if workdir:
                _, params, step = restore_params(cfg, workdir, step)
            out = trainer.evaluate(params, step or 0)
            out["step"] = step or 0
            return out
        finally:
            trainer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(values: dict) -> int:
    print(json.dumps(evaluate(values["config"], values["workdir"], values["step"]), indent=1))
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS)
