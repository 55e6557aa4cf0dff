"""The training loop end to end (configs/tiny.py): metrics, evaluation, checkpoints, and exact
resume after SIGKILL mid-training and during an asynchronous checkpoint save."""
import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import procs
import pytest
from run_metrics import assert_same_metrics
from testutil import ROOT, main_command, run_main

from brorl_jax.train.loop import restore_params
from brorl_jax.workdir.logger import read_metrics
from configs import tiny

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

STEPS = 4


def _cmd(workdir, warm):
    return main_command(workdir, f"--config.train.steps={STEPS}", *warm)


def _run(workdir, warm, env_extra=None, timeout=600):
    return run_main(workdir, f"--config.train.steps={STEPS}", *warm,
                    env=dict(os.environ, **(env_extra or {})), timeout=timeout)


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
    proc = procs.Popen(_cmd(workdir, tiny_warm_start), cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_metrics.json")
# The recording's machine and this one differ in the update's float reductions (XLA's CPU code
# follows the host's vector units and the suite's fast compile flags, tests/compile_env.py; a Zen 4
# with AVX-512 differs by ~1e-7 in the entropy, and a loss that is ~1e-8, zero in exact
# arithmetic, changes sign): those keys are compared to float32 rounding of a few steps; every
# sample-decided key (rewards, pass rates, eval pass@k, rollout and filter counts) exactly, so a
# change of the samples still fails (tests/run_metrics.py says which is which).
MACHINES = {"rel": 1e-4, "abs_": 1e-6}


def test_metrics_equal_the_recorded_run(uninterrupted):
    """The tiny run from the shared warm start logs, step for step, the metrics recorded in
    tests/train/golden/tiny_metrics.json (losses and gradient statistics to float32 rounding;
    rewards, pass rates, eval pass@k and rollout counts exactly; timings aside): the warm start,
    rl_step and the loop compute what the train layer computed before it was split into
    context / step / CollectState (recorded at commit db2ec30; how: the file's "command").
    Re-record only for an intended change of the numbers, and say why in the commit."""
    with open(GOLDEN) as f:
        golden = json.load(f)
    records = read_metrics(os.path.join(uninterrupted[0], "metrics.jsonl"))
    assert len(records) == len(golden["records"])
    assert_same_metrics(records, golden["records"], **MACHINES)


def _cli_config(overrides):
    """configs/tiny.py with --config.KEY=VALUE overrides (the shared warm start's)."""
    cfg = tiny.get_config()
    for arg in overrides:
        key, value = arg[len("--config."):].split("=", 1)
        section, name = key.split(".")
        cfg[section][name] = type(cfg[section][name])(value)
    cfg.train.steps = STEPS
    return cfg


def test_evaluate_command_loads_the_model_once_and_repeats_the_runs_evaluation(
        uninterrupted, tiny_warm_start, monkeypatch):
    """`python -m brorl_jax.evaluate --workdir` on the finished run: the model loads once, no
    training loader and no temporary work directory are made, and the held-out pass@k of the
    last checkpoint is exactly the run's own final evaluation (same prompts, seeds, params)."""
    import tempfile

    from brorl_jax import data, models
    from brorl_jax.evaluate import evaluate

    loads = []
    real = models.from_pretrained
    monkeypatch.setattr(models, "from_pretrained",
                        lambda *a, **kw: loads.append(a) or real(*a, **kw))

    def forbidden(*a, **kw):
        raise AssertionError("evaluate must not build this")
    monkeypatch.setattr(data, "make_prompt_loader", forbidden)
    monkeypatch.setattr(tempfile, "mkdtemp", forbidden)
    out = evaluate(_cli_config(tiny_warm_start), str(uninterrupted[0]))
    assert len(loads) == 1
    last = read_metrics(os.path.join(uninterrupted[0], "metrics.jsonl"))[-1]
    assert out["step"] == STEPS
    for key in ("eval/pass@1", "eval/pass@2", "eval/mean@2", "eval/num_prompts"):
        assert out[key] == last[key], key


def test_log_every_writes_every_kth_evaluated_and_last_step():
    from brorl_jax.train.loop import should_log
    steps, every = 7, 3
    logged = [d for d in range(1, steps + 1)
              if should_log(d, every, evaluated=d in (4, steps), stop=False)]
    assert logged == [3, 4, 6, 7]
    assert should_log(5, every, evaluated=False, stop=True)       # the step a signal stops at
    assert [d for d in range(1, 5) if should_log(d, 1, evaluated=False, stop=False)] == \
        [1, 2, 3, 4]
