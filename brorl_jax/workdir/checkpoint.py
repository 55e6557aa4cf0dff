"""Checkpoints with orbax: the training state, RNG and data-iterator state, saved asynchronously.

What is saved at step s (after s completed RL steps):
  state  - the TrainState pytree (policy params, optimizer state, reference params, step)
  meta   - JSON: data-iterator state, RNG key data, counters (skipped steps, samples generated)

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
during a save leaves no half-written checkpoint behind: `latest_step()` only sees finished ones.
Orbax coordinates the save across hosts.

Faults:
  * restore: `restore_latest` tries the newest checkpoint, then older ones; a checkpoint that
    cannot be restored (a damaged file, a wrong structure, unreadable meta) is logged with the
    reason and, once an older one restored, moved to checkpoints/broken/<step>-<time> (never
    deleted). When none restores, nothing is moved and CheckpointError lists each step's reason.
  * save: before starting a save the free disk space is compared with the size of a checkpoint;
    too little stops the run at that save (DiskFullError) with the last complete checkpoint
    intact. A write that fails anyway (asynchronously) is surfaced at the next `check()` (the
    loop calls it after every step), the next save or `wait()`, naming the step whose save failed.
"""
from __future__ import annotations

import datetime
import errno
import logging as std_logging
import os
import shutil
import sys
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from brorl_jax.errors import CheckpointError, DiskFullError, debug_enabled

BROKEN = "broken"


def _maybe_crash_during_save(step: int) -> None:
    """Fault injection for the kill-and-resume tests: BRORL_KILL_DURING_SAVE=<step> kills this
    process with SIGKILL right after the asynchronous save of <step> has started, i.e. while
    orbax is still writing it. Unset in normal runs."""
    target = os.environ.get("BRORL_KILL_DURING_SAVE")
    if target is not None and int(target) == step:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _free_bytes(directory: str) -> int:
    """Free space where checkpoints go. Fault injection for the disk-full test:
    BRORL_SAVE_FREE_BYTES=<n> pretends only n bytes are free. Unset in normal runs."""
    fake = os.environ.get("BRORL_SAVE_FREE_BYTES")
    if fake is not None:
        return int(fake)
    return shutil.disk_usage(directory).free


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def is_disk_full(exc: BaseException) -> bool:
    """True for ENOSPC anywhere in the exception chain (OSError, or TensorStore's text)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def first_line(exc: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message`, without TensorStore's spec dump."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    for cut in (" See full TensorStore details", " [tensorstore_spec"):
        line = line.split(cut)[0]
    return f"{type(exc).__name__}: {line[:limit]}"


def _from_orbax(exc: BaseException | None) -> bool:
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _OrbaxErrorFilter(std_logging.Filter):
    """Orbax logs every failed background write with a full traceback at ERROR level (hundreds
    of lines per failure); the error is re-raised to the loop, which reports it in one message
    and writes the traceback to the error log. Such records keep their first line only (the
    full record with --debug)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if debug_enabled() or record.levelno < std_logging.ERROR or not record.exc_info:
            return True
        if "orbax" in record.pathname or _from_orbax(record.exc_info[1]):
            first = record.getMessage().strip().splitlines()
            record.msg, record.args = (first[0][:200] if first else ""), None
            record.exc_info, record.exc_text = None, None
        return True


_FILTER = _OrbaxErrorFilter()


def _quiet_unraisable(previous):
    """After a failed restore, TensorStore completes the reads orbax abandoned and calls back
    into orbax's closed event loop, and abandoned orbax coroutines are collected with their
    errors: each reports an unraisable exception (dozens of tracebacks after the real message).
    Those are dropped unless --debug; the failure itself was already reported."""

    def hook(unraisable):
        exc = unraisable.exc_value
        if not debug_enabled() and (
                (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
                or _from_orbax(exc)):
            return
        previous(unraisable)

    hook.brorl_quiet = True
    return hook


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` with the two items this project saves.

    read_only=True (evaluate, export): never creates the directory and never cleans up orbax's
    temporary directories (a training run may be writing one right now)."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False, log: Callable[[str], None] = print,
                 agree: Callable[[bool], bool] = lambda ok: ok):
        """`agree(ok)` -> whether ok holds on every process (the trainer passes an all-gather):
        several processes take the same decision on a save's free space and a restore."""
        self.directory = os.path.abspath(directory)
        self.read_only = read_only
        self._log = log
        self._agree = agree
        self._pending: int | None = None       # step of the save that may still be running
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoints directory {self.directory}; train first.")
        if not getattr(sys.unraisablehook, "brorl_quiet", False):
            sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
        for name in ("absl", "asyncio"):     # orbax logs through absl; abandoned tasks: asyncio
            if _FILTER not in std_logging.getLogger(name).filters:
                std_logging.getLogger(name).addFilter(_FILTER)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an asynchronous save of `state` and `meta` at `step`; returns at once.
        Raises DiskFullError / CheckpointError (last complete checkpoint intact) when the
        previous save failed or the disk cannot hold another checkpoint."""
        self.wait()                     # the previous save: its error, if any, surfaces here
        problem = self._space_problem(step, state)
        if not self._agree(problem is None):
            raise DiskFullError(problem or self._space_message(step, "another process's disk"))
        self._pending = step
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - the synchronous part of the save failed
            raise self._save_error(step, e) from e
        _maybe_crash_during_save(step)

    def _space_problem(self, step: int, state: Any) -> str | None:
        steps = self.all_steps()
        if steps:
            need = _dir_bytes(os.path.join(self.directory, str(max(steps))))
        else:
            need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
        need = int(need * 1.1) + (1 << 20)
        free = _free_bytes(self.directory)
        if free < need:
            return self._space_message(step, f"{free / 2**20:.0f} MiB free, a checkpoint takes "
                                             f"~{need / 2**20:.0f} MiB")
        return None

    def _space_message(self, step: int, what: str) -> str:
        last = self.latest_step()
        resume = (f"the last complete checkpoint, step {last}, is intact and a restart resumes "
                  "from it" if last is not None else "no checkpoint was written yet")
        return (f"disk full: cannot save checkpoint step {step} in {self.directory} ({what}). "
                f"The run stopped at this save; {resume}. Free space (or move the work directory, "
                "or lower train.keep_checkpoints) and restart with the same --workdir.")

    def _save_error(self, step: int, exc: BaseException) -> CheckpointError:
        if is_disk_full(exc):
            return DiskFullError(self._space_message(step, "no space left on device"))
        last = self.latest_step()
        return CheckpointError(f"saving checkpoint step {step} in {self.directory} failed: "
                               f"{first_line(exc)}. The last complete checkpoint is "
                               f"{'step ' + str(last) if last is not None else 'none'}.")

    def check(self) -> None:
        """Raises the error of a finished asynchronous save, without waiting for one running
        (several processes wait only once the save is finished on all of them)."""
        if self._pending is not None and \
                self._agree(not self._manager.is_saving_in_progress()):
            self.wait()

    def wait(self) -> None:
        """Blocks until the last asynchronous save is complete on disk; raises its error."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(step if step is not None else -1, e) from e

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores step `step` into the structure, shapes and shardings of `abstract_state`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_latest(self, abstract_state: Any, *, check_meta: Callable[[dict], None] = None,
                       move_broken: bool = True) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that restores; None when there is none.
        abstract_state: the template, or a function of the step giving it.

        A checkpoint that fails (or whose meta `check_meta` rejects) is logged with the reason;
        the ones newer than the restored step are moved to checkpoints/broken/ when move_broken
        (so the run can write those steps again). Raises CheckpointError when none restores."""
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            return None
        failures = []
        for step in steps:
            error = None
            try:
                template = abstract_state(step) if callable(abstract_state) else abstract_state
                state, meta = self.restore(step, template)
                if check_meta is not None:
                    check_meta(meta)
            except Exception as e:  # noqa: BLE001 - any failure means: try the previous one
                error = first_line(e)
            if not self._agree(error is None):      # every process restores the same step
                error = error or "another process cannot restore it"
                failures.append((step, error))
                self._log(f"[checkpoint] step {step} cannot be restored: {error}")
                continue
            if failures:
                moved = [self._move_aside(s) for s, _ in failures] if move_broken else []
                self._agree(True)                   # the moves are done before anyone reloads
                self._manager.reload()
                self._log(f"[checkpoint] restored step {step} instead" + (
                    "; moved aside: " + ", ".join(moved) if moved else ""))
            return step, state, meta
        listing = "\n  ".join(f"step {s}: {why}" for s, why in failures)
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be restored:\n  {listing}\nNothing was "
            "moved or deleted. If the code or config changed since they were written, resume with "
            "the version that wrote them; otherwise start a new run with another --workdir (the "
            "run's metrics and checkpoints stay where they are).")

    def _move_aside(self, step: int) -> str:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        dest = os.path.join(self.directory, BROKEN, f"{step}-{stamp}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(os.path.join(self.directory, str(step)), dest)
        return os.path.relpath(dest, os.path.dirname(self.directory))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()
