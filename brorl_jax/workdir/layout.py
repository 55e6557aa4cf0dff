"""The work directory's layout, checked before any expensive work, and history kept, not replaced.

    workdir/
      .brorl_lock          who runs in this directory now: host, pid, start time (one run at a
                           time: an exclusive flock held while the run lives)
      brorl_config.json    the resolved config of the run (workdir/saved_config.py; runs from before
                           it was renamed kept it as config.json, still read on resume)
      config_changes.jsonl changes accepted on resume (harmless ones and deliberate overrides)
      metrics.jsonl        one JSON object per logged step (workdir/logger.py)
      metrics.jsonl.1 ...  earlier histories: a fresh start, or steps past the checkpoint resumed
      checkpoints/<step>/  orbax checkpoints; checkpoints/broken/<step>-<time>/ ones that failed
                           to restore, moved aside (never deleted)
      logs/                full tracebacks of errors (the command prints a short message)
      warm_start_model/    the finished supervised warm start (a Hugging Face directory, written
                           to a temporary name and renamed when complete) with
                           brorl_warm_start.json: the config it was made with; a fresh start
                           with the same warm-start config loads it instead of running it again
      tensorboard/, curves.png
"""
from __future__ import annotations

import datetime
import difflib
import errno
import fcntl
import json
import os
import socket

from brorl_jax.errors import DiskFullError, WorkdirError, WorkdirLockedError, is_disk_full

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
LOCK_FILE = ".brorl_lock"


def prepare(workdir: str) -> None:
    """Creates the work directory if needed and checks its layout (a checkpoints file, a
    metrics directory, files the run cannot write); raises WorkdirError naming the path and the
    fix. Writes nothing into an existing directory: a run refused by another run's lock leaves
    it as it was (the write probe, check_writable, comes after the lock)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir!r} is a file, not a directory; give a directory.")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"cannot create the work directory {workdir!r}: {e.strerror}; give "
                           "--workdir a path you can write.") from e
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


def check_writable(workdir: str) -> None:
    """Writes and removes a probe file in the work directory (once the run holds its lock);
    raises WorkdirError naming the path and the fix when it cannot."""
    probe = os.path.join(workdir, f".write_test.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"cannot write in the work directory {workdir!r}: {e.strerror}; "
                           "fix its permissions or give another --workdir.") from e


def require_existing(workdir: str | None, flag: str = "--workdir") -> str:
    """For commands that read a run (evaluate, export): the directory must exist; they never
    create it. Raises WorkdirError with the closest existing name."""
    if not workdir:
        raise WorkdirError(f"{flag} is required.")
    if os.path.isdir(workdir):
        if is_locked(workdir):
            holder = read_lock(workdir) or {}
            print(f"[workdir] {workdir} is in use by a run ({_holder_text(holder)}); reading its "
                  "complete checkpoints only, writing nothing there", flush=True)
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


# -- one run per work directory --------------------------------------------------------------------
def _holder_text(info: dict) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{info.get('started', '?')}"
            + (f" ({info['command']})" if info.get("command") else ""))


def read_lock(workdir: str) -> dict | None:
    """The holder recorded in the work directory's lock file ({host, pid, started, command}), or
    None when there is none (never locked, or released cleanly). Reads only."""
    try:
        with open(os.path.join(workdir, LOCK_FILE)) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "started": "?", "command": f"unreadable: {text[:80]!r}"}
    return info if isinstance(info, dict) else None


def is_locked(workdir: str) -> bool:
    """Whether a live process holds the work directory's lock (a shared flock that cannot be
    taken). Takes nothing and writes nothing; False when there is no lock file."""
    try:
        fd = os.open(os.path.join(workdir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


_HELD: dict[str, "WorkdirLock"] = {}      # this process's locks, by real path


class WorkdirLock:
    """The exclusive lock of a work directory, held from the door to `release()` (or the end of
    the process: the kernel drops a flock with its holder, so a killed run leaves no lock a new
    run has to clean up; its record stays and is reported when taken over)."""

    def __init__(self, workdir: str, fd: int | None, info: dict):
        self.workdir, self._fd, self.info = workdir, fd, info

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empties the record (a clean release) and drops the lock; idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.pop(os.path.realpath(self.workdir), None)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit modules may be gone
            pass


def acquire(workdir: str, *, process_index: int = 0, log=print,
            command: str | None = None) -> WorkdirLock:
    """Takes the work directory's exclusive lock (process 0; the other processes of a run check
    that a run holds it). Raises WorkdirLockedError naming the holder when another live process
    holds it; a record left by a process that is gone is taken over with a message."""
    path = os.path.join(workdir, LOCK_FILE)
    if process_index != 0:
        return WorkdirLock(workdir, None, {})      # checked by check_lock once the runtime exists
    real = os.path.realpath(workdir)
    if real in _HELD and _HELD[real].held:
        raise WorkdirLockedError(
            f"--workdir {workdir!r} is already in use by another trainer in this process "
            f"({_holder_text(_HELD[real].info)}); close it (trainer.close()) first, or give "
            "another --workdir.")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise WorkdirError(f"cannot create the lock file {path!r}: {e.strerror}; fix the work "
                           "directory's permissions or give another --workdir.") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise WorkdirError(f"cannot lock {path!r}: {e.strerror} (a file system without "
                               "locks?); give a --workdir on a local or lock-capable file "
                               "system.") from e
        holder = read_lock(workdir) or {}
        raise WorkdirLockedError(
            f"--workdir {workdir!r} is in use by another run: {_holder_text(holder)} (lock "
            f"file {path}). Wait for it to finish or stop it, or give another --workdir; two "
            "runs in one directory would interleave their metrics and checkpoints.") from None
    stale = read_lock(workdir)
    if stale:
        here = stale.get("host") == socket.gethostname()
        gone = "is no longer running" if here and not _pid_alive(stale.get("pid")) else (
            "no longer holds it" if here else "no longer holds it (another host)")
        log(f"[workdir] taking over the lock of {workdir}: the run that held it "
            f"({_holder_text(stale)}) {gone}")
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command or _command_line()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    os.fsync(fd)
    lock = WorkdirLock(workdir, fd, info)
    _HELD[real] = lock
    return lock


def _command_line() -> str:
    import sys
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]


def check_lock(lock: WorkdirLock, allgather) -> None:
    """With several processes (after the runtime exists): process 0 took the lock at the door;
    every other process checks that the lock file it sees (a shared file system) names process 0
    of this run. `allgather(json value) -> [value per process]`; all processes raise together
    (WorkdirLockedError) when one of them sees another run's lock."""
    records = allgather(lock.info if lock.held else None)
    ours = records[0]
    seen = read_lock(lock.workdir) if not lock.held else ours
    problem = None
    if ours and seen is not None and (seen.get("host"), seen.get("pid"), seen.get("started")) != \
            (ours.get("host"), ours.get("pid"), ours.get("started")):
        problem = (f"--workdir {lock.workdir!r} as this process sees it is locked by another run "
                   f"({_holder_text(seen)}), not by this run's process 0 ({_holder_text(ours)})")
    problems = allgather(problem)
    bad = [(i, p) for i, p in enumerate(problems) if p]
    if bad:
        raise WorkdirLockedError(f"process {bad[0][0]}: {bad[0][1]}. Every process of a run must "
                                 "see the same work directory, and only one run may use it.")


# -- the warm start, kept ------------------------------------------------------------------------
WARM_START = "warm_start_model"
WARM_START_RECORD = "brorl_warm_start.json"
# What a warm start depends on: the model, the data (prompts and their tokenization), the SFT
# settings, the seed its batches derive from and the sequence length its batches are cut to.
WARM_START_KEYS = ("model.", "data.", "sft.", "train.seed", "rollout.max_new_tokens")


def _warm_start_config(cfg) -> dict:
    from brorl_jax.config import _flatten
    return {k: v for k, v in sorted(_flatten(cfg).items())
            if any(k == p or (p.endswith(".") and k.startswith(p)) for p in WARM_START_KEYS)}


def keep_warm_start(workdir: str, cfg, model) -> str:
    """Saves the finished warm start as WORKDIR/warm_start_model (a Hugging Face directory)
    with the config it was made with; written beside and renamed when complete."""
    import shutil
    import tempfile

    from brorl_jax import models
    dest = os.path.join(workdir, WARM_START)
    tmp = tempfile.mkdtemp(prefix=f".{WARM_START}.", dir=workdir)
    try:
        models.save_pretrained(model, tmp)
        with open(os.path.join(tmp, WARM_START_RECORD), "w") as f:
            json.dump({"config": _warm_start_config(cfg)}, f, indent=1)
        os.chmod(tmp, 0o755)
        set_aside(dest)
        os.replace(tmp, dest)
    except Exception as e:
        if is_disk_full(e):
            raise DiskFullError(f"disk full saving the warm start to {dest}: free space and "
                                "restart with the same --workdir (the warm start runs again; "
                                "nothing else was written).") from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def kept_warm_start(workdir: str, cfg, log=print):
    """The params of a warm start this work directory already finished with the same warm-start
    config (a fresh start after an interruption), else None. A kept one made with another config
    is set aside (warm_start_model.N, by keep_warm_start) and the warm start runs again."""
    dest = os.path.join(workdir, WARM_START)
    try:
        with open(os.path.join(dest, WARM_START_RECORD)) as f:
            saved = json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = _warm_start_config(cfg)
    if saved != now:
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        log(f"[sft] the warm start kept in {dest} was made with other values of "
            f"{', '.join(changed[:5])}; running it again (the old one will be kept as "
            f"{WARM_START}.N)")
        return None
    from brorl_jax import models
    try:
        model = models.from_pretrained(dest, dtype=cfg.model.dtype,
                                       param_dtype=cfg.model.param_dtype)
    except (OSError, ValueError) as e:
        log(f"[sft] the warm start kept in {dest} cannot be loaded ({e}); running it again")
        return None
    log(f"[sft] warm start kept from an earlier start: {dest} (made with the same model, data "
        "and sft settings); not running it again")
    return model.params
