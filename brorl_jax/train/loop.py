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

Faults (docs/reliability.md): everything that can be checked is checked before the model loads
(config, work directory, a changed config on resume, data rows, a verifier for every data
source); a checkpoint that cannot be restored falls back to the previous one; a save that cannot
complete stops the run at that save; a verifier failing on every sample stops the run; SIGINT /
SIGTERM stop after the current step with a checkpoint.
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
from brorl_jax.config import (algo_config, derived_learning_rate, json_option, optimizer_config,
                              validate)
from brorl_jax.errors import (CheckpointError, ConfigError, DataError, ModelError,
                              TrainingStopped, VerifierError)
from brorl_jax.rewards import ScoringService
from brorl_jax.rewards import custom as custom_reward
from brorl_jax.rewards.health import VerifierFailure, VerifierHealth, check_records
from brorl_jax.train import evaluation, run_config, workdir as workdir_lib
from brorl_jax.train.checkpoint import Checkpointer
from brorl_jax.train.collect import Collector
from brorl_jax.train.logger import MetricsLogger, check_config, plot_metrics, progress
from brorl_jax.train.runtime import Runtime, make_runtime
from brorl_jax.train.signals import GracefulStop

# Rollout metrics that add up over processes (the others are averaged).
SUMMED_METRICS = ("perf/generated_samples", "perf/generated_tokens",
                  "dynamic_sampling/kept_groups", "dynamic_sampling/padded_groups")
# Update metrics logged under loss/ (the rest under update/).
LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high",
             "dual_clip_frac", "ratio_mean", "tis_dropped_frac", "tis_weight_mean")


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def check_model_path(path: str) -> None:
    """ModelError unless model.path is empty (the demo model), a known builtin:NAME or an
    existing path; nothing is loaded or materialised."""
    problem = models.model_path_problem(path) if path else None
    if problem:
        raise ModelError(f"config key 'model.path' = {path!r}: {problem}.")


def load_model(cfg) -> models.Model:
    """The config's model (the embedded demo model when model.path is empty), with the config's
    attention implementation. A path that does not hold a model raises ModelError."""
    path = cfg.model.path or models.ensure_demo_model()
    check_model_path(cfg.model.path)
    try:
        model = models.from_pretrained(path, dtype=cfg.model.dtype,
                                       param_dtype=cfg.model.param_dtype)
    except (OSError, ValueError) as e:
        raise ModelError(f"config key 'model.path' = {path!r} does not hold a usable model: "
                         f"{e}") from e
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

    def __init__(self, cfg, workdir: str, *, allow_config_change=()):
        # Checks first, cheapest first: nothing expensive starts before they pass.
        validate(cfg)
        check_config(cfg)                 # train.loggers: a missing extra is named here
        self.cfg = cfg
        self.workdir = workdir
        workdir_lib.prepare(workdir)
        check_model_path(cfg.model.path)
        self.resuming = workdir_lib.has_checkpoints(workdir)
        allow = run_config.check_allow_list(allow_config_change)
        self.config_changes = run_config.check_resume(cfg, workdir, allow) if self.resuming else []
        train_records, eval_records = self.load_records()

        self.model = load_model(cfg)
        self.mcfg = self.model.config
        tok = self.model.tokenizer
        if tok is None:
            raise ModelError(f"model directory {cfg.model.path!r} has no tokenizer files; RL "
                             "needs one to turn completions into text for the verifiers.")
        self.tokenizer = tok
        self.eos_ids = tuple(self.model.generation_eos_ids)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.seq_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens

        self.algo_cfg = algo_config(cfg)
        self.optimizer_cfg = optimizer_config(cfg)
        self.lr, self.lr_note = derived_learning_rate(cfg)
        self.logger_args = dict(loggers=cfg.train.loggers, config=cfg, lr=self.lr,
                                lr_note=self.lr_note)
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
        # Several processes: each takes an equal share of every generation round.
        procs = self.runtime.num_processes
        gen_batch = algo.generation_batch_size(cfg.algo.prompts_per_step,
                                               cfg.algo.generation_batch_multiplier)
        try:
            self.loader = data.make_prompt_loader(
                train_records, self.prompt_tokenizer, batch_size=-(-gen_batch // procs) * procs,
                seed=cfg.data.seed)
        except ValueError as e:      # too few usable prompts for one generation batch
            raise DataError(f"data.train = {cfg.data.train!r}: {e}") from e
        if self.loader.num_too_long:
            _log(f"[data] {self.loader.num_too_long} training prompts longer than "
                 f"data.max_prompt_len={cfg.data.max_prompt_len} were skipped")
        eval_prompts = [(self.prompt_tokenizer(r), r) for r in eval_records]
        self.eval_prompts = [(ids, r) for ids, r in eval_prompts
                             if len(ids) <= cfg.data.max_prompt_len][:cfg.eval.num_prompts]
        if not self.eval_prompts:
            raise DataError(f"no held-out prompts: {len(eval_records)} evaluation records, none "
                            f"within data.max_prompt_len={cfg.data.max_prompt_len} tokens. Give "
                            "data.eval, raise data.eval_size (a file's first min(data.eval_size, "
                            "10%) rows are held out) or data.max_prompt_len.")

        self.checkpointer = Checkpointer(
            os.path.join(workdir, workdir_lib.CHECKPOINTS), keep=cfg.train.keep_checkpoints,
            log=_log, agree=lambda ok: all(self.runtime.allgather_json(bool(ok))))
        self.stopping = GracefulStop(_log)
        self.health = VerifierHealth()
        self.scorer = ScoringService(num_workers=cfg.rewards.num_workers,
                                     timeout_s=cfg.rewards.timeout_s,
                                     batch_deadline_s=cfg.rewards.batch_deadline_s,
                                     recycle_after=cfg.rewards.recycle_after,
                                     reward_map=self.reward_map,
                                     reward_options=self.reward_options)

    def load_records(self) -> tuple[list[dict], list[dict]]:
        """The training and held-out records, each data source mapped to a verifier and every
        ground truth checked by it; bad rows skipped and reported with file and line."""
        def show(report):
            if report.skipped:
                _log(f"[data] {report.summary()}")

        train, held_out, _ = data.load_train_and_eval(self.cfg.data, on_report=show)
        try:   # rewards.custom: the user's reward file, scored in the workers (rewards/custom.py)
            self.reward_map, self.reward_options = custom_reward.setup(
                self.cfg.rewards, json_option(self.cfg, "rewards.map"))
            verifiers, bad = check_records(train + held_out, self.reward_map)
            note = custom_reward.door_check(self.cfg.rewards, self.reward_map,
                                            self.reward_options, train)
            if note:
                _log(note)
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
        _log("[data] verifiers: " + ", ".join(f"{s} -> {v}" for s, v in sorted(verifiers.items())))
        if not train:
            raise DataError(f"no usable training rows in data.train = {self.cfg.data.train!r} "
                            "(every row was skipped; see the [data] lines above).")
        return train, held_out

    # -- the three device-facing calls and scoring ----------------------------------------------
    def generate(self, params, prompt_ids, *, n: int, temperature: float, seed: int,
                 top_p: float | None = None, top_k: int | None = None,
                 max_new_tokens: int | None = None, stream: bool = False):
        """Rollouts of the current policy (params as the runtime's rollout takes them): a
        rollout.RolloutResult, or with ``stream=True`` a rollout.RolloutStream of the groups in
        the order they finish."""
        r = self.cfg.rollout
        call = self.runtime.stream if stream else self.runtime.generate
        return call(
            self.model, params, prompt_ids, rollouts_per_prompt=n,
            max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=temperature,
            top_p=r.top_p if top_p is None else top_p, top_k=r.top_k if top_k is None else top_k,
            seed=seed, eos_ids=self.eos_ids)

    def score(self, records: list[dict], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [G, N] for rollouts [G, N, S], scored in the worker pool; every verdict is
        counted in self.health (the current step's or evaluation's)."""
        g, n = lengths.shape
        flat_records, texts = [], []
        for gi in range(g):
            for ni in range(n):
                flat_records.append(records[gi])
                texts.append(self.tokenizer.decode(tokens[gi, ni, :int(lengths[gi, ni])].tolist(),
                                                   skip_special_tokens=True))
        results = self.scorer.score_batch(flat_records, texts)
        self.health.add(flat_records, results)
        return np.array([r.score for r in results], np.float32).reshape(g, n)

    def collect(self, params, data_iter, step: int) -> tuple[dict, dict]:
        """This process's rows of step `step`'s update batch and the step's rollout metrics,
        with the verifier health per data source; stops when a verifier failed on every sample
        of a data source (checked before a dynamic-sampling error, which it would cause)."""
        params = self.runtime.rollout_params(params)
        self.health.reset()
        try:
            batch, metrics = self.collector.collect(params, data_iter, step, self.generate,
                                                    self.score)
        except algo.DynamicSamplingError as e:
            self._check_health(self.health, f"step {step + 1}", gather=False)
            raise TrainingStopped(f"step {step + 1}: {e}") from e
        health = self._check_health(self.health, f"step {step + 1}")
        metrics.update(health.metrics())
        return batch, metrics

    def _check_health(self, health: VerifierHealth, where: str,
                      gather: bool = True) -> VerifierHealth:
        """Every process's verdicts together (so all log the same metrics and stop together);
        raises VerifierError when a data source failed on every sample."""
        if gather:
            health = VerifierHealth.merged(self.runtime.allgather_json(health.to_json()))
        try:
            health.check(where)
        except VerifierFailure as e:
            raise VerifierError(str(e)) from None
        return health

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
        step_health, self.health = self.health, VerifierHealth()    # the evaluation's own
        bar = progress(total=len(prompts), desc=f"eval at step {step}: {k} samples per prompt",
                       unit="prompt", enabled=self.runtime.process_index == 0)
        try:
            for start in range(0, len(prompts), chunk):
                part = prompts[start:start + chunk]
                res = self.generate(params, [ids for ids, _ in part], n=k,
                                    temperature=c.temperature, top_p=c.top_p, top_k=0,
                                    max_new_tokens=c.max_new_tokens if c.max_new_tokens > 0
                                    else None, seed=10_000_019 + first + start)
                rewards.append(self.score([r for _, r in part], res.tokens, res.lengths))
                bar.update(len(part))
            self._check_health(self.health, f"the evaluation at step {step}")
        finally:
            bar.close()
            self.health = step_health
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
        enabled = self.runtime.process_index == 0
        index = self.runtime.process_index
        restored = self.checkpointer.restore_latest(
            self.runtime.place_state(state), check_meta=self._check_meta, move_broken=enabled)
        if restored is not None:
            ckpt_step, state, meta = restored
            try:
                data_iter.set_state(meta["data_per_process"][index])
            except ValueError as e:
                raise DataError(f"the training data no longer matches checkpoint step "
                                f"{ckpt_step} (data.train = {cfg.data.train!r} changed on disk?): "
                                f"{e}. Restore the data, or start a new run with another "
                                "--workdir.") from e
            self.collector.load_state_dict(meta.get("collect_per_process", [{}] * (index + 1))[index])
            _log(f"[resume] from checkpoint step {ckpt_step} in {self.workdir}")
            self._record_config(ckpt_step)
            logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard,
                                   enabled=enabled, resume_step=ckpt_step, **self.logger_args)
            if logger.kept:
                _log(f"[metrics] lines logged after step {ckpt_step} kept in {logger.kept}")
            return state, data_iter, meta["counters"], logger, None
        self._record_config(None)
        logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard, enabled=enabled,
                               **self.logger_args)
        if logger.kept:
            _log(f"[metrics] fresh start: the earlier history kept in {logger.kept}")
        _log(f"[config] {self.lr_note}")
        if cfg.sft.steps > 0:
            state = self.new_state(self.warm_start(state.params))
        state = self.runtime.place_state(state)
        first = self.evaluate(state.params, 0)
        logger.write(0, first)
        _log(f"[eval] before RL: pass@1 = {first['eval/pass@1']:.3f}")
        return state, data_iter, {"skipped_steps": 0, "generated_samples": 0}, logger, first

    def _check_meta(self, meta: dict) -> None:
        """A checkpoint's meta must hold this process's data position and the counters."""
        index = self.runtime.process_index
        if not isinstance(meta.get("data_per_process"), list) or \
                len(meta["data_per_process"]) <= index or "counters" not in meta:
            raise CheckpointError(f"meta lacks this process's data position or the counters "
                                  f"(keys: {sorted(meta)})")

    def _record_config(self, resumed_from: int | None) -> None:
        if self.runtime.process_index == 0:
            for line in run_config.record(self.cfg, self.workdir, resumed_from=resumed_from,
                                          accepted=self.config_changes):
                _log(line)

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
        self.stopping.install()         # SIGINT/SIGTERM: finish the step, save, stop
        state, data_iter, counters, logger, first_eval = self.start()
        from tqdm import tqdm
        start = int(state.step)
        bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
                   desc="BroRL", disable=self.runtime.process_index != 0, file=sys.stdout)
        metrics: dict[str, Any] = {}
        stop = self.stop_requested()            # a signal during the start
        for step in bar:
            if stop:
                break
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
            stop = self.stop_requested()        # SIGINT/SIGTERM: save this step, then stop
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps or stop:
                self.save(done, state, data_iter, counters)
            self.checkpointer.check()   # a failed asynchronous save stops the run here
        bar.close()
        self.checkpointer.wait()
        self.finish(logger, metrics, first_eval)
        self.stopping.uninstall()
        if stop:
            raise self.stopping.stop(self.checkpointer.latest_step())
        return RunResult(state, metrics)

    def stop_requested(self) -> bool:
        """Whether any process received SIGINT/SIGTERM (all processes stop at the same step)."""
        if self.runtime.num_processes == 1:
            return self.stopping.requested
        return any(self.runtime.allgather_json(self.stopping.requested))

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
        self.stopping.uninstall()
        self.scorer.close()
        self.checkpointer.close()


def _update_metrics(upd: dict) -> dict:
    return {k if k.startswith("mass_balance/") else
            f"loss/{k}" if k in LOSS_KEYS else f"update/{k}": float(v) for k, v in upd.items()}


def train(cfg, workdir: str, *, allow_config_change=()) -> RunResult:
    trainer = Trainer(cfg, workdir, allow_config_change=allow_config_change)
    try:
        return trainer.run()
    finally:
        trainer.close()


def restore_params(cfg, workdir: str, step: int | None = None):
    """(model, params, step) of checkpoint `step` (default: the newest that restores) in
    `workdir`. Reads only: never creates the directory, never moves or cleans anything."""
    workdir_lib.require_existing(workdir)
    ckpt_dir = os.path.join(workdir, workdir_lib.CHECKPOINTS)
    if not workdir_lib.has_checkpoints(workdir):
        raise CheckpointError(f"no complete checkpoint in {ckpt_dir}; train first.")
    model = load_model(cfg)
    ckpt = Checkpointer(ckpt_dir, read_only=True, log=_log)
    try:
        optimizer = algo.make_optimizer(optimizer_config(cfg))
        template = algo.create_train_state(model.params, optimizer,
                                           with_reference=cfg.algo.kl_coef > 0)
        if step is None:
            step, state, _ = ckpt.restore_latest(template, move_broken=False)
        elif step not in ckpt.all_steps():
            raise CheckpointError(f"checkpoint step {step} not in {ckpt_dir}; available: "
                                  f"{ckpt.all_steps()}.")
        else:
            try:
                state, _ = ckpt.restore(step, template)
            except Exception as e:  # noqa: BLE001 - name the step and the cause
                from brorl_jax.train.checkpoint import first_line
                raise CheckpointError(f"checkpoint step {step} in {ckpt_dir} cannot be restored: "
                                      f"{first_line(e)}. Available: {ckpt.all_steps()}; give "
                                      "another --step or none (the newest that restores).") from e
    finally:
        ckpt.close()
    return model, state.params, step
