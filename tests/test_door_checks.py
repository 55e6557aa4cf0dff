"""Every value checked at the door (issue 26 item 3), as a table over the schema: every float key
gets nan and inf, every int key a value no int32 holds; each must be refused by validate() with
a message naming the key. Validation only: no model, no JAX device. Keys added to the schema
later are covered without editing this file.
"""
import math

import pytest

from brorl_jax.config import (
    INFINITE_OK,
    ConfigError,
    _flatten,
    check_mesh,
    default_config,
    validate,
)
from configs import demo

SCHEMA = _flatten(default_config())
FLOAT_KEYS = sorted(k for k, v in SCHEMA.items() if isinstance(v, float))
INT_KEYS = sorted(k for k, v in SCHEMA.items() if isinstance(v, int) and not isinstance(v, bool))
CASES = ([(k, math.nan) for k in FLOAT_KEYS]
         + [(k, math.inf) for k in FLOAT_KEYS if k not in INFINITE_OK]
         + [(k, -math.inf) for k in FLOAT_KEYS if k not in INFINITE_OK]
         + [(k, 10**11) for k in INT_KEYS] + [(k, -(10**11)) for k in INT_KEYS])


def _set(cfg, key, value):
    *sections, name = key.split(".")
    node = cfg
    for s in sections:
        node = node[s]
    node[name] = value


def test_the_table_covers_the_schema():
    assert len(FLOAT_KEYS) > 30 and len(INT_KEYS) > 30
    assert set(INFINITE_OK) <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_non_finite_and_huge_values_are_refused_naming_the_key(key, value):
    cfg = demo.get_config()
    _set(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert f"'{key}'" in str(e.value)


def test_token_counts_beyond_int32_are_refused():
    cfg = demo.get_config()
    cfg.rollout.rollouts_per_prompt = 1 << 26           # fits int32, its token count does not
    with pytest.raises(ConfigError, match=r"one generation round holds .* more than int32"):
        validate(cfg)


def test_infinite_clipping_bounds_stay_allowed():
    validate(demo.get_config())            # reward_clip_low/high = -inf/inf: no clipping


@pytest.mark.parametrize("sizes,devices,ok", [
    ({"data": -1}, 1, True), ({"data": 4, "fsdp": 2}, 1, False), ({"data": 4, "fsdp": 2}, 8, True),
    ({"data": 2}, 1, False), ({"data": -1, "tensor": 2}, 8, True), ({"data": 3}, 8, False)])
def test_mesh_sizes_must_match_the_devices_on_one_device_too(sizes, devices, ok):
    cfg = demo.get_config()
    for axis, size in sizes.items():
        cfg.mesh[axis] = size
    if ok:
        check_mesh(cfg, devices)
    else:
        with pytest.raises(ConfigError, match=rf"mesh.data={sizes['data']}.* do not match the "
                                              rf"{devices} device"):
            check_mesh(cfg, devices)
