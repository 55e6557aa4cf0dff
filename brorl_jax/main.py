"""Entry point: python -m brorl_jax.main --config=configs/NAME.py[:preset] --workdir=DIR [--config.key=value ...]

With no --config the embedded demo config runs: a small model is built locally, warm-started by a
short supervised phase on a Reasoning Gym arithmetic task, then trained with BroRL on CPU, printing
held-out pass@1 before and after. Started again with the same --workdir, a run resumes from its
latest complete checkpoint (the newest one that restores); a resume refuses a config that
changes the run's meaning unless --allow_config_change names the keys (docs/reliability.md).
"""
from __future__ import annotations

import os

from brorl_jax import cli

FLAGS = [cli.Flag("string", "workdir", None, "Where checkpoints, metrics.jsonl, TensorBoard "
                  "events and plots go. Default: runs/<config name>."),
         cli.Flag("list", "allow_config_change", [], "Config keys (or sections) that may differ "
                  "from the config the run in --workdir started with, when resuming it; "
                  "recorded in WORKDIR/config_changes.jsonl.")]


def main(values: dict) -> int:
    from brorl_jax.config import validate
    cfg = validate(values["config"])
    # Heavy imports after validation so a bad config fails in a second.
    from brorl_jax.parallel.distributed import maybe_initialize_distributed
    from brorl_jax.train.loop import train
    maybe_initialize_distributed()
    train(cfg, values["workdir"] or os.path.join("runs", cfg.name),
          allow_config_change=values["allow_config_change"])
    return 0


def run() -> None:
    """Console-script entry (`brorl-jax`)."""
    cli.run(main, FLAGS, log_dirs=("workdir",))


if __name__ == "__main__":
    run()
