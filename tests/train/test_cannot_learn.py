"""A run that cannot learn says so (issue 45 item 1), through the real command on configs/tiny.py:
greedy rollouts are refused at the door, a reward beyond float32 stops at the door naming the
function, and RL steps whose every update is non-finite stop the run (exit code 2) after
train.max_skipped_steps of them in a row, each a warning, with the checkpoints already written
kept as they were."""
import json
import os
import shutil

import pytest
from testutil import run_main

pytestmark = pytest.mark.slow     # end-to-end: out of `-m "not slow"`

SCORERS = "tests/rewards/verl_style_scorers.py"


def _failure(out) -> str:
    return f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_greedy_rollouts_are_refused_at_the_door(tmp_path):
    out = run_main(tmp_path / "run", "--config.rollout.temperature=0")
    assert out.returncode == 2, _failure(out)
    assert "config key 'rollout.temperature' = 0 (greedy)" in out.stderr
    assert "no step can learn" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()          # refused before the work directory


def test_a_reward_beyond_float32_stops_at_the_door(tmp_path):
    out = run_main(tmp_path / "run", f"--config.rewards.custom={SCORERS}:returns_beyond_float32")
    assert out.returncode == 2, _failure(out)
    assert "returns_beyond_float32" in out.stderr and "beyond float32" in out.stderr
    assert "Traceback" not in out.stderr


def test_steps_with_every_update_non_finite_stop_the_run(tmp_path, tiny_warm_start):
    """A learning rate of 1e30 sends the weights to ~1e30 in the first update; from then on every
    loss overflows, the NaN guard skips every update, and after train.max_skipped_steps = 2 such
    steps the run stops with exit code 2 naming the keys; the step-1 checkpoint is kept."""
    run = tmp_path / "run"
    out = run_main(run, "--config.optim.lr=1e30", "--config.train.steps=8",
                   "--config.train.checkpoint_every=1", "--config.train.max_skipped_steps=2",
                   "--config.train.tensorboard=False", "--config.eval.every=0", *tiny_warm_start)
    assert out.returncode == 2, _failure(out)
    assert out.stdout.count("[nan-guard] warning") == 2, out.stdout[-3000:]
    assert "2 RL steps in a row had every update non-finite" in out.stderr, _failure(out)
    assert "optim.lr" in out.stderr and "Traceback" not in out.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["update/skipped"] for r in rows if r["step"] == 1] == [0.0]   # the first update
    assert os.path.isdir(run / "checkpoints" / "1")                      # kept as written


def _demo_copy(tmp_path, name):
    from brorl_jax.models import ensure_demo_model
    dest = tmp_path / name
    shutil.copytree(ensure_demo_model(), dest)
    return dest


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_models_the_rollouts_cannot_use_are_refused_once_loaded(tmp_path):
    """A model with no stop id anywhere decoded every sample to max_new_tokens with no word; a
    tokenizer larger than the model's vocabulary failed at the first rollout. Both are refused
    by main once the model has loaded, naming the directory and the fix."""
    no_eos = _demo_copy(tmp_path, "no_eos")
    for name in ("config.json", "generation_config.json"):
        _edit_json(no_eos / name, lambda c: c.pop("eos_token_id", None))
    _edit_json(no_eos / "tokenizer_config.json", lambda c: c.update(eos_token=None))
    wide = _demo_copy(tmp_path, "wide_tokenizer")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(wide)
    tok.add_tokens([f"<extra_{i}>" for i in range(8)])
    tok.save_pretrained(wide)
    for model, message in ((no_eos, "has no end-of-sequence id"),
                           (wide, "tokens, more than the model's vocab_size 105")):
        out = run_main(tmp_path / f"run_{model.name}", f"--config.model.path={model}")
        assert out.returncode == 2, _failure(out)
        assert message in out.stderr and str(model) in out.stderr and "Traceback" not in out.stderr


def test_a_warm_start_without_references_is_refused_before_the_model_loads(tmp_path):
    """A warm start on a data source with no reference completion (gsm8k rows here) failed
    after the model had loaded; it is refused as soon as the data is read."""
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1),
                        "data_source": "gsm8k"}) for i in range(40)]
    (tmp_path / "gsm.jsonl").write_text("\n".join(rows) + "\n")
    out = run_main(tmp_path / "run", f"--config.data.train={tmp_path}/gsm.jsonl",
                   "--config.sft.steps=5")
    assert out.returncode == 2, _failure(out)
    assert "'sft.steps' > 0 asks for a warm start" in out.stderr and "'gsm8k'" in out.stderr
    assert "Traceback" not in out.stderr
