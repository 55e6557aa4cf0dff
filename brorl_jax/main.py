"""Entry point: python -m brorl_jax.main --config=configs/NAME.py[:preset] --workdir=DIR [--config.key=value ...]

With no --config the embedded demo config runs: a small model is built locally, warm-started by a
short supervised phase on a Reasoning Gym arithmetic task, then trained with BroRL on CPU, printing
held-out pass@1 before and after. Started again with the same --workdir, a run resumes from its
latest complete checkpoint.
"""
from __future__ import annotations

import os

from brorl_jax import cli

FLAGS = [cli.Flag("string", "workdir", None, "Where checkpoints, metrics.jsonl, TensorBoard "
                  "events and plots go. Default: runs/<config name>.")]


def main(values: dict) -> int:
    from brorl_jax.config import validate
    cfg = validate(values["config"])
    # Heavy imports after validation so a bad config fails in a second.
    from brorl_jax.parallel.distributed import maybe_initialize_distributed
    from brorl_jax.train.loop import train
    maybe_initialize_distributed()
    train(cfg, values["workdir"] or os.path.join("runs", cfg.name))
    return 0


def run() -> None:
    """Console-script entry (`brorl-jax`)."""
    cli.run(main, FLAGS)


if __name__ == "__main__":
    run()
