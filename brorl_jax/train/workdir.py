"""The work directory's layout, checked before any expensive work, and history kept, not replaced.

    workdir/
      config.json          the resolved config of the run (train/run_config.py)
      config_changes.jsonl changes accepted on resume (harmless ones and deliberate overrides)
      metrics.jsonl        one JSON object per logged step (train/logger.py)
      metrics.jsonl.1 ...  earlier histories: a fresh start, or steps past the checkpoint resumed
      checkpoints/<step>/  orbax checkpoints; checkpoints/broken/<step>-<time>/ ones that failed
                           to restore, moved aside (never deleted)
      logs/                full tracebacks of errors (the command prints a short message)
      tensorboard/, warm_start_model/, curves.png
"""
from __future__ import annotations

import difflib
import os

from brorl_jax.errors import WorkdirError

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"


def prepare(workdir: str) -> None:
    """Creates the work directory if needed and checks that the run can write what it writes;
    raises WorkdirError naming the path and the fix."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir!r} is a file, not a directory; give a directory.")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"cannot create the work directory {workdir!r}: {e.strerror}; give "
                           "--workdir a path you can write.") from e
    probe = os.path.join(workdir, f".write_test.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"cannot write in the work directory {workdir!r}: {e.strerror}; "
                           "fix its permissions or give another --workdir.") from e
    ckpt = os.path.join(workdir, CHECKPOINTS)
    if os.path.exists(ckpt) and not os.path.isdir(ckpt):
        raise WorkdirError(f"{ckpt!r} is a file; checkpoints are written into a directory of "
                           "that name. Move the file away or give another --workdir.")
    metrics = os.path.join(workdir, METRICS)
    if os.path.isdir(metrics):
        raise WorkdirError(f"{metrics!r} is a directory; the run appends its metrics to a file "
                           "of that name. Move it away or give another --workdir.")
    for path in (ckpt, metrics):
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise WorkdirError(f"{path!r} is not writable; fix its permissions or give another "
                               "--workdir.")


def require_existing(workdir: str | None, flag: str = "--workdir") -> str:
    """For commands that read a run (evaluate, export): the directory must exist; they never
    create it. Raises WorkdirError with the closest existing name."""
    if not workdir:
        raise WorkdirError(f"{flag} is required.")
    if os.path.isdir(workdir):
        return workdir
    parent = os.path.dirname(os.path.abspath(workdir))
    hint = ""
    if os.path.isdir(parent):
        near = difflib.get_close_matches(os.path.basename(os.path.normpath(workdir)),
                                         [d for d in os.listdir(parent)
                                          if os.path.isdir(os.path.join(parent, d))], n=1)
        if near:
            hint = f" Did you mean {os.path.join(os.path.dirname(workdir), near[0])!r}?"
    what = "is not a directory" if os.path.exists(workdir) else "does not exist"
    raise WorkdirError(f"{flag} {workdir!r} {what}.{hint}")


def has_checkpoints(workdir: str) -> bool:
    """True when the work directory holds at least one finished checkpoint directory (a resume);
    orbax names them by step, temporary ones carry a suffix."""
    ckpt = os.path.join(workdir, CHECKPOINTS)
    return os.path.isdir(ckpt) and any(name.isdigit() for name in os.listdir(ckpt))


def set_aside(path: str) -> str | None:
    """Renames `path` to the first free `path.N` (N = 1, 2, ...) and returns the new name; None
    when `path` does not exist. Earlier histories are numbered, never overwritten."""
    if not os.path.exists(path):
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def keep_copy(path: str) -> str | None:
    """Copies `path` to the first free `path.N` (the file itself stays); None when absent."""
    if not os.path.exists(path):
        return None
    import shutil
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    shutil.copy2(path, f"{path}.{n}")
    return f"{path}.{n}"
