"""The outer loop in plain Python: data -> rollout -> scoring -> update, with checkpoints,
logging and evaluation around the pure, compiled steps.

One RL step (BroRL §3.1):
  1. generation rounds: take `ceil(prompts_per_step * generation_batch_multiplier)` prompts,
     generate N responses each over the shared prompt, score them in the worker pool, keep the
     groups with 0 < #correct < N (dynamic sampling), until `prompts_per_step` groups are kept
     or `max_generation_rounds` is reached;
  2. advantages (REINFORCE++-baseline by default) over the kept groups;
  3. reference log-probs (when the KL term is on), then the PPO update in mini-batches;
  4. a periodic reference reset, logging, evaluation and an asynchronous checkpoint.

Resuming: the checkpoint holds the train state, the data-iterator state and counters; every
random draw of step s is derived from (seed, s), so a resumed run repeats exactly what an
uninterrupted one would have done.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from brorl_jax import algo, data, models, rollout
from brorl_jax.config import ConfigError, derived_learning_rate, validate
from brorl_jax.train import evaluation
from brorl_jax.train.checkpoint import Checkpointer
from brorl_jax.train.logger import MetricsLogger, plot_metrics
from brorl_jax.train.monitoring import rollout_monitoring, step_rollout_stats
from brorl_jax.train.options import Options, scheduled_lr
from brorl_jax.train.runtime import MeshRuntime, global_advantages, use_mesh


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Building the pieces
# ------------------------------------------------------------------------------------------------
def load_model(cfg) -> models.Model:
    path = cfg.model.path or models.ensure_demo_model()
    model = models.from_pretrained(path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    if cfg.model.attention_impl != model.config.attention_impl:
        model.config = dataclasses.replace(model.config, attention_impl=cfg.model.attention_impl)
    return model


def load_records(cfg, spec: str, size: int, seed: int) -> list[dict]:
    """Records from a file path or "reasoning_gym:task[,task]" (generated, seeded)."""
    if spec.startswith("reasoning_gym:"):
        kwargs = json.loads(cfg.data.reasoning_gym_kwargs or "{}")
        return data.reasoning_gym_source(spec.split(":", 1)[1], size=size, seed=seed, **kwargs)
    records, report = data.load_dataset(spec)
    if report.skipped:
        _log(f"[data] {spec}: skipped {len(report.skipped)} rows; first: "
             + "; ".join(str(s) for s in report.skipped[:5]))
    return records


def build_datasets(cfg) -> tuple[list[dict], list[dict]]:
    """Training and held-out records. Generated sources get disjoint seeds for the two."""
    if not cfg.data.train:
        raise ValueError("config key 'data.train' is empty; give a JSONL/Parquet path or "
                         "'reasoning_gym:<task>'.")
    train = load_records(cfg, cfg.data.train, cfg.data.train_size, cfg.data.seed)
    if cfg.data.eval:
        held_out = load_records(cfg, cfg.data.eval, cfg.data.eval_size, cfg.data.seed + 1)
    elif cfg.data.train.startswith("reasoning_gym:"):
        held_out = load_records(cfg, cfg.data.train, cfg.data.eval_size, cfg.data.seed + 10_007)
        # A generated question may repeat across seeds; keep held-out questions out of training.
        seen = {r["prompt"] if "prompt" in r else json.dumps(r.get("prompt_messages"))
                for r in held_out}
        train = [r for r in train
                 if (r["prompt"] if "prompt" in r else json.dumps(r.get("prompt_messages")))
                 not in seen]
    else:
        n = min(cfg.data.eval_size, len(train) // 10)
        held_out, train = train[:n], train[n:]
    return train, held_out


class Trainer:
    """Owns the side effects of a run: model, data iterator, scoring pool, files, logs."""

    def __init__(self, cfg, workdir: str):
        validate(cfg)
        self.cfg = cfg
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.model = load_model(cfg)
        self.mcfg = self.model.config
        tok = self.model.tokenizer
        if tok is None:
            raise ValueError(f"model directory {cfg.model.path!r} has no tokenizer files; RL "
                             "needs one to turn completions into text for the verifiers.")
        self.tokenizer = tok
        self.eos_ids = tuple(self.model.generation_eos_ids)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.prompt_tokenizer = data.PromptTokenizer(
            tok, cfg.data.max_prompt_len, system_prompt=cfg.data.system_prompt or None,
            use_chat_template=cfg.data.use_chat_template)
        train_records, eval_records = build_datasets(cfg)
        self.gen_batch = math.ceil(cfg.algo.prompts_per_step
                                   * cfg.algo.generation_batch_multiplier)
        # Several processes: each takes an equal share of every generation round.
        procs = jax.process_count()
        self.gen_batch = -(-self.gen_batch // procs) * procs
        self.loader = data.make_prompt_loader(
            train_records, self.prompt_tokenizer, batch_size=self.gen_batch, seed=cfg.data.seed)
        if self.loader.num_too_long:
            _log(f"[data] {self.loader.num_too_long} training prompts longer than "
                 f"data.max_prompt_len={cfg.data.max_prompt_len} were skipped")
        self.eval_prompts = [(self.prompt_tokenizer(r), r) for r in eval_records]
        self.eval_prompts = [(ids, r) for ids, r in self.eval_prompts
                             if len(ids) <= cfg.data.max_prompt_len][:cfg.eval.num_prompts]
        self.seq_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        self.n = cfg.rollout.rollouts_per_prompt
        self.rows = cfg.algo.prompts_per_step * self.n
        self.lr, self.lr_note = derived_learning_rate(cfg)
        self.optimizer = algo.make_optimizer(optimizer_config(cfg, self.lr))
        self.algo_cfg = algo_config(cfg)
        # Mass-balance diagnostics (BroRL Lemma 2) come from the update's pi_old pass over the
        # vocabulary, at the run's N; no extra pass.
        diag_n = self.n if cfg.train.mass_balance_diagnostics else None
        self.update_fn = jax.jit(algo.make_update_step(self.mcfg, self.algo_cfg, self.optimizer,
                                                       diagnostics_n=diag_n),
                                 donate_argnums=(0,))
        self.logprob_fn = jax.jit(algo.make_logprob_fn(self.mcfg, self.algo_cfg))
        # --- opt-in options, not in the paper (brorl_jax/train/options.py; all off by default) --
        self.options = Options(cfg)
        # Several devices: the mesh path (train/runtime.py); one device: the plain jit above.
        self.runtime = (MeshRuntime(cfg, self.mcfg, self.optimizer, diagnostics_n=diag_n)
                        if use_mesh() else None)
        self.num_processes = jax.process_count()
        if self.num_processes > 1 and (self.options.custom_collect or self.options.stateful):
            raise ConfigError("the rollout options (adaptive N, over-generation, reward clipping, "
                             "advantage EMA) run in one process only; turn them off for a "
                             "multi-process run.")
        self._fns_by_temperature: dict[float, tuple] = {}
        self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                         keep=cfg.train.keep_checkpoints)
        from brorl_jax.rewards import ScoringService
        self.scorer = ScoringService(num_workers=cfg.rewards.num_workers,
                                     timeout_s=cfg.rewards.timeout_s,
                                     batch_deadline_s=cfg.rewards.batch_deadline_s,
                                     recycle_after=cfg.rewards.recycle_after)

    # --------------------------------------------------------------------------------------
    def decode(self, tokens: np.ndarray, length: int) -> str:
        return self.tokenizer.decode(tokens[:length].tolist(), skip_special_tokens=True)

    def score(self, records: list[dict], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [G, N] for rollouts [G, N, S], scored in the worker pool."""
        g, n = lengths.shape
        flat_records, texts = [], []
        for gi in range(g):
            for ni in range(n):
                flat_records.append(records[gi])
                texts.append(self.decode(tokens[gi, ni], int(lengths[gi, ni])))
        results = self.scorer.score_batch(flat_records, texts)
        return np.array([r.score for r in results], np.float32).reshape(g, n)

    def rollout_params(self, params):
        """Parameters in the form the rollout takes (a host copy when sharded over processes)."""
        return self.runtime.host_params(params) if self.runtime is not None else params

    def generate(self, params, prompt_ids, *, n, temperature, top_p, top_k, max_new_tokens,
                 seed):
        if self.runtime is not None:
            return self.runtime.generate(
                self.model, params, prompt_ids, rollouts_per_prompt=n,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=seed, eos_ids=self.eos_ids, impl=self.cfg.rollout.impl,
                memory_budget_bytes=int(self.cfg.rollout.memory_budget_gb * 2**30) or None)
        if getattr(self, "_rollout_engine", None) is None:   # holds the compiled rollout programs
            self._rollout_engine = rollout.Engine(self.mcfg, impl=self.cfg.rollout.impl)
        return self._rollout_engine.generate(
            params, prompt_ids, rollouts_per_prompt=n, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, eos_ids=self.eos_ids,
            memory_budget_bytes=int(self.cfg.rollout.memory_budget_gb * 2**30) or None)

    # --------------------------------------------------------------------------------------
    def evaluate(self, params, step: int) -> dict:
        """pass@k / mean@k on the held-out prompts at the evaluation temperature and top-p."""
        c = self.cfg.eval
        k = c.samples_per_prompt
        max_new = c.max_new_tokens if c.max_new_tokens > 0 else self.cfg.rollout.max_new_tokens
        params = self.rollout_params(params)
        prompts, first = self.eval_prompts, 0
        if self.num_processes > 1:      # each process evaluates an equal block of the prompts
            per = -(-len(prompts) // self.num_processes)
            first = per * jax.process_index()
            prompts = prompts[first:first + per]
            real = len(prompts)
            prompts = prompts + [self.eval_prompts[0]] * (per - real)
        rewards = []
        chunk = max(1, 4096 // k)
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            res = self.generate(params, [ids for ids, _ in part], n=k,
                                temperature=c.temperature, top_p=c.top_p, top_k=0,
                                max_new_tokens=max_new, seed=10_000_019 + first + start)
            rewards.append(self.score([r for _, r in part], res.tokens, res.lengths))
        rewards = np.concatenate(rewards)
        if self.num_processes > 1:
            reals = self.runtime.allgather_rows(np.asarray([real]))
            every = self.runtime.allgather_rows(rewards[None])
            rewards = np.concatenate([every[i][:reals[i]] for i in range(self.num_processes)])
        ks = tuple(sorted({1, k}))
        return evaluation.summarize(rewards, ks, self.cfg.algo.correct_threshold)

    # --------------------------------------------------------------------------------------
    def collect(self, params, data_iter, step: int) -> tuple[dict, dict]:
        """Generation rounds with dynamic sampling until prompts_per_step groups are kept.

        Returns the fixed-shape update batch (numpy) and the step's rollout metrics.
        """
        cfg = self.cfg
        if self.options.custom_collect:     # adaptive N / over-generation / reward clip / EMA
            return self.options.collect(self, params, data_iter, step, _round_seed)
        params = self.rollout_params(params)
        acfg = self.algo_cfg
        if self.num_processes > 1:      # each process fills its share of the update batch
            acfg = dataclasses.replace(
                acfg, prompts_per_step=acfg.prompts_per_step // self.num_processes)
        sampler = algo.DynamicSampler.from_config(acfg)
        t_roll = t_score = 0.0
        gen_tokens = gen_samples = 0
        rewards_all, lengths_all, truncated_all, monitor = [], [], [], []
        while sampler.need_more():          # raises a clear error at the round cap ("error")
            batch = next(data_iter)
            t0 = time.perf_counter()
            res = self.generate(params, batch["prompt_ids"], n=self.n,
                                temperature=self.options.rollout_temperature(step),
                                top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                                seed=_round_seed(cfg.train.seed, step, sampler.rounds))
            t1 = time.perf_counter()
            rewards = self.score(batch["records"], res.tokens, res.lengths)
            t2 = time.perf_counter()
            t_roll += t1 - t0
            t_score += t2 - t1
            gen_tokens += int(res.lengths.sum())
            gen_samples += res.lengths.size
            rewards_all.append(rewards)
            lengths_all.append(res.lengths)
            truncated_all.append(res.truncated)
            monitor.append(rollout_monitoring(res.tokens, res.lengths, rewards))
            shaped = rewards
            if self.algo_cfg.length_penalty:
                shaped = algo.apply_length_penalty(rewards, res.lengths, step=step,
                                                   max_length=cfg.rollout.max_new_tokens,
                                                   cfg=self.algo_cfg)
            prompt_arr = np.empty(len(batch["prompt_ids"]), object)
            prompt_arr[:] = [list(p) for p in batch["prompt_ids"]]
            sampler.add(rewards, {"prompt_ids": prompt_arr, "tokens": res.tokens,
                                  "logprobs": res.logprobs, "mask": res.mask,
                                  "lengths": res.lengths, "shaped": np.asarray(shaped)})
        kept, group_valid, ds_stats = sampler.finalize()
        prompts = [p if isinstance(p, list) else [self.pad_id] for p in kept["prompt_ids"]]
        advantages = global_advantages(self.runtime, self.algo_cfg.advantage_estimator,
                                       np.asarray(kept["shaped"]), np.asarray(group_valid),
                                       eps=self.algo_cfg.advantage_eps)
        update_batch = algo.assemble_update_batch(
            prompts, kept["tokens"], kept["logprobs"], kept["mask"], advantages, group_valid,
            seq_len=self.seq_len, pad_id=self.pad_id)
        stats = step_rollout_stats(
            rewards_all, lengths_all, truncated_all, correct_threshold=cfg.algo.correct_threshold,
            pass_rate=ds_stats["pass_rate"], rounds=ds_stats["generation_rounds"],
            kept_groups=ds_stats["kept_groups"], padded_groups=ds_stats["padded_groups"],
            update_batch=update_batch, t_rollout=t_roll, t_scoring=t_score,
            generated_samples=gen_samples, generated_tokens=gen_tokens)
        rewards_all = np.concatenate(rewards_all)
        for key in monitor[0]:
            stats[key] = float(np.mean([m[key] for m in monitor]))
        if self.cfg.train.mass_balance_diagnostics:
            from brorl_jax.theory import group_reward_balance, reward_balance_metrics
            stats.update(reward_balance_metrics(group_reward_balance(
                rewards_all, None,
                correct_threshold=cfg.algo.correct_threshold)))
        return update_batch, stats

    # --------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Trains to cfg.train.steps (resuming from the latest checkpoint in the workdir) and
        returns the last step's metrics; the final TrainState is then `self.state`."""
        cfg = self.cfg
        ckpt_step = self.checkpointer.latest_step()
        state = self.new_state(self.model.params)
        data_iter = iter(self.loader)
        counters = {"skipped_steps": 0, "generated_samples": 0}
        logger = None
        if ckpt_step is not None:
            state, meta = self.checkpointer.restore(ckpt_step, self.place(state))
            per_process = meta.get("data_per_process")
            data_iter.set_state(per_process[jax.process_index()] if per_process else meta["data"])
            counters = meta["counters"]
            self.options.load_state_dict(meta.get("options"))
            _log(f"[resume] from checkpoint step {ckpt_step} in {self.workdir}")
            logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard,
                                   enabled=jax.process_index() == 0, resume_step=ckpt_step)
        else:
            logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard,
                                   enabled=jax.process_index() == 0)
            _log(f"[config] {self.lr_note}")
            if cfg.sft.steps > 0:
                from brorl_jax.train.sft import warm_start
                t0 = time.perf_counter()
                params, sft_metrics = warm_start(self, state.params)
                if self.num_processes > 1:   # each process saw its own prompt shard: take one
                    from jax.experimental import multihost_utils
                    params = multihost_utils.broadcast_one_to_all(jax.device_get(params))
                state = self.new_state(params)
                _log(f"[sft] {cfg.sft.steps} supervised steps in {time.perf_counter() - t0:.0f}s, "
                     f"final loss {sft_metrics['sft/loss']:.3f}")
                if jax.process_index() == 0:
                    # The warm-started model as a HF directory: the common starting point of
                    # comparisons (experiments/compare_n) and a checkpoint users can load.
                    models.save_pretrained(self.model.with_params(params),
                                           os.path.join(self.workdir, "warm_start_model"))
            state = self.place(state)
            ev = self.evaluate(state.params, 0)
            logger.write(0, ev)
            _log(f"[eval] before RL: pass@1 = {ev['eval/pass@1']:.3f}")
        start = int(state.step)
        first_eval = None
        if ckpt_step is None:
            first_eval = ev
        from tqdm import tqdm
        bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
                   desc="BroRL", disable=jax.process_index() != 0, file=sys.stdout)
        last = {}
        for step in bar:
            t0 = time.perf_counter()
            batch, metrics = self.collect(state.params, data_iter, step)
            if self.runtime is not None:
                metrics = self.runtime.reduce_metrics(metrics, sums=SUMMED_METRICS,
                                                      maxes=("response/length_max",))
            t1 = time.perf_counter()
            rng = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
            state, upd = self.update(state, batch, step, rng)
            upd = {k if k.startswith("mass_balance/") else
                   f"loss/{k}" if k in LOSS_KEYS else f"update/{k}": float(v)
                   for k, v in jax.device_get(upd).items()}
            t2 = time.perf_counter()
            if upd["update/skipped"]:
                counters["skipped_steps"] += 1
                _log(f"[nan-guard] step {step}: non-finite loss or gradient; update skipped")
            if cfg.algo.ref_reset_every and (step + 1) % cfg.algo.ref_reset_every == 0 \
                    and self.algo_cfg.kl_coef > 0:
                state = algo.reset_reference(state, self.optimizer,
                                             reset_optimizer=cfg.algo.reset_optimizer_on_ref_reset)
                if self.runtime is not None:     # keep the mesh layout of the new copies
                    from brorl_jax.parallel.sharded import place
                    state = place(state, self.runtime.state_sharding(state))
                _log(f"[reference] reset at step {step + 1}"
                     + (" (optimizer state cleared)" if cfg.algo.reset_optimizer_on_ref_reset
                        else ""))
                metrics["ref_reset"] = 1
            counters["generated_samples"] += metrics["perf/generated_samples"]
            wall = time.perf_counter() - t0
            metrics.update({k: v for k, v in upd.items()})
            metrics.update({
                "time/update_s": t2 - t1, "time/step_s": wall,
                "perf/samples_per_s": metrics["perf/generated_samples"] / wall,
                "perf/tokens_per_s": metrics["perf/generated_tokens"] / wall,
                "counters/skipped_steps": counters["skipped_steps"],
                "counters/generated_samples": counters["generated_samples"],
                "optim/lr": self.lr,
            })
            if cfg.optim.schedule != "constant":     # option: log the scheduled LR
                metrics["optim/lr"] = scheduled_lr(optimizer_config(cfg, self.lr),
                                                   (step + 1) * cfg.algo.ppo_mini_batches - 1)
            if self.options.schedule:                # option: temperature schedule
                metrics["rollout/temperature"] = self.options.rollout_temperature(step)
            done = step + 1
            if cfg.eval.every and done % cfg.eval.every == 0 and done != cfg.train.steps:
                metrics.update(self.evaluate(state.params, done))
            if done == cfg.train.steps:
                metrics.update(self.evaluate(state.params, done))
            logger.write(done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            pass_rate=f"{metrics['dynamic_sampling/pass_rate']:.2f}")
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                meta = {"data": data_iter.get_state(), "counters": counters}
                if self.num_processes > 1:   # every process's own position in its data shard
                    meta["data_per_process"] = self.runtime.allgather_json(meta["data"])
                if self.options.stateful:            # option state (pass rates, advantage EMA)
                    meta["options"] = self.options.state_dict()
                self.checkpointer.save(done, state, meta)
            last = metrics
        bar.close()
        self.checkpointer.wait()
        if "eval/pass@1" in last:
            before = first_eval["eval/pass@1"] if first_eval else None
            msg = f"[eval] after RL: pass@1 = {last['eval/pass@1']:.3f}"
            if before is not None:
                msg += f" (before: {before:.3f})"
            _log(msg)
        if cfg.train.plots and jax.process_index() == 0 and os.path.exists(logger.path):
            png = plot_metrics(logger.path, os.path.join(self.workdir, "curves.png"))
            if png:
                _log(f"[plots] {png}")
        logger.close()
        self.state = state      # the final TrainState (params, opt_state, ref_params, step)
        return last

    def place(self, state: algo.TrainState) -> algo.TrainState:
        """The state laid out for the update: on the mesh when there is one."""
        return self.runtime.place_state(state) if self.runtime is not None else state

    def update(self, state, batch: dict, step: int, rng):
        """Reference log-probs (KL on) and the PPO update of RL step `step` on host `batch`
        (this process's rows)."""
        if self.runtime is not None:
            temperature = self.options.update_temperature(step)
            acfg = (self.algo_cfg if temperature is None else
                    dataclasses.replace(self.algo_cfg, temperature=temperature))
            return self.runtime.update(acfg, state, batch, rng)
        batch = jax.tree.map(jnp.asarray, batch)
        update_fn, logprob_fn = self.update_fns(step)
        if self.algo_cfg.kl_coef > 0:
            batch["ref_logprobs"], _, _ = logprob_fn(state.ref_params, batch)
        return update_fn(state, batch, rng)

    def update_fns(self, step: int):
        """(update_fn, logprob_fn) for RL step `step`: the default pair unless a temperature
        schedule (an option, not in the paper) sets another temperature; one compiled pair per
        distinct temperature, so a schedule recompiles only at its phase boundaries."""
        temperature = self.options.update_temperature(step)
        if temperature is None:
            return self.update_fn, self.logprob_fn
        if temperature not in self._fns_by_temperature:
            acfg = dataclasses.replace(self.algo_cfg, temperature=temperature)
            diag_n = self.n if self.cfg.train.mass_balance_diagnostics else None
            self._fns_by_temperature[temperature] = (
                jax.jit(algo.make_update_step(self.mcfg, acfg, self.optimizer,
                                              diagnostics_n=diag_n), donate_argnums=(0,)),
                jax.jit(algo.make_logprob_fn(self.mcfg, acfg)))
        return self._fns_by_temperature[temperature]

    def new_state(self, params) -> algo.TrainState:
        return algo.create_train_state(params, self.optimizer,
                                       with_reference=self.algo_cfg.kl_coef > 0)

    def close(self) -> None:
        self.scorer.close()
        self.checkpointer.close()


# Rollout metrics that add up over processes (the others are averaged).
SUMMED_METRICS = ("perf/generated_samples", "perf/generated_tokens",
                  "dynamic_sampling/kept_groups", "dynamic_sampling/padded_groups")

LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high",
             "ratio_mean", "tis_dropped_frac", "tis_weight_mean")


def optimizer_config(cfg, lr: float) -> algo.OptimizerConfig:
    """optax counts optimizer updates (ppo_mini_batches per RL step); optim.warmup_steps and
    the decay length (train.steps) count RL steps, so both are converted here."""
    o = cfg.optim
    per_step = cfg.algo.ppo_mini_batches
    return algo.OptimizerConfig(
        name=o.name, learning_rate=lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip if o.grad_clip > 0 else None, schedule=o.schedule,
        warmup_steps=o.warmup_steps * per_step,
        decay_steps=max(cfg.train.steps, o.warmup_steps + 1) * per_step,
        end_lr_fraction=o.final_lr_ratio)


def algo_config(cfg) -> algo.AlgoConfig:
    """The update's frozen config from the run config (one source of truth: brorl_jax.config)."""
    a, r = cfg.algo, cfg.rollout
    return algo.AlgoConfig(
        rollouts_per_prompt=r.rollouts_per_prompt, prompts_per_step=a.prompts_per_step,
        dynamic_sampling=a.dynamic_sampling, correct_threshold=a.correct_threshold,
        generation_batch_multiplier=a.generation_batch_multiplier,
        max_generation_rounds=a.max_generation_rounds,
        dynamic_sampling_cap_policy=a.dynamic_sampling_cap_policy, advantage_estimator=a.advantage,
        clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, loss_agg=a.loss_agg,
        ppo_mini_batches=a.ppo_mini_batches, micro_batch_size=a.micro_batch_size,
        temperature=r.temperature if r.temperature > 0 else 1.0,
        tis_mode="ice_pop" if a.tis else "off", tis_low=a.tis_low, tis_high=a.tis_high,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_clamp=a.kl_clamp,
        ref_reset_interval=a.ref_reset_every,
        reset_optimizer_on_ref_reset=a.reset_optimizer_on_ref_reset, entropy_coef=a.entropy_coef,
        length_penalty=a.length_penalty, length_penalty_coef=a.length_penalty_coef,
        length_penalty_eta_min=a.length_penalty_eta_min,
        length_penalty_eta_max=a.length_penalty_eta_max,
        logprob_impl=a.logprob_impl, remat=cfg.model.remat)


def _round_seed(seed: int, step: int, round_: int) -> int:
    """A distinct, reproducible rollout seed for every (run seed, step, generation round)."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


def train(cfg, workdir: str) -> dict:
    trainer = Trainer(cfg, workdir)
    try:
        return trainer.run()
    finally:
        trainer.close()


def restore_params(cfg, workdir: str, step: int | None = None):
    """(model, params, step) of checkpoint `step` (default: latest) in `workdir`."""
    model = load_model(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {workdir}/checkpoints; train first "
                                    "or give --step of an existing one.")
        if step not in ckpt.all_steps():
            raise FileNotFoundError(f"checkpoint step {step} not in {workdir}/checkpoints; "
                                    f"available: {ckpt.all_steps()}.")
        lr, _ = derived_learning_rate(cfg)
        optimizer = algo.make_optimizer(optimizer_config(cfg, lr))
        template = algo.create_train_state(model.params, optimizer,
                                           with_reference=cfg.algo.kl_coef > 0)
        state, _ = ckpt.restore(step, template)
    finally:
        ckpt.close()
    return model, state.params, step
