"""Kill -9 with samples in flight (issue 28): a stream run at algo.max_staleness = 1 is killed by
SIGKILL at the start of a step while its paused engine holds the previous step's carried
samples; resumed, it ends with the uninterrupted run's parameters and logs the same metrics,
every step exactly once. The in-flight work is regenerated, not saved: the stream is closed at
every checkpoint step (collect.stream_ends_after), so the resumed run replays from the last
checkpoint what the uninterrupted one did after it."""
import os
import signal
import sys

import jax
import numpy as np
import procs
import pytest
from run_metrics import read as read_run_metrics

from brorl_jax.train.loop import restore_params
from brorl_jax.workdir.logger import read_metrics
from configs import tiny

pytestmark = pytest.mark.slow     # three end-to-end runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, KILL_AT = 4, 2, 3     # killed before step index 3: checkpoint 2, then one carry
FLAGS = ["--config.algo.stream_rounds=True", "--config.algo.max_staleness=1",
         f"--config.train.checkpoint_every={EVERY}", f"--config.train.steps={STEPS}",
         "--config.algo.max_generation_rounds=4", "--config.train.tensorboard=False"]
# Runs `main` with rl_step wrapped: at step KILL_AT it checks that samples are in flight in the
# paused stream, waits for the last checkpoint's commit, and kills its own process (SIGKILL).
KILLER = """
import os, runpy, signal, sys, time
import brorl_jax.train.loop as loop
from brorl_jax.train import collect
real, at, commit = loop.rl_step, int(os.environ["KILL_AT"]), os.environ["KILL_AFTER"]
def rl_step(ctx, state, cstate, data_iter, step):
    if step == at:
        live = collect.carried_stream(ctx)      # the collector's paused stream
        assert live is not None and live.stream.in_flight > 0, "nothing in flight"
        deadline = time.time() + 300
        while not os.path.exists(commit) and time.time() < deadline:
            time.sleep(0.05)
        print("killed with", live.stream.in_flight, "prompts in flight", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(ctx, state, cstate, data_iter, step)
loop.rl_step = rl_step
sys.argv = ["brorl_jax.main"] + sys.argv[1:]
runpy.run_module("brorl_jax.main", run_name="__main__", alter_sys=True)
"""


def _args(workdir, warm):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", *warm, *FLAGS]


def _run(cmd, env_extra=None):
    return procs.run(cmd, cwd=ROOT, env=dict(os.environ, **(env_extra or {})),
                     capture_output=True, text=True, timeout=600)


def _main(workdir, warm, **kw):
    return _run([sys.executable, "-m", "brorl_jax.main", *_args(workdir, warm)], **kw)


def _params(workdir):
    _, params, step = restore_params(tiny.get_config(), str(workdir), None)
    assert step == STEPS
    return jax.tree.map(np.asarray, params)


def test_kill_with_samples_in_flight_then_resume_equals_the_uninterrupted_run(
        tmp_path, tiny_warm_start):
    whole = tmp_path / "whole"
    out = _main(whole, tiny_warm_start)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    carried = {r["step"]: r.get("rollout/carried_samples", 0)
               for r in read_metrics(str(whole / "metrics.jsonl"))}
    assert carried[KILL_AT] > 0            # step index KILL_AT - 1 left samples in flight

    killed = tmp_path / "killed"
    commit = killed / "checkpoints" / str(EVERY) / "commit_success.txt"
    out = _run([sys.executable, "-c", KILLER, *_args(killed, tiny_warm_start)],
               {"KILL_AT": str(KILL_AT), "KILL_AFTER": str(commit)})
    assert out.returncode == -signal.SIGKILL, out.stdout[-2000:] + out.stderr[-3000:]
    assert "prompts in flight" in out.stdout
    assert commit.exists()

    out = _main(killed, tiny_warm_start)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"[resume] from checkpoint step {EVERY}" in out.stdout

    want, got = _params(whole), dict(jax.tree_util.tree_leaves_with_path(_params(killed)))
    for path, leaf in jax.tree_util.tree_leaves_with_path(want):
        np.testing.assert_array_equal(got[path], leaf, err_msg=jax.tree_util.keystr(path))
    # the same layout and process: every value bit for bit, the update's floats included
    a, b = read_run_metrics(whole), read_run_metrics(killed)
    assert [r["step"] for r in b] == list(range(STEPS + 1))
    assert a == b
