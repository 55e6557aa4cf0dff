"""The outer loop in plain Python: the RL step (train/step.py) over the training data, with
checkpoints, logging, evaluation and signals around it.

    ctx = build_context(cfg, eval_records)                         # train/context.py
    for step in range(start, cfg.train.steps):
        train_state, collect_state, metrics = rl_step(ctx, train_state, collect_state,
                                                      data_iter, step)
        evaluation every eval.every steps and at the end (train/evaluation.evaluate(ctx, ...)),
        metrics logged every train.log_every steps (and at every evaluation and the last step),
        an asynchronous checkpoint every train.checkpoint_every steps.

`Trainer` owns the side effects of a run: the work directory, the data iterator, the
checkpointer, the metrics logger and the signal handlers; the context (model, tokenizer, runtime,
scorer, evaluation prompts) is built once and is all the step, evaluation and warm start read.

Resuming: the checkpoint holds the train state, the data-iterator state, the CollectState (per
process) and counters; every random draw of step s is derived from (seed, s), so a resumed run
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

from brorl_jax import algo, data, models
from brorl_jax.config import as_run_config, derived_learning_rate, optimizer_config
from brorl_jax.errors import CheckpointError, DataError, TrainingStopped
from brorl_jax.train import door, evaluation
from brorl_jax.train.context import (
    RunContext,
    base_model_dir,
    build_context,
    check_model_path,
    load_model,
    load_records,
    log as _log,
    make_prompt_tokenizer,
)
from brorl_jax.train.sft import check_references, run_warm_start
from brorl_jax.train.step import LOSS_KEYS, rl_step  # noqa: F401 - re-exported
from brorl_jax.workdir import layout, saved_config
from brorl_jax.workdir.checkpoint import Checkpointer
from brorl_jax.workdir.logger import MetricsLogger, plot_metrics
from brorl_jax.workdir.signals import GracefulStop

__all__ = ["Trainer", "RunResult", "train", "restore_params", "check_model_path", "load_model"]


@dataclasses.dataclass
class RunResult:
    """What `Trainer.run` returns: the final TrainState and CollectState, the last step's
    metrics."""
    state: algo.TrainState
    metrics: dict
    collect_state: algo.CollectState = dataclasses.field(default_factory=algo.CollectState)


class Trainer:
    """The loop, checkpoints, logging and signals of a run (module docstring)."""

    def __init__(self, cfg, workdir: str, *, allow_config_change=()):
        # Checks first, cheapest first: nothing expensive starts before they pass.
        self._facts = door.check_training(cfg)
        cfg = self._facts.cfg           # the typed RunConfig from here on
        self.cfg = cfg
        self.workdir = workdir
        layout.prepare(workdir)     # reads only: a locked directory stays as it was
        self.lock = layout.acquire(workdir, process_index=jax.process_index(), log=_log)
        try:                            # released on any failure from here (a notebook goes on)
            layout.check_writable(workdir)
            self._build(cfg, workdir, allow_config_change)
        except BaseException:
            self.lock.release()
            raise

    def _build(self, cfg, workdir: str, allow_config_change) -> None:
        self.resuming = layout.has_checkpoints(workdir)
        allow = saved_config.check_allow_list(allow_config_change)
        self.config_changes = saved_config.check_resume(cfg, workdir, allow) if self.resuming else []
        train_records, eval_records = load_records(cfg)
        if cfg.sft.steps > 0:           # before the model loads
            check_references(train_records)
        self.data_metrics = data.check_overlap(train_records, eval_records, log=_log)  # step 0
        self.lr, self.lr_note = derived_learning_rate(cfg)
        model = load_model(cfg)
        if self._facts.model_cfg is None:       # a .gguf model: its config came with it
            self._facts = door.check_loaded_model(cfg, model.config)
        # the training data's checks before the context's (evaluation prompts, runtime, scorer)
        self.loader = self._make_loader(train_records, make_prompt_tokenizer(cfg, model))
        self.logger_args = dict(loggers=cfg.train.loggers, config=cfg, lr=self.lr,
                                lr_note=self.lr_note)
        self.ctx: RunContext = build_context(
            cfg, eval_records, model=model, records=train_records + eval_records,
            paused_engine_bytes=self._facts.paused_engine_bytes)
        try:                            # the scoring workers run from here: stop them on error
            layout.check_lock(self.lock, self.runtime.allgather_json)
            self.checkpointer = Checkpointer(
                os.path.join(workdir, layout.CHECKPOINTS), keep=cfg.train.keep_checkpoints,
                log=_log, agree=lambda ok: all(self.runtime.allgather_json(bool(ok))))
        except BaseException:
            self.ctx.close()
            raise
        self.updates_per_step = cfg.updates_per_step
        self.skipped_in_a_row = 0       # RL steps with every update non-finite (_check_skips)
        self.stopping = GracefulStop(_log)

    def _make_loader(self, train_records, prompt_tokenizer):
        cfg = self.cfg
        # Several processes: each takes an equal share of every generation round (the runtime
        # spans jax.process_count() processes).
        procs = jax.process_count()
        gen_batch = cfg.round_prompts
        try:
            loader = data.make_prompt_loader(
                train_records, prompt_tokenizer,
                batch_size=-(-gen_batch // procs) * procs, seed=cfg.data.seed)
        except ValueError as e:      # too few usable prompts for one generation batch
            raise DataError(f"data.train = {cfg.data.train!r}: {e}") from e
        if loader.num_too_long:
            _log(f"[data] {loader.num_too_long} training prompts longer than "
                 f"data.max_prompt_len={cfg.data.max_prompt_len} were skipped")
        return loader

    # -- what the context holds, under the names callers (notebook, experiments) use ------------
    @property
    def model(self):
        return self.ctx.model

    @property
    def tokenizer(self):
        return self.ctx.tokenizer

    @property
    def prompt_tokenizer(self):
        return self.ctx.prompt_tokenizer

    @property
    def runtime(self):
        return self.ctx.runtime

    def evaluate(self, params, step: int) -> dict:
        """pass@k / mean@k on the held-out prompts (train/evaluation.evaluate); a signal during
        it stops the run at once (there is no safe point inside)."""
        with self.stopping.during(f"the evaluation at step {step}",
                                  self.checkpointer.latest_step()):
            return evaluation.evaluate(self.ctx, params, step)

    # -- the run ----------------------------------------------------------------------------------
    def start(self):
        """(train state, collect state, data iterator, counters, logger, metrics at step 0 or
        None): restored from the latest checkpoint, or a fresh start (warm start, evaluation
        before RL)."""
        cfg, ctx = self.cfg, self.ctx
        state = ctx.new_train_state(ctx.model.params)
        data_iter = iter(self.loader)
        enabled = self.runtime.process_index == 0
        index = self.runtime.process_index
        restored = self.checkpointer.restore_latest(
            algo.adapters.checkpoint_template(self.runtime.place_state(state), cfg.update),
            check_meta=self._check_meta, move_broken=enabled)
        if restored is not None:
            ckpt_step, state, meta = restored
            # under LoRA: the base from model.path, the saved merges merged into it again, and
            # laid out beside the restored adapters
            if algo.adapters.uses_lora(state):
                state = self.runtime.relayout(algo.adapters.from_checkpoint(
                    state, ctx.model.params, ctx.mcfg, self.runtime.place_params))
            try:
                data_iter.set_state(meta["data_per_process"][index])
            except ValueError as e:
                raise DataError(f"the training data no longer matches checkpoint step "
                                f"{ckpt_step} (data.train = {cfg.data.train!r} changed on disk?): "
                                f"{e}. Restore the data, or start a new run with another "
                                "--workdir.") from e
            collect_state = algo.CollectState.from_json(
                meta.get("collect_per_process", [{}] * (index + 1))[index])
            _log(f"[resume] from checkpoint step {ckpt_step} in {self.workdir}")
            self._record_config(ckpt_step)
            logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard,
                                   enabled=enabled, resume_step=ckpt_step, **self.logger_args)
            if logger.kept:
                _log(f"[metrics] lines logged after step {ckpt_step} kept in {logger.kept}")
            return state, collect_state, data_iter, meta["counters"], logger, None
        self._record_config(None)
        logger = MetricsLogger(self.workdir, tensorboard=cfg.train.tensorboard, enabled=enabled,
                               **self.logger_args)
        if logger.kept:
            _log(f"[metrics] fresh start: the earlier history kept in {logger.kept}")
        _log(f"[config] {self.lr_note}")
        if cfg.sft.steps > 0:
            state = ctx.new_train_state(self.warm_start(state.params))
        state = self.runtime.place_state(state)
        first = self.evaluate(state.params, 0)
        logger.write(0, {**first, **self.data_metrics})
        _log(f"[eval] before RL: pass@1 = {first['eval/pass@1']:.3f}")
        counters = {"skipped_steps": 0, "generated_samples": 0}
        return state, algo.CollectState(), data_iter, counters, logger, first

    def warm_start(self, params):
        """The supervised warm start (train/sft.py), or the one this work directory already
        finished with the same settings (a restart after an interruption does not redo it); a
        signal during it stops the run at once; the result is kept as warm_start_model/."""
        kept = layout.kept_warm_start(self.workdir, self.cfg, log=_log)
        if kept is not None:
            return kept
        with self.stopping.during("the warm start"):
            params = run_warm_start(self.ctx, params, self.loader.prompts)
        if self.runtime.process_index == 0:
            layout.keep_warm_start(self.workdir, self.cfg, self.ctx.model.with_params(params))
        return params

    def _check_skips(self, step: int, metrics: dict) -> None:
        """The NaN guard's skips of `step`: a line when it skipped some updates, a warning when
        it skipped all; train.max_skipped_steps steps in a row with every update skipped stop
        the run (TrainingStopped, exit code 2), since it cannot learn. The last checkpoint is
        kept as it is."""
        skipped, updates = int(metrics["update/skipped"]), self.updates_per_step
        if skipped < updates:
            self.skipped_in_a_row = 0
            if skipped:
                _log(f"[nan-guard] step {step}: {skipped} of {updates} updates non-finite "
                     "(loss or gradient); skipped")
            return
        self.skipped_in_a_row += 1
        limit = self.cfg.train.max_skipped_steps
        _log(f"[nan-guard] warning: step {step}: every update non-finite and skipped (loss "
             f"{metrics.get('loss/loss', float('nan')):.4g}, grad norm "
             f"{metrics.get('update/grad_norm', float('nan')):.4g}, reward mean "
             f"{metrics.get('reward/mean', float('nan')):.4g}); {self.skipped_in_a_row} such "
             f"step(s) in a row (train.max_skipped_steps={limit})")
        if limit and self.skipped_in_a_row >= limit:
            raise TrainingStopped(
                f"{self.skipped_in_a_row} RL steps in a row had every update non-finite (steps "
                f"{step - self.skipped_in_a_row + 1}-{step}): the run is not learning. Likely "
                f"causes: a learning rate that diverged the weights ({self.lr:g}: lower optim.lr "
                "or optim.base_lr), rewards too large for float32 arithmetic (rescale them). "
                "The last checkpoint is kept; train.max_skipped_steps=0 never stops.")

    def _check_meta(self, meta: dict) -> None:
        """A checkpoint's meta must hold this process's data position and the counters."""
        index = self.runtime.process_index
        if not isinstance(meta.get("data_per_process"), list) or \
                len(meta["data_per_process"]) <= index or "counters" not in meta:
            raise CheckpointError(f"meta lacks this process's data position or the counters "
                                  f"(keys: {sorted(meta)})")

    def _record_config(self, resumed_from: int | None) -> None:
        if self.runtime.process_index == 0:
            for line in saved_config.record(self.cfg, self.workdir, resumed_from=resumed_from,
                                            accepted=self.config_changes):
                _log(line)
            if resumed_from is None:
                saved_config.record_base_model(self.workdir, base_model_dir(self.cfg))

    def run(self) -> RunResult:
        """Trains to cfg.train.steps, resuming from the latest checkpoint in the workdir."""
        cfg, ctx = self.cfg, self.ctx
        self.stopping.install()         # SIGINT/SIGTERM: finish the step, save, stop
        state, collect_state, data_iter, counters, logger, first_eval = self.start()
        from tqdm import tqdm
        start = int(state.step)
        bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
                   desc="BroRL", disable=self.runtime.process_index != 0, file=sys.stdout)
        schedule = algo.learning_rate_schedule(ctx.optimizer_cfg)
        metrics: dict[str, Any] = {}
        stop = self.stop_requested()            # a signal during the start
        spent = budget_spent(cfg, counters)     # resumed after the sample budget was spent
        for step in () if spent else bar:
            if stop:
                break
            t0 = time.perf_counter()
            state, collect_state, metrics = rl_step(ctx, state, collect_state, data_iter, step)
            done = step + 1
            if metrics["update/skipped"]:
                counters["skipped_steps"] += 1
            self._check_skips(step, metrics)
            if metrics.get("ref_reset"):
                _log(f"[reference] reset at step {done}" + (
                    " (optimizer state cleared)" if cfg.algo.reset_optimizer_on_ref_reset else ""))
            counters["generated_samples"] += metrics["perf/generated_samples"]
            wall = time.perf_counter() - t0
            metrics.update({
                "time/step_s": wall,
                "perf/samples_per_s": metrics["perf/generated_samples"] / wall,
                "perf/tokens_per_s": metrics["rollout/useful_tokens"] / wall,
                "counters/skipped_steps": counters["skipped_steps"],
                "counters/generated_samples": counters["generated_samples"],
                "optim/lr": float(schedule(done * self.updates_per_step - 1)),
            })
            last = done == cfg.train.steps or budget_spent(cfg, counters)
            evaluated = last or bool(cfg.eval.every and done % cfg.eval.every == 0)
            if evaluated:
                metrics.update(self.evaluate(state.params, done))
            stop = self.stop_requested()        # SIGINT/SIGTERM: save this step, then stop
            if should_log(done, cfg.train.log_every, evaluated=evaluated, stop=stop):
                logger.write(done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            pass_rate=f"{metrics['dynamic_sampling/pass_rate']:.2f}")
            if done % cfg.train.checkpoint_every == 0 or last or stop:
                self.save(done, state, collect_state, data_iter, counters)
            self.checkpointer.check()   # a failed asynchronous save stops the run here
            if last:
                break
        bar.close()
        self.checkpointer.wait()
        self.finish(logger, metrics, first_eval)
        self.stopping.uninstall()
        if stop:
            raise self.stopping.stop(self.checkpointer.latest_step())
        return RunResult(state, metrics, collect_state)

    def stop_requested(self) -> bool:
        """Whether any process received SIGINT/SIGTERM (all processes stop at the same step)."""
        if self.runtime.num_processes == 1:
            return self.stopping.requested
        return any(self.runtime.allgather_json(self.stopping.requested))

    def save(self, step: int, state, collect_state: algo.CollectState, data_iter,
             counters: dict) -> None:
        """An asynchronous checkpoint: the state, every process's data position and
        CollectState, and the counters."""
        meta = {"data_per_process": self.runtime.allgather_json(data_iter.get_state()),
                "collect_per_process": self.runtime.allgather_json(collect_state.to_json()),
                "counters": counters}
        self.checkpointer.save(step, algo.adapters.checkpoint_view(state), meta)

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
        try:
            self.stopping.uninstall()
            self.ctx.close()
            self.checkpointer.close()
        finally:
            self.lock.release()


def budget_spent(cfg, counters: dict) -> bool:
    """train.sample_budget: whether the run has generated the samples it was given."""
    budget = cfg.train.sample_budget
    return bool(budget) and counters["generated_samples"] >= budget


def should_log(done: int, log_every: int, *, evaluated: bool, stop: bool) -> bool:
    """train.log_every: the metrics of every k-th step, and of every step that evaluated (the
    last one always does) or stops the run, are written; the others are computed only (the
    progress bar shows them)."""
    return done % log_every == 0 or evaluated or stop


def train(cfg, workdir: str, *, allow_config_change=()) -> RunResult:
    trainer = Trainer(cfg, workdir, allow_config_change=allow_config_change)
    try:
        return trainer.run()
    finally:
        trainer.close()


def restore_params(cfg, workdir: str, step: int | None = None, *,
                   model: models.Model | None = None):
    """(model, params, step) of checkpoint `step` (default: the newest that restores) in
    `workdir`; `model` (e.g. a run context's) is the template, loaded from the config when not
    given. Reads only: never creates the directory, never moves or cleans anything. Under LoRA
    the params are the base (model.path's, its merges merged again) and the adapters."""
    model, saved, step = restore_checkpoint(cfg, workdir, step, model=model)
    return model, algo.adapters.from_checkpoint(saved, model.params, model.config).params, step


def restore_checkpoint(cfg, workdir: str, step: int | None = None, *,
                       model: models.Model | None = None):
    """(model, the train state as the checkpoint holds it, step): restore_params before the base
    goes back in (algo.adapters.checkpoint_view: under LoRA the adapters, their optimizer state
    and the merged adapters, no base)."""
    layout.require_existing(workdir)
    ckpt_dir = os.path.join(workdir, layout.CHECKPOINTS)
    if not layout.has_checkpoints(workdir):
        raise CheckpointError(f"no complete checkpoint in {ckpt_dir}; train first.")
    saved_config.check_base_model(workdir, base_model_dir(cfg))
    model = load_model(cfg, weights_from_checkpoint=True) if model is None else model
    if models.lora.enabled(model.config) and models.hf.has_no_weights(base_model_dir(cfg)):
        raise CheckpointError(f"model.path {base_model_dir(cfg)!r} holds the base model's config "
                              "and tokenizer without its weights, and a LoRA checkpoint holds "
                              "only the adapters: point --config.model.path at the base model.")
    try:
        return _restore_state(cfg, ckpt_dir, step, model)
    except CheckpointError as e:
        differs = saved_config.differences(cfg, workdir)
        if not differs:
            raise
        raise CheckpointError(f"{e} The config differs from the run's own "
                              f"({saved_config.CONFIG_FILE}) in {'; '.join(differs)}: without "
                              "--config, evaluate and export read the run's own.") from e


def _restore_state(cfg, ckpt_dir: str, step: int | None, model: models.Model):
    ckpt = Checkpointer(ckpt_dir, read_only=True, log=_log)
    try:
        optimizer = algo.make_optimizer(optimizer_config(cfg))
        if models.lora.enabled(model.config):
            state = algo.adapters.lora_train_state(model.params, model.config, optimizer, 0)
        else:
            state = algo.create_train_state(model.params, optimizer,
                                            with_reference=cfg.algo.kl_coef > 0)
        template = algo.adapters.checkpoint_template(state, as_run_config(cfg).update)
        if step is None:
            step, state, _ = ckpt.restore_latest(template, move_broken=False)
        elif step not in ckpt.all_steps():
            raise CheckpointError(f"checkpoint step {step} not in {ckpt_dir}; available: "
                                  f"{ckpt.all_steps()}.")
        else:
            try:
                state, _ = ckpt.restore(step, template(step) if callable(template) else template)
            except Exception as e:  # noqa: BLE001 - name the step and the cause
                from brorl_jax.workdir.checkpoint import first_line
                raise CheckpointError(f"checkpoint step {step} in {ckpt_dir} cannot be restored: "
                                      f"{first_line(e)}. Available: {ckpt.all_steps()}; give "
                                      "another --step or none (the newest that restores).") from e
    finally:
        ckpt.close()
    return model, state, step
