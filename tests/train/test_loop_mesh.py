"""The real training loop on a device mesh and over two processes (brorl_jax/train/runtime.py).

* One process with 4 simulated CPU devices (data=2 x fsdp=2): the loop shards the train state,
  runs the sharded update / log-prob steps and the sharded rollout, and ends with the parameters
  of the same run on one device (same seeds, same rollouts), within float tolerance.
* Two processes with 2 devices each on localhost through jax.distributed (gloo): each process
  reads its own prompt shard, generates and scores locally and feeds its rows of the global
  update batch; both end with the same parameters, and a restart resumes collectively from the
  checkpoint (per-process data positions included) to the next step.
"""
from __future__ import annotations

import numpy as np
import pytest
from mesh_runs import run_one, run_two, worker_env
from run_metrics import read as read_metrics
from testutil import run_main

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`


STEPS = ["--config.train.steps=2"]


def test_mesh_run_matches_single_device(tmp_path, tiny_warm_start):
    one, _ = run_one(1, tmp_path / "one", tmp_path / "one.npz", *STEPS, *tiny_warm_start)
    four, _ = run_one(4, tmp_path / "four", tmp_path / "four.npz", *STEPS, *tiny_warm_start,
                      "--config.mesh.fsdp=2")
    assert one["mesh"] is None
    assert four["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "four.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], rtol=2e-4, atol=2e-5, err_msg=key)
    ma, mb = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four")
    # Same seeds -> the sharded rollout drew the same samples, so the same rewards.
    for ra, rb in zip(ma[1:], mb[1:]):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["perf/generated_samples"] == rb["perf/generated_samples"]
        assert rb["loss/loss"] == pytest.approx(ra["loss/loss"], rel=1e-3, abs=1e-5)
    assert ma[-1]["eval/pass@1"] == mb[-1]["eval/pass@1"]


# The options not in the paper run multi-process through the one collect path: adaptive N
# (per-process pass rates), over-generation and the EMA advantage normaliser (over both
# processes' groups).
OPTIONS = ['--config.rollout.adaptive_n=true', '--config.rollout.adaptive_n_buckets="4,8"',
           '--config.rollout.adaptive_n_thresholds="0.5"',
           '--config.rollout.overgenerate_factor=1.5', '--config.algo.advantage_normalizer="ema"']


def test_two_process_training_run_agrees_and_resumes(tmp_path, tiny_warm_start):
    work = tmp_path / "run"
    # prompts_per_step=2 over 2 processes: each fills its 8 rows of the 16-row update batch.
    common = ["--config.mesh.fsdp=2", "--config.rewards.num_workers=1"] + OPTIONS + tiny_warm_start
    reports, texts = run_two(work, [tmp_path / "p0.npz", tmp_path / "p1.npz"], common + STEPS)
    assert sorted(r["pid"] for r in reports) == [0, 1]
    assert all(r["devices"] == 4 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
               for r in reports)
    assert "[eval] after RL" in texts[0] and "[eval] after RL" not in texts[1]  # process 0 logs
    p0, p1 = np.load(tmp_path / "p0.npz"), np.load(tmp_path / "p1.npz")
    for key in p0.files:
        np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)
    rows = read_metrics(work)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(np.isfinite(r["loss/loss"]) for r in rows[1:])
    assert all(r["advantage/ema_std"] > 0 and 4 <= r["monitor/n_mean"] <= 8 for r in rows[1:])

    # Restart for one more step: collective restore of the sharded state and each process's
    # own data position from the checkpoint, then the same agreement.
    reports, texts = run_two(work, [tmp_path / "q0.npz", tmp_path / "q1.npz"],
                             common + ["--config.train.steps=3"])
    assert "[resume] from checkpoint step 2" in texts[0]
    q0, q1 = np.load(tmp_path / "q0.npz"), np.load(tmp_path / "q1.npz")
    moved = 0.0
    for key in q0.files:
        np.testing.assert_array_equal(q0[key], q1[key], err_msg=key)
        moved = max(moved, float(np.abs(q0[key] - p0[key]).max()))
    assert moved > 0          # the resumed step really trained
    assert [r["step"] for r in read_metrics(work)][-1] == 3


@pytest.mark.parametrize("overrides, message", [
    (["--config.mesh.fsdp=3"], "mesh: 4 devices cannot be split"),
    (["--config.rollout.rollouts_per_prompt=3", "--config.algo.micro_batch_size=6"],
     "algo.prompts_per_step x rollout.rollouts_per_prompt = 6"),
])
def test_mesh_that_does_not_fit_stops_main_with_message(tmp_path, overrides, message):
    out = run_main(tmp_path, *overrides, env=worker_env(4), timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert message in out.stderr
    assert "Traceback" not in out.stderr
