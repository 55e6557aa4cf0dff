"""The door: every check a run passes before its weights load, cheapest first, and the facts
those checks find, handed to the runtime as numbers (issue 26 item 3).

    facts = check_training(cfg)                 # python -m brorl_jax.main (the Trainer);
                                                # facts.cfg: the typed RunConfig from here on
    facts = check_evaluation(cfg, workdir)      # python -m brorl_jax.evaluate
    facts = check_loaded_model(cfg, model.config)   # a .gguf model: its config came with it
    build_context(..., paused_engine_bytes=facts.paused_engine_bytes)

The checks, in order: the config's keys, ranges and combinations (config.validate); for
training, settings under which no step can learn (check_learnable); the mesh
against the devices (config.check_mesh); the loggers' optional extras (workdir/logger.py
check_config); for an evaluation, the work directory and its checkpoints; the model path
(context.check_model_path); the model's config.json, read without its weights
(read_model_config); the memory plans (check_memory_plan, below). The work directory's own
checks (its lock, the resume policy: workdir/) follow in the Trainer, before the data loads.

The memory plans: settings the run's own plans cannot hold are refused before the weights load,
the warm start or the first evaluation.

    check_memory_plan(cfg, model_cfg, num_devices=..., num_processes=..., device_bytes=...)

Each fact comes from the plan that acts on it; nothing is restated here:
  * the rollout's decode slots and KV pages (rollout.plan: min_budget_bytes, plan_slots,
    rollout_params_bytes) for the largest call of a training round (ceil(overgenerate_factor x
    the largest N) samples of each prompt of a generation batch) and of an evaluation
    (eval.samples_per_prompt, eval.max_new_tokens, train.evaluation.prompts_per_call), prompts
    up to data.max_prompt_len (bucketed as the engine buckets them);
  * the update's rows per micro-batch (algo.update.micro_batch_rows over RunConfig.seq_len) and,
    on one device whose memory is known, the training state and the activations a micro-batch
    keeps under full rematerialisation (algo.update.train_state_bytes, remat_saved_bytes), plus
    the paused rollout engine when samples are carried across the update
    (RunConfig.carries_samples: train/rollout_calls.paused_engine_bytes, the stream's
    rollout.plan.stream_plan).
    The same reservation is taken off the device memory the update's remat policy plans with:
    the door hands it to the runtime (DoorFacts.paused_engine_bytes; train/runtime.py,
    algo.update.plan_remat_policy).
Device memory is known on GPU/TPU (algo.update.device_memory_bytes) and unknown on CPU, where
only the checks that need none run. Each refusal is a ConfigError naming the key, its value, the
limit the plan computed and the key to change.
"""
from __future__ import annotations

import dataclasses
import math

import jax

from brorl_jax import algo, models
from brorl_jax.config import INT32_MAX, RunConfig, as_run_config, check_mesh, validate
from brorl_jax.errors import CheckpointError, ConfigError
from brorl_jax.models.moe import routing_record_bytes
from brorl_jax.rollout import plan as rollout_plan
from brorl_jax.train.context import (
    base_model_dir,
    check_model_path,
    eval_sampling,
    stored_param_dtype,
    with_config_impls,
)
from brorl_jax.train.evaluation import prompts_per_call
from brorl_jax.train.rollout_calls import (
    RolloutCall,
    paused_engine_bytes,
    records_routing,
    rollout_device_count,
    training_call,
)
from brorl_jax.workdir import layout
from brorl_jax.workdir.logger import check_config as check_loggers

GB = 2**30


@dataclasses.dataclass(frozen=True)
class DoorFacts:
    """What the door found, for the run to use instead of finding it again."""
    cfg: RunConfig                          # the validated, typed config (config.validate)
    model_cfg: models.ModelConfig | None    # from config.json, no weights; None for a .gguf
    paused_engine_bytes: int                # per device, beside the update (0: none paused)


def check_training(cfg) -> DoorFacts:
    """The checks of a training run (module docstring), before its work directory is touched."""
    cfg = validate(cfg)
    check_learnable(cfg)
    check_mesh(cfg, jax.device_count(), jax.process_count())
    check_loggers(cfg)                  # train.loggers: a missing extra is named here
    check_model_path(cfg.model.path)
    return check_loaded_model(cfg, read_model_config(cfg))   # config.json only: no weights yet


def check_learnable(cfg: RunConfig) -> None:
    """Settings under which no step can learn, refused before anything loads: greedy rollouts
    (rollout.temperature 0, no schedule from step 0) give a prompt's N samples the same tokens,
    so no group has 0 < #correct < N (dynamic sampling keeps none; without it every advantage
    is 0)."""
    r = cfg.rollout
    scheduled = any(step == 0 for step, _ in algo.policies.parse_temperature_schedule(
        r.temperature_schedule))
    if r.temperature == 0 and not scheduled:
        raise ConfigError(
            f"config key 'rollout.temperature' = 0 (greedy) gives the N = "
            f"{algo.policies.nominal_n(r)} samples of a prompt the same tokens: no group has "
            "0 < #correct < N, so no step can learn. Set rollout.temperature > 0 (the paper "
            "samples at 1.0); greedy evaluation is eval.temperature=0.")


def check_evaluation(cfg, workdir: str | None) -> DoorFacts:
    """The checks of an evaluation (of checkpoints in `workdir`, or of the model alone): the
    rollouts' memory plans only (an evaluation trains nothing)."""
    cfg = validate(cfg)
    if workdir:                          # before anything expensive; never created
        layout.require_existing(workdir)
        if not layout.has_checkpoints(workdir):
            raise CheckpointError(f"no complete checkpoint in {workdir}/checkpoints; train "
                                  "first.")
    check_model_path(cfg.model.path)
    return check_loaded_model(cfg, read_model_config(cfg), update=False)


def check_loaded_model(cfg, model_cfg: models.ModelConfig | None, *, update: bool = True
                       ) -> DoorFacts:
    """The memory plans of `model_cfg` on this process's devices (check_at_door) and the facts
    the runtime takes from them; called again once a .gguf model has loaded (model_cfg None
    before: its config comes out of the conversion)."""
    cfg = as_run_config(cfg)
    check_lora_rank(cfg, model_cfg)
    check_routing_replay(cfg, model_cfg)
    check_moe_aux_loss(cfg, model_cfg)
    check_expert_mesh(cfg, model_cfg)
    check_at_door(cfg, model_cfg, update=update)
    return DoorFacts(cfg, model_cfg, paused_engine_bytes(
        cfg, model_cfg, num_devices=rollout_device_count(cfg), num_processes=jax.process_count()))


def check_routing_replay(cfg, model_cfg: models.ModelConfig | None) -> None:
    """algo.routing_replay="rollout" replays experts: a dense model has none (refused once its
    config is known)."""
    if model_cfg is not None and cfg.algo.routing_replay != "off" and not model_cfg.is_moe:
        raise ConfigError(
            f"config key 'algo.routing_replay' = {cfg.algo.routing_replay!r} replays a "
            f"mixture-of-experts model's expert choices, but model_type={model_cfg.model_type!r}"
            " has no experts. Set algo.routing_replay='off'.")


def check_moe_aux_loss(cfg, model_cfg: models.ModelConfig | None) -> None:
    """algo.moe_aux_loss_coef > 0 balances a router: a dense model has none."""
    if model_cfg is not None and cfg.algo.moe_aux_loss_coef > 0 and not model_cfg.is_moe:
        raise ConfigError(
            f"config key 'algo.moe_aux_loss_coef' = {cfg.algo.moe_aux_loss_coef} weights a "
            f"mixture-of-experts router's load-balancing loss, but model_type="
            f"{model_cfg.model_type!r} has no experts. Set algo.moe_aux_loss_coef=0.")


def check_expert_mesh(cfg, model_cfg: models.ModelConfig | None) -> None:
    """mesh.expert > 1 splits a mixture-of-experts model's experts (parallel/expert_parallel.py):
    the model must have experts, as many on every device."""
    p = cfg.mesh.expert
    if model_cfg is None or p == 1:
        return
    if not model_cfg.is_moe:
        raise ConfigError(
            f"config key 'mesh.expert'={p} splits a mixture-of-experts model's experts, but "
            f"model_type={model_cfg.model_type!r} has none. Set mesh.expert=1 (mesh.data splits "
            "the rows).")
    if model_cfg.num_experts % p:
        raise ConfigError(
            f"config key 'mesh.expert'={p} does not divide the model's {model_cfg.num_experts} "
            "experts: each device of the expert axis holds as many; pick a divisor of "
            f"{model_cfg.num_experts}.")


def check_lora_rank(cfg, model_cfg) -> None:
    """model.lora_rank at most the smallest dimension of the targeted projections' kernels."""
    rank = cfg.model.lora_rank
    if model_cfg is None or rank == 0:
        return
    targets = models.lora.parse_targets(cfg.model.lora_targets)
    most = models.lora.max_rank(model_cfg, targets)
    if rank > most:
        raise ConfigError(f"config key 'model.lora_rank' = {rank} exceeds {most}, the smallest "
                          f"dimension of the targeted projections ({cfg.model.lora_targets}) of "
                          "this model; set model.lora_rank <= " + str(most) + ".")


def read_model_config(cfg) -> models.ModelConfig | None:
    """The ModelConfig load_model(cfg) will have, read from the model's config.json without its
    weights; None for a .gguf file or a path load_model will refuse."""
    mcfg = models.read_config(base_model_dir(cfg),
                              dtype=cfg.model.dtype, param_dtype=stored_param_dtype(cfg))
    return None if mcfg is None else with_config_impls(mcfg, cfg)


def rollout_calls(cfg, num_processes: int = 1) -> tuple[RolloutCall, RolloutCall]:
    """The largest training-round call and the largest evaluation call of a run (per process)."""
    train = training_call(cfg, num_processes)
    k = cfg.eval.samples_per_prompt
    evaluation = RolloutCall(
        "evaluation", min(prompts_per_call(k), -(-cfg.eval.num_prompts // num_processes)), k,
        eval_sampling(cfg).max_new_tokens, "eval.samples_per_prompt",
        "eval.max_new_tokens" if cfg.eval.max_new_tokens > 0 else "rollout.max_new_tokens",
        eval_sampling(cfg).precision)
    return train, evaluation


def _gb(nbytes: float, up: bool) -> str:
    """nbytes in GB at 3 significant digits, rounded up (a minimum) or down (a maximum), so the
    value printed is one the plan accepts."""
    x = nbytes / GB
    if x <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{(math.ceil(x / step) if up else math.floor(x / step)) * step:.3g}"


def _n_params(model_cfg) -> int:
    from brorl_jax.models.hf import param_shapes
    return sum(int(x.size) for x in jax.tree.leaves(param_shapes(model_cfg)))


def check_at_door(cfg, model_cfg, *, update: bool = True) -> None:
    """check_memory_plan with this process's devices: the rollout runs on its local devices
    (train/runtime.py), the device memory is the first local device's (None on CPU); nothing
    to check before a .gguf model's config is known (model_cfg None) beyond the update's rows."""
    check_memory_plan(cfg, model_cfg, num_devices=rollout_device_count(cfg),
                      num_processes=jax.process_count(),
                      device_bytes=algo.update.device_memory_bytes(), update=update)


def check_memory_plan(cfg, model_cfg, *, num_devices: int, num_processes: int = 1,
                      device_bytes: int | None = None, n_params: int | None = None,
                      update: bool = True) -> None:
    """ConfigError when a plan of the run cannot hold its settings (module docstring).
    model_cfg: the model's ModelConfig (None: only the checks without the model run);
    num_devices: the rollout's devices (this process's); device_bytes: one device's memory
    (None = unknown: the checks that need it are skipped); n_params: the model's parameter
    count (default: counted from model_cfg's shapes, only when device_bytes is known);
    update=False: the rollouts only (an evaluation trains nothing)."""
    cfg = as_run_config(cfg)
    errors = _update_rows(cfg) if update else []
    if model_cfg is not None:
        if device_bytes is not None and n_params is None:
            n_params = _n_params(model_cfg)
        for call in rollout_calls(cfg, num_processes):
            errors += _rollout_call(cfg, model_cfg, call, num_devices, device_bytes, n_params)
        if (update and device_bytes is not None and num_devices == 1 and num_processes == 1
                and cfg.model.remat):       # one device: the update plan is not sharded
            errors += _update_micro_batch(cfg, model_cfg, device_bytes, n_params,
                                          paused_engine_bytes(cfg, model_cfg, num_devices=1))
    if errors:
        raise ConfigError("the memory plan cannot hold this config:\n  " + "\n  ".join(errors))


def _update_rows(cfg) -> list[str]:
    """algo.micro_batch_tokens holds at least one row (update.micro_batch_rows)."""
    try:
        algo.update.micro_batch_rows(cfg.update, cfg.seq_len)
    except ValueError as e:
        return [f"config key {e}, or lower data.max_prompt_len / rollout.max_new_tokens (a row "
                "holds both), or set it to 0 (algo.micro_batch_size rows per micro-batch)."]
    return []


def _rollout_call(cfg, model_cfg, call: RolloutCall, devices: int, device_bytes, n_params
                  ) -> list[str]:
    prompt_len = rollout_plan.bucket_prompt_length(cfg.data.max_prompt_len)
    budget = cfg.memory_budget_bytes
    model_cfg = call.model_config(model_cfg)
    shapes = (model_cfg, call.num_prompts, prompt_len, call.samples_per_prompt,
              call.max_new_tokens)
    sizes = (f"{call.samples_per_prompt} samples per prompt ({call.n_keys}), prompts up to "
             f"data.max_prompt_len={cfg.data.max_prompt_len} tokens, {call.max_new_tokens} new "
             f"tokens ({call.length_key})")
    lower = f"lower {call.length_key}, data.max_prompt_len or {call.n_keys.split(' x ')[0]}"
    key = f"config key 'rollout.memory_budget_gb' = {cfg.rollout.memory_budget_gb:g}"
    routing = records_routing(cfg, model_cfg)      # the pools hold the experts (replay)
    least = rollout_plan.min_budget_bytes(*shapes, num_devices=devices, record_routing=routing)
    if budget is not None and budget < least:
        return [f"{key} is too small for the {call.what} rollouts ({sizes}): one decode slot "
                f"with the KV pages of a whole sample and its prompt pool needs "
                f"{_gb(least, True)} GB over {devices} device(s) (rollout.plan.min_budget_bytes)."
                f" Raise rollout.memory_budget_gb to at least {_gb(least, True)}, set it to 0 "
                f"(a slot per sample), or {lower}."]
    plan = rollout_plan.plan_slots(*shapes, budget, num_devices=devices, record_routing=routing)
    if call.what == "training" and cfg.algo.stream_rounds:     # an open stream's larger pool
        plan = rollout_plan.stream_plan(model_cfg, plan, prompt_len, call.max_new_tokens,
                                        routing)
    if plan.num_pages + 1 > INT32_MAX:
        return [f"{key}: the {call.what} rollouts ({sizes}) would take {plan.num_pages + 1:,} "
                f"KV pages of {plan.page_size} positions per device ({plan.slots:,} decode "
                f"slots), more than int32 page ids hold ({INT32_MAX:,}). Set "
                "rollout.memory_budget_gb (fewer slots at once) or "
                f"{lower}."]
    if device_bytes is None:
        return []
    # one process on the training mesh: its expert axis splits the rollout's experts too
    # (rollout.Engine, parallel.expert_parallel.rollout_param_specs)
    split = (cfg.mesh.expert if not cfg.mesh.rollout_devices and jax.process_count() == 1
             else 1)
    params = rollout_plan.rollout_params_bytes(model_cfg, n_params, split)
    need = plan.bytes_per_device + params
    if need <= device_bytes:
        return []
    how = ("a slot and the KV pages of its whole length for every sample" if budget is None
           else "the budget's decode slots and KV pages")
    room = (device_bytes - params) * devices
    fix = (f"Set rollout.memory_budget_gb to at most {_gb(room, False)} (over {devices} "
           f"device(s)), or {lower}." if room >= least else
           f"No budget fits beside the parameters: {lower}, or use a 16-bit model.dtype.")
    return [f"{key}: the {call.what} rollouts ({sizes}) need {_gb(need, True)} GB per device "
            f"({how}: {plan.slots:,} slots, {plan.num_pages:,} pages, "
            f"{_gb(plan.bytes_per_device, True)} GB; the rollout's copy of the parameters: "
            f"{_gb(params, True)} GB), more than the {_gb(device_bytes, False)} GB of a device. "
            + fix]


def _update_micro_batch(cfg, model_cfg, device_bytes: int, n_params: int, paused: int = 0
                        ) -> list[str]:
    """One device: the training state, one micro-batch's activations under full remat (the
    least any remat policy keeps), the paused rollout engine (`paused` bytes) and, under
    routing replay, the update batch's routing record (UpdateBatch.routing) fit the device."""
    update = algo.update
    acfg, width = cfg.update, cfg.seq_len
    mini = max(1, cfg.update_rows // cfg.algo.ppo_mini_batches)
    rows = min(update.micro_batch_rows(acfg, width), mini)
    routing = (routing_record_bytes(model_cfg, cfg.update_rows * width)
               if records_routing(cfg, model_cfg) else 0)
    state = update.train_state_bytes(model_cfg, n_params) + paused + routing
    saved = update.remat_saved_bytes(model_cfg, rows * width, "full")
    if state + saved <= device_bytes:
        return []
    key = ("algo.micro_batch_tokens" if cfg.algo.micro_batch_tokens > 0
           else "algo.micro_batch_size")
    per_row = update.remat_saved_bytes(model_cfg, width, "full")
    fit = int((device_bytes - state) // per_row) if device_bytes > state else 0
    fix = (f"Lower {key} to at most {fit * width if key.endswith('tokens') else fit} "
           f"({fit} row(s) of {width} tokens), or lower data.max_prompt_len / "
           "rollout.max_new_tokens." if fit >= 1 else
           "Not even one row fits: lower data.max_prompt_len / rollout.max_new_tokens, or use a "
           "smaller model.")
    beside = (f"{_gb(state - paused - routing, True)} GB of training state "
              "(algo.update.train_state_bytes)"
              + (f", {_gb(routing, True)} GB of the batch's recorded routing "
                 "(algo.routing_replay='rollout')" if routing else "")
              + (f" and {_gb(paused, True)} GB of the rollout engine paused across the update "
                 f"with its samples in flight (algo.max_staleness={cfg.algo.max_staleness}; "
                 "set it to 0, or lower rollout.memory_budget_gb, to free it)" if paused else ""))
    return [f"config key '{key}' = {cfg.algo[key.split('.')[1]]}: a micro-batch of {rows} "
            f"row(s) x {width} tokens keeps {_gb(saved, True)} GB of activations for the "
            f"backward pass even with full rematerialisation, beside {beside}: more than the "
            f"{_gb(device_bytes, False)} GB of the device. " + fix]
