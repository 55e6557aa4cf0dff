"""The run context: what every RL step, evaluation and warm start reads, built once per run.

    ctx = build_context(cfg, eval_records)     # the model loads here, once
    ctx.model, ctx.tokenizer, ctx.runtime, ctx.scorer, ctx.eval_prompts, ...
    ctx.rollouts(params, prompts, n=..., seed=..., sampling=ctx.train_sampling(step))

The context owns no per-step state and no files: the Trainer (train/loop.py) adds the data
iterator, the work directory, checkpoints, logs and signals; `python -m brorl_jax.evaluate`
needs only the context. Rollout arguments are assembled in one place (`RunContext.rollouts`,
from a `Sampling`); scoring (`Scorer.score`) returns the rewards with the verifier health of
exactly those samples, so nothing mutates shared counters.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from brorl_jax import algo, data, models
from brorl_jax.config import RunConfig, UpdateConfig, as_run_config, json_option, optimizer_config
from brorl_jax.errors import ConfigError, DataError, ModelError, VerifierError
from brorl_jax.rewards import ScoringService, custom as custom_reward
from brorl_jax.rewards.health import VerifierFailure, VerifierHealth, check_records
from brorl_jax.rewards.registry import resolve_reward_name
from brorl_jax.train.rollout_calls import rollout_precision
from brorl_jax.train.runtime import Runtime, make_runtime

# Seed offset of the held-out evaluation's rollouts (distinct from every training round's).
EVAL_SEED = 10_000_019


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Model and data (checked before anything expensive)
# ------------------------------------------------------------------------------------------------
def check_model_path(path: str) -> None:
    """ModelError unless model.path is empty (the demo model), a known builtin:NAME or an
    existing path; nothing is loaded or materialised."""
    problem = models.model_path_problem(path) if path else None
    if problem:
        raise ModelError(f"config key 'model.path' = {path!r}: {problem}.")


def with_config_impls(mcfg: models.ModelConfig, cfg) -> models.ModelConfig:
    """``mcfg`` with the config's model implementations (model.attention_impl, mlp_impl,
    moe_impl, mesh.expert_capacity_factor): implementations of the same model, not part of the
    checkpoint."""
    want = dict(attention_impl=cfg.model.get("attention_impl", mcfg.attention_impl),
                mlp_impl=cfg.model.get("mlp_impl", mcfg.mlp_impl),
                moe_impl=cfg.model.get("moe_impl", mcfg.moe_impl),
                expert_capacity_factor=cfg.mesh.get("expert_capacity_factor",
                                                    mcfg.expert_capacity_factor),
                **lora_settings(cfg))
    changes = {f: v for f, v in want.items() if getattr(mcfg, f) != v}
    return dataclasses.replace(mcfg, **changes) if changes else mcfg


def lora_settings(cfg) -> dict:
    """ModelConfig's LoRA fields from model.lora_* (none when lora_rank is 0: the model's
    config stays as it was)."""
    rank = cfg.model.get("lora_rank", 0)
    if not rank:
        return {}
    return dict(lora_rank=rank, lora_alpha=float(cfg.model.lora_alpha),
                lora_targets=models.lora.parse_targets(cfg.model.lora_targets))


def stored_param_dtype(cfg) -> str:
    """The dtype the weights load in: model.param_dtype, or under LoRA the compute dtype (the
    frozen base needs no float32 master copy, and the loaded weights are then the train
    state's base itself, not a second copy)."""
    return cfg.model.dtype if cfg.model.get("lora_rank", 0) else cfg.model.param_dtype


def base_model_dir(cfg) -> str:
    """Where the config's base model is: model.path, or the embedded demo model's directory."""
    return cfg.model.path or models.ensure_demo_model()


def load_model(cfg, *, weights_from_checkpoint: bool = False) -> models.Model:
    """The config's model (the embedded demo model when model.path is empty), with the config's
    attention and MLP implementations. A path that does not hold a model raises ModelError; so
    does a run's copy of its base model (config and tokenizer, no weights) unless the caller
    restores every weight from a checkpoint."""
    path = base_model_dir(cfg)
    check_model_path(cfg.model.path)
    if models.hf.has_no_weights(path) and not weights_from_checkpoint:
        raise ModelError(f"config key 'model.path' = {path!r} is a run's copy of its base "
                         "model's config and tokenizer files, without weights: it serves "
                         "evaluate and export of that run's checkpoints (--workdir) only. Point "
                         "model.path at a model with weights.")
    try:
        model = models.from_pretrained(path, dtype=cfg.model.dtype,
                                       param_dtype=stored_param_dtype(cfg))
    except (OSError, ValueError) as e:
        raise ModelError(f"config key 'model.path' = {path!r} does not hold a usable model: "
                         f"{e}") from e
    _check_generation(model, path)
    mcfg = with_config_impls(model.config, cfg)
    if mcfg is model.config:
        return model
    return models.Model(mcfg, model.params, model.tokenizer, model.generation_eos_ids)


def _check_generation(model: models.Model, path: str) -> None:
    """A model the rollouts cannot use as it is, refused once it has loaded: no stop id anywhere
    (every sample would run to rollout.max_new_tokens), or a tokenizer with ids the embedding
    does not have (the first rollout would fail)."""
    if not model.generation_eos_ids and not model.config.eos_token_ids:
        raise ModelError(f"the model at {path!r} has no end-of-sequence id (none in "
                         "generation_config.json, config.json's eos_token_id or the tokenizer's "
                         "eos_token), so every sample would run to rollout.max_new_tokens; set "
                         "eos_token_id in its generation_config.json.")
    vocab = model.config.vocab_size
    if model.tokenizer is not None and len(model.tokenizer) > vocab:
        raise ModelError(f"the tokenizer at {path!r} has {len(model.tokenizer)} tokens, more than "
                         f"the model's vocab_size {vocab}: ids from {vocab} up have no embedding. "
                         "Use the tokenizer saved with these weights.")


def reward_routing(cfg) -> tuple[dict, dict]:
    """(reward_map, reward_options): rewards.map with the user's rewards.custom function routed
    to its data sources (rewards/custom.py; the file is imported only in the workers)."""
    return custom_reward.setup(cfg.rewards, json_option(cfg, "rewards.map"))


def load_records(cfg) -> tuple[list[dict], list[dict]]:
    """The training and held-out records, each data source mapped to a verifier and every
    ground truth checked by it; bad rows skipped and reported with file and line."""
    def show(report):
        if report.skipped:
            log(f"[data] {report.summary()}")

    train, held_out, _ = data.load_train_and_eval(cfg.data, on_report=show)
    try:   # rewards.custom: the user's reward file, tried on the first training row here
        reward_map, reward_options = reward_routing(cfg)
        verifiers, bad = check_records(train + held_out, reward_map)
        note = custom_reward.door_check(cfg.rewards, reward_map, reward_options, train)
        if note:
            log(note)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if bad:
        report = data.DataReport(num_rows=len(train) + len(held_out))
        for b in bad:
            report.skip(b.record["source"], b.record["row"], data.records.BAD_GROUND_TRUTH,
                        f"{b.verifier}: {b.message}")
        report.num_kept = report.num_rows - len(bad)
        dropped = {id(b.record) for b in bad}
        train = [r for r in train if id(r) not in dropped]
        held_out = [r for r in held_out if id(r) not in dropped]
        show(report)
    log("[data] verifiers: " + ", ".join(f"{s} -> {v}" for s, v in sorted(verifiers.items())))
    if not train:
        raise DataError(f"no usable training rows in data.train = {cfg.data.train!r} "
                        "(every row was skipped; see the [data] lines above).")
    return train, held_out


# ------------------------------------------------------------------------------------------------
# Scoring
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Scored:
    """Rewards [M] float32 of M samples and the verifier health of exactly those samples."""
    rewards: np.ndarray
    health: VerifierHealth


class Scorer:
    """Completions -> text -> the verifier worker pool (rewards.ScoringService)."""

    def __init__(self, service: ScoringService, tokenizer):
        self.service = service
        self.tokenizer = tokenizer

    def score(self, records: Sequence[dict], tokens: np.ndarray, lengths: np.ndarray) -> Scored:
        """M samples: records [M] (one per sample), tokens [M, S], lengths [M]."""
        texts = [self.tokenizer.decode(tokens[i, :int(lengths[i])].tolist(),
                                       skip_special_tokens=True) for i in range(len(records))]
        results = self.service.score_batch(list(records), texts)
        health = VerifierHealth()
        health.add(records, results)
        return Scored(np.array([r.score for r in results], np.float32), health)

    def close(self) -> None:
        self.service.close()


def merge_health(parts: Sequence[VerifierHealth]) -> VerifierHealth:
    """One VerifierHealth of several scoring calls' (or processes') samples together."""
    return VerifierHealth.merged([h.to_json() for h in parts])


# ------------------------------------------------------------------------------------------------
# Sampling settings and the context
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How rollouts are sampled: the training steps' (rollout.*, the temperature per step of
    rollout.temperature_schedule) or the evaluation's (eval.*)."""
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    # the rollout copy's (weights, KV cache) precision: rollout.weight_dtype / kv_dtype for the
    # training steps; the compute dtype for evaluation unless eval.low_precision
    precision: tuple[str, str] = ("bf16", "bf16")


def update_config_at(algo_cfg: UpdateConfig, temperature: float) -> UpdateConfig:
    """The update's config for rollouts sampled at `temperature`: log-probs are of logits / T
    with T the sampling temperature (1 for greedy rollouts), so a scheduled temperature changes
    the update's config (one compiled update per distinct temperature)."""
    t = temperature if temperature > 0 else 1.0
    if t == algo_cfg.temperature:
        return algo_cfg
    return dataclasses.replace(algo_cfg, temperature=t)


def eval_sampling(cfg) -> Sampling:
    """The evaluation's sampling settings (eval.*; eval.max_new_tokens -1 = the rollout's)."""
    c = cfg.eval
    return Sampling(c.temperature, c.top_p, 0,
                    c.max_new_tokens if c.max_new_tokens > 0 else cfg.rollout.max_new_tokens,
                    rollout_precision(cfg) if c.low_precision else ("bf16", "bf16"))


@dataclasses.dataclass
class RunContext:
    """Everything a step, an evaluation or the warm start reads (module docstring)."""
    cfg: RunConfig
    model: models.Model
    tokenizer: Any
    prompt_tokenizer: data.PromptTokenizer
    eos_ids: tuple[int, ...]
    pad_id: int
    seq_len: int                      # RunConfig.seq_len (bench/steps.py sets its own)
    optimizer_cfg: algo.OptimizerConfig
    optimizer: Any
    runtime: Runtime
    scorer: Scorer
    eval_prompts: list                # [(prompt ids, record)] held out, within max_prompt_len
    temperature_schedule: tuple = ()
    # the collector's stream left paused for the next step (train/collect.py carried_stream)
    live_stream: Any = dataclasses.field(default=None, repr=False)

    @property
    def mcfg(self):
        return self.model.config

    # -- sampling -------------------------------------------------------------------------------
    def rollout_temperature(self, step: int) -> float:
        """Sampling temperature of RL step `step`: rollout.temperature unless scheduled."""
        return algo.policies.temperature_at(self.temperature_schedule, step,
                                            self.cfg.rollout.temperature)

    def train_sampling(self, step: int) -> Sampling:
        r = self.cfg.rollout
        return Sampling(self.rollout_temperature(step), r.top_p, r.top_k, r.max_new_tokens,
                        rollout_precision(self.cfg))

    def eval_sampling(self) -> Sampling:
        return eval_sampling(self.cfg)

    def update_config(self, step: int) -> UpdateConfig:
        """The UpdateConfig of step `step` (update_config_at): the update's jit key."""
        return update_config_at(self.cfg.update, self.rollout_temperature(step))

    # -- the one place rollout arguments are put together ---------------------------------------
    def rollouts(self, params, prompt_ids, *, n: int, seed: int, sampling: Sampling,
                 stream: bool = False, open_stream: dict | None = None):
        """Rollouts of the current policy (params as the runtime's rollout takes them): a
        rollout.RolloutResult, or with ``stream=True`` a rollout.RolloutStream of the groups in
        the order they finish, or with ``open_stream`` (plan_prompts, version) an open stream
        fed later (rollout.OpenStream; prompt_ids None). The runtime adds its device settings
        (memory budget, impl)."""
        kw = dict(rollouts_per_prompt=n, max_new_tokens=sampling.max_new_tokens,
                  temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                  seed=seed, eos_ids=self.eos_ids, precision=sampling.precision)
        if open_stream is not None:
            return self.runtime.open_stream(self.model, params,
                                            prompt_len=self.cfg.data.max_prompt_len,
                                            **open_stream, **kw)
        call = self.runtime.stream if stream else self.runtime.generate
        return call(self.model, params, prompt_ids, **kw)

    # -- health across processes ----------------------------------------------------------------
    def check_health(self, health: VerifierHealth, where: str, gather: bool = True
                     ) -> VerifierHealth:
        """Every process's verdicts together (so all log the same metrics and stop together);
        raises VerifierError when a data source failed on every sample."""
        if gather:
            health = VerifierHealth.merged(self.runtime.allgather_json(health.to_json()))
        try:
            health.check(where)
        except VerifierFailure as e:
            raise VerifierError(str(e)) from None
        return health

    def new_train_state(self, params) -> algo.TrainState:
        if models.lora.enabled(self.mcfg):      # adapters train; the base is the reference
            return algo.adapters.lora_train_state(params, self.mcfg, self.optimizer,
                                                  self.cfg.train.seed)
        return algo.create_train_state(params, self.optimizer,
                                       with_reference=self.cfg.algo.kl_coef > 0)

    def close(self) -> None:
        if self.live_stream is not None:
            self.live_stream.close()
            self.live_stream = None
        self.scorer.close()


def held_out_prompts(cfg, prompt_tokenizer, eval_records: Sequence[dict]) -> list:
    """[(prompt ids, record)] of the first eval.num_prompts held-out records within
    data.max_prompt_len; DataError when none is."""
    prompts = [(prompt_tokenizer(r), r) for r in eval_records]
    prompts = [(ids, r) for ids, r in prompts
               if len(ids) <= cfg.data.max_prompt_len][:cfg.eval.num_prompts]
    if not prompts:
        raise DataError(f"no held-out prompts: {len(eval_records)} evaluation records, none "
                        f"within data.max_prompt_len={cfg.data.max_prompt_len} tokens. Give "
                        "data.eval, raise data.eval_size (a file's first min(data.eval_size, "
                        "10%) rows are held out) or data.max_prompt_len.")
    return prompts


def make_prompt_tokenizer(cfg, model: models.Model) -> data.PromptTokenizer:
    """Records -> prompt token ids (chat template, system prompt, data.max_prompt_len) with the
    model's tokenizer; ModelError when the model has none."""
    if model.tokenizer is None:
        raise ModelError(f"model directory {cfg.model.path!r} has no tokenizer files; RL "
                         "needs one to turn completions into text for the verifiers.")
    return data.PromptTokenizer(
        model.tokenizer, cfg.data.max_prompt_len, system_prompt=cfg.data.system_prompt or None,
        use_chat_template=cfg.data.use_chat_template)


def verifiers_for(records: Sequence[dict], reward_map: dict, reward_options: dict) -> list[str]:
    """The verifiers a run can call: those its records' data sources resolve to, and every one
    rewards.map or a verifier option names. The scoring workers load only these (each imports
    what its verifiers need: math_verify, reasoning_gym, the code sandbox, a user's file)."""
    sources = {str(r.get("data_source")) for r in records}
    return sorted({resolve_reward_name(s, reward_map) for s in sources}
                  | set(reward_map.values()) | set(reward_options))


def build_context(cfg, eval_records: Sequence[dict], *, model: models.Model | None = None,
                  records: Sequence[dict] | None = None,
                  paused_engine_bytes: int | None = None) -> RunContext:
    """The run's context from a validated config and its held-out records: the model (loaded
    here unless given), the runtime, the scoring pool and the evaluation prompts. `records`:
    every record the run will score (default: the held-out ones); the workers load the
    verifiers those need. `paused_engine_bytes`: the door's count (train/door.py DoorFacts),
    handed to the runtime (None: the runtime counts it)."""
    cfg = as_run_config(cfg)
    model = load_model(cfg) if model is None else model
    prompt_tokenizer = make_prompt_tokenizer(cfg, model)
    tok = model.tokenizer
    eval_prompts = held_out_prompts(cfg, prompt_tokenizer, eval_records)
    optimizer_cfg = optimizer_config(cfg)
    optimizer = algo.make_optimizer(optimizer_cfg)
    # Mass-balance diagnostics (BroRL Lemma 2) come from the update's pi_old pass over the
    # vocabulary, at the run's N; no extra pass.
    diag_n = algo.host.group_size(cfg) if cfg.train.mass_balance_diagnostics else None
    runtime = make_runtime(cfg, model.config, optimizer, diagnostics_n=diag_n,
                           paused_engine_bytes=paused_engine_bytes)
    reward_map, reward_options = reward_routing(cfg)
    service = ScoringService(num_workers=cfg.rewards.num_workers, timeout_s=cfg.rewards.timeout_s,
                             batch_deadline_s=cfg.rewards.batch_deadline_s,
                             recycle_after=cfg.rewards.recycle_after,
                             reward_map=reward_map, reward_options=reward_options,
                             rewards=verifiers_for(eval_records if records is None else records,
                                                   reward_map, reward_options))
    return RunContext(
        cfg=cfg, model=model, tokenizer=tok, prompt_tokenizer=prompt_tokenizer,
        eos_ids=tuple(model.generation_eos_ids),
        pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        seq_len=cfg.seq_len, optimizer_cfg=optimizer_cfg,
        optimizer=optimizer, runtime=runtime, scorer=Scorer(service, tok),
        eval_prompts=eval_prompts,
        temperature_schedule=algo.policies.parse_temperature_schedule(
            cfg.rollout.temperature_schedule))
