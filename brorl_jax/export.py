"""Export a training checkpoint to a Hugging Face directory (config, safetensors, tokenizer).

  python -m brorl_jax.export --config=configs/NAME.py --workdir=DIR [--step=S] --out=HF_DIR

The result loads with transformers' AutoModelForCausalLM and with brorl_jax.models.from_pretrained.
"""
from __future__ import annotations

from brorl_jax import cli

FLAGS = [cli.Flag("string", "workdir", None, "The run's work directory.", required=True),
         cli.Flag("integer", "step", None, "Checkpoint step (default: the latest)."),
         cli.Flag("string", "out", None, "Output Hugging Face directory.", required=True)]


def export(cfg, workdir: str, out: str, step: int | None = None) -> int:
    from brorl_jax import models
    from brorl_jax.train.loop import restore_params
    model, params, step = restore_params(cfg, workdir, step)
    models.save_pretrained(model.with_params(params), out)
    return step


def main(values: dict) -> int:
    step = export(values["config"], values["workdir"], values["out"], values["step"])
    print(f"exported step {step} of {values['workdir']} to {values['out']}")
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS)
