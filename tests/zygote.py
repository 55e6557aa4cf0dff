"""A fork server for the suite's command-line subprocesses (`python -m brorl_jax.main ...`).

Every `main`, `evaluate` or `export` the tests start used to pay 10-12 s of imports (JAX,
transformers' tokenizer stack, reasoning_gym, math_verify, orbax, grain) before doing a second of
work; the suite starts about a hundred of them. A zygote imports all of that once, before any JAX
backend exists (JAX itself only warns about a fork after its backend has started), and forks a
child per command. A child is a real process: its own pid, exit code and signals (the fault
tests interrupt and kill -9 them), stdin/stdout/stderr passed as file descriptors, the
environment and working directory of the request, sys.argv / sys.path as `python -m`, `python
-c` or `python SCRIPT` set them, Python's default signal handlers, fresh `random` and NumPy seeds.
It then runs the command exactly as the interpreter would, and exits through the normal
interpreter shutdown (atexit handlers, thread joins, flushes).

What a child cannot get from a fork is what Python and the preloaded libraries read from the
environment at start-up, so a zygote serves only requests whose start-up environment (the
variables `startup_env` names) equals its own: the client starts one zygote per distinct
start-up environment and falls back to a plain subprocess for anything else (a preexec_fn,
pass_fds, another executable). All children of one zygote share its string-hash seed.

Protocol over a Unix socket, one short connection per request: {"op": "spawn", ...} with the
child's three standard file descriptors (SCM_RIGHTS) -> {"pid": N}; {"op": "poll", "pid": N} ->
{"status": waitpid status or null}. The zygote reaps its children and keeps their statuses
until asked. Client: tests/procs.py.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

# Environment variables read at interpreter or library start-up: a request must match the zygote.
# Of JAX_*, only JAX's config options (read when jax is imported); the others (e.g.
# JAX_COORDINATOR_ADDRESS for brorl_jax.parallel.distributed) are read when the command runs.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "HF_", "TRANSFORMERS",
                    "TOKENIZERS", "TF_", "LD_")

# What a `main` / `evaluate` / `export` run imports (measured: ~11 s on the dev machine). Entry
# modules themselves (brorl_jax.main, .evaluate, .export) are not imported: they run as __main__.
PRELOAD = ("jax", "jax.numpy", "flax", "optax", "orbax.checkpoint", "grain", "numpy",
           "ml_collections", "absl.app", "absl.flags", "tqdm", "transformers", "torch",
           "reasoning_gym", "math_verify", "sympy",
           "brorl_jax.cli", "brorl_jax.config", "brorl_jax.train.loop",
           "brorl_jax.parallel.distributed", "brorl_jax.models.hf",
           "brorl_jax.data.reasoning_gym_source", "brorl_jax.rewards")


def startup_env(env: dict) -> dict:
    from jax._src.config import config
    jax_options = {name.upper() for name in config._value_holders}
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) or k in jax_options}


def _preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional library: the child imports it or fails
            pass
    try:
        from transformers import AutoTokenizer  # noqa: F401 - its lazy module is most of the cost

        from brorl_jax.config import choices
        choices()
    except Exception:  # noqa: BLE001
        pass
    from jax._src import xla_bridge
    assert not xla_bridge._backends, "a preloaded module started a JAX backend: forks would hang"


def _set_parent_death_signal() -> None:
    """The zygote dies with the pytest worker that started it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the client's atexit handler stops it
        pass


def serve(path: str):
    """Runs the server loop; returns a request in a forked child (the caller runs it)."""
    _set_parent_death_signal()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)          # the client waits for this name: ready
    statuses: dict[int, int] = {}
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([listener], [], [], 0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            statuses[pid] = status
        if not ready:
            continue
        conn, _ = listener.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
            while not msg.endswith(b"\n"):
                more = conn.recv(1 << 22)
                if not more:
                    break
                msg += more
            req = json.loads(msg)
            if req["op"] == "poll":
                conn.sendall(json.dumps({"status": statuses.pop(req["pid"], None)}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                req["fds"] = fds
                return req
            for fd in fds:
                os.close(fd)
            children.add(pid)
            conn.sendall(json.dumps({"pid": pid}).encode())


def run_child(req: dict) -> None:
    """Becomes the requested `python ARGS...` process; errors propagate like the interpreter's."""
    for target, fd in zip((0, 1, 2), req["fds"]):
        if fd != target:
            os.dup2(fd, target)
    for fd in req["fds"]:
        if fd > 2:
            os.close(fd)
    if req.get("start_new_session"):
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    import random
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    args = req["args"]
    import runpy
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        import types
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def finish_child(req: dict) -> None:
    """run_child, then the interpreter's own shutdown up to the point where only memory is left
    to free: non-daemon threads joined, atexit handlers, standard streams flushed. Tearing down
    the ~3,500 preloaded modules (2 s here) is skipped: os._exit. An uncaught exception prints
    its traceback and exits 1; an uncaught KeyboardInterrupt ends the process by SIGINT, as
    Python does."""
    import atexit
    import threading
    import traceback
    interrupted = False
    try:
        run_child(req)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught error
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe
                pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()               # not this file's directory: children set their own
    child = serve(sys.argv[1])
    if child is not None:
        finish_child(child)
