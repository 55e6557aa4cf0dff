"""Entry point: python -m brorl_jax.main --config=configs/NAME.py[:preset] --workdir=DIR [--config.key=value ...]

With no --config the embedded demo config runs: a small model is built locally, warm-started by a
short supervised phase on a Reasoning Gym arithmetic task, then trained with BroRL on CPU, printing
held-out pass@1 before and after. Started again with the same --workdir, a run resumes from its
latest complete checkpoint.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import configs

_DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), "demo.py")

# Flags are defined when the command runs, not at import: several CLI modules (main, evaluate,
# export, experiments) define --config, and importing two of them into one process (a test, a
# notebook) must not collide in absl's global flag registry.
_FLAGS: dict = {}


def _define_flags() -> None:
    if _FLAGS:
        return
    _FLAGS["config"] = config_flags.DEFINE_config_file(
        "config", _DEFAULT_CONFIG, "Config file (configs/NAME.py), optionally with ':preset'.")
    _FLAGS["workdir"] = flags.DEFINE_string(
        "workdir", None, "Where checkpoints, metrics.jsonl, TensorBoard events and plots go. "
        "Default: runs/<config name>.")


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from brorl_jax.config import ConfigError, validate

    cfg = _FLAGS["config"].value
    try:
        validate(cfg)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    # Heavy imports after validation so a bad config fails in a second.
    from brorl_jax.parallel.distributed import maybe_initialize_distributed
    from brorl_jax.train.loop import train
    maybe_initialize_distributed()
    workdir = _FLAGS["workdir"].value or os.path.join("runs", cfg.name)
    logging.set_verbosity(logging.WARNING)
    try:
        train(cfg, workdir)
    except ConfigError as e:     # a setting that only fails against the devices (mesh sizes)
        print(str(e), file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """Console-script entry (`brorl-jax`)."""
    _define_flags()
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run()
