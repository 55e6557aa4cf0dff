"""tests/procs.py's forked commands behave as fresh interpreters do (subprocess, side by side):
argv, sys.path[0], working directory, environment, exit codes, uncaught errors, atexit, stdin,
signals, timeouts; and what a fork cannot give falls back to a real subprocess."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import procs
import pytest

PROBE = """
import json, os, sys, atexit
atexit.register(lambda: print("atexit ran", flush=True))
data = sys.stdin.read()
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("PROBE_VAR"), "stdin": data, "name": __name__}))
sys.exit(int(sys.argv[-1]))
"""


def _both(args, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 120)
    forked, fresh = procs.run(args, **kw), subprocess.run(args, **kw)
    assert isinstance(forked, subprocess.CompletedProcess)
    return forked, fresh


def test_a_forked_command_sees_what_a_fresh_one_sees(tmp_path):
    env = dict(os.environ, PROBE_VAR="x")
    for extra in ("0", "3"):
        forked, fresh = _both([sys.executable, "-c", PROBE, "a", extra], env=env, cwd=tmp_path,
                              input="hello")
        assert forked.returncode == fresh.returncode == int(extra)
        assert forked.stdout == fresh.stdout and "atexit ran" in forked.stdout
    script = tmp_path / "script.py"
    script.write_text(PROBE)
    forked, fresh = _both([sys.executable, str(script), "b", "0"], env=env, input="")
    assert forked.stdout == fresh.stdout
    assert json.loads(forked.stdout.splitlines()[0])["path0"] == str(tmp_path)
    forked, fresh = _both([sys.executable, "-m", "json.tool", "--help"])
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)


def test_errors_exits_and_signals_match():
    for code in ("raise ValueError('boom')", "import sys; sys.exit('a message')",
                 "import os; os.kill(os.getpid(), 9)", "raise KeyboardInterrupt"):
        forked, fresh = _both([sys.executable, "-c", code])
        assert forked.returncode == fresh.returncode, code
        assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], code
    proc = procs.Popen([sys.executable, "-c", "import time\nprint('up', flush=True)\n"
                        "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, procs._ForkedPopen)
    assert proc.stdout.readline() == "up\n" and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.stdout.close()
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)


def test_what_a_fork_cannot_give_runs_as_a_real_subprocess():
    for args, kw in ((["true"], {}), ([sys.executable, "-c", "pass"], {"preexec_fn": os.getpid}),
                     ([sys.executable, "-u", "-c", "pass"], {})):
        proc = procs.Popen(args, **kw)
        assert not isinstance(proc, procs._ForkedPopen), args
        assert proc.wait(60) == 0
