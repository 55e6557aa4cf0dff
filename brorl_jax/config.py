"""The configuration schema: every key a run understands, its type, its paper default, and checks.

Configs in `configs/` start from `default_config()` and override values; `validate()` runs at
start-up and stops the run with a message that names the key and what is allowed when a key is
unknown (usually a typo), has the wrong type, or is inconsistent with another key.

Defaults follow the BroRL paper and its ProRLv2 recipe (see the README's configuration table);
values the paper does not state are marked "not stated" with the choice made.
"""
from __future__ import annotations

import difflib
import json
import math
from typing import Any

import ml_collections

from brorl_jax.errors import ConfigError


def default_config() -> ml_collections.ConfigDict:
    """The full schema with the paper's defaults (BroRL: N=512, 128 prompts per step)."""
    c = ml_collections.ConfigDict()
    c.name = "brorl"

    # --- model -----------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.path = ""                 # local Hugging Face directory; "" = the embedded demo model
    c.model.dtype = "float32"         # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"   # parameter dtype: float32 | bfloat16
    c.model.remat = True              # rematerialise each layer in the update's backward pass
    c.model.attention_impl = "flash"  # flash (Pallas kernel on GPU/TPU, jnp reference on CPU) | reference | xla | cudnn
    c.model.mlp_impl = "auto"         # auto (fused SwiGLU Triton kernels on GPU, XLA on CPU/TPU) | reference | pallas

    # --- data ------------------------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    # A JSONL/Parquet path (veRL layout accepted) or "reasoning_gym:task[,task...]".
    c.data.train = ""
    c.data.eval = ""                  # held-out prompts; "" = a disjoint slice of data.train
    c.data.train_size = 10_000        # prompts generated for reasoning_gym sources
    c.data.eval_size = 256
    c.data.max_prompt_len = 1024      # longer prompts are skipped and counted, never truncated
    c.data.system_prompt = ""
    c.data.use_chat_template = True
    c.data.seed = 0
    # reasoning_gym generator options (JSON object as a string so it stays one typed field)
    c.data.reasoning_gym_kwargs = "{}"
    # Column names of JSONL/Parquet files when they differ from the defaults (JSON object):
    # '{"prompt": "question_text", "ground_truth": "meta.label", "data_source": "src"}'.
    c.data.fields = "{}"

    # --- rollout ---------------------------------------------------------------------------
    c.rollout = ml_collections.ConfigDict()
    c.rollout.rollouts_per_prompt = 512   # N [BroRL Table 1]
    c.rollout.max_new_tokens = 16384 - 1024  # 16k context [BroRL 4.2.1] minus the prompt limit
    c.rollout.temperature = 1.0           # not stated in BroRL (ProRL v1: 1.2; NeMo-RL: 1.0)
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.memory_budget_gb = 0.0      # rollout working memory (decode slots, KV pages); 0 = a slot per sample
    c.rollout.impl = "auto"               # auto | pallas | reference (auto: Pallas on GPU/TPU)
    # Options NOT in the paper (docs/options.md), all off by default:
    c.rollout.temperature_schedule = ""   # "step:T,step:T", e.g. "0:1.3,100:0.9,200:0.7"; "" = off
    c.rollout.adaptive_n = False          # N per prompt from its EMA pass rate, bucketed
    c.rollout.adaptive_n_buckets = "256,512,768"   # N for easy ... hard prompts (ascending)
    c.rollout.adaptive_n_thresholds = "0.7,0.3"    # pass-rate boundaries (descending)
    c.rollout.adaptive_n_ema_decay = 0.5  # weight of the old pass-rate estimate per visit
    c.rollout.overgenerate_factor = 1.0   # > 1: generate ceil(factor * N), keep N by select_rule
    c.rollout.select_rule = "dedup_then_balanced"  # | dedup | balanced

    # --- the update (algorithm) ------------------------------------------------------------
    # Every key here is a field of brorl_jax.algo.AlgoConfig (the update's) or of
    # brorl_jax.algo.CollectConfig (the host-side collect's) under the same name.
    c.algo = ml_collections.ConfigDict()
    c.algo.prompts_per_step = 128         # B after dynamic-sampling filtering [BroRL Table 1]
    c.algo.advantage = "reinforce_pp_baseline"  # algo.ADVANTAGES [BroRL 3.1]
    c.algo.advantage_eps = 1e-6                # GRPO: (R - mean) / (std + eps) [veRL core_algos]
    c.algo.whiten_eps = 1e-8                   # batch whitening: / sqrt(var + eps) [veRL masked_whiten]
    c.algo.dynamic_sampling = True        # keep only groups with a learning signal [BroRL 3.1]
    c.algo.dynamic_sampling_rule = "correct_count"  # algo.GROUP_FILTERS: 0 < #correct < N [BroRL 3.1]
    c.algo.correct_threshold = 1.0        # a sample counts as correct when reward >= this
    c.algo.generation_batch_multiplier = 1.5   # NeMo-RL ProRLv2 value (over-generate per round)
    c.algo.max_generation_rounds = 10          # NeMo-RL dynamic_sampling_max_gen_batches
    c.algo.dynamic_sampling_cap_policy = "error"         # error | pad (train on what was kept, rest masked)
    # One stream per step (docs/rollout.md): prompts enter the running engine as slots free up,
    # no round drains it; False = today's rounds. Not in the paper.
    c.algo.stream_rounds = False
    c.algo.max_staleness = 0                   # k: train on samples up to k updates old (TIS); needs the stream
    # With samples carried (k >= 1): decode calls the engine runs, under the weights it has,
    # while the update runs (docs/rollout.md "Decoding during the update"). -1 = with
    # mesh.rollout_devices, until the update is done (timing-dependent, so not reproducible run
    # to run), else none; D >= 0 = exactly D (a reproducible schedule). Not in the paper.
    c.algo.decode_during_update = -1
    c.algo.clip_eps_low = 0.2                  # [ProRLv2]
    c.algo.clip_eps_high = 0.28                # [ProRLv2]
    c.algo.dual_clip_c = 3.0                   # A < 0: loss <= -c A; 0 = off [veRL default clip_ratio_c]
    c.algo.loss_agg = "token_mean"             # algo.LOSS_AGG (NeMo-RL token_level_loss)
    c.algo.ppo_mini_batches = 1                # optimizer steps per RL step (not stated)
    c.algo.ppo_epochs = 1                      # passes over the batch per RL step (not stated)
    c.algo.micro_batch_size = 64               # sequences per gradient-accumulation micro-batch
    c.algo.micro_batch_tokens = 0              # tokens per micro-batch (whole rows); 0 = micro_batch_size rows
    c.algo.pack_sequences = True               # several sequences per update row (docs/algo.md); False = one per row
    c.algo.tis_mode = "truncate"               # algo.TIS_MODES: min(w, tis_high) [BroRL 3.1 cites Yao et al.]
    c.algo.tis_low = 0.5                       # ICE-POP's lower bound (tis_mode="ice_pop")
    c.algo.tis_high = 2.0                      # truncation C [veRL rollout_is_threshold, Yao et al.]
    c.algo.recompute_old_logprobs = True       # trainer-side pi_old at step start (veRL old_log_prob)
    c.algo.kl_coef = 1e-4                      # NeMo-RL / OpenRLHF ProRLv2 configs
    c.algo.kl_estimator = "k2"                 # algo.KL_ESTIMATORS [ProRLv2]
    c.algo.kl_clamp = 10.0                     # k2's log-ratio clamp [ProRLv2]; k1/k3 as veRL
    c.algo.ref_reset_every = 200               # steps between reference resets [ProRLv2: 200-500]; 0 = never
    c.algo.reset_optimizer_on_ref_reset = False  # ProRL v1: True, ProRLv2: False
    c.algo.entropy_coef = 0.0                  # entropy bonus, off (not in the paper)
    c.algo.length_penalty = False              # scheduled cosine length penalty [ProRLv2], off
    c.algo.length_penalty_coef = 0.1           # lambda_len (not stated)
    c.algo.length_penalty_eta_min = -1.0       # eta at the length limit (not stated)
    c.algo.length_penalty_eta_max = 0.0        # eta at length 0 (not stated)
    c.algo.length_penalty_on_steps = 100       # ProRLv2 example: 100 steps on, 500 off
    c.algo.length_penalty_off_steps = 500
    c.algo.logprob_impl = "auto"               # auto | pallas | chunked | naive
    # Options NOT in the paper (docs/options.md), all off by default:
    c.algo.reward_clip_low = -math.inf         # clip the shaped reward
    c.algo.reward_clip_high = math.inf
    c.algo.advantage_normalizer = "batch"      # algo.ADVANTAGE_NORMALIZERS; ema: EMA of the batch std
    c.algo.advantage_ema_decay = 0.99

    # --- optimiser -------------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"                # adamw | lion (lion: not in the paper)
    c.optim.base_lr = 1e-6                # eta_0 at the base batch (OpenRLHF ProRLv2 example)
    c.optim.base_batch = 8192             # samples/step of the base recipe (512 x 16)
    c.optim.scale_lr_with_batch = True    # lr = base_lr * sqrt(batch / base_batch) [BroRL 4.2.1]
    c.optim.lr = -1.0                     # explicit lr; -1 = derived by the sqrt rule
    c.optim.schedule = "constant"         # constant | warmup_cosine (not in the paper)
    c.optim.warmup_steps = 0
    c.optim.final_lr_ratio = 0.1
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip = 1.0

    # --- rewards ---------------------------------------------------------------------------
    c.rewards = ml_collections.ConfigDict()
    c.rewards.num_workers = 2
    c.rewards.timeout_s = 5.0             # per item (ProRL code tests: 5 s)
    c.rewards.batch_deadline_s = 600.0
    c.rewards.recycle_after = 2000        # items per worker before it is replaced
    # data_source -> verifier (JSON object), on top of veRL's common names that are understood
    # by default (rewards/registry.py DEFAULT_REWARD_MAP). Keys: a data_source, its family
    # (the part before "/") or a shell pattern ("numina_*"). '{"my_set": "math"}'.
    c.rewards.map = "{}"
    # A reward function from a file, veRL's compute_score convention (rewards/custom.py,
    # docs/rewards.md): "path/to/file.py:fn" ("" = none); the data sources it scores (comma-
    # separated shell patterns; rewards.map entries win); keyword arguments for it (JSON object,
    # veRL's custom_reward_function.reward_kwargs); the batched form (lists in, list out) sent
    # in chunks of custom_batch_size, at most custom_concurrency chunks at once, each under
    # custom_batch_timeout_s.
    c.rewards.custom = ""
    c.rewards.custom_sources = "*"
    c.rewards.custom_kwargs = "{}"
    c.rewards.custom_batched = False
    c.rewards.custom_batch_size = 64
    c.rewards.custom_concurrency = 1
    c.rewards.custom_batch_timeout_s = 60.0
    # Groups scored at once while decoding goes on (rounds and stream): 1 = one at a time, in
    # order. More helps a scorer that waits (a remote sandbox, a model judge: its calls run in
    # that many threads); the stream's filter then sees each group that many groups late (a
    # fixed lag: runs stay reproducible). The built-in scoring service takes one call at a time
    # (it already spreads a group's samples over its workers), so it gains nothing from more.
    c.rewards.groups_in_flight = 1

    # --- supervised warm start (used by the demo; 0 steps = none) --------------------------
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0
    c.sft.batch_size = 64
    c.sft.lr = 1e-3
    c.sft.label_noise = 0.0           # fraction of warm-start answers made off by one (demo)
    c.sft.untagged_frac = 0.0         # fraction of warm-start answers without <answer> tags (demo)

    # --- evaluation ------------------------------------------------------------------------
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 0                      # steps; 0 = only before and after training
    c.eval.num_prompts = 256
    c.eval.samples_per_prompt = 16        # k for pass@k and mean@k [BroRL App. D]
    c.eval.temperature = 0.6              # [BroRL App. D]
    c.eval.top_p = 0.95
    c.eval.max_new_tokens = -1            # -1 = rollout.max_new_tokens

    # --- loop ------------------------------------------------------------------------------
    c.train = ml_collections.ConfigDict()
    c.train.steps = 200
    c.train.seed = 0
    c.train.checkpoint_every = 10
    c.train.keep_checkpoints = 3
    c.train.log_every = 1                 # metrics written every k steps (+ evaluations, the end)
    c.train.plots = True
    c.train.tensorboard = True
    # Where metrics go, comma-separated: jsonl (always, the public record) | tensorboard | wandb
    # | mlflow (the last two: pip install 'brorl_jax[wandb]' / '[mlflow]'; train/logger.py).
    c.train.loggers = "jsonl,tensorboard"
    c.train.mass_balance_diagnostics = False

    # --- parallelism -----------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1                      # -1 = the rest of the devices
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.rules = "default"              # a rule set of brorl_jax.parallel.rules.PARAM_RULES
    # Disaggregated rollout: R devices decode (their own mesh; with P processes the first R / P
    # of each process's, a multiple of P), the mesh above is laid over the others and trains;
    # weights move after each update by a reshard. 0 = colocated (every device does both).
    c.mesh.rollout_devices = 0
    return c


def choices() -> dict[str, tuple[str, ...]]:
    """Every key whose value is a name, and the names allowed: read from the registries that
    implement them (adding an estimator, filter or verifier there adds it here)."""
    from brorl_jax import algo
    from brorl_jax.algo import policies
    from brorl_jax.models.config import ATTENTION_IMPLS, MLP_IMPLS
    from brorl_jax.parallel.rules import PARAM_RULES
    from pallas_kernels.fused_logprob import IMPLS as LOGPROB_IMPLS
    from pallas_kernels.sampling import IMPLS as ROLLOUT_IMPLS
    return {
        "model.dtype": ("float32", "bfloat16"),
        "model.param_dtype": ("float32", "bfloat16"),
        "model.attention_impl": ATTENTION_IMPLS,
        "model.mlp_impl": MLP_IMPLS,
        "rollout.impl": ROLLOUT_IMPLS,
        "rollout.select_rule": policies.SELECT_RULES,
        "algo.advantage": tuple(algo.ADVANTAGES),
        "algo.dynamic_sampling_rule": tuple(algo.GROUP_FILTERS),
        "algo.dynamic_sampling_cap_policy": algo.CAP_POLICIES,
        "algo.loss_agg": tuple(algo.LOSS_AGG),
        "algo.kl_estimator": tuple(algo.KL_ESTIMATORS),
        "algo.tis_mode": tuple(algo.TIS_MODES),
        "algo.logprob_impl": LOGPROB_IMPLS,
        "algo.advantage_normalizer": tuple(policies.ADVANTAGE_NORMALIZERS),
        "optim.name": algo.OPTIMIZERS,
        "optim.schedule": algo.SCHEDULES,
        "mesh.rules": tuple(PARAM_RULES),
    }


POSITIVE = (
    "rollout.rollouts_per_prompt", "rollout.max_new_tokens", "algo.prompts_per_step",
    "algo.ppo_mini_batches", "algo.ppo_epochs", "algo.micro_batch_size",
    "algo.max_generation_rounds", "algo.kl_clamp", "data.max_prompt_len", "optim.base_lr",
    "optim.base_batch", "rewards.num_workers", "rewards.timeout_s", "eval.samples_per_prompt",
    "eval.num_prompts", "train.keep_checkpoints", "train.checkpoint_every", "train.log_every",
    "rewards.batch_deadline_s", "rewards.recycle_after", "sft.batch_size", "sft.lr",
    "rewards.custom_batch_size", "rewards.custom_concurrency", "rewards.custom_batch_timeout_s",
    "rewards.groups_in_flight",
)
NON_NEGATIVE = (
    "algo.kl_coef", "algo.clip_eps_high", "algo.ref_reset_every", "algo.micro_batch_tokens",
    "algo.max_staleness", "mesh.rollout_devices",
    "algo.advantage_eps", "algo.whiten_eps", "algo.entropy_coef", "algo.length_penalty_on_steps",
    "algo.length_penalty_off_steps", "train.steps", "eval.every", "sft.steps",
    "optim.warmup_steps", "rollout.memory_budget_gb", "train.seed", "data.seed",
    "data.train_size", "data.eval_size", "eval.temperature", "optim.weight_decay",
    "optim.grad_clip",
)
# Float keys where an infinite value means something (no clipping); every other float key must
# be finite, and no float key may be NaN (validate).
INFINITE_OK = ("algo.reward_clip_low", "algo.reward_clip_high")
# Integer keys are counts, sizes, steps and seeds that end up in int32 arrays and loop bounds:
# each must fit in int32, and so must the token counts they multiply into (validate).
INT32_MAX = 2**31 - 1
# JSON-object keys and what their values must be (checked by validate, read by json_option).
JSON_OBJECT_KEYS = ("data.reasoning_gym_kwargs", "data.fields", "rewards.map",
                    "rewards.custom_kwargs")
DATA_SPEC_SUFFIXES = (".jsonl", ".parquet", ".pq")


def verifier_names() -> tuple[str, ...]:
    """The verifiers a data source can be mapped to (rewards.map): the rewards registry."""
    from brorl_jax.rewards.registry import REWARDS
    return tuple(sorted(REWARDS))


def unknown_key_message(key: str) -> str:
    """'unknown config key ...' with the closest schema key: validate() and the command line."""
    near = difflib.get_close_matches(key, list(_flatten(default_config())), n=1)
    hint = f" Did you mean '{near[0]}'?" if near else ""
    return f"unknown config key '{key}'.{hint}"


def json_option(cfg: ml_collections.ConfigDict, key: str) -> dict:
    """The parsed value of a JSON-object key (JSON_OBJECT_KEYS) of a validated config."""
    text = _get(cfg, key)
    return json.loads(text) if text.strip() else {}


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def validate(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks `cfg` against the schema; returns it unchanged or raises ConfigError.

    Raises on: a key the schema does not have (with the closest known key), a value whose type
    differs from the schema's (ints are accepted where floats are expected), a value outside its
    allowed set or range, and inconsistent combinations. This is the only validation of the
    algorithm's settings: AlgoConfig is derived from a validated config (algo_config).
    """
    schema = _flatten(default_config())
    given = _flatten(cfg)
    errors = []
    for key, value in given.items():
        if key not in schema:
            errors.append(unknown_key_message(key))
            continue
        want = type(schema[key])
        ok = isinstance(value, want) or (want is float and isinstance(value, int)
                                         and not isinstance(value, bool))
        if want is int and isinstance(value, bool):
            ok = False
        if not ok:
            errors.append(f"config key '{key}' must be {want.__name__}, got "
                          f"{type(value).__name__} {value!r}.")
    missing = [k for k in schema if k not in given]
    if missing:
        errors.append("config is missing keys " + ", ".join(sorted(missing)) +
                      "; start configs from brorl_jax.config.default_config().")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    errors += _validate_numbers(schema, given)
    if errors:      # nan / inf / huge values would make the range checks below misleading
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    for key, allowed in choices().items():
        if _get(cfg, key) not in allowed:
            errors.append(f"config key '{key}' is {_get(cfg, key)!r}; allowed: "
                          + ", ".join(repr(a) for a in allowed) + ".")
    for key in POSITIVE:
        if not _get(cfg, key) > 0:
            errors.append(f"config key '{key}' must be > 0, got {_get(cfg, key)!r}.")
    for key in NON_NEGATIVE:
        if not _get(cfg, key) >= 0:
            errors.append(f"config key '{key}' must be >= 0, got {_get(cfg, key)!r}.")
    a, r = cfg.algo, cfg.rollout
    if not 0.0 <= a.clip_eps_low < 1.0:
        errors.append(f"config key 'algo.clip_eps_low' must be in [0, 1), got {a.clip_eps_low}.")
    if a.dual_clip_c != 0 and not a.dual_clip_c > 1.0:
        errors.append(f"config key 'algo.dual_clip_c' must be 0 (off) or > 1, got "
                      f"{a.dual_clip_c}.")
    if a.tis_mode != "off" and not 0.0 <= a.tis_low < 1.0 < a.tis_high:
        errors.append(f"config keys 'algo.tis_low'/'algo.tis_high' must satisfy "
                      f"0 <= tis_low < 1 < tis_high, got {a.tis_low}, {a.tis_high}.")
    if r.temperature < 0:
        errors.append(f"config key 'rollout.temperature' must be >= 0 (0 = greedy), got "
                      f"{r.temperature}.")
    if not 0.0 < r.top_p <= 1.0:
        errors.append(f"config key 'rollout.top_p' must be in (0, 1], got {r.top_p}.")
    if r.top_k < 0:
        errors.append(f"config key 'rollout.top_k' must be >= 0 (0 = off), got {r.top_k}.")
    if r.rollouts_per_prompt < 2:
        errors.append("config key 'rollout.rollouts_per_prompt' must be >= 2: the group "
                      "baselines of every advantage estimator need several responses per prompt.")
    if a.generation_batch_multiplier < 1.0:
        errors.append("config key 'algo.generation_batch_multiplier' must be >= 1.0, got "
                      f"{a.generation_batch_multiplier}.")
    samples = a.prompts_per_step * r.rollouts_per_prompt
    if samples <= 0 or a.ppo_mini_batches <= 0 or a.micro_batch_size <= 0:
        pass                                   # already reported as a range error
    elif samples % a.ppo_mini_batches:
        errors.append(f"algo.prompts_per_step * rollout.rollouts_per_prompt = {samples} samples "
                      f"must divide into 'algo.ppo_mini_batches'={a.ppo_mini_batches} equal "
                      "mini-batches.")
    elif (samples // a.ppo_mini_batches) % min(a.micro_batch_size, samples // a.ppo_mini_batches):
        errors.append(f"each PPO mini-batch has {samples // a.ppo_mini_batches} samples, which "
                      f"'algo.micro_batch_size'={a.micro_batch_size} does not divide; pick a "
                      "divisor.")
    if cfg.model.attention_impl == "cudnn" and cfg.model.dtype == "float32":
        errors.append("config key 'model.attention_impl'='cudnn' needs a 16-bit compute dtype "
                      "(cuDNN flash attention takes fp16/bf16 only); set model.dtype='bfloat16' "
                      "or use attention_impl='xla'.")
    errors += _validate_options(cfg)
    if not 0.0 < cfg.eval.top_p <= 1.0:
        errors.append(f"config key 'eval.top_p' must be in (0, 1], got {cfg.eval.top_p}.")
    if cfg.eval.max_new_tokens != -1 and cfg.eval.max_new_tokens <= 0:
        errors.append("config key 'eval.max_new_tokens' must be > 0 or -1 (= "
                      f"rollout.max_new_tokens), got {cfg.eval.max_new_tokens}.")
    errors += _validate_io_keys(cfg)
    for axis in ("data", "fsdp", "tensor"):
        v = cfg.mesh[axis]
        if v == 0 or v < -1:
            errors.append(f"config key 'mesh.{axis}' must be a positive size or -1 (the rest), "
                          f"got {v}.")
    if sum(cfg.mesh[ax] == -1 for ax in ("data", "fsdp", "tensor")) > 1:
        errors.append("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1.")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def _validate_numbers(schema: dict, given: dict) -> list[str]:
    """Every float finite (NaN nowhere; inf only in INFINITE_OK), every int within int32, and the
    token counts of one generation round and one update within int32 (they are int32 arrays and
    sums on device)."""
    errors = []
    for key, value in given.items():
        want = type(schema.get(key))
        if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):
                errors.append(f"config key '{key}' is nan; give a number.")
            elif math.isinf(value) and key not in INFINITE_OK:
                errors.append(f"config key '{key}' must be finite, got {value}.")
            elif math.isfinite(value) and abs(value) > 1e30:
                errors.append(f"config key '{key}' = {value:g} is out of range (|value| <= 1e30).")
        elif want is int and isinstance(value, int) and not isinstance(value, bool):
            if not -INT32_MAX <= value <= INT32_MAX:
                errors.append(f"config key '{key}' = {value} does not fit in int32 (|value| <= "
                              f"{INT32_MAX}); counts, sizes and seeds are int32 on device.")
    if errors:
        return errors
    get = given.get
    n, prompts = get("rollout.rollouts_per_prompt", 0), get("algo.prompts_per_step", 0)
    seq = get("data.max_prompt_len", 0) + get("rollout.max_new_tokens", 0)
    mult = get("algo.generation_batch_multiplier", 1.0)
    if min(n, prompts, seq) > 0 and mult >= 1.0:
        tokens = math.ceil(prompts * mult) * n * seq
        if tokens > INT32_MAX:
            errors.append(
                f"one generation round holds ceil(algo.prompts_per_step {prompts} x "
                f"algo.generation_batch_multiplier {mult:g}) x rollout.rollouts_per_prompt {n} x "
                f"(data.max_prompt_len + rollout.max_new_tokens = {seq}) = {tokens:,} tokens, "
                f"more than int32 counts ({INT32_MAX:,}); lower rollout.rollouts_per_prompt, "
                "algo.prompts_per_step or the lengths.")
    return errors


def check_mesh(cfg: ml_collections.ConfigDict, num_devices: int,
               num_processes: int = 1) -> None:
    """ConfigError unless mesh.data x mesh.fsdp x mesh.tensor (-1 = the rest) uses exactly the
    devices JAX sees less mesh.rollout_devices (the rollout's own, when disaggregated: an equal
    share of every process's devices); on one device too (where the mesh is otherwise unused)."""
    from brorl_jax.parallel.mesh import AXES, mesh_shape
    rollout = int(cfg.mesh.get("rollout_devices", 0))
    if rollout:
        if rollout % num_processes:
            raise ConfigError(f"config key 'mesh.rollout_devices'={rollout} does not split over "
                              f"the {num_processes} processes: each process decodes on its own "
                              f"first mesh.rollout_devices / {num_processes} devices; make it a "
                              f"multiple of {num_processes} (or 0: colocated).")
        if rollout >= num_devices:
            raise ConfigError(f"config key 'mesh.rollout_devices'={rollout} leaves none of the "
                              f"{num_devices} device{'s' if num_devices != 1 else ''} JAX sees "
                              f"to train on; set it below {num_devices} (or 0: colocated).")
    train = num_devices - rollout
    sizes = {a: int(cfg.mesh[a]) for a in AXES}
    try:
        mesh_shape(sizes, train)
    except ValueError as e:
        given = ", ".join(f"mesh.{a}={v}" for a, v in sizes.items())
        seen = (f"the {num_devices} device{'s' if num_devices != 1 else ''} JAX sees" if not
                rollout else f"the {train} training devices ({num_devices} JAX sees less "
                f"mesh.rollout_devices={rollout})")
        raise ConfigError(f"config keys {given} do not match {seen} ({e}). Set the sizes so "
                          "their product is the device count, or one of them to -1 (the rest; "
                          "the default is mesh.data=-1, mesh.fsdp=1, mesh.tensor=1).") from None


def _validate_io_keys(cfg: ml_collections.ConfigDict) -> list[str]:
    """Keys that used to fail only when first used: JSON objects, data specs, optimizer
    constants, the data source -> verifier map."""
    errors = []
    parsed = {}
    for key in JSON_OBJECT_KEYS:
        text = _get(cfg, key)
        try:
            value = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            errors.append(f"config key '{key}' must be a JSON object, e.g. '{{\"a\": 1}}'; "
                          f"{e.msg} at column {e.colno} of {text!r}.")
            continue
        if not isinstance(value, dict):
            errors.append(f"config key '{key}' must be a JSON object ({{...}}), got {text!r}.")
            continue
        parsed[key] = value
    if "data.fields" in parsed:
        from brorl_jax.data.records import DEFAULT_FIELDS
        for name, column in parsed["data.fields"].items():
            if name not in DEFAULT_FIELDS:
                errors.append(f"config key 'data.fields' names {name!r}; the fields are "
                              f"{', '.join(sorted(DEFAULT_FIELDS))} (each mapped to a column).")
            elif not isinstance(column, str) or not column:
                errors.append(f"config key 'data.fields': {name!r} must map to a column name, "
                              f"got {column!r}.")
    errors += _validate_custom_reward(cfg)
    if "rewards.map" in parsed:
        names = verifier_names() + (("custom",) if cfg.rewards.custom else ())
        for source, verifier in parsed["rewards.map"].items():
            if not source or verifier not in names:
                errors.append(f"config key 'rewards.map' sends {source!r} to {verifier!r}; "
                              f"verifiers: {', '.join(names)}.")
    for key in ("data.train", "data.eval"):
        spec = _get(cfg, key)
        if spec and not spec.startswith("reasoning_gym:") and \
                not spec.lower().endswith(DATA_SPEC_SUFFIXES):
            errors.append(f"config key '{key}' = {spec!r}: give a .jsonl or .parquet file or "
                          "'reasoning_gym:task1,task2'.")
    o = cfg.optim
    for name in ("b1", "b2"):
        if not 0.0 <= o[name] < 1.0:
            errors.append(f"config key 'optim.{name}' must be in [0, 1), got {o[name]}.")
    if not o.eps > 0:
        errors.append(f"config key 'optim.eps' must be > 0, got {o.eps}.")
    for name in ("label_noise", "untagged_frac"):
        if not 0.0 <= cfg.sft[name] <= 1.0:
            errors.append(f"config key 'sft.{name}' must be in [0, 1], got {cfg.sft[name]}.")
    return errors


def _validate_custom_reward(cfg: ml_collections.ConfigDict) -> list[str]:
    """rewards.custom: the file exists (nothing is imported here; the door check in a worker
    does that, rewards/custom.py). train.loggers is checked by train/logger.check_config."""
    if not cfg.rewards.custom:
        return []
    from brorl_jax.rewards.custom import CustomRewardError, check_file
    try:
        check_file(cfg.rewards.custom)
    except CustomRewardError as e:
        return [f"config key {e}."]
    return []


def _validate_options(cfg: ml_collections.ConfigDict) -> list[str]:
    """Checks of the opt-in options that are not in the paper (brorl_jax/algo/policies.py)."""
    from brorl_jax.algo.policies import parse_adaptive_n, parse_temperature_schedule
    errors = []
    a, r, o = cfg.algo, cfg.rollout, cfg.optim
    try:
        parse_temperature_schedule(r.temperature_schedule)
    except ValueError as e:
        errors.append(str(e))
    try:
        buckets, _ = parse_adaptive_n(r.adaptive_n_buckets, r.adaptive_n_thresholds)
    except ValueError as e:
        errors.append(str(e))
        buckets = ()
    rows = a.prompts_per_step * r.rollouts_per_prompt
    if r.adaptive_n and buckets:
        if min(buckets) < 2:
            errors.append(f"config key 'rollout.adaptive_n_buckets' = {r.adaptive_n_buckets!r}: "
                          "every N must be >= 2 (the group baseline needs two samples).")
        if max(buckets) > rows:
            errors.append(f"config key 'rollout.adaptive_n_buckets' = {r.adaptive_n_buckets!r}: "
                          f"the largest N ({max(buckets)}) must fit the update batch of "
                          f"algo.prompts_per_step * rollout.rollouts_per_prompt = {rows} rows.")
        if cfg.train.mass_balance_diagnostics:
            errors.append("train.mass_balance_diagnostics needs one N for all prompts; turn off "
                          "rollout.adaptive_n or the diagnostics.")
    if not 0.0 <= r.adaptive_n_ema_decay < 1.0:
        errors.append("config key 'rollout.adaptive_n_ema_decay' must be in [0, 1), got "
                      f"{r.adaptive_n_ema_decay}.")
    if not r.overgenerate_factor >= 1.0 or not math.isfinite(r.overgenerate_factor):
        errors.append("config key 'rollout.overgenerate_factor' must be >= 1.0 (1.0 = off), got "
                      f"{r.overgenerate_factor}.")
    if not a.reward_clip_low < a.reward_clip_high:
        errors.append(f"config keys 'algo.reward_clip_low' < 'algo.reward_clip_high' required, "
                      f"got {a.reward_clip_low}, {a.reward_clip_high} (-inf, inf = no clipping).")
    if a.advantage_normalizer == "ema" and a.advantage != "reinforce_pp_baseline":
        errors.append("config key 'algo.advantage_normalizer'='ema' replaces the batch whitening "
                      "of algo.advantage='reinforce_pp_baseline'; got algo.advantage="
                      f"{a.advantage!r}.")
    if not 0.0 <= a.advantage_ema_decay < 1.0:
        errors.append("config key 'algo.advantage_ema_decay' must be in [0, 1), got "
                      f"{a.advantage_ema_decay}.")
    if not 0.0 <= o.final_lr_ratio <= 1.0:
        errors.append(f"config key 'optim.final_lr_ratio' must be in [0, 1], got "
                      f"{o.final_lr_ratio}.")
    if a.max_staleness > 0 and not a.stream_rounds:
        errors.append(f"config key 'algo.max_staleness'={a.max_staleness} carries samples "
                      "across steps, which only the stream does; set algo.stream_rounds=True "
                      "or algo.max_staleness=0.")
    if a.max_staleness > 0 and (a.tis_mode == "off" or not a.recompute_old_logprobs):
        errors.append(f"config key 'algo.max_staleness'={a.max_staleness} trains on samples of "
                      "older weights, corrected per token by the truncated IS weight "
                      "pi_old / behaviour; it needs algo.tis_mode != 'off' and "
                      "algo.recompute_old_logprobs=True (or algo.max_staleness=0).")
    if a.decode_during_update < -1:
        errors.append(f"config key 'algo.decode_during_update' must be -1 (until the update is "
                      f"done, when disaggregated) or a count >= 0, got {a.decode_during_update}.")
    if a.decode_during_update > 0 and a.max_staleness == 0:
        errors.append(f"config key 'algo.decode_during_update'={a.decode_during_update} decodes "
                      "the carried samples while the update runs, and nothing is carried at "
                      "algo.max_staleness=0; set algo.max_staleness >= 1 (with "
                      "algo.stream_rounds=True) or algo.decode_during_update to -1 or 0.")
    if a.stream_rounds and r.adaptive_n:
        errors.append("config key 'algo.stream_rounds'=True decodes one N for every prompt; "
                      "turn off rollout.adaptive_n or algo.stream_rounds.")
    return errors


def describe() -> str:
    """Every config key with its default, and the allowed names where a key picks from a
    registry: what `--help` shows below the flags."""
    allowed = choices()
    lines = ["Config keys (override with --config.KEY=VALUE):"]
    for key, value in _flatten(default_config()).items():
        line = f"  {key} = {value!r}"
        if key in allowed:
            line += "   (" + " | ".join(allowed[key]) + ")"
        elif key == "rewards.map":
            line += "   (data_source -> " + " | ".join(verifier_names()) + ")"
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# What the rest of the code reads: values derived from a validated config
# ------------------------------------------------------------------------------------------------
def samples_per_step(cfg: ml_collections.ConfigDict) -> int:
    """Samples that enter one update: prompts_per_step (post-filter) x rollouts_per_prompt."""
    return cfg.algo.prompts_per_step * cfg.rollout.rollouts_per_prompt


def row_width(cfg: ml_collections.ConfigDict) -> int:
    """Tokens of one update row (the run context's seq_len): the longest prompt the data keeps
    plus the longest response, data.max_prompt_len + rollout.max_new_tokens."""
    return cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


def rollout_memory_budget_bytes(cfg: ml_collections.ConfigDict) -> int | None:
    """rollout.memory_budget_gb in bytes over all rollout devices; None for 0 (no budget: a slot
    per sample, rollout.plan_slots)."""
    return int(cfg.rollout.memory_budget_gb * 2**30) or None


def derived_learning_rate(cfg: ml_collections.ConfigDict) -> tuple[float, str]:
    """The learning rate a run uses and a sentence saying how it was derived.

    BroRL scales the learning rate by sqrt(B_new / B_0) when it enlarges the batch [BroRL 4.2.1].
    The paper does not say whether B counts prompts or samples; we count samples (prompts x N),
    which makes BroRL's 128 x 512 batch 8x ProRL's 512 x 16 and the LR x sqrt(8) = 2.83.
    """
    if cfg.optim.lr > 0:
        return cfg.optim.lr, f"lr = {cfg.optim.lr:g} (set explicitly by optim.lr)"
    base = cfg.optim.base_lr
    if not cfg.optim.scale_lr_with_batch:
        return base, f"lr = optim.base_lr = {base:g} (batch scaling off)"
    from brorl_jax.algo import scaled_learning_rate
    b = samples_per_step(cfg)
    lr = scaled_learning_rate(base, cfg.optim.base_batch, b)
    return lr, (f"lr = base_lr {base:g} x sqrt({b} / {cfg.optim.base_batch}) = "
                f"{base:g} x {math.sqrt(b / cfg.optim.base_batch):.4g} = {lr:.4g}")


def _with_overrides(cfg, overrides: dict, owner) -> ml_collections.ConfigDict:
    """A copy of cfg (default_config() when None) with `overrides` given by the field names of
    `owner` (AlgoConfig / OptimizerConfig), set in the run config where those fields live."""
    cfg = (default_config() if cfg is None else cfg).copy_and_resolve_references()
    for name, value in overrides.items():
        cfg[owner.section_of(name)][name] = value
    return validate(cfg)


def algo_config(cfg: ml_collections.ConfigDict | None = None, **overrides):
    """The update's frozen AlgoConfig from a run config (default: the schema's defaults), with
    `overrides` by field name (= config key name), validated like a config file."""
    from brorl_jax.algo import AlgoConfig
    if cfg is not None and not overrides:
        return AlgoConfig.from_run_config(cfg)
    return AlgoConfig.from_run_config(_with_overrides(cfg, overrides, AlgoConfig))


def collect_config(cfg: ml_collections.ConfigDict | None = None, **overrides):
    """The host-side collect's frozen CollectConfig, as algo_config builds the update's."""
    from brorl_jax.algo import CollectConfig
    if cfg is not None and not overrides:
        return CollectConfig.from_run_config(cfg)
    return CollectConfig.from_run_config(_with_overrides(cfg, overrides, CollectConfig))


def optimizer_config(cfg: ml_collections.ConfigDict | None = None, **overrides):
    """The optimizer's OptimizerConfig from a run config: the learning rate by the sqrt batch
    rule (derived_learning_rate), warm-up and decay converted from RL steps to optimizer updates
    (ppo_mini_batches x ppo_epochs per RL step). `overrides` by optim.* key name."""
    from brorl_jax.algo import OptimizerConfig
    if cfg is None or overrides:
        cfg = _with_overrides(cfg, overrides, OptimizerConfig)
    return OptimizerConfig.from_run_config(cfg, derived_learning_rate(cfg)[0])
