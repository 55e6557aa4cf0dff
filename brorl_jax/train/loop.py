"""The outer loop in plain Python: data -> rollout -> scoring -> update, with checkpoints,
logging and evaluation around the pure, compiled steps.

One RL step (BroRL §3.1), as `Trainer.run` reads:
  1. collect (train/collect.py): generation rounds of
     ceil(prompts_per_step * generation_batch_multiplier) prompts, N responses each over the shared
     prompt, scored in the worker pool, groups kept by dynamic sampling until prompts_per_step are
     kept (or the round cap), advantages (REINFORCE++-baseline by default), the update batch;
  2. update (train/runtime.py): reference log-probs when the KL term is on, then the PPO update
     in mini-batches;
  3. a periodic reference reset, logging, evaluation and an asynchronous checkpoint.

Resuming: the checkpoint holds the train state, the data-iterator state, the collect policies'
state and counters; every random draw of step s is derived from (seed, s), so a resumed run
repeats exactly what an uninterrupted one would have done.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from brorl_jax import algo, data, models
from brorl_jax.config import algo_config, derived_learning_rate, optimizer_config, validate
from brorl_jax.rewards import ScoringService
from brorl_jax.train import evaluation
from brorl_jax.train.checkpoint import Checkpointer
from brorl_jax.train.collect import Collector
from brorl_jax.train.logger import MetricsLogger, plot_metrics
from brorl_jax.train.runtime import Runtime, make_runtime

# Rollout metrics that add up over processes (the others are averaged).
SUMMED_METRICS = ("perf/generated_samples", "perf/generated_tokens",
                  "dynamic_sampling/kept_groups", "dynamic_sampling/padded_groups")
# Update metrics logged under loss/ (the rest under update/).
LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high",
             "dual_clip_frac", "ratio_mean", "tis_dropped_frac", "tis_weight_mean")


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def load_model(cfg) -> models.Model:
    """The config's model (the embedded demo model when model.path is empty), with the config's
    attention implementation."""
    path = cfg.model.path or models.ensure_demo_model()
    model = models.from_pretrained(path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    if cfg.model.attention_impl == model.config.attention_impl:
        return model
    mcfg = dataclasses.replace(model.config, attention_impl=cfg.model.attention_impl)
    return models.Model(mcfg, model.params, model.tokenizer, model.generation_eos_ids)


@dataclasses.dataclass
class RunResult:
    """What `Trainer.run` returns: the final TrainState and the last step's metrics."""
    state: algo.TrainState
    metrics: dict


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
        self.seq_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens

        self.algo_cfg = algo_config(cfg)
        self.optimizer_cfg = optimizer_config(cfg)
        self.lr, self.lr_note = derived_learning_rate(cfg)
        self.optimizer = algo.make_optimizer(self.optimizer_cfg)
        self.updates_per_step = cfg.algo.ppo_mini_batches * cfg.algo.ppo_epochs
        # Mass-balance diagnostics (BroRL Lemma 2) come from the update's pi_old pass over the
        # vocabulary, at the run's N; no extra pass.
        diag_n = cfg.rollout.rollouts_per_prompt if cfg.train.mass_balance_diagnostics else None
        self.runtime: Runtime = make_runtime(cfg, self.mcfg, self.optimizer, diagnostics_n=diag_n)
        self.collector = Collector(cfg, self.algo_cfg, self.runtime, seq_len=self.seq_len,
                                   pad_id=self.pad_id)

        self.prompt_tokenizer = data.PromptTokenizer(
            tok, cfg.data.max_prompt_len, system_prompt=cfg.data.system_prompt or None,
            use_chat_template=cfg.data.use_chat_template)
        train_records, eval_records, reports = data.load_train_and_eval(cfg.data)
        for report in reports:
            if report.skipped:
                _log(f"[data] {report.summary()}")
        # Several processes: each takes an equal share of every generation round.
        procs = self.runtime.num_processes
        gen_batch = algo.generation_batch_size(cfg.algo.prompts_per_step,
                                               cfg.algo.generation_batch_multiplier)
        self.loader = data.make_prompt_loader(
            train_records, self.prompt_tokenizer, batch_size=-(-gen_batch // procs) * procs,
            seed=cfg.data.seed)
        if self.loader.num_too_long:
            _log(f"[data] {self.loader.num_too_long} training prompts longer than "
                 f"data.max_prompt_len={cfg.data.max_prompt_len} were skipped")
        eval_prompts = [(self.prompt_tokenizer(r), r) for r in eval_records]
        self.eval_prompts = [(ids, r) for ids, r in eval_prompts
                             if len(ids) <= cfg.data.max_prompt_len][:cfg.eval.num_prompts]

        self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                         keep=cfg.train.keep_checkpoints)
        self.scorer = ScoringService(num_workers=cfg.rewards.num_workers,
                                     timeout_s=cfg.rewards.timeout_s,
                                     batch_deadline_s=cfg.rewards.batch_deadline_s,
                                     recycle_after=cfg.rewards.recycle_after)

    # -- the three device-facing calls and scoring ----------------------------------------------
    def generate(self, params, prompt_ids, *, n: int, temperature: float, seed: int,
                 top_p: float | None = None, top_k: int | None = None,
                 max_new_tokens: int | None = None):
        """Rollouts of the current policy (params as the runtime's rollout takes them)."""
        r = self.cfg.rollout
        return self.runtime.generate(
            self.model, params, prompt_ids, rollouts_per_prompt=n,
            max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=temperature,
            top_p=r.top_p if top_p is None else top_p, top_k=r.top_k if top_k is None else top_k,
            seed=seed, eos_ids=self.eos_ids)

    def score(self, records: list[dict], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [G, N] for rollouts [G, N, S], scored in the worker pool."""
        g, n = lengths.shape
        flat_records, texts = [], []
        for gi in range(g):
            for ni in range(n):
                flat_records.append(records[gi])
                texts.append(self.tokenizer.decode(tokens[gi, ni, :int(lengths[gi, ni])].tolist(),
                                                   skip_special_tokens=True))
        results = self.scorer.score_batch(flat_records, texts)
        return np.array([r.score for r in results], np.float32).reshape(g, n)

    def collect(self, params, data_iter, step: int) -> tuple[dict, dict]:
        """This process's rows of step `step`'s update batch and the step's rollout metrics."""
        params = self.runtime.rollout_params(params)
        return self.collector.collect(params, data_iter, step, self.generate, self.score)

    def evaluate(self, params, step: int) -> dict:
        """pass@k / mean@k on the held-out prompts at the evaluation temperature and top-p; each
        process evaluates an equal block of the prompts."""
        c = self.cfg.eval
        k = c.samples_per_prompt
        params = self.runtime.rollout_params(params)
        procs, index = self.runtime.num_processes, self.runtime.process_index
        per = -(-len(self.eval_prompts) // procs)
        first = per * index
        prompts = self.eval_prompts[first:first + per]
        real = len(prompts)
        prompts = prompts + [self.eval_prompts[0]] * (per - real)    # equal shapes everywhere
        rewards = []
        chunk = max(1, 4096 // k)
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            res = self.generate(params, [ids for ids, _ in part], n=k, temperature=c.temperature,
                                top_p=c.top_p, top_k=0,
                                max_new_tokens=c.max_new_tokens if c.max_new_tokens > 0 else None,
                                seed=10_000_019 + first + start)
            rewards.append(self.score([r for _, r in part], res.tokens, res.lengths))
        rewards = np.concatenate(rewards)
        reals = self.runtime.allgather_rows(np.asarray([real]))
        every = self.runtime.allgather_rows(rewards[None])
        rewards = np.concatenate([every[i][:reals[i]] for i in range(procs)])
        return evaluation.summarize(rewards, tuple(sorted({1, k})), self.cfg.algo.correct_threshold)

    # -- the run ----------------------------------------------------------------------------------
    def new_state(self, params) -> algo.TrainState:
        return algo.create_train_state(params, self.optimizer,
                                       with_reference=self.algo_cfg.kl_coef > 0)

    def start(self):
        """(state, data iterator, counters, logger, metrics at step 0 or None): restored from
        the latest checkpoint, or a fresh start (warm start, evaluation before RL)."""
        cfg = self.cfg
        state = self.new_state(self.model.params)
        data_iter = iter(self.loader)
        ckpt_step = self.checkpointer.latest_step()
        enabled = self.runtime.process_index == 0
        if ckpt_step is not None:
            state, meta = self.checkpointer.restore(ckpt_step, self.runtime.place_state(state))
            index = self.runtime.process_index
            data_iter.set_state(meta["data_per_process"][index])
            self.collector.load_state_dict(meta.get("collect_per_process", [{}] * (index + 1))[index])
            _log(f"[resume] from checkpoint step {ckpt_step} in {self.workdir}")
            logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard,
                                   enabled=enabled, resume_step=ckpt_step)
            return state, data_iter, meta["counters"], logger, None
        logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard, enabled=enabled)
        _log(f"[config] {self.lr_note}")
        if cfg.sft.steps > 0:
            state = self.new_state(self.warm_start(state.params))
        state = self.runtime.place_state(state)
        first = self.evaluate(state.params, 0)
        logger.write(0, first)
        _log(f"[eval] before RL: pass@1 = {first['eval/pass@1']:.3f}")
        return state, data_iter, {"skipped_steps": 0, "generated_samples": 0}, logger, first

    def warm_start(self, params):
        """cfg.sft.steps supervised steps (the demo's warm start); the result is also saved as a
        Hugging Face directory, the common starting point of comparisons (experiments.compare_n)."""
        from brorl_jax.train.sft import warm_start
        t0 = time.perf_counter()
        params, sft_metrics = warm_start(self, params)
        params = self.runtime.broadcast(params)  # each process saw its own prompts: take one
        _log(f"[sft] {self.cfg.sft.steps} supervised steps in {time.perf_counter() - t0:.0f}s, "
             f"final loss {sft_metrics['sft/loss']:.3f}")
        if self.runtime.process_index == 0:
            models.save_pretrained(self.model.with_params(params),
                                   os.path.join(self.workdir, "warm_start_model"))
        return params

    def run(self) -> RunResult:
        """Trains to cfg.train.steps, resuming from the latest checkpoint in the workdir."""
        cfg = self.cfg
        state, data_iter, counters, logger, first_eval = self.start()
        from tqdm import tqdm
        start = int(state.step)
        bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
                   desc="BroRL", disable=self.runtime.process_index != 0, file=sys.stdout)
        metrics: dict[str, Any] = {}
        for step in bar:
            t0 = time.perf_counter()
            batch, metrics = self.collect(state.params, data_iter, step)
            metrics = self.runtime.reduce_metrics(metrics, sums=SUMMED_METRICS,
                                                  maxes=("response/length_max",))
            t1 = time.perf_counter()
            rng = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
            state, upd = self.runtime.update(self.collector.update_config(step), state, batch, rng)
            metrics.update(_update_metrics(jax.device_get(upd)))
            t2 = time.perf_counter()
            if metrics["update/skipped"]:
                counters["skipped_steps"] += 1
                _log(f"[nan-guard] step {step}: non-finite loss or gradient; update skipped")
            state, reset = algo.maybe_reset_reference(state, self.algo_cfg, self.optimizer)
            if reset:
                state = self.runtime.relayout(state)
                metrics["ref_reset"] = 1
                _log(f"[reference] reset at step {step + 1}" + (
                    " (optimizer state cleared)" if cfg.algo.reset_optimizer_on_ref_reset else ""))
            counters["generated_samples"] += metrics["perf/generated_samples"]
            done = step + 1
            wall = time.perf_counter() - t0
            metrics.update({
                "time/update_s": t2 - t1, "time/step_s": wall,
                "perf/samples_per_s": metrics["perf/generated_samples"] / wall,
                "perf/tokens_per_s": metrics["perf/generated_tokens"] / wall,
                "counters/skipped_steps": counters["skipped_steps"],
                "counters/generated_samples": counters["generated_samples"],
                "optim/lr": float(algo.learning_rate_schedule(self.optimizer_cfg)(
                    done * self.updates_per_step - 1)),
            })
            if done == cfg.train.steps or (cfg.eval.every and done % cfg.eval.every == 0):
                metrics.update(self.evaluate(state.params, done))
            logger.write(done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            pass_rate=f"{metrics['dynamic_sampling/pass_rate']:.2f}")
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                self.save(done, state, data_iter, counters)
        bar.close()
        self.checkpointer.wait()
        self.finish(logger, metrics, first_eval)
        return RunResult(state, metrics)

    def save(self, step: int, state, data_iter, counters: dict) -> None:
        """An asynchronous checkpoint: the state, every process's data position and collect
        policy state, and the counters."""
        meta = {"data_per_process": self.runtime.allgather_json(data_iter.get_state()),
                "collect_per_process": self.runtime.allgather_json(self.collector.state_dict()),
                "counters": counters}
        self.checkpointer.save(step, state, meta)

    def finish(self, logger: MetricsLogger, last: dict, first_eval: dict | None) -> None:
        if "eval/pass@1" in last:
            msg = f"[eval] after RL: pass@1 = {last['eval/pass@1']:.3f}"
            if first_eval is not None:
                msg += f" (before: {first_eval['eval/pass@1']:.3f})"
            _log(msg)
        if self.cfg.train.plots and self.runtime.process_index == 0 and \
                os.path.exists(logger.path):
            png = plot_metrics(logger.path, os.path.join(self.workdir, "curves.png"))
            if png:
                _log(f"[plots] {png}")
        logger.close()

    def close(self) -> None:
        self.scorer.close()
        self.checkpointer.close()


def _update_metrics(upd: dict) -> dict:
    return {k if k.startswith("mass_balance/") else
            f"loss/{k}" if k in LOSS_KEYS else f"update/{k}": float(v) for k, v in upd.items()}


def train(cfg, workdir: str) -> RunResult:
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
        optimizer = algo.make_optimizer(optimizer_config(cfg))
        template = algo.create_train_state(model.params, optimizer,
                                           with_reference=cfg.algo.kl_coef > 0)
        state, _ = ckpt.restore(step, template)
    finally:
        ckpt.close()
    return model, state.params, step
