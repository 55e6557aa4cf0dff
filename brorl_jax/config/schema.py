"""The run-config schema: one frozen dataclass per section of a config file, key for key
(`cfg.algo.max_staleness` in a file is `cfg.algo.max_staleness` in code), each field with its
default, its range and its source; the numbers derived from several keys, each computed once
(RunConfig's properties); and UpdateConfig, the update's own settings (its jit key).

Defaults follow the BroRL paper and its ProRLv2 recipe (see the README's configuration table);
values the paper does not state are marked "not stated" with the choice made. A field's `range`
(metadata) is checked by `brorl_jax.config.validate`: "> 0", ">= 0", an interval "[0, 1)", and
`finite=False` where an infinite value means something (no clipping). Rules that tie several keys
together live in validate.

This module imports nothing of brorl_jax, so every layer may read the types.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any


def setting(default: Any, range: str | None = None, *, note: str = "", source: str = "",
            finite: bool = True, path: bool = False) -> Any:
    """A field of the schema: its default, its allowed range (checked by validate, the message
    says `note` after the range) and the paper or code it comes from; path=True: a file or
    directory (validate expands a leading ~)."""
    return dataclasses.field(default=default, metadata=dict(range=range, note=note, source=source,
                                                            finite=finite, path=path))


class Section:
    """A section of the run config: attribute reads as in the file, and the few ConfigDict reads
    (`s["key"]`, `s.get("key", default)`, `s.items()`) code written against the file uses."""

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def keys(self):
        return [f.name for f in dataclasses.fields(self)]

    def items(self):
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclasses.dataclass(frozen=True)
class Model(Section):
    path: str = setting("", path=True)       # local Hugging Face directory; "" = the embedded demo model
    dtype: str = setting("float32")          # compute dtype: float32 | bfloat16
    param_dtype: str = setting("float32")    # parameter dtype: float32 | bfloat16
    remat: bool = setting(True)              # rematerialise each layer in the update's backward pass
    # flash (Pallas kernel on GPU/TPU, jnp reference on CPU) | reference | xla | cudnn
    attention_impl: str = setting("flash")
    # auto (fused SwiGLU Triton kernels on GPU, XLA on CPU/TPU) | reference | pallas
    mlp_impl: str = setting("auto")
    # mixture-of-experts models: the experts' grouped GEMM, grouped (Pallas: Hopper GPU, TPU;
    # jax.lax.ragged_dot elsewhere) | ragged (jax.lax.ragged_dot) | dense (every expert on every token)
    moe_impl: str = setting("grouped")
    # LoRA (models/lora.py; docs/algo.md "LoRA"): adapters of this rank train, the base is frozen
    # in the compute dtype and is the KL reference; 0 = off (full fine-tuning)
    lora_rank: int = setting(0, ">= 0", note=" (0 = off)")
    # A @ B is scaled by alpha / rank; a fixed alpha keeps the best learning rate about the same
    # across ranks (Thinking Machines, "LoRA without regret", 2025, uses 32)
    lora_alpha: float = setting(32.0, "> 0")
    # the adapted projections, comma-separated from q,k,v,o,gate,up,down
    lora_targets: str = setting("q,k,v,o,gate,up,down")


@dataclasses.dataclass(frozen=True)
class Data(Section):
    # A JSONL/Parquet path (veRL layout accepted) or "reasoning_gym:task[,task...]".
    train: str = setting("", path=True)
    eval: str = setting("", path=True)       # held-out prompts; "" = a disjoint slice of data.train
    train_size: int = setting(10_000, ">= 0")  # prompts generated for reasoning_gym sources
    eval_size: int = setting(256, ">= 0")
    max_prompt_len: int = setting(1024, "> 0")  # longer prompts are skipped and counted, never truncated
    system_prompt: str = setting("")
    use_chat_template: bool = setting(True)
    seed: int = setting(0, ">= 0")
    # reasoning_gym generator options (JSON object as a string so it stays one typed field)
    reasoning_gym_kwargs: str = setting("{}")
    # Column names of JSONL/Parquet files when they differ from the defaults (JSON object):
    # '{"prompt": "question_text", "ground_truth": "meta.label", "data_source": "src"}'.
    fields: str = setting("{}")
    # The data_source of file rows that have none (it picks their verifier: rewards.map, e.g.
    # "math"); "" = such rows are skipped and counted. A row's own data_source always wins.
    default_source: str = setting("")


@dataclasses.dataclass(frozen=True)
class Rollout(Section):
    rollouts_per_prompt: int = setting(512, "> 0", source="BroRL Table 1")   # N
    # 16k context [BroRL 4.2.1] minus the prompt limit
    max_new_tokens: int = setting(16384 - 1024, "> 0", source="BroRL 4.2.1")
    # not stated in BroRL (ProRL v1: 1.2; NeMo-RL: 1.0)
    temperature: float = setting(1.0, ">= 0", note=" (0 = greedy)")
    top_p: float = setting(1.0, "(0, 1]")
    top_k: int = setting(0, ">= 0", note=" (0 = off)")
    # rollout working memory (decode slots, KV pages); 0 = a slot per sample
    memory_budget_gb: float = setting(0.0, ">= 0")
    impl: str = setting("auto")              # auto | pallas | reference (auto: Pallas on GPU/TPU)
    # The rollout copy's precision (docs/rollout.md "FP8 rollouts"; not in the paper: its write-ups
    # ask for FP8 on the exploration path, verl and NeMo-RL ship it): bf16 (the compute dtype) |
    # fp8 (e4m3, per-output-channel weight scales / per-(position, head) KV scales). fp8 needs TIS.
    weight_dtype: str = setting("bf16", source="verl docs/low_precision/fp8.md")
    kv_dtype: str = setting("bf16", source="slime FP8 KV cache")
    # Options NOT in the paper (docs/options.md), all off by default:
    temperature_schedule: str = setting("")  # "step:T,step:T", e.g. "0:1.3,100:0.9,200:0.7"; "" = off
    adaptive_n: bool = setting(False)        # N per prompt from its EMA pass rate, bucketed
    adaptive_n_buckets: str = setting("256,512,768")   # N for easy ... hard prompts (ascending)
    adaptive_n_thresholds: str = setting("0.7,0.3")    # pass-rate boundaries (descending)
    adaptive_n_ema_decay: float = setting(0.5, "[0, 1)")  # weight of the old pass-rate estimate per visit
    # per round: a probe of knapsack_probe samples per prompt, then the round's other samples
    # (its prompts x N) by Knapsack RL's value, knapsack_chunk at a time, <= knapsack_max_n each
    knapsack: bool = setting(False, source="Knapsack RL, arXiv 2509.25849")
    knapsack_probe: int = setting(8, ">= 2")
    knapsack_chunk: int = setting(8, "> 0")
    knapsack_max_n: int = setting(256, ">= 2")
    # > 1: generate ceil(factor * N), keep N by select_rule
    overgenerate_factor: float = setting(1.0, ">= 1.0", note=" (1.0 = off)")
    select_rule: str = setting("dedup_then_balanced")  # | dedup | balanced


@dataclasses.dataclass(frozen=True)
class Algo(Section):
    """The update's settings (UpdateConfig reads them) and the host-side collect's (selection,
    shaping, dynamic sampling, advantages, the update batch's layout)."""
    prompts_per_step: int = setting(128, "> 0", source="BroRL Table 1")  # B after dynamic-sampling filtering
    advantage: str = setting("reinforce_pp_baseline", source="BroRL 3.1")   # algo.ADVANTAGES
    # GRPO: (R - mean) / (std + eps) [veRL core_algos]
    advantage_eps: float = setting(1e-6, ">= 0", source="veRL core_algos")
    # batch whitening: / sqrt(var + eps) [veRL masked_whiten]
    whiten_eps: float = setting(1e-8, ">= 0", source="veRL masked_whiten")
    dynamic_sampling: bool = setting(True, source="BroRL 3.1")  # keep only groups with a learning signal
    # algo.GROUP_FILTERS: 0 < #correct < N [BroRL 3.1]
    dynamic_sampling_rule: str = setting("correct_count", source="BroRL 3.1")
    correct_threshold: float = setting(1.0)  # a sample counts as correct when reward >= this
    # NeMo-RL ProRLv2 value (over-generate per round)
    generation_batch_multiplier: float = setting(1.5, ">= 1.0", source="NeMo-RL ProRLv2")
    max_generation_rounds: int = setting(10, "> 0", source="NeMo-RL dynamic_sampling_max_gen_batches")
    dynamic_sampling_cap_policy: str = setting("error")  # error | pad (train on what was kept, rest masked)
    # One stream per step (docs/rollout.md): prompts enter the running engine as slots free up,
    # no round drains it; False = today's rounds. Not in the paper.
    stream_rounds: bool = setting(False)
    # k: train on samples up to k updates old (TIS); needs the stream
    max_staleness: int = setting(0, ">= 0")
    # With samples carried (k >= 1): decode calls the engine runs, under the weights it has,
    # while the update runs (docs/rollout.md "Decoding during the update"). -1 = with
    # mesh.rollout_devices, until the update is done (timing-dependent, so not reproducible run
    # to run), else none; D >= 0 = exactly D (a reproducible schedule). Not in the paper.
    decode_during_update: int = setting(-1)
    clip_eps_low: float = setting(0.2, "[0, 1)", source="ProRLv2")
    clip_eps_high: float = setting(0.28, ">= 0", source="ProRLv2")
    # A < 0: loss <= -c A; 0 = off [veRL default clip_ratio_c]
    dual_clip_c: float = setting(3.0, source="veRL clip_ratio_c")
    loss_agg: str = setting("token_mean", source="NeMo-RL token_level_loss")   # algo.LOSS_AGG
    ppo_mini_batches: int = setting(1, "> 0")  # optimizer steps per RL step (not stated)
    ppo_epochs: int = setting(1, "> 0")        # passes over the batch per RL step (not stated)
    micro_batch_size: int = setting(64, "> 0")  # sequences per gradient-accumulation micro-batch
    # tokens per micro-batch (whole rows); 0 = micro_batch_size rows
    micro_batch_tokens: int = setting(0, ">= 0")
    # several sequences per update row (docs/algo.md); False = one per row
    pack_sequences: bool = setting(True)
    # algo.TIS_MODES: min(w, tis_high) [BroRL 3.1 cites Yao et al.]
    tis_mode: str = setting("truncate", source="BroRL 3.1")
    tis_low: float = setting(0.5)              # ICE-POP's lower bound (tis_mode="ice_pop")
    # truncation C [veRL rollout_is_threshold, Yao et al.]
    tis_high: float = setting(2.0, source="veRL rollout_is_threshold")
    # trainer-side pi_old at step start (veRL old_log_prob)
    recompute_old_logprobs: bool = setting(True, source="veRL old_log_prob")
    kl_coef: float = setting(1e-4, ">= 0", source="NeMo-RL / OpenRLHF ProRLv2 configs")
    kl_estimator: str = setting("k2", source="ProRLv2")   # algo.KL_ESTIMATORS
    kl_clamp: float = setting(10.0, "> 0", source="ProRLv2")  # k2's log-ratio clamp; k1/k3 as veRL
    # steps between reference resets [ProRLv2: 200-500]; 0 = never
    ref_reset_every: int = setting(200, ">= 0", source="ProRLv2")
    reset_optimizer_on_ref_reset: bool = setting(False)  # ProRL v1: True, ProRLv2: False
    entropy_coef: float = setting(0.0, ">= 0")  # entropy bonus, off (not in the paper)
    # scheduled cosine length penalty [ProRLv2], off
    length_penalty: bool = setting(False, source="ProRLv2")
    length_penalty_coef: float = setting(0.1)  # lambda_len (not stated)
    length_penalty_eta_min: float = setting(-1.0)  # eta at the length limit (not stated)
    length_penalty_eta_max: float = setting(0.0)   # eta at length 0 (not stated)
    # ProRLv2 example: 100 steps on, 500 off
    length_penalty_on_steps: int = setting(100, ">= 0", source="ProRLv2")
    length_penalty_off_steps: int = setting(500, ">= 0", source="ProRLv2")
    logprob_impl: str = setting("auto")        # auto | pallas | chunked | naive
    # Options NOT in the paper (docs/options.md), all off by default:
    reward_clip_low: float = setting(-math.inf, finite=False)   # clip the shaped reward
    reward_clip_high: float = setting(math.inf, finite=False)
    # algo.ADVANTAGE_NORMALIZERS; ema: EMA of the batch std
    advantage_normalizer: str = setting("batch")
    advantage_ema_decay: float = setting(0.99, "[0, 1)")
    # mixture-of-experts models: "rollout" replays the rollout's expert choices in the update
    # (R3, algo/routing_replay.py MODES; docs/algo.md "Routing replay"), "off" routes afresh
    routing_replay: str = setting("off", source="verl / slime R3")
    # mixture-of-experts models: the router load-balancing loss's weight, off (algo/moe_losses.py;
    # docs/algo.md "Router load-balancing loss"; Qwen3-MoE pretraining used 0.001)
    moe_aux_loss_coef: float = setting(0.0, ">= 0", source="verl / slime / SkyRL: off")


@dataclasses.dataclass(frozen=True)
class Optim(Section):
    name: str = setting("adamw")             # adamw | lion (lion: not in the paper)
    # eta_0 at the base batch (OpenRLHF ProRLv2 example)
    base_lr: float = setting(1e-6, "> 0", source="OpenRLHF ProRLv2")
    base_batch: int = setting(8192, "> 0")   # samples/step of the base recipe (512 x 16)
    # lr = base_lr * sqrt(batch / base_batch) [BroRL 4.2.1]
    scale_lr_with_batch: bool = setting(True, source="BroRL 4.2.1")
    lr: float = setting(-1.0)                # explicit lr; -1 = derived by the sqrt rule
    schedule: str = setting("constant")      # constant | warmup_cosine (not in the paper)
    warmup_steps: int = setting(0, ">= 0")
    final_lr_ratio: float = setting(0.1, "[0, 1]")
    weight_decay: float = setting(0.01, ">= 0")
    b1: float = setting(0.9, "[0, 1)")
    b2: float = setting(0.999, "[0, 1)")
    eps: float = setting(1e-8, "> 0")
    grad_clip: float = setting(1.0, ">= 0")


@dataclasses.dataclass(frozen=True)
class Rewards(Section):
    num_workers: int = setting(2, "> 0")
    timeout_s: float = setting(5.0, "> 0")   # per item (ProRL code tests: 5 s)
    batch_deadline_s: float = setting(600.0, "> 0")
    recycle_after: int = setting(2000, "> 0")  # items per worker before it is replaced
    # data_source -> verifier (JSON object), on top of veRL's common names that are understood
    # by default (rewards/registry.py DEFAULT_REWARD_MAP). Keys: a data_source, its family
    # (the part before "/") or a shell pattern ("numina_*"). '{"my_set": "math"}'.
    map: str = setting("{}")
    # A reward function from a file, veRL's compute_score convention (rewards/custom.py,
    # docs/rewards.md): "path/to/file.py:fn" ("" = none); the data sources it scores (comma-
    # separated shell patterns; rewards.map entries win); keyword arguments for it (JSON object,
    # veRL's custom_reward_function.reward_kwargs); the batched form (lists in, list out) sent
    # in chunks of custom_batch_size, at most custom_concurrency chunks at once, each under
    # custom_batch_timeout_s.
    custom: str = setting("", path=True)
    custom_sources: str = setting("*")
    custom_kwargs: str = setting("{}")
    custom_batched: bool = setting(False)
    custom_batch_size: int = setting(64, "> 0")
    custom_concurrency: int = setting(1, "> 0")
    custom_batch_timeout_s: float = setting(60.0, "> 0")
    # Groups scored at once while decoding goes on (rounds and stream): 1 = one at a time, in
    # order. More helps a scorer that waits (a remote sandbox, a model judge: its calls run in
    # that many threads); the stream's filter then sees each group that many groups late (a
    # fixed lag: runs stay reproducible). The built-in scoring service takes one call at a time
    # (it already spreads a group's samples over its workers), so it gains nothing from more.
    groups_in_flight: int = setting(1, "> 0")


@dataclasses.dataclass(frozen=True)
class Sft(Section):
    """Supervised warm start (used by the demo; 0 steps = none)."""
    steps: int = setting(0, ">= 0")
    batch_size: int = setting(64, "> 0")
    lr: float = setting(1e-3, "> 0")
    label_noise: float = setting(0.0, "[0, 1]")    # fraction of warm-start answers made off by one (demo)
    untagged_frac: float = setting(0.0, "[0, 1]")  # fraction of warm-start answers without <answer> tags (demo)


@dataclasses.dataclass(frozen=True)
class Eval(Section):
    every: int = setting(0, ">= 0")          # steps; 0 = only before and after training
    num_prompts: int = setting(256, "> 0")
    samples_per_prompt: int = setting(16, "> 0", source="BroRL App. D")  # k for pass@k and mean@k
    temperature: float = setting(0.6, ">= 0", source="BroRL App. D")
    top_p: float = setting(0.95, "(0, 1]")
    max_new_tokens: int = setting(-1)        # -1 = rollout.max_new_tokens
    # evaluate with the rollout's weight_dtype / kv_dtype; False: always in the compute dtype
    low_precision: bool = setting(False)


@dataclasses.dataclass(frozen=True)
class Train(Section):
    steps: int = setting(200, ">= 0")
    # Generated samples (before filtering) after which the run ends, at the end of the step that
    # reaches them (evaluated and saved as the last step); 0 = off. Arms compared at equal
    # samples whose steps differ in size (adaptive N) stop on this; train.steps stays the cap.
    sample_budget: int = setting(0, ">= 0")
    seed: int = setting(0, ">= 0")
    checkpoint_every: int = setting(10, "> 0")
    keep_checkpoints: int = setting(3, "> 0")
    log_every: int = setting(1, "> 0")       # metrics written every k steps (+ evaluations, the end)
    plots: bool = setting(True)
    tensorboard: bool = setting(True)
    # Where metrics go, comma-separated: jsonl (always, the public record) | tensorboard | wandb
    # | mlflow (the last two: pip install 'brorl_jax[wandb]' / '[mlflow]'; train/logger.py).
    loggers: str = setting("jsonl,tensorboard")
    mass_balance_diagnostics: bool = setting(False)
    # RL steps in a row whose every update was non-finite (all skipped by the NaN guard) before
    # the run stops with exit code 2: it is not learning (diverged weights, rewards the update
    # cannot hold). 0 = never stop (each such step is still a warning).
    max_skipped_steps: int = setting(3, ">= 0")


@dataclasses.dataclass(frozen=True)
class Mesh(Section):
    data: int = setting(-1)                  # -1 = the rest of the devices
    fsdp: int = setting(1)
    tensor: int = setting(1)
    # Expert parallelism: a mixture-of-experts layer's experts split over this many devices,
    # each token sent to its experts' devices and back (parallel/expert_parallel.py; the rows
    # split over it too), in the update and in the rollout (whose copy of the params then holds
    # E / expert experts a device). 1 = off: the experts are sharded over fsdp and gathered per
    # layer.
    expert: int = setting(1, "> 0")
    # Under expert parallelism, the rows a device may send each other device in one exchange:
    # capacity_factor x tokens x top_k / expert, rows past it dropped (their expert output 0,
    # as GShard / Switch). 0 = exact: tokens x top_k, nothing ever dropped (buffers `expert`
    # times the rows sent); docs/scale.md section 1 "Capacity".
    expert_capacity_factor: float = setting(0.0, ">= 0", note=" (0 = exact)")
    rules: str = setting("default")          # a rule set of brorl_jax.parallel.rules.PARAM_RULES
    # Disaggregated rollout: R devices decode (their own mesh; with P processes the first R / P
    # of each process's, a multiple of P), the mesh above is laid over the others and trains;
    # weights move after each update by a reshard. 0 = colocated (every device does both).
    rollout_devices: int = setting(0, ">= 0")


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    """A validated run config (brorl_jax.config.validate): the sections of the file as typed,
    frozen dataclasses, and the numbers derived from them (computed here, nowhere else)."""
    name: str = "brorl"
    model: Model = dataclasses.field(default_factory=Model)
    data: Data = dataclasses.field(default_factory=Data)
    rollout: Rollout = dataclasses.field(default_factory=Rollout)
    algo: Algo = dataclasses.field(default_factory=Algo)
    optim: Optim = dataclasses.field(default_factory=Optim)
    rewards: Rewards = dataclasses.field(default_factory=Rewards)
    sft: Sft = dataclasses.field(default_factory=Sft)
    eval: Eval = dataclasses.field(default_factory=Eval)
    train: Train = dataclasses.field(default_factory=Train)
    mesh: Mesh = dataclasses.field(default_factory=Mesh)

    # -- derived values ---------------------------------------------------------------------------
    @property
    def update_rows(self) -> int:
        """Sequences (samples) in one update batch: algo.prompts_per_step (after the filter)
        x rollout.rollouts_per_prompt."""
        return self.algo.prompts_per_step * self.rollout.rollouts_per_prompt

    @property
    def seq_len(self) -> int:
        """Tokens of one update row: the longest prompt the data keeps plus the longest response,
        data.max_prompt_len + rollout.max_new_tokens."""
        return self.data.max_prompt_len + self.rollout.max_new_tokens

    @property
    def round_prompts(self) -> int:
        """Prompts generated per round, ceil(generation_batch_multiplier x prompts_per_step). With
        BroRL's 62% pass rate a 1.5x margin usually fills a step in one round."""
        return max(1, math.ceil(self.algo.generation_batch_multiplier * self.algo.prompts_per_step))

    @property
    def carries_samples(self) -> bool:
        """Whether groups still in flight at the update are carried into the next step in the
        paused engine: the stream (algo.stream_rounds) with algo.max_staleness >= 1."""
        return self.algo.stream_rounds and self.algo.max_staleness >= 1

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step: algo.ppo_mini_batches x algo.ppo_epochs."""
        return self.algo.ppo_mini_batches * self.algo.ppo_epochs

    @property
    def memory_budget_bytes(self) -> int | None:
        """rollout.memory_budget_gb in bytes over all rollout devices; None for 0 (no budget: a slot
        per sample, rollout.plan_slots)."""
        return int(self.rollout.memory_budget_gb * 2**30) or None

    @property
    def update(self) -> "UpdateConfig":
        """The update's settings (its jit key): see UpdateConfig."""
        a = self.algo
        return UpdateConfig(
            # greedy rollouts (temperature 0) train on the log-probs of the plain softmax
            temperature=self.rollout.temperature if self.rollout.temperature > 0 else 1.0,
            remat=self.model.remat, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
            dual_clip_c=a.dual_clip_c, loss_agg=a.loss_agg, ppo_mini_batches=a.ppo_mini_batches,
            ppo_epochs=a.ppo_epochs, micro_batch_size=a.micro_batch_size,
            micro_batch_tokens=a.micro_batch_tokens, tis_mode=a.tis_mode, tis_low=a.tis_low,
            tis_high=a.tis_high, recompute_old_logprobs=a.recompute_old_logprobs,
            kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_clamp=a.kl_clamp,
            ref_reset_every=a.ref_reset_every,
            reset_optimizer_on_ref_reset=a.reset_optimizer_on_ref_reset,
            entropy_coef=a.entropy_coef, logprob_impl=a.logprob_impl,
            moe_aux_loss_coef=a.moe_aux_loss_coef)

    def replace(self, section: str, **values: Any) -> "RunConfig":
        """A copy with `values` in `section` (not validated: tests that vary one setting of a
        built run; a run's own settings come through brorl_jax.config.validate)."""
        new = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **{section: new})

    # -- the ConfigDict the file was (saving, logging, copies to change) ---------------------------
    def to_dict(self) -> dict:
        """The nested dict of the file's keys and values."""
        return {k: _as_dict(v) for k, v in self.items()}

    def to_config_dict(self):
        """A mutable ml_collections.ConfigDict with these values (e.g. to derive a variant)."""
        import ml_collections
        return ml_collections.ConfigDict(self.to_dict())

    copy_and_resolve_references = to_config_dict

    def to_json(self, **kwargs) -> str:
        return self.to_config_dict().to_json(**kwargs)


def _as_dict(value: Any) -> Any:
    if isinstance(value, Section):
        return {k: _as_dict(v) for k, v in value.items()}
    return value


# section name -> its dataclass, in the file's order
SECTIONS = {"model": Model, "data": Data, "rollout": Rollout, "algo": Algo, "optim": Optim,
            "rewards": Rewards, "sft": Sft, "eval": Eval, "train": Train, "mesh": Mesh}


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Exactly the settings the compiled update reads (algo/update.py): a static argument of the
    jitted steps, so the key of their compile cache. A setting only the collect reads is not
    here, so changing it compiles no update step again. Built in one place, RunConfig.update;
    a scheduled temperature replaces `temperature` per step (train/context.py)."""
    temperature: float                # rollout.temperature (> 0; greedy rollouts train at 1.0)
    remat: bool                       # model.remat
    clip_eps_low: float               # the rest: algo.<same name>
    clip_eps_high: float
    dual_clip_c: float
    loss_agg: str
    ppo_mini_batches: int
    ppo_epochs: int
    micro_batch_size: int
    micro_batch_tokens: int
    tis_mode: str
    tis_low: float
    tis_high: float
    recompute_old_logprobs: bool
    kl_coef: float
    kl_estimator: str
    kl_clamp: float
    ref_reset_every: int
    reset_optimizer_on_ref_reset: bool
    entropy_coef: float
    logprob_impl: str
    moe_aux_loss_coef: float          # algo.moe_aux_loss_coef (mixture-of-experts models)
