"""Faults and bad input (issue 17, docs/reliability.md): one test per class, each running the
real command in a subprocess on the tiny config, checking the exit code, that the message names
the key / file / line, and that checkpoints and metrics already written are unchanged (hashes).

One finished tiny run (2 steps) is shared by every test that needs a run (each test works on a
copy); the subprocesses share the session's JAX compilation cache and fork from a preloaded
interpreter (tests/procs.py). Commands that
fail at the door run in parallel.
"""
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import procs
import pytest
from testutil import ROOT

from brorl_jax.workdir.logger import read_metrics

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

TINY = ["--config=configs/tiny.py", "--config.sft.steps=0"]
STEPS = 2


@pytest.fixture(scope="module")
def env():
    """The session's environment: its JAX compilation cache (tests/conftest.py) already holds the
    tiny config's programs when another file compiled them first."""
    return dict(os.environ)


def start(env, module, *args, extra_env=None):
    return procs.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                       env=dict(env, **(extra_env or {})), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(env, module, *args, extra_env=None, timeout=300):
    return finish(start(env, module, *args, extra_env=extra_env), timeout)


def run_all(env, commands, timeout=300):
    """Runs several (module, *args) commands at once; returns [(rc, out, err)] in order."""
    procs = [start(env, *c) for c in commands]
    return [finish(p, timeout) for p in procs]


def hashes(workdir, what=("checkpoints", "metrics.jsonl")):
    """{relative path: sha256} of every file under `what` in the workdir."""
    out = {}
    for name in what:
        path = os.path.join(workdir, name)
        files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**"),
                                                              recursive=True)
        for f in files:
            if os.path.isfile(f):
                with open(f, "rb") as fh:
                    out[os.path.relpath(f, workdir)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def short_error(rc, err, code=2):
    """A user error: the expected exit code, an `error:` line, no traceback."""
    assert rc == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, env):
    """One finished tiny run (checkpoints at steps 1 and 2); tests work on copies."""
    workdir = str(tmp_path_factory.mktemp("finished") / "run")
    rc, out, err = run(env, "brorl_jax.main", *TINY, f"--workdir={workdir}",
                       f"--config.train.steps={STEPS}", timeout=900)
    assert rc == 0, out[-2000:] + err[-3000:]
    return workdir


@pytest.fixture
def copy(finished, tmp_path):
    dest = str(tmp_path / "run")
    shutil.copytree(finished, dest)
    return dest


def resume_args(workdir, steps=STEPS):
    return [*TINY, f"--workdir={workdir}", f"--config.train.steps={steps}"]


def final_params(workdir, step):
    from brorl_jax.train.loop import restore_params
    from configs import tiny
    _, params, got = restore_params(tiny.get_config(), workdir, step)
    assert got == step
    return jax.tree.map(np.asarray, params)


# 1. Errors at the door ---------------------------------------------------------------------------
def test_errors_at_the_door_are_short_with_exit_code_2(env, finished, tmp_path):
    before = hashes(finished)
    typo = "--config.rollout.rollouts_per_promt=4"
    results = run_all(env, [
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'a'}", typo),
        ("brorl_jax.evaluate", *TINY, f"--workdir={finished}", typo),
        ("brorl_jax.export", *TINY, f"--workdir={finished}", f"--out={tmp_path / 'hf'}",
         "--config.algo.advantage=ppo"),
        ("brorl_jax.experiments.compare_n", *TINY, f"--out={tmp_path / 'cmp'}", "--n=16,x"),
        ("brorl_jax.theory.simulate", "--vocab=100", "--correct=100", f"--out={tmp_path / 's'}"),
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'b'}", typo, "--debug"),
    ])
    for rc, _, err in results[:2]:
        short_error(rc, err)
        assert ("unknown config key 'rollout.rollouts_per_promt'. Did you mean "
                "'rollout.rollouts_per_prompt'?") in err
        assert "--debug prints it" in err
    assert "'algo.advantage' is 'ppo'; allowed:" in short_error(*results[2][::2])
    assert "--n must be comma-separated integers" in short_error(*results[3][::2])
    assert "error: correct must be in [1, vocab - 1]" in short_error(*results[4][::2])
    rc, _, err = results[5]
    assert rc == 2 and "Traceback" in err and "unknown config key" in err   # --debug: traceback
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "hf")
    assert hashes(finished) == before
    # A bug is not a user error: its traceback is shown (exit code 1).
    out = procs.run([sys.executable, "-c", "from brorl_jax import cli\n"
                     "cli.run(lambda values: 1 // 0)"], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ZeroDivisionError" in out.stderr


# 2. Validate before expensive work ---------------------------------------------------------------
def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_bad_values_are_refused_before_expensive_work(env, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where a directory belongs")
    sources = _jsonl(tmp_path / "sources.jsonl", [
        {"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "data_source": src}
        for i, src in enumerate(["openai/gsm8k"] * 20 + ["hiyouga/geometry3k", "my_set"])])
    mapped = '{"my_set": "math", "hiyouga/geometry3k": "math"}'
    results = run_all(env, [
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w1'}",
         "--config.train.checkpoint_every=0"),
        ("brorl_jax.main", *TINY, f"--workdir={blocked}"),
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w3'}", f"--config.data.train={sources}"),
        # mapped: the run gets past the data sources and stops at the next check (no prompt
        # fits max_prompt_len=1) before any rollout
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w4'}", f"--config.data.train={sources}",
         f"--config.rewards.map={mapped}", "--config.data.max_prompt_len=1"),
    ])
    err = short_error(*results[0][::2])
    assert "config key 'train.checkpoint_every' must be > 0, got 0" in err
    assert not os.path.exists(tmp_path / "w1")                    # stopped before anything
    err = short_error(*results[1][::2])
    assert f"{blocked / 'checkpoints'}" in err and "is a file" in err
    rc, out, err = results[2]
    short_error(rc, err)
    assert "no verifier for data_source 'hiyouga/geometry3k' (veRL scores it with geo3k" in err
    assert "no verifier for data_source 'my_set'" in err and "rewards.map" in err
    assert "openai/gsm8k" not in err                             # a veRL name understood
    assert "[data] verifiers" not in out                          # refused before the model
    rc, out, err = results[3]
    assert f"data.train = '{sources}': 0 usable prompts" in short_error(rc, err)
    assert ("[data] verifiers: hiyouga/geometry3k -> math, my_set -> math, "
            "openai/gsm8k -> final_number") in out


# 3. A run remembers its config ------------------------------------------------------------------
def test_resume_refuses_a_changed_config_and_logs_allowed_changes(env, copy):
    saved = json.load(open(os.path.join(copy, "brorl_config.json")))
    assert saved["rollout"]["rollouts_per_prompt"] == 8 and saved["train"]["steps"] == STEPS
    before = hashes(copy)
    rc, out, err = run(env, "brorl_jax.main", *resume_args(copy),
                       "--config.rollout.rollouts_per_prompt=4", "--config.optim.base_lr=1e-3")
    short_error(rc, err)
    assert "rollout.rollouts_per_prompt: 8 -> 4" in err and "optim.base_lr: 0.00015 -> 0.001" in err
    assert "the derived learning rate would change" in err
    assert "--allow_config_change=optim.base_lr,rollout.rollouts_per_prompt" in err
    assert "another --workdir" in err
    assert hashes(copy) == before

    rc, out, err = run(env, "brorl_jax.main", *resume_args(copy), "--config.eval.every=5",
                       "--config.rollout.temperature=0.9",
                       "--allow_config_change=rollout.temperature")
    assert rc == 0, err[-3000:]
    assert "[config] eval.every: 0 -> 5, allowed: evaluation cadence" in out
    assert "[config] rollout.temperature: 1.0 -> 0.9, override (--allow_config_change)" in out
    change = json.loads(open(os.path.join(copy, "config_changes.jsonl")).read())
    assert change["resumed_from_step"] == STEPS
    assert change["changes"]["rollout.temperature"] == {"old": 1.0, "new": 0.9, "how": "override"}
    assert json.load(open(os.path.join(copy, "brorl_config.json")))["rollout"]["temperature"] == 0.9
    assert hashes(copy) == before


# 4. Checkpoint fallback, disk full --------------------------------------------------------------
def _damage(workdir, step):
    for f in glob.glob(os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0",
                                    "d", "*")):
        with open(f, "wb") as fh:
            fh.write(b"damaged")


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(env, finished, copy):
    metrics_before = hashes(copy, ("metrics.jsonl",))["metrics.jsonl"]
    step1 = {k: v for k, v in hashes(copy).items() if k.startswith("checkpoints/1/")}
    _damage(copy, 2)
    damaged = {k.split("/", 2)[2]: v for k, v in hashes(copy).items()
               if k.startswith("checkpoints/2/")}
    rc, out, err = run(env, "brorl_jax.main", *resume_args(copy))
    assert rc == 0, err[-3000:]
    assert "[checkpoint] step 2 cannot be restored: Exception: Encountered error while reading" \
        in out
    assert "[checkpoint] restored step 1 instead; moved aside: checkpoints/broken/2-" in out
    assert "[resume] from checkpoint step 1" in out
    # the broken checkpoint was moved, byte for byte, not deleted; step 1 untouched
    (moved,) = glob.glob(os.path.join(copy, "checkpoints", "broken", "2-*"))
    assert {k.split("/", 3)[3]: v for k, v in hashes(copy).items()
            if k.startswith("checkpoints/broken/")} == damaged
    assert {k: v for k, v in hashes(copy).items() if k.startswith("checkpoints/1/")} == step1
    # the history past step 1 is kept in a numbered copy; step 2 was redone identically,
    # from the data-iterator and collect state of checkpoint 1
    assert hashes(copy, ("metrics.jsonl.1",))["metrics.jsonl.1"] == metrics_before
    assert [r["step"] for r in read_metrics(os.path.join(copy, "metrics.jsonl"))] == [0, 1, 2]
    redone, original = final_params(copy, 2), final_params(finished, 2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(redone), jax.tree.leaves(original)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_no_restorable_checkpoint_is_a_clear_error_and_moves_nothing(env, copy, tmp_path):
    _damage(copy, 2)
    with open(os.path.join(copy, "checkpoints", "1", "meta", "metadata"), "w") as f:
        f.write("{not json")
    before = hashes(copy)
    (rc, out, err), (rc2, _, err2) = run_all(env, [
        ("brorl_jax.main", *resume_args(copy)),
        ("brorl_jax.export", *TINY, f"--workdir={copy}", f"--out={tmp_path / 'hf'}")])
    for code, e in ((rc, err), (rc2, err2)):
        short_error(code, e)
        assert f"no checkpoint in {copy}/checkpoints can be restored" in e
        assert "step 2: Exception: Encountered error while reading" in e
        assert "step 1: JSONDecodeError" in e and "Nothing was moved or deleted" in e
    assert hashes(copy) == before
    assert not os.path.exists(os.path.join(copy, "checkpoints", "broken"))


def test_disk_full_stops_the_run_at_that_save(env, copy):
    before = hashes(copy)
    metrics = open(os.path.join(copy, "metrics.jsonl")).read()
    rc, out, err = run(env, "brorl_jax.main", *resume_args(copy, steps=4),
                       extra_env={"BRORL_SAVE_FREE_BYTES": str(2 << 20)})
    short_error(rc, err)
    assert "disk full: cannot save checkpoint step 3" in err
    assert "the last complete checkpoint, step 2, is intact and a restart resumes from it" in err
    after = hashes(copy)
    assert {k: after[k] for k in before if k.startswith("checkpoints/")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints/")}
    assert sorted(os.listdir(os.path.join(copy, "checkpoints"))) == ["1", "2"]
    assert open(os.path.join(copy, "metrics.jsonl")).read().startswith(metrics)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs",
                                            str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs (the env-var test above covers the "
                    "user-visible behaviour without it)")
    yield str(mount)
    subprocess.run(["umount", str(mount)], check=False)


def test_an_asynchronous_write_that_runs_out_of_space_is_reported_with_its_step(small_tmpfs):
    """The free-space check passes (we pretend), the background write then hits ENOSPC: the
    error surfaces at check()/wait() as DiskFullError naming the step; step 1 stays intact."""
    import jax.numpy as jnp

    from brorl_jax.errors import DiskFullError
    from brorl_jax.workdir.checkpoint import Checkpointer
    ckpt = Checkpointer(os.path.join(small_tmpfs, "ck"), log=lambda m: None)
    ckpt.save(1, {"w": jnp.ones((16,))}, {"step": 1})
    ckpt.wait()
    os.environ["BRORL_SAVE_FREE_BYTES"] = str(1 << 40)
    try:
        big = jnp.asarray(np.random.default_rng(0).random((1024, 1024), np.float32))
        ckpt.save(2, {"w": big}, {"step": 2})
        with pytest.raises(DiskFullError, match="cannot save checkpoint step 2 .*no space left"):
            deadline = time.time() + 60
            while time.time() < deadline:
                ckpt.check()
                time.sleep(0.05)
            ckpt.wait()
    finally:
        del os.environ["BRORL_SAVE_FREE_BYTES"]
    assert ckpt.all_steps() == [1]
    state, meta = ckpt.restore(1, {"w": jnp.zeros((16,))})
    assert meta == {"step": 1}
    ckpt.close()


def test_a_warm_start_save_that_runs_out_of_space_is_one_line(small_tmpfs, env):
    """The warm start (3.2 MB of weights) saved into a 3 MB work directory: safetensors' own
    error ('No space left on device (os error 28)', not an OSError) was a traceback."""
    rc, out, err = run(env, "brorl_jax.main", "--config=configs/tiny.py", "--config.sft.steps=2",
                       f"--workdir={small_tmpfs}/run", "--config.train.tensorboard=False")
    assert "disk full saving the warm start to" in short_error(rc, err), err[-3000:]
    assert not os.path.exists(os.path.join(small_tmpfs, "run", "warm_start_model"))


@pytest.fixture
def read_only_dir(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    if not mounted or subprocess.run(["mount", "-o", "remount,bind,ro", str(path)],
                                     capture_output=True).returncode:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)
        pytest.skip("needs root to bind-mount a read-only directory (root writes through "
                    "permission bits)")
    yield str(path)
    subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_cache_directory_is_one_line(read_only_dir, env, tmp_path):
    """BRORL_JAX_CACHE read-only: a config file that writes its prompt files there read as an
    invalid command line, the demo model's first build as a traceback."""
    ro = {"BRORL_JAX_CACHE": read_only_dir}
    results = run_all(dict(env, **ro), [
        ("brorl_jax.main", "--config=configs/smollm2_arith.py", f"--workdir={tmp_path / 'a'}"),
        ("brorl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path / 'b'}")])
    for rc, _, err in results:
        assert f"the cache directory {read_only_dir} is not writable" in short_error(rc, err)
        assert "BRORL_JAX_CACHE" in err and "invalid command line" not in err


# 5. Verifier health -----------------------------------------------------------------------------
def test_verifier_health_is_in_the_metrics(finished):
    for record in read_metrics(os.path.join(finished, "metrics.jsonl"))[1:]:
        assert record["verifier/reasoning_gym/basic_arithmetic/failed_frac"] == 0.0
        assert 0.0 <= record["verifier/reasoning_gym/basic_arithmetic/no_answer_frac"] <= 1.0


def test_a_verifier_failing_on_every_sample_stops_the_run(env, tmp_path):
    # puzzles mapped to the Reasoning Gym verifier, which cannot tell their task: every sample
    # raises. The first rows are held out, so the evaluation before RL sees them first.
    rows = [{"prompt": f"{i}*{i}=", "ground_truth": str(i * i), "data_source": "my_puzzles"}
            for i in range(4)]
    rows += [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "data_source": "lighteval/MATH"}
             for i in range(16)]
    rows.insert(8, {"prompt": "1/2=", "ground_truth": "\\frac{1}{", "data_source": "math"})
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    rc, out, err = run(env, "brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w'}",
                       f"--config.data.train={path}", "--config.sft.steps=0",
                       "--config.rewards.map={\"my_puzzles\": \"reasoning_gym\"}")
    short_error(rc, err)
    assert ("the verifier of data source 'my_puzzles' failed on all 4 samples of the evaluation "
            "at step 0; first failure: verifier error: ValueError: cannot tell the reasoning-gym "
            "task") in err
    # the unparseable math ground truth was reported when the data loaded, with file and line
    assert (f"{path} row 8 (line 9): bad_ground_truth (math: math-verify cannot parse the ground "
            "truth '\\\\frac{1}{'") in out


# 6. Rows fail, not files -------------------------------------------------------------------------
def test_bad_rows_are_skipped_with_file_and_line_and_an_empty_file_is_named(env, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1),
                        "data_source": "math"}).encode() for i in range(30)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"\n".join(good[:3] + [b'{"prompt": "caf\xe9 au lait"}', b'{"prompt": ',
                                             b"[1, 2]"] + good[3:]) + b"\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b'{"question_text": "x", "label": "1"}\n\xff\xfe\n{oops\n')
    table = tmp_path / "table.parquet"
    pq.write_table(pa.table({"q": ["1+1="], "a": ["2"]}), table)
    results = run_all(env, [
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w1'}", f"--config.data.train={mixed}",
         f"--config.data.eval={empty}"),
        ("brorl_jax.main", *TINY, f"--workdir={tmp_path / 'w2'}", f"--config.data.train={table}"),
    ])
    rc, out, err = results[0]
    short_error(rc, err)
    assert f"{mixed} row 3 (line 4): not_utf8 (byte 0xe9 at column 16 is not UTF-8)" in out
    assert f"{mixed} row 4 (line 5): invalid_json" in out
    assert f"{mixed} row 5 (line 6): not_an_object" in out
    assert f"error: {empty}: no usable rows" in err
    assert "Its columns: question_text, label" in err and "--config.data.fields=" in err
    rc, out, err = results[1]
    assert f"error: {table}: no usable rows" in short_error(rc, err)
    assert "Its columns: q, a" in err


# 7. Signals -------------------------------------------------------------------------------------
def test_sigint_and_sigterm_stop_after_the_current_step(env, finished, tmp_path):
    procs = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        workdir = str(tmp_path / f"run{sig}")
        shutil.copytree(finished, workdir)
        procs.append((sig, workdir, hashes(workdir),
                      start(env, "brorl_jax.main", *resume_args(workdir, steps=8))))
    sent = set()
    deadline = time.time() + 600
    while len(sent) < len(procs) and time.time() < deadline:
        for sig, workdir, _, proc in procs:
            metrics = os.path.join(workdir, "metrics.jsonl")
            if sig not in sent and any(r["step"] >= 3 for r in read_metrics(metrics)):
                proc.send_signal(sig)          # at the end of step 3 or later
                sent.add(sig)
            assert proc.poll() is None or sig in sent, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    for sig, workdir, before, proc in procs:
        rc, out, err = finish(proc)
        assert rc == 128 + sig, err[-3000:]
        name = signal.Signals(sig).name
        assert f"[signal] {name}: stopping after the current step" in out
        last = err.strip().splitlines()[-1]
        latest = max(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                     if d.isdigit())
        assert 3 <= latest < 8
        assert last == (f"stopped by {name}; a restart with the same --workdir resumes from "
                        f"step {latest}.")
        # the step that was running finished, was logged and checkpointed; older ones untouched
        assert [r["step"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))] == \
            list(range(latest + 1))
        after = hashes(workdir)
        assert {k: after[k] for k in before if k.startswith("checkpoints/2/")} == \
            {k: v for k, v in before.items() if k.startswith("checkpoints/2/")}
        final_params(workdir, latest)                             # restorable


# 8. History is never lost -----------------------------------------------------------------------
def test_history_is_kept_and_readers_never_create_a_workdir(env, tmp_path, finished):
    workdir = tmp_path / "again"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 0, "run": "second"}\n')
    (workdir / "metrics.jsonl.1").write_text('{"step": 0, "run": "first"}\n')
    (workdir / "brorl_config.json").write_text('{"name": "old"}\n')
    misspelled = finished + "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "openai/gsm8k"}
            for i in range(12)]
    same = _jsonl(tmp_path / "same.jsonl", rows + rows[:2])     # two rows repeat
    results = run_all(env, [
        ("brorl_jax.main", *TINY, f"--workdir={workdir}", "--config.train.steps=0",
         "--config.sft.steps=0", f"--config.data.train={same}", f"--config.data.eval={same}"),
        ("brorl_jax.evaluate", *TINY, f"--workdir={misspelled}"),
        ("brorl_jax.export", *TINY, f"--workdir={misspelled}", f"--out={tmp_path / 'hf'}"),
        ("brorl_jax.evaluate", *TINY, f"--workdir={empty}"),
    ])
    assert "no complete checkpoint" in short_error(*results.pop()[::2])
    assert os.listdir(empty) == []                  # not even logs/: readers write nothing
    rc, out, err = results[0]
    assert rc == 0, err[-3000:]
    assert (workdir / "metrics.jsonl.1").read_text() == '{"step": 0, "run": "first"}\n'
    assert (workdir / "metrics.jsonl.2").read_text() == '{"step": 0, "run": "second"}\n'
    assert (workdir / "brorl_config.json.1").read_text() == '{"name": "old"}\n'
    (first,) = read_metrics(str(workdir / "metrics.jsonl"))
    assert first["step"] == 0
    assert f"earlier history kept in {workdir}/metrics.jsonl.2" in out
    # data.eval = data.train with repeated rows: warned and counted in the first metrics row
    assert (first["data/eval_in_train"], first["data/train_repeated_rows"],
            first["data/eval_repeated_rows"]) == (14, 2, 2)
    assert ("[data] warning: 14 of 14 held-out prompts are also training prompts (first: "
            f"{same} row 0); the held-out score is then partly a training score") in out
    assert f"[data] warning: 2 of 14 training rows repeat an earlier prompt (first: {same} " \
        "row 12)" in out
    for rc, _, err in results[1:]:
        short_error(rc, err)
        assert f"--workdir '{misspelled}' does not exist. Did you mean '{finished}'?" in err
    assert not os.path.exists(misspelled) and not os.path.exists(tmp_path / "hf")


# 9. One run per work directory (issue 26) --------------------------------------------------------
HOLD = ("import sys, time\n"
        "from brorl_jax.workdir import layout as workdir\n"
        "lock = workdir.acquire(sys.argv[1], command='holder')\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


def all_files(workdir):
    """{relative path: sha256} of every file in the directory (nothing added, nothing changed)."""
    return hashes(workdir, sorted(os.listdir(workdir)))


def untouched(workdir):
    """Every file's hash, and every directory's entries and modification time: a file written
    and removed again (a probe) changes its directory's mtime, so equal states mean nothing
    was created, removed or changed in between."""
    dirs = {os.path.relpath(d, workdir): (os.stat(d).st_mtime_ns, sorted(names + files))
            for d, names, files in os.walk(workdir)}
    return all_files(workdir), dirs


def wait_for_holder(workdir, pid, proc, timeout=300):
    from brorl_jax.workdir.layout import read_lock
    deadline = time.time() + timeout
    while (read_lock(workdir) or {}).get("pid") != pid:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


def test_a_work_directory_belongs_to_one_run_at_a_time(env, copy, tmp_path):
    holder = procs.Popen([sys.executable, "-c", HOLD, copy], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before, state = all_files(copy), untouched(copy)
        (rc, out, err), (rc2, out2, err2), (rc3, out3, err3) = run_all(env, [
            ("brorl_jax.main", *resume_args(copy, steps=3)),
            ("brorl_jax.evaluate", *TINY, f"--workdir={copy}"),
            ("brorl_jax.export", *TINY, f"--workdir={copy}", f"--out={tmp_path / 'hf'}"),
        ])
        short_error(rc, err)
        assert (f"--workdir '{copy}' is in use by another run: pid {holder.pid} on host "
                f"{os.uname().nodename}, started ") in err and "(holder)" in err
        assert "give another --workdir" in err and "[resume]" not in out
        # readers read a locked directory and write nothing into it
        assert rc2 == 0, err2[-3000:]
        assert f"[workdir] {copy} is in use by a run (pid {holder.pid}" in out2
        assert rc3 == 0, err3[-3000:]
        assert os.path.exists(tmp_path / "hf" / "model.safetensors")
        # the refused main and the readers wrote nothing there, not even a file removed again
        assert untouched(copy) == state and not os.path.exists(os.path.join(copy, "logs"))
    finally:
        holder.kill()                                  # SIGKILL: its record stays behind
        holder.wait()
    # a lock left by a dead process is taken over; a second main stops at the door
    first = start(env, "brorl_jax.main", *resume_args(copy, steps=3))
    wait_for_holder(copy, first.pid, first)
    rc, out, err = run(env, "brorl_jax.main", *resume_args(copy, steps=3))
    short_error(rc, err)
    assert f"is in use by another run: pid {first.pid} on host" in err
    rc, out, err = finish(first)
    assert rc == 0, err[-3000:]
    assert (f"[workdir] taking over the lock of {copy}: the run that held it (pid {holder.pid} "
            f"on host {os.uname().nodename}") in out and "(holder)) is no longer running" in out
    assert [r["step"] for r in read_metrics(os.path.join(copy, "metrics.jsonl"))] == [0, 1, 2, 3]
    assert {k: v for k, v in all_files(copy).items() if k.startswith("checkpoints/2/")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints/2/")}
    assert open(os.path.join(copy, ".brorl_lock")).read() == ""      # released cleanly


# 10. Exports never overwrite ---------------------------------------------------------------------
def test_exports_never_overwrite(env, copy, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    replaced = tmp_path / "replaced"
    replaced.mkdir()
    (replaced / "old.txt").write_text("old\n")
    (tmp_path / "a_file").write_text("x")
    legacy = str(tmp_path / "legacy")            # a run from before brorl_config.json
    shutil.copytree(copy, legacy)
    os.replace(os.path.join(legacy, "brorl_config.json"), os.path.join(legacy, "config.json"))
    before, legacy_before = all_files(copy), all_files(legacy)
    export = ("brorl_jax.export", *TINY, f"--workdir={copy}")
    results = run_all(env, [
        (*export, f"--out={copy}"),
        (*export, f"--out={os.path.join(copy, 'hf')}"),
        (*export, f"--out={mine}"),
        (*export, f"--out={tmp_path / 'a_file'}"),
        (*export, f"--out={replaced}", "--overwrite"),
        ("brorl_jax.main", *resume_args(legacy), "--config.algo.advantage=grpo"),
    ])
    for rc, _, err in results[:2]:
        assert "is inside the run's work directory" in short_error(rc, err)
    assert f"--out '{mine}' is not empty" in short_error(*results[2][::2])
    assert "--overwrite to replace it" in results[2][2]
    assert "is a file; give a directory" in short_error(*results[3][::2])
    rc, out, err = results[4]
    assert rc == 0, err[-3000:]
    assert {"config.json", "generation_config.json", "model.safetensors"} <= \
        set(os.listdir(replaced))
    assert "model_type" in json.load(open(replaced / "config.json"))
    assert not os.path.exists(replaced / "old.txt")
    assert [n for n in os.listdir(tmp_path) if ".export-" in n or ".old-" in n] == []
    # an old work directory's config.json is still its resume check
    err = short_error(*results[5][::2])
    assert "algo.advantage: 'reinforce_pp_baseline' -> 'grpo'" in err
    assert (mine / "config.json").read_text() == '{"mine": true}\n'
    assert all_files(copy) == before
    assert {k: v for k, v in all_files(legacy).items() if not k.startswith("logs/")} == \
        legacy_before                          # main logs its error in its own logs/ only


# 11. Every value checked at the door (issue 26; the full table over the schema is
# tests/test_door_checks.py) -------------------------------------------------------------------
def test_values_the_plan_cannot_hold_are_refused_at_the_door(env, tmp_path):
    w = lambda name: f"--workdir={tmp_path / name}"       # noqa: E731
    results = run_all(env, [
        ("brorl_jax.main", *TINY, w("a"), "--config.rollout.temperature=inf"),
        ("brorl_jax.main", *TINY, w("b"), "--config.rollout.temperature=nan"),
        ("brorl_jax.main", *TINY, w("c"), "--config.rollout.rollouts_per_prompt=100000000000"),
        ("brorl_jax.main", *TINY, w("d"), "--config.mesh.data=4", "--config.mesh.fsdp=2"),
        ("brorl_jax.main", *TINY, w("e"), "--config.rollout.rollouts_per_prompt=abc"),
        ("brorl_jax.main", "--config=configs/brorl.py:n=abc", w("f")),
        ("brorl_jax.main", *TINY, w("g"), "--config.data.max_prompt_len=8"),
        ("brorl_jax.experiments.compare_n", *TINY, f"--out={tmp_path / 'h'}", "--seeds="),
        ("brorl_jax.experiments.compare_n", *TINY, f"--out={tmp_path / 'i'}", "--n="),
    ])
    errs = [short_error(rc, err) for rc, _, err in results]
    assert "config key 'rollout.temperature' must be finite, got inf" in errs[0]
    assert "config key 'rollout.temperature' is nan" in errs[1]
    assert ("config key 'rollout.rollouts_per_prompt' = 100000000000 does not fit in int32"
            in errs[2])
    assert ("config keys mesh.data=4, mesh.fsdp=2, mesh.tensor=1 do not match the 1 device JAX "
            "sees") in errs[3]
    assert ("config key 'rollout.rollouts_per_prompt' must be an integer (int), got 'abc'"
            in errs[4])
    assert "config preset argument 'n' must be int, got 'abc'" in errs[5]
    assert "longer than data.max_prompt_len=8" in errs[6]
    assert "raise data.max_prompt_len (now 8; the longest prompt has " in errs[6]
    assert "--seeds is empty" in errs[7] and "--n is empty" in errs[8]
    for name in "abcdef":                      # refused before the work directory was made
        assert not os.path.exists(tmp_path / name)


# 12. Signals during the warm start and an evaluation (issue 26) ---------------------------------
def _wait_for_line(proc, text, timeout=600):
    """Reads the process's stdout until a line contains `text`; returns the lines read."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} not printed: {''.join(lines)[-3000:]}"
                         f"{proc.communicate()[1][-3000:]}")


def test_a_signal_during_the_warm_start_or_an_evaluation_stops_within_seconds(env, tmp_path):
    warm = ["--config=configs/tiny.py", "--config.train.steps=0",
            "--config.train.tensorboard=False"]
    sft_dir, eval_dir = tmp_path / "sft", tmp_path / "eval"
    # 1. during the evaluation before RL (this run also puts the warm start's program into the
    # shared compilation cache, so the second run's signal lands in SFT steps, not a compile)
    in_eval = start(env, "brorl_jax.main", *warm, f"--workdir={eval_dir}",
                    "--config.eval.num_prompts=16", "--config.eval.samples_per_prompt=32")
    _wait_for_line(in_eval, "[sft] 60 supervised steps")     # the evaluation before RL follows
    time.sleep(3.0)                                          # the warm start saved, in the eval
    in_eval.send_signal(signal.SIGINT)
    t0 = time.time()
    rc, out, err = finish(in_eval)
    assert rc == 130, err[-3000:]
    assert time.time() - t0 < 60, "the evaluation did not stop within seconds"
    assert "[signal] SIGINT during the evaluation at step 0: stopping now" in out
    assert "stopped by SIGINT during the evaluation at step 0" in err
    assert os.path.exists(eval_dir / "warm_start_model" / "brorl_warm_start.json")
    kept = hashes(str(eval_dir), ("warm_start_model",))
    # 2. during the warm start: stops within seconds, keeps nothing half-done
    in_sft = start(env, "brorl_jax.main", *warm, f"--workdir={sft_dir}")
    _wait_for_line(in_sft, "[config] lr =")           # the next thing is the warm start
    time.sleep(3.0)
    in_sft.send_signal(signal.SIGTERM)
    t0 = time.time()
    rc, out, err = finish(in_sft)
    assert rc == 143, err[-3000:]
    # within one SFT step (or the compile of the first one): a loose bound for a loaded machine;
    # the warm start did not run to its end
    assert time.time() - t0 < 60, "the warm start did not stop within seconds"
    assert "[signal] SIGTERM during the warm start: stopping now" in out
    assert "supervised steps in" not in out
    assert err.strip().splitlines()[-1] == (
        "stopped by SIGTERM during the warm start; a restart with the same --workdir starts "
        "from the beginning (no checkpoint was written yet; a finished warm start is kept and "
        "not run again).")
    assert not os.path.exists(sft_dir / "warm_start_model")   # an unfinished one is not kept
    # 3. the restart does not redo the finished warm start: it loads it and goes on
    rc, out, err = run(env, "brorl_jax.main", *warm, f"--workdir={eval_dir}")
    assert rc == 0, err[-3000:]
    assert (f"[sft] warm start kept from an earlier start: {eval_dir}/warm_start_model") in out
    assert "supervised steps in" not in out and "[eval] before RL: pass@1" in out
    assert hashes(str(eval_dir), ("warm_start_model",)) == kept


def test_evaluate_and_export_read_the_runs_own_config(copy, env, tmp_path):
    """Without --config, evaluate and export read the run's saved config (configs/tiny.py with
    the run's overrides), --config.KEY on top; they used to build the default file's
    (configs/demo.py: 200 held-out prompts, 4 samples each). The run is only read."""
    before = hashes(copy)
    (rc_e, out_e, err_e), (rc_x, out_x, err_x) = run_all(env, [
        ("brorl_jax.evaluate", f"--workdir={copy}", "--config.eval.num_prompts=4"),
        ("brorl_jax.export", f"--workdir={copy}", f"--out={tmp_path / 'hf'}")])
    assert rc_e == 0, err_e[-3000:]
    result = json.loads(out_e[out_e.index("\n{"):])          # after the progress lines
    assert result["step"] == STEPS and result["eval/num_prompts"] == 4    # the override
    assert "eval/mean@2" in result                  # the run's eval.samples_per_prompt (tiny: 2)
    assert "brorl_config.json: the run's own config, with eval.num_prompts from the command " \
           "line" in err_e
    assert rc_x == 0, err_x[-3000:]
    assert os.path.exists(tmp_path / "hf" / "config.json")
    assert hashes(copy) == before


def test_export_never_writes_over_the_base_model(copy, env, tmp_path):
    """--out at the run's model.path (or inside it, or a directory holding it) is refused even
    with --overwrite: the run's restores read that model. It used to be replaced."""
    from brorl_jax.models import ensure_demo_model
    base = tmp_path / "base"
    shutil.copytree(ensure_demo_model(), base)
    before = hashes(str(base), what=sorted(os.listdir(base)))
    model = f"--config.model.path={base}"
    results = run_all(env, [
        ("brorl_jax.export", f"--workdir={copy}", model, f"--out={out}", "--overwrite")
        for out in (base, base / "sub", tmp_path)])
    for rc, _, err in results:
        assert "is or holds the run's base model" in short_error(rc, err)
    assert hashes(str(base), what=sorted(os.listdir(base))) == before


def test_a_checkpoint_that_does_not_fit_the_given_config_names_the_keys(copy, env):
    """evaluate with --config naming another model (SmolLM2) than the run's: the restore fails
    and the error names the keys that differ from the run's own config, and that evaluate
    without --config reads that one."""
    rc, out, err = run(env, "brorl_jax.evaluate", "--config=configs/smollm2_arith.py",
                       f"--workdir={copy}")
    err = short_error(rc, err)
    assert "can be restored" in err, err[-3000:]
    assert ("The config differs from the run's own (brorl_config.json) in model.path: '' -> "
            "'builtin:smollm2-135m-instruct':") in err, err[-3000:]
    assert "without --config, evaluate and export read the run's own" in err


def test_a_finished_run_exports_and_evaluates_after_its_base_model_is_gone(copy, env, tmp_path):
    """A fresh start copies its base model's config and tokenizer files (base_model/, no
    weights): once model.path is gone, evaluate and export of the run read the copy and the
    checkpoint's weights, and give what they gave with the base present; the copy alone is never
    trained or evaluated as a model."""
    from brorl_jax.models import ensure_demo_model
    base = tmp_path / "base"
    shutil.copytree(ensure_demo_model(), base)
    saved = os.path.join(copy, "brorl_config.json")
    with open(saved) as f:
        config = json.load(f)
    config["model"]["path"] = str(base)
    with open(saved, "w") as f:
        json.dump(config, f)
    assert sorted(os.listdir(os.path.join(copy, "base_model"))) == [
        "brorl_no_weights.json", "chat_template.jinja", "config.json", "generation_config.json",
        "tokenizer.json", "tokenizer_config.json"]
    with_base = run_all(env, [("brorl_jax.export", f"--workdir={copy}", f"--out={tmp_path / 'a'}")])
    shutil.rmtree(base)
    without = run_all(env, [("brorl_jax.export", f"--workdir={copy}", f"--out={tmp_path / 'b'}"),
                            ("brorl_jax.evaluate", f"--workdir={copy}"),
                            ("brorl_jax.evaluate", *TINY,
                             f"--config.model.path={os.path.join(copy, 'base_model')}")])
    for rc, _, err in with_base + without[:2]:
        assert rc == 0, err[-3000:]
    assert "is gone: the run's copy of its config and tokenizer" in without[0][2]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    score = json.loads(without[1][1][without[1][1].rindex("{\n"):])
    assert 0 <= score["eval/pass@1"] <= 1 and score["step"] == 2
    assert "without weights: it serves evaluate and export" in short_error(*without[2][::2])


def test_evaluate_and_export_refuse_a_base_model_that_changed(copy, env, tmp_path):
    """A fresh start records the hashes of its base model's config and tokenizer files
    (base_model.json); evaluate and export with a model.path whose files differ are refused
    naming them, where they built prompts and shipped files the run did not train with."""
    from brorl_jax.models import ensure_demo_model
    assert os.path.exists(os.path.join(copy, "base_model.json"))
    edited = tmp_path / "edited"
    shutil.copytree(ensure_demo_model(), edited)
    template = edited / "chat_template.jinja"
    template.write_text("{# another template #}" + template.read_text())    # another file
    results = run_all(env, [
        ("brorl_jax.evaluate", f"--workdir={copy}", f"--config.model.path={edited}"),
        ("brorl_jax.export", f"--workdir={copy}", f"--config.model.path={edited}",
         f"--out={tmp_path / 'hf'}")])
    for rc, _, err in results:
        assert "chat_template.jinja differ(s) from the base model the run started with" in \
            short_error(rc, err), err[-3000:]
    assert not os.path.exists(tmp_path / "hf")
