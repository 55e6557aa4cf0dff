"""Every value checked at the door (issue 26 item 3), as a table over the schema: every float key
gets nan and inf, every int key a value no int32 holds; each must be refused by validate() with
a message naming the key. Validation only: no model, no JAX device. Keys added to the schema
later are covered without editing this file.
"""
import math
import os

import pytest

from brorl_jax.config import (
    INFINITE_OK,
    INT32_MAX,
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


@pytest.mark.parametrize("rollout,data,devices,processes,says", [
    (4, 4, 8, 1, None), (4, -1, 8, 1, None),
    (4, 8, 8, 1, r"do not match the 4 training devices \(8 JAX sees less mesh.rollout_devices=4"),
    (8, -1, 8, 1, r"'mesh.rollout_devices'=8 leaves none of the 8 devices .* below 8"),
    (2, -1, 4, 2, None), (4, 4, 8, 2, None),
    (3, -1, 8, 2, r"'mesh.rollout_devices'=3 does not split over the 2 processes: .* multiple "
                  r"of 2")])
def test_a_disaggregated_rollout_takes_its_devices_from_the_mesh(rollout, data, devices,
                                                                  processes, says):
    cfg = demo.get_config()
    cfg.mesh.rollout_devices, cfg.mesh.data = rollout, data
    if says is None:
        check_mesh(cfg, devices, processes)
    else:
        with pytest.raises(ConfigError, match=says):
            check_mesh(cfg, devices, processes)


def test_decoding_during_the_update_needs_carried_samples():
    cfg = demo.get_config()
    cfg.algo.decode_during_update = 2
    with pytest.raises(ConfigError, match=r"'algo.decode_during_update'=2 .* nothing is carried "
                                          r"at algo.max_staleness=0"):
        validate(cfg)
    cfg.algo.stream_rounds, cfg.algo.max_staleness = True, 1
    validate(cfg)
    cfg.algo.decode_during_update = -2
    with pytest.raises(ConfigError, match=r"'algo.decode_during_update' must be -1"):
        validate(cfg)


# -- the memory plans (train/door.py): what the plans cannot hold, refused before the
# weights load, each fix the message names accepted by the same plan ---------------------------
from brorl_jax.models.demo_model import demo_model_config  # noqa: E402
from brorl_jax.rollout import plan as rollout_plan  # noqa: E402
from brorl_jax.train import door, rollout_calls  # noqa: E402

MODEL = demo_model_config(vocab_size=128, bos_token_id=1, eos_token_id=2)
MB = 2**20


def _plan_config(overrides):
    cfg = demo.get_config()
    for key, value in overrides.items():
        _set(cfg, key, value)
    return validate(cfg)            # every case passes the value checks: only the plan refuses


def _check(cfg, device_bytes=None, **kw):
    door.check_memory_plan(cfg, MODEL, num_devices=1, device_bytes=device_bytes, **kw)


def _number_after(text, words):
    import re
    return float(re.search(re.escape(words) + r" ([0-9][0-9.e+-]*[0-9])", text).group(1))


PLAN_CASES = [   # (id, overrides, device bytes, key named, what the message says, fix: the key
    #              to change and the words before the value the message gives, or a value)
    ("budget_below_one_slot", {"rollout.memory_budget_gb": 1e-6}, None,
     "rollout.memory_budget_gb", r"= 1e-06 is too small for the training rollouts .* at least ",
     ("rollout.memory_budget_gb", "to at least")),
    ("eval_samples_beyond_the_budget", {"eval.samples_per_prompt": 16384,
                                        "rollout.memory_budget_gb": 0.002}, None,
     "rollout.memory_budget_gb", r"too small for the evaluation rollouts \(16384 samples per "
                                 r"prompt \(eval.samples_per_prompt\)",
     ("rollout.memory_budget_gb", "to at least")),
    ("micro_batch_tokens_below_a_row", {"algo.micro_batch_tokens": 31}, None,
     "algo.micro_batch_tokens", r"= 31 is less than one row of 32 tokens; set it to at least 32",
     ("algo.micro_batch_tokens", "set it to at least")),
    ("no_budget_beyond_the_device", {"rollout.rollouts_per_prompt": 256}, 40 * MB,
     "rollout.memory_budget_gb", r"= 0: the training rollouts .* more than the 0.039 GB of a "
                                 r"device\. Set rollout.memory_budget_gb to at most ",
     ("rollout.memory_budget_gb", "to at most")),
    ("budget_beyond_the_device", {"rollout.memory_budget_gb": 1.0}, 40 * MB,
     "rollout.memory_budget_gb", r"= 1: the training rollouts .* at most ",
     ("rollout.memory_budget_gb", "to at most")),
    ("page_ids_beyond_int32", {"eval.samples_per_prompt": INT32_MAX}, None,
     "rollout.memory_budget_gb", r"2,147,483,648 KV pages .* more than int32 page ids",
     ("eval.samples_per_prompt", 4096)),
    ("micro_batch_beyond_the_device", {"model.remat": True, "algo.micro_batch_size": 1024,
                                       "rollout.memory_budget_gb": 0.002}, 40 * MB,
     "algo.micro_batch_size", r"= 1024: a micro-batch of 1024 row\(s\) x 32 tokens .* Lower "
                              r"algo.micro_batch_size to at most ",
     ("algo.micro_batch_size", "to at most")),
]


@pytest.mark.parametrize("overrides,device_bytes,key,says,fix", [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])
def test_settings_the_memory_plan_cannot_hold_are_refused_naming_key_limit_and_fix(
        overrides, device_bytes, key, says, fix):
    cfg = _plan_config(overrides)
    with pytest.raises(ConfigError, match=says) as e:
        _check(cfg, device_bytes)
    assert f"config key '{key}' = " in str(e.value)
    # the value the message gives is one the plan accepts
    fix_key, words = fix
    value = words if not isinstance(words, str) else _number_after(str(e.value), words)
    if fix_key == "algo.micro_batch_size":     # at most that many rows: a divisor of the batch
        value = 1 << (int(value).bit_length() - 1)
    elif fix_key.startswith("algo."):
        value = int(value)
    _check(_plan_config({**overrides, fix_key: value}), device_bytes)


def test_the_door_minimum_is_the_plan_s_own():
    """min_budget_bytes is the budget plan_slots refuses below: the door and the rollout agree."""
    cfg = _plan_config({})
    for call in door.rollout_calls(cfg):
        shapes = (MODEL, call.num_prompts, 32, call.samples_per_prompt, call.max_new_tokens)
        least = rollout_plan.min_budget_bytes(*shapes, num_devices=2)
        assert rollout_plan.plan_slots(*shapes, least, num_devices=2).slots >= 1
        with pytest.raises(ValueError, match=f"pass at least {least} "):
            rollout_plan.plan_slots(*shapes, least - 1, num_devices=2)


def test_the_plan_passes_the_shipped_configs_and_skips_what_needs_device_memory():
    _check(_plan_config({}))                          # demo: no budget, CPU (memory unknown)
    _check(_plan_config({}), device_bytes=2**30)
    cfg = _plan_config({"rollout.rollouts_per_prompt": 256})
    _check(cfg)                                       # beyond 40 MB, but the memory is unknown
    _check(_plan_config({"algo.micro_batch_tokens": 31}), update=False)   # evaluate: no update


def test_main_refuses_at_the_door_before_data_or_weights_load(tmp_path, monkeypatch):
    from brorl_jax.train import loop

    def never(*_):
        raise AssertionError("loaded before the memory plan was checked")
    monkeypatch.setattr(loop, "load_records", never)
    monkeypatch.setattr(loop, "load_model", never)
    cfg = _plan_config({"rollout.memory_budget_gb": 1e-6})
    with pytest.raises(ConfigError, match="'rollout.memory_budget_gb' = 1e-06 is too small"):
        loop.Trainer(cfg, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")        # refused before the work directory


def test_the_engine_paused_across_the_update_is_counted_beside_it(monkeypatch):
    """With samples carried across the update (algo.stream_rounds, algo.max_staleness >= 1)
    the paused stream's slots, pages and pool (rollout.plan.stream_plan) sit beside the
    training state: a device the update alone fits is refused at k = 1, naming the key, and the
    remat policy plans with the memory left (Runtime.update_device_bytes)."""
    import jax

    from brorl_jax.algo import update
    from brorl_jax.models.hf import param_shapes
    over = {"model.remat": True, "algo.micro_batch_size": 64, "rollout.memory_budget_gb": 0.004,
            "algo.stream_rounds": True}
    k0 = _plan_config(over)
    k1 = _plan_config({**over, "algo.max_staleness": 1})
    assert rollout_calls.paused_engine_bytes(k0, MODEL, num_devices=1) == 0
    apart = _plan_config({**over, "algo.max_staleness": 1, "mesh.rollout_devices": 4})
    assert rollout_calls.paused_engine_bytes(apart, MODEL, num_devices=4) == 0   # not beside it
    paused = rollout_calls.paused_engine_bytes(k1, MODEL, num_devices=1)
    call, _ = door.rollout_calls(k1)
    plan = rollout_plan.plan_slots(MODEL, call.num_prompts, 32, call.samples_per_prompt,
                                   call.max_new_tokens, int(0.004 * 2**30))
    assert paused == rollout_plan.stream_plan(MODEL, plan, 32, call.max_new_tokens).bytes_per_device
    n_params = sum(int(x.size) for x in jax.tree.leaves(param_shapes(MODEL)))
    alone = (update.train_state_bytes(MODEL, n_params)
             + update.remat_saved_bytes(MODEL, 64 * 32, "full"))
    device = alone + paused // 2
    _check(k0, device)
    with pytest.raises(ConfigError, match=r"algo.micro_batch_size' = 64: .* GB of the rollout "
                                          r"engine paused across the update .*max_staleness=1"):
        _check(k1, device)
    _check(k1, alone + paused)
    found = [door.check_loaded_model(cfg, MODEL) for cfg in (k0, k1)]   # what the door finds
    from brorl_jax.train.runtime import LocalRuntime
    monkeypatch.setattr(update, "device_memory_bytes", lambda: device)
    for (cfg, less), facts in zip(((k0, 0), (k1, rollout_calls.paused_engine_bytes(
            k1, MODEL, num_devices=jax.local_device_count()))), found):
        assert LocalRuntime(cfg, MODEL, None, diagnostics_n=None).update_device_bytes() \
            == device - less
        # the door hands its count to the runtime as a number (Trainer -> build_context)
        assert facts.paused_engine_bytes == less
        assert LocalRuntime(cfg, MODEL, None, diagnostics_n=None,
                            paused_engine_bytes=facts.paused_engine_bytes
                            ).update_device_bytes() == device - less


def test_a_lora_rank_above_the_smallest_targeted_dimension_is_refused():
    from testutil import tiny_model_config

    from brorl_jax.train.door import check_lora_rank
    cfg = default_config()
    cfg.model.lora_rank, cfg.model.lora_targets = 17, "q,k"     # k's kernel is [32, 16]
    with pytest.raises(ConfigError, match=r"'model.lora_rank' = 17 exceeds 16, .*; set "
                                          r"model.lora_rank <= 16"):
        check_lora_rank(validate(cfg), tiny_model_config())
    cfg.model.lora_targets = "q,up"
    check_lora_rank(validate(cfg), tiny_model_config())
