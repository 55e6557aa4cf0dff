"""Checkpoints with orbax: the training state, RNG and data-iterator state, saved asynchronously.

What is saved at step s (after s completed RL steps):
  state  - the TrainState pytree (policy params, optimizer state, reference params, step)
  meta   - JSON: data-iterator state, RNG key data, counters (skipped steps, samples generated)

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
during a save leaves no half-written checkpoint behind: `latest_step()` only sees finished ones,
and `restore()` resumes from the newest of those. Orbax coordinates the save across hosts.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def _maybe_crash_during_save(step: int) -> None:
    """Fault injection for the kill-and-resume tests: BRORL_KILL_DURING_SAVE=<step> kills this
    process with SIGKILL right after the asynchronous save of <step> has started, i.e. while
    orbax is still writing it. Unset in normal runs."""
    target = os.environ.get("BRORL_KILL_DURING_SAVE")
    if target is not None and int(target) == step:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` with the two items this project saves."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an asynchronous save of `state` and `meta` at `step`; returns at once."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        _maybe_crash_during_save(step)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores step `step` into the structure, shapes and shardings of `abstract_state`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def wait(self) -> None:
        """Blocks until the last asynchronous save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
