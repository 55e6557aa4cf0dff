"""SIGINT / SIGTERM during training: stop at a safe point, not in the middle of a step.

The first signal only sets a flag and prints one line; the loop finishes the current step, saves
a checkpoint of it (waiting for the write to complete), shuts the scoring workers down and exits
with 130 (SIGINT) or 143 (SIGTERM), saying from which step a restart resumes. A second signal
stops at once (KeyboardInterrupt / errors.Interrupted): the in-flight checkpoint is finished by the
checkpointer's close and the restart resumes from the last complete one.

Phases with no safe point of their own -- the supervised warm start and an evaluation -- are
run inside `GracefulStop.during(what)`: a signal that arrives there stops at once (within the
Python step it interrupts: one SFT step or one decode step, seconds at most) instead of waiting
for the phase to end. A finished warm start is kept in WORKDIR/warm_start_model (workdir/layout.py),
so a restart does not run it again; an interrupted one is run again. A signal that arrived before
such a phase began (during an RL step) keeps the old behaviour: the step, its evaluation included,
finishes and is checkpointed.

The scoring workers ignore both signals (a terminal's Ctrl-C and a scheduler's SIGTERM reach the
whole process group); the trainer stops them itself.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from brorl_jax.errors import Interrupted

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopNow(KeyboardInterrupt):
    """Raised by the handler inside a phase without a safe point: a BaseException (as Ctrl-C's
    KeyboardInterrupt), so no `except Exception` on the way turns it into another error;
    `interrupted` is the errors.Interrupted the command reports (cli.report)."""

    def __init__(self, interrupted: Interrupted):
        super().__init__(str(interrupted))
        self.interrupted = interrupted


class GracefulStop:
    """Installs handlers for SIGINT and SIGTERM that request a stop at the next safe point."""

    def __init__(self, log=print):
        self.signum: int | None = None
        self._log = log
        self._previous: dict[int, object] = {}
        self._during: tuple[str, int | None] | None = None    # (phase, resume step) or None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """No-op outside the main thread (Python delivers signals to the main thread only)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in NAMES:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:          # the second signal: stop now
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Interrupted(f"stopped by a second {NAMES[signum]} without finishing the step; "
                              "a restart resumes from the last complete checkpoint", signum)
        self.signum = signum
        if self._during is not None:         # no safe point to wait for: stop now
            what, resume_step = self._during
            self._during = None
            self._log(f"[signal] {NAMES[signum]} during {what}: stopping now")
            sys.stdout.flush()
            raise StopNow(self.stop(resume_step, during=what))
        self._log(f"[signal] {NAMES[signum]}: stopping after the current step (send it again "
                  "to stop at once)")
        sys.stdout.flush()

    @contextlib.contextmanager
    def during(self, what: str, resume_step: int | None = None):
        """A phase without a safe point (warm start, evaluation): a signal arriving inside it
        raises Interrupted at once. `resume_step`: the checkpoint a restart resumes from."""
        if not self._previous or self.signum is not None:
            yield                            # not installed, or already stopping after a step
            return
        self._during = (what, resume_step)
        try:
            yield
        finally:
            self._during = None

    def stop(self, resume_step: int | None, during: str | None = None) -> Interrupted:
        """The exception that ends the run after a requested stop (on a process that did not
        receive the signal itself: as SIGTERM, "another process")."""
        signum = self.signum if self.signum is not None else signal.SIGTERM
        name = NAMES[signum] if self.signum is not None else "a signal to another process"
        where = (f"resumes from step {resume_step}" if resume_step is not None
                 else "starts from the beginning (no checkpoint was written yet; a finished "
                      "warm start is kept and not run again)")
        phase = f" during {during}" if during else ""
        return Interrupted(f"stopped by {name}{phase}; a restart with the same --workdir "
                           f"{where}.", signum)
