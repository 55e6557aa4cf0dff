"""The training loop end to end (configs/tiny.py): metrics, evaluation, checkpoints, and exact
resume after SIGKILL mid-training and during an asynchronous checkpoint save."""
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from brorl_jax.train.logger import read_metrics
from brorl_jax.train.loop import restore_params
from configs import tiny

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


def _cmd(workdir, warm):
    return [sys.executable, "-m", "brorl_jax.main", "--config=configs/tiny.py",
            f"--workdir={workdir}", f"--config.train.steps={STEPS}", *warm]


def _run(workdir, warm, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(_cmd(workdir, warm), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_warm_start):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    out = _run(workdir, tiny_warm_start)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return workdir, out


def test_smoke_run_writes_metrics_eval_and_plots(uninterrupted):
    workdir, out = uninterrupted
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    first, last = records[0], records[-1]
    assert "eval/pass@1" in first and "eval/pass@1" in last and "eval/pass@2" in last
    for key in ("reward/mean", "dynamic_sampling/pass_rate", "response/length_mean",
                "loss/clip_frac", "loss/kl", "loss/entropy", "loss/tis_dropped_frac",
                "perf/samples_per_s", "perf/tokens_per_s", "time/rollout_s", "time/scoring_s",
                "time/update_s", "monitor/path_diversity"):
        assert all(key in r for r in records[1:]), key
    # Mixed groups were kept and trained on, so the run really moved the parameters.
    assert sum(r["dynamic_sampling/kept_groups"] for r in records[1:]) > 0
    assert os.path.isdir(os.path.join(workdir, "tensorboard"))
    assert "[eval] after RL: pass@1" in out.stdout


def _final_params(workdir):
    _, params, step = restore_params(tiny.get_config(), str(workdir), None)
    assert step == STEPS
    return jax.tree.map(np.asarray, params)


def test_kill_and_resume_is_bit_identical(uninterrupted, tmp_path, tiny_warm_start):
    reference = _final_params(uninterrupted[0])
    workdir = tmp_path / "killed"
    metrics = workdir / "metrics.jsonl"

    # 1. SIGKILL at an arbitrary moment after step 2 was logged (checkpoints are every step)
    #    and a checkpoint is complete (orbax commits asynchronously; on a loaded machine the
    #    step-1 save can still be running when step 2 is logged).
    proc = subprocess.Popen(_cmd(workdir, tiny_warm_start), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    committed = lambda: any((workdir / "checkpoints" / str(s) / "commit_success.txt").exists()
                            for s in range(1, STEPS))
    deadline = time.time() + 600
    while time.time() < deadline:
        if metrics.exists() and any(r["step"] >= 2 for r in read_metrics(str(metrics))) \
                and committed():
            break
        assert proc.poll() is None, "run ended before it could be killed"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    # 2. Resume, and die by SIGKILL while the step-3 checkpoint is being written.
    out = _run(workdir, tiny_warm_start, {"BRORL_KILL_DURING_SAVE": "3"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert "[resume] from checkpoint step" in out.stdout

    # 3. Resume again and finish.
    out = _run(workdir, tiny_warm_start)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[resume] from checkpoint step" in out.stdout

    resumed = _final_params(workdir)
    flat_ref = jax.tree_util.tree_leaves_with_path(reference)
    flat_res = dict(jax.tree_util.tree_leaves_with_path(resumed))
    for path, leaf in flat_ref:
        np.testing.assert_array_equal(flat_res[path], leaf, err_msg=jax.tree_util.keystr(path))
    # The metrics history reads as one run: every step exactly once.
    assert [r["step"] for r in read_metrics(str(metrics))] == list(range(STEPS + 1))


def test_export_checkpoint_to_hugging_face(uninterrupted, tmp_path):
    import torch
    import transformers

    from brorl_jax.export import export
    out = tmp_path / "hf"
    step = export(tiny.get_config(), str(uninterrupted[0]), str(out))
    assert step == STEPS
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    params = _final_params(uninterrupted[0])
    from brorl_jax import models
    ours = models.from_pretrained(str(out))
    tokens = np.array([[5, 17, 30, 44, 9, 12]], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(tokens)), ref, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(ours.params["embed"]["embedding"]),
                                  params["embed"]["embedding"])
