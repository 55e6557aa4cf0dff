"""What every command (main, evaluate, export, experiments.compare_n) shares: the `--config`
flag, flags defined when the command runs (not at import: several command modules in one process
must not collide in absl's global flag registry), and errors at the door.

    def main(values: dict) -> int | None: ...
    if __name__ == "__main__":
        cli.run(main, [cli.Flag("string", "workdir", None, "Where the run writes.")])

Errors at the door (docs/reliability.md):
  * a user error (brorl_jax.errors.UserError: config, data, model, checkpoint, work directory,
    disk, verifier) ends the command with `error: <what, where, the fix>` on stderr and exit
    code 2; the full traceback goes to a log file (WORKDIR/logs/ for the commands that write
    their directory -- main's --workdir, compare_n's --out -- when it exists and no other run
    holds it; else the system temp directory: evaluate and export never write into the run they
    read, nor export into --out) and to stderr with --debug / BRORL_DEBUG=1;
  * a command line that does not parse (a misspelled --config.KEY, a bad value, a config file
    that fails to load) is reported the same way, naming the key with the closest known one;
  * SIGINT / SIGTERM: exit 130 / 143 with one line (the trainer stops at a safe point first);
  * a disk that fills up anywhere: exit 2 naming the file;
  * anything else is a bug: its traceback is shown as usual (exit 1).
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import os
import re
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

import configs
from brorl_jax.errors import (  # noqa: F401
    DEBUG_ENV,
    CheckpointError,
    ConfigError,
    DataError,
    DiskFullError,
    Interrupted,
    ModelError,
    UserError,
    VerifierError,
    WorkdirError,
    debug_enabled,
    exception_chain,
    is_disk_full,
)

DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), "demo.py")
# Flags defined here belong to the command that calls run(), so its --help lists them.
flags.disclaim_key_flags()


@dataclasses.dataclass(frozen=True)
class Flag:
    """One absl flag: kind ("string", "integer", "list", "bool", ...), name, default, help."""
    kind: str
    name: str
    default: Any
    help: str
    required: bool = False


DEBUG_FLAG = Flag("bool", "debug", False, f"Print the full traceback of an error (also "
                  f"{DEBUG_ENV}=1); without it a user error prints a short message and the "
                  "traceback goes to a log file.")


def _config_help() -> str:
    from brorl_jax.config import choices, verifier_names
    lines = ["Config file (configs/NAME.py), optionally with ':preset'; override any key with "
             "--config.KEY=VALUE. Keys that pick a named implementation:"]
    lines += [f"  {key}: {' | '.join(names)}" for key, names in choices().items()]
    lines.append(f"  rewards.map (JSON data_source -> verifier): {' | '.join(verifier_names())}")
    return "\n".join(lines)


def define(extra: Sequence[Flag], config_default: str = DEFAULT_CONFIG) -> dict:
    """Defines --config, --debug and `extra` in absl's registry; returns {name: FlagHolder}."""
    holders = {"config": config_flags.DEFINE_config_file("config", config_default, _config_help())}
    for f in list(extra) + [DEBUG_FLAG]:
        definer = getattr(flags, f"DEFINE_{f.kind}")
        holders[f.name] = definer(f.name, f.default, f.help, required=f.required)
    return holders


# -- the config a command reads a run with -------------------------------------------------------
def _config_args(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Whether --config is on the command line, and the keys of its --config.KEY overrides."""
    given, keys = False, []
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg.startswith("--config."):
            keys.append(arg[len("--config."):].split("=", 1)[0])
        elif arg == "--config" or arg.startswith("--config="):
            given = True
    return given, keys


def run_config(values: dict, workdir: str | None, argv: Sequence[str] | None = None):
    """The config `evaluate` and `export` read a run with: the run's own (its saved
    brorl_config.json) when --workdir names a run and --config is not given, with the command
    line's --config.KEY overrides on top (parsed and typed by config_flags against the default
    config file); else --config's, as given."""
    cfg = values["config"]
    given, keys = _config_args(sys.argv if argv is None else argv)
    if not workdir or given:
        return cfg
    from brorl_jax.workdir import saved_config
    saved = saved_config.as_config(workdir)
    if saved is None:                   # a run from before saved configs: the default file
        return cfg
    for key in keys:
        *parents, name = key.split(".")
        src, dst = cfg, saved
        for part in parents:
            src, dst = src[part], dst[part]
        dst[name] = src[name]
    print(f"[config] {os.path.join(workdir, saved_config.CONFIG_FILE)}: the run's own config"
          + (f", with {', '.join(keys)} from the command line" if keys else ""), file=sys.stderr)
    stand_in = saved_config.stand_in_base(workdir, saved.model.path)
    if stand_in:
        print(f"[config] model.path {saved.model.path!r} is gone: the run's copy of its config "
              f"and tokenizer ({stand_in}) stands in; the checkpoint holds the weights",
              file=sys.stderr)
        saved.model.path = stand_in
    return saved


# -- errors at the door ---------------------------------------------------------------------------
def _root_message(exc: BaseException) -> str:
    """The most specific message in an exception chain (absl and config_flags wrap the cause)."""
    messages, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip()
        if isinstance(exc, KeyError) and text.startswith(("'", '"')):
            text = text[1:-1].encode().decode("unicode_escape") if text else text
        if text:
            messages.append(f"{text}")
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return messages[-1] if messages else "unknown error"


def _parses_as(value: str, want: type) -> bool:
    """Whether config_flags can read `value` as a `want` (int, float, bool; str always)."""
    try:
        if want is bool:
            return value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "t", "f")
        if want is int:
            int(value)
        elif want is float:
            float(value)
    except ValueError:
        return False
    return True


def _type_errors(argv: Sequence[str], schema: dict) -> list[str]:
    """'config key K must be TYPE, got V' for every --config.K=V whose V is not a K's type."""
    out = []
    for arg in argv[1:]:
        m = re.match(r"--config\.([^=]+)=(.*)", arg, re.S)
        if m and m.group(1) in schema:
            want = type(schema[m.group(1)])
            if want in (int, float, bool) and not _parses_as(m.group(2), want):
                kind = {int: "an integer", float: "a number", bool: "true or false"}[want]
                out.append(f"config key '{m.group(1)}' must be {kind} ({want.__name__}), got "
                           f"{m.group(2)!r}.")
    return out


def command_line_error(argv: Sequence[str], exc: BaseException) -> str:
    """The message for a command line absl/config_flags could not parse: unknown config keys
    named with the closest known key (the schema's own wording), else the underlying cause."""
    from brorl_jax.config import _flatten, default_config, unknown_key_message
    schema = _flatten(default_config())
    sections = {k.split(".", 1)[0] for k in schema}
    unknown = []
    for arg in argv[1:]:
        m = re.match(r"--config\.([^=]+)", arg)
        if m and m.group(1) not in schema and m.group(1) not in sections:
            unknown.append(unknown_key_message(m.group(1)))
    if unknown:
        return "invalid command line:\n  " + "\n  ".join(unknown)
    mistyped = _type_errors(argv, schema)
    if mistyped:
        return "invalid command line:\n  " + "\n  ".join(mistyped)
    cause = _root_message(exc)
    if "Failed loading config file" in str(exc) or "config file" in cause.lower():
        path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        return f"cannot load the config file {path!r}: {cause}"
    return f"invalid command line: {cause}"


def _log_path(values: dict, exc: BaseException | None = None,
              log_dirs: Sequence[str] = ()) -> str:
    """WORKDIR/logs/ for a command that writes that directory (`log_dirs`: the flags naming it),
    unless another run holds it; else the system temp directory."""
    from brorl_jax.errors import WorkdirLockedError
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for key in log_dirs:
        d = values.get(key)
        if isinstance(d, str) and d and os.path.isdir(d) and \
                not isinstance(exc, WorkdirLockedError):
            return os.path.join(d, "logs", f"error-{stamp}.log")
    return os.path.join(tempfile.gettempdir(), f"brorl_jax-error-{stamp}-{os.getpid()}.log")


def _write_log(exc: BaseException, values: dict, log_dirs: Sequence[str] = ()) -> str | None:
    path = _log_path(values, exc, log_dirs)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(" ".join(sys.argv) + "\n\n")
            f.write("".join(traceback.format_exception(exc)))
        return path
    except OSError:
        return None


def cache_error(exc: BaseException | None) -> WorkdirError | None:
    """A write into the cache directory ($BRORL_JAX_CACHE: the demo model, generated prompt
    files) that the file system refused, as one line naming the directory and the fix; None for
    any other error. It read as an invalid command line (a config file writes there) or a
    traceback (the demo model)."""
    from brorl_jax.models.builtin_store import default_cache_dir
    cache = str(default_cache_dir())
    for e in exception_chain(exc):
        if (isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
                and str(e.filename or "").startswith(cache)):
            return WorkdirError(f"the cache directory {cache} is not writable ({e.strerror}: "
                                f"{e.filename}); it holds the demo model and generated prompt "
                                "files. Set BRORL_JAX_CACHE to a writable directory.")
    return None


def report(exc: BaseException, values: dict, log_dirs: Sequence[str] = ()) -> int:
    """Prints the short message for a user error, an interruption or a full disk; returns the
    exit code. Anything else is re-raised (a bug: its traceback is the report)."""
    if not isinstance(exc, UserError):
        exc = cache_error(exc) or exc
    if not isinstance(exc, UserError) and is_disk_full(exc):
        name = exc.filename if isinstance(exc, OSError) else None
        exc = DiskFullError(f"disk full writing {name or 'a file'}: free space and "
                            "restart with the same --workdir (it resumes from its last complete "
                            "checkpoint).")
    if isinstance(exc, KeyboardInterrupt):
        exc = getattr(exc, "interrupted", None) or Interrupted(
            "interrupted (SIGINT); a restart with the same --workdir resumes from its last "
            "complete checkpoint.", signal.SIGINT)
    if not isinstance(exc, (UserError, Interrupted)):
        raise exc
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, Interrupted):
        print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    log = _write_log(exc, values, log_dirs)
    print(f"error: {exc}", file=sys.stderr)
    if not debug_enabled():
        print(f"(traceback: {log or 'not written'}; --debug prints it)", file=sys.stderr)
    sys.stderr.flush()
    return exc.exit_code


def _fail_at_parse(argv: Sequence[str], exc: BaseException) -> None:
    if "--debug" in argv or debug_enabled():
        os.environ[DEBUG_ENV] = "1"
    code = report(cache_error(exc) or ConfigError(command_line_error(argv, exc)).with_traceback(
        exc.__traceback__), {})
    sys.exit(code)


def _parse_flags(argv: Sequence[str]):
    try:
        return flags.FLAGS(argv)
    except BrokenPipeError:
        raise
    except Exception as e:  # noqa: BLE001 - flags.Error, or whatever a config file raised
        _fail_at_parse(argv, e)


def _exit_now(code: int) -> None:
    """Ends the process without interpreter finalization: after a stop inside a phase without a
    safe point (workdir/signals.py StopNow) XLA may still be compiling or running on its own
    threads, and tearing the interpreter down under them can crash (SIGSEGV instead of the exit
    code). The trainer has already closed its checkpointer and workers; logs are flushed."""
    logging.flush()
    import logging as std_logging
    std_logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def platform_error(exc: BaseException) -> ConfigError | None:
    """A failure that comes from JAX_PLATFORMS naming a platform this machine cannot start, as
    one line at the door (jax's own is a traceback at the first array); None for any other.
    Asked after the command failed: starting the platform before its main would come before
    jax.distributed.initialize, which must come first."""
    wanted = os.environ.get("JAX_PLATFORMS", "")
    if not wanted or isinstance(exc, (UserError, Interrupted, KeyboardInterrupt)):
        return None
    import jax
    try:
        jax.devices()
        return None
    except Exception as e:  # noqa: BLE001 - jax raises RuntimeError or AssertionError here
        cause = _root_message(e)
        cause = f" ({cause})" if cause != "unknown error" else ""
        return ConfigError(
            f"environment variable JAX_PLATFORMS={wanted!r}: jax cannot start it on this machine"
            f"{cause}. Unset it to run on what the machine has, or install that platform's jax "
            "(e.g. pip install 'jax[cuda12]').")


_SIGNALLED: list[Interrupted] = []      # the SIGTERM this command received, if any


def _terminated(signum, frame):
    exc = Interrupted("stopped by SIGTERM; a restart with the same --workdir resumes from its "
                      "last complete checkpoint.", signum)
    _SIGNALLED.append(exc)
    raise exc


def raise_if_signalled() -> None:
    """Raises the SIGTERM this command received even if its first raise was lost: a signal
    handler's exception that lands in a garbage-collection callback (jax has one) is printed
    and dropped by Python, and the command would go on to exit 0. Commands call it before they
    commit their result; the entry calls it after main."""
    if _SIGNALLED:
        raise _SIGNALLED[0]


def run(main: Callable[[dict], int | None], extra: Sequence[Flag] = (), *,
        config_default: str = DEFAULT_CONFIG, log_dirs: Sequence[str] = ()) -> None:
    """Defines the flags, parses the command line and calls main({name: value}); user errors end
    the command with a short message and exit code 2 (module docstring). `log_dirs`: the flags
    naming a directory the command writes (its error logs go to DIR/logs/)."""
    try:
        holders = define(extra, config_default)
    except Exception as e:  # noqa: BLE001 - config_flags parses --config.KEY overrides here
        _fail_at_parse(sys.argv, e)

    def entry(argv):
        if len(argv) > 1:               # one line, not absl's usage text and exit code 1
            first = argv[1]
            hint = (f"; give the config as --config={first}"
                    if first.split(":", 1)[0].endswith(".py") else "")
            _fail_at_parse(argv, ValueError(f"unexpected argument(s) {argv[1:]}{hint}"))
        if holders["debug"].value:
            os.environ[DEBUG_ENV] = "1"
        logging.set_verbosity(logging.WARNING)
        signal.signal(signal.SIGTERM, _terminated)
        values = {name: h.value for name, h in holders.items() if name != "debug"}
        try:
            list(values["config"].keys())   # a config file that failed to load raises here
        except Exception as e:  # noqa: BLE001
            _fail_at_parse(sys.argv, e)
        try:
            code = main(values)
            raise_if_signalled()
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - report() re-raises bugs
            platform = platform_error(e)
            if platform is not None:
                platform.__cause__ = e
            code = report(platform or e, values, log_dirs)
            if getattr(e, "interrupted", None) is not None:
                _exit_now(code)
        sys.exit(code or 0)

    app.run(entry, flags_parser=_parse_flags)
