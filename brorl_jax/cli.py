"""What every command (main, evaluate, export, experiments.compare_n) shares: the `--config`
flag, flags defined when the command runs (not at import: several command modules in one process
must not collide in absl's global flag registry), and errors turned into a short message.

    def main(values: dict) -> int | None: ...
    if __name__ == "__main__":
        cli.run(main, [cli.Flag("string", "workdir", None, "Where the run writes.")])
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

import configs

DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), "demo.py")
# Flags defined here belong to the command that calls run(), so its --help lists them.
flags.disclaim_key_flags()


@dataclasses.dataclass(frozen=True)
class Flag:
    """One absl flag: kind ("string", "integer", "list", "bool", ...), name, default, help."""
    kind: str
    name: str
    default: Any
    help: str
    required: bool = False


def _config_help() -> str:
    from brorl_jax.config import choices
    lines = ["Config file (configs/NAME.py), optionally with ':preset'; override any key with "
             "--config.KEY=VALUE. Keys that pick a named implementation:"]
    lines += [f"  {key}: {' | '.join(names)}" for key, names in choices().items()]
    return "\n".join(lines)


def define(extra: Sequence[Flag], config_default: str = DEFAULT_CONFIG) -> dict:
    """Defines --config and `extra` in absl's registry; returns {name: FlagHolder}."""
    holders = {"config": config_flags.DEFINE_config_file("config", config_default, _config_help())}
    for f in extra:
        definer = getattr(flags, f"DEFINE_{f.kind}")
        holders[f.name] = definer(f.name, f.default, f.help, required=f.required)
    return holders


def run(main: Callable[[dict], int | None], extra: Sequence[Flag] = (), *,
        config_default: str = DEFAULT_CONFIG) -> None:
    """Defines the flags, parses the command line and calls main({name: value}); a config error
    ends the command with its message and exit code 2, not a traceback."""
    holders = define(extra, config_default)

    def entry(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        logging.set_verbosity(logging.WARNING)
        from brorl_jax.config import ConfigError
        try:
            values = {name: h.value for name, h in holders.items()}
            code = main(values)
        except ConfigError as e:
            print(str(e), file=sys.stderr)
            code = 2
        sys.exit(code or 0)

    app.run(entry)
