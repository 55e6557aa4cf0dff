"""The run config: the typed schema (schema.py: one frozen dataclass per section, key for key
with the file, each field's default, range and source; the derived numbers as RunConfig
properties), `validate` (checks.py: a config file's ConfigDict with --config.KEY=VALUE overrides
-> RunConfig, or a ConfigError naming the key and the fix) and what is built from a config
(derive.py: overrides by key name, the update's UpdateConfig, the learning rate).

Configs in `configs/` start from `default_config()` and override values."""
from brorl_jax.config.checks import (
    DATA_SPEC_SUFFIXES,
    INFINITE_OK,
    INT32_MAX,
    JSON_OBJECT_KEYS,
    _flatten,
    check_mesh,
    check_update_split,
    choices,
    default_config,
    describe,
    json_option,
    unknown_key_message,
    validate,
    verifier_names,
)
from brorl_jax.config.derive import (
    as_run_config,
    derived_learning_rate,
    make_config,
    optimizer_config,
    update_config,
)
from brorl_jax.config.schema import SECTIONS, RunConfig, UpdateConfig, setting
from brorl_jax.errors import ConfigError

__all__ = [
    "DATA_SPEC_SUFFIXES", "INFINITE_OK", "INT32_MAX", "JSON_OBJECT_KEYS", "SECTIONS", "ConfigError",
    "RunConfig", "UpdateConfig", "_flatten", "as_run_config", "check_mesh",
    "check_update_split", "choices",
    "default_config", "derived_learning_rate", "describe", "json_option", "make_config",
    "optimizer_config", "setting", "unknown_key_message", "update_config", "validate",
    "verifier_names",
]
