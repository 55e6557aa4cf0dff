"""Standalone evaluation: pass@k and mean@k on the held-out prompts of a config.

  python -m brorl_jax.evaluate --workdir=DIR [--step=S] [--config.KEY=VALUE ...]
  python -m brorl_jax.evaluate --config=configs/NAME.py --config.model.path=HF_DIR   (no workdir)

With --workdir and no --config the run's own config (DIR/brorl_config.json) is used, with the
command line's --config.KEY overrides on top (cli.run_config); --config replaces it.

Defaults are the paper's evaluation settings (temperature 0.6, top-p 0.95, 16 samples per
prompt, pass@1 as their mean) unless the config's eval section says otherwise. The work
directory is only read: a missing one is an error (never created), nothing in it is changed.
"""
from __future__ import annotations

import json

from brorl_jax import cli

FLAGS = [cli.Flag("string", "workdir", None, "Evaluate this run's checkpoint (else the model at "
                  "config.model.path)."),
         cli.Flag("integer", "step", None, "Checkpoint step (default: the latest).")]


def evaluate(cfg, workdir: str | None = None, step: int | None = None) -> dict:
    """pass@k / mean@k of checkpoint `step` of the run in `workdir` (default: the newest that
    restores), or of the model at config.model.path without a workdir. Builds the run context
    only (the model loads once; no training loader, no work directory of its own)."""
    from brorl_jax.train import door
    from brorl_jax.train.context import build_context, load_model, load_records
    from brorl_jax.train.evaluation import evaluate as evaluate_params
    from brorl_jax.train.loop import restore_params
    facts = door.check_evaluation(cfg, workdir)     # before anything expensive
    cfg = facts.cfg                                 # the typed RunConfig from here on
    _, eval_records = load_records(cfg)
    model = load_model(cfg, weights_from_checkpoint=bool(workdir))
    if facts.model_cfg is None:              # a .gguf model: its config came with it
        facts = door.check_loaded_model(cfg, model.config, update=False)
    ctx = build_context(cfg, eval_records, model=model,
                        paused_engine_bytes=facts.paused_engine_bytes)
    try:
        params = ctx.model.params
        if workdir:
            _, params, step = restore_params(cfg, workdir, step, model=ctx.model)
        out = evaluate_params(ctx, params, step or 0)
        out["step"] = step or 0
        return out
    finally:
        ctx.close()


def main(values: dict) -> int:
    cfg = cli.run_config(values, values["workdir"])
    print(json.dumps(evaluate(cfg, values["workdir"], values["step"]), indent=1))
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS)
