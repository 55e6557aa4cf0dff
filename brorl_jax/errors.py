"""The errors a user can fix, as opposed to bugs: every command stops on them with a short message
(what is wrong, where, the fix) and exit code 2 instead of a traceback (brorl_jax/cli.py).

No imports from the rest of the package, so any module can raise these. Each subclasses the
built-in type callers used to catch before (ValueError, FileNotFoundError), so code written
against those keeps working.
"""
from __future__ import annotations

import os

# Set by `--debug` (or BRORL_DEBUG=1 in the environment): show full tracebacks and library logs.
DEBUG_ENV = "BRORL_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")


class UserError(Exception):
    """Something the user gave or controls is wrong (config, data, model, checkpoint, work
    directory, disk); the message names it and the fix. Commands exit with `exit_code`."""
    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config key is unknown, mistyped or inconsistent; the message names it and the fix."""


class DataError(UserError, ValueError):
    """A data file or source cannot give any usable prompt (the message names the file)."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data path that does not exist."""


class ModelError(UserError, ValueError):
    """config.model.path does not hold a usable model."""


class WorkdirError(UserError):
    """The work directory (or a path inside it) is missing, not a directory, or not writable."""


class WorkdirLockedError(WorkdirError):
    """Another live run holds the work directory (workdir/layout.py: one run at a time); nothing
    is written into it, not even the error log."""


class CheckpointError(UserError):
    """No checkpoint can be restored, or a save failed."""


class DiskFullError(CheckpointError):
    """A save (or a write) ran out of disk space; the last complete checkpoint is intact."""


def exception_chain(exc: BaseException | None):
    """`exc` and the exceptions it was raised from (__cause__, else __context__), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that found no space: an
    OSError with errno ENOSPC, or a library's own error that says so (safetensors raises a
    SafetensorError 'No space left on device (os error 28)')."""
    import errno
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC)
               or "No space left on device" in str(e) for e in exception_chain(exc))


class VerifierError(UserError):
    """A verifier failed (raised, timed out, its worker died) on every sample of a data source in
    one step or evaluation: training on the zeros would be meaningless."""


class TrainingStopped(UserError):
    """The run cannot continue for a reason the config controls (e.g. the dynamic-sampling round
    cap); the message names the keys to change."""


class Interrupted(Exception):
    """The run stopped at a safe point after SIGINT / SIGTERM. exit code 128 + signal number
    (130 / 143), as a shell reports a process ended by that signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
