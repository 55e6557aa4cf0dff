"""Export a training checkpoint to a Hugging Face directory (config, safetensors, tokenizer).

  python -m brorl_jax.export --config=configs/NAME.py --workdir=DIR [--step=S] --out=HF_DIR

The result loads with transformers' AutoModelForCausalLM and with brorl_jax.models.from_pretrained.
"""
from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

import configs

_FLAGS: dict = {}  # defined when run as a command, not at import (see brorl_jax/main.py)


def _define_flags() -> None:
    _FLAGS["config"] = config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(configs.__file__), "demo.py"), "Config of the run.")
    _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "The run's work directory.",
                                            required=True)
    _FLAGS["step"] = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    _FLAGS["out"] = flags.DEFINE_string("out", None, "Output Hugging Face directory.",
                                        required=True)


def export(cfg, workdir: str, out: str, step: int | None = None) -> int:
    from brorl_jax import models
    from brorl_jax.train.loop import restore_params
    model, params, step = restore_params(cfg, workdir, step)
    models.save_pretrained(model.with_params(params), out)
    return step


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    f = {k: v.value for k, v in _FLAGS.items()}
    step = export(f["config"], f["workdir"], f["out"], f["step"])
    print(f"exported step {step} of {f['workdir']} to {f['out']}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
