"""`Popen` and `run` with subprocess's signatures for the suite's `python ...` commands, started by
a zygote (tests/zygote.py says what a child is and is not) instead of a fresh interpreter.

    from procs import Popen, run
    run([sys.executable, "-m", "brorl_jax.main", ...], env=env, capture_output=True, text=True)

A command that is not `sys.executable ...`, or asks for what a fork cannot give (preexec_fn,
pass_fds, user/group changes, another executable), runs as a plain subprocess. One zygote per
pytest process and start-up environment, started on first use (about 11 s of imports, paid
once instead of once per command) and stopped at exit. BRORL_TESTS_NO_ZYGOTE=1 turns it off.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from zygote import startup_env

HERE = os.path.dirname(os.path.abspath(__file__))
_ZYGOTES: dict[tuple, "_Zygote"] = {}


class _Zygote:
    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="brorl_zygote_")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py"), self.path],
                                     env=env, cwd=os.path.dirname(HERE),
                                     stdin=subprocess.DEVNULL)
        atexit.register(self.stop)

    def _ready(self) -> None:
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the test zygote exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the test zygote did not start within 300 s")
            time.sleep(0.05)

    def request(self, req: dict, fds=()) -> dict:
        self._ready()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            socket.send_fds(s, [json.dumps(req).encode() + b"\n"], list(fds))
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return json.loads(data)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


def _zygote_for(env: dict) -> _Zygote:
    key = tuple(sorted(startup_env(env).items()))
    if key not in _ZYGOTES:
        _ZYGOTES[key] = _Zygote(env)
    return _ZYGOTES[key]


class _ForkedPopen(subprocess.Popen):
    """subprocess.Popen whose child is forked by a zygote: pipes, communicate(), timeouts,
    send_signal() and kill() are Popen's own; waiting asks the zygote, the child's parent."""

    def __init__(self, zygote: _Zygote, args, **kwargs):
        self._zygote = zygote
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        reply = self._zygote.request(
            {"op": "spawn", "args": [os.fsdecode(a) for a in args[1:]],
             "env": dict(os.environ if env is None else env),
             "cwd": os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd(),
             "start_new_session": bool(start_new_session)}, fds)
        self.pid = reply["pid"]
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _status(self):
        try:
            return self._zygote.request({"op": "poll", "pid": self.pid})["status"]
        except OSError:
            # The zygote is gone, so the child's exit status is unknown: report it as killed
            # (waitpid status 9 = SIGKILL) so no caller reads an unknown end as success.
            return 9

    def _internal_poll(self, _deadstate=None, *args, **kwargs):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._status()
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _try_wait(self, wait_flags):
        while True:
            status = self._status()
            if status is not None:
                return self.pid, status
            if wait_flags & os.WNOHANG:
                return 0, 0
            time.sleep(0.02)


def _forkable(args, kwargs) -> bool:
    if os.environ.get("BRORL_TESTS_NO_ZYGOTE") or isinstance(args, (str, bytes)):
        return False
    args = [os.fsdecode(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable or kwargs.get("shell"):
        return False
    if args[1].startswith("-") and args[1] not in ("-m", "-c"):
        return False                    # an interpreter option (-u, -X ...): start it for real
    refused = ("preexec_fn", "pass_fds", "user", "group", "extra_groups", "umask",
               "process_group", "executable")
    return not any(kwargs.get(k) not in (None, (), -1) for k in refused)


def Popen(args, **kwargs) -> subprocess.Popen:  # noqa: N802 - subprocess's name
    if not _forkable(args, kwargs):
        return subprocess.Popen(args, **kwargs)
    env = kwargs.get("env")
    return _ForkedPopen(_zygote_for(dict(os.environ if env is None else env)), args, **kwargs)


def run(args, *, input=None, capture_output=False, timeout=None, check=False,  # noqa: A002
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, with the process from `Popen` above."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.communicate()
            raise e
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
