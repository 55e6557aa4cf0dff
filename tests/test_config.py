"""Config validation: typos, wrong types and inconsistent values stop the run with a clear message."""
import subprocess
import sys

import ml_collections
import pytest

from brorl_jax.config import ConfigError, default_config, derived_learning_rate, validate
from configs import brorl, demo, prorl


@pytest.mark.parametrize("module", [demo, brorl, prorl])
def test_shipped_configs_validate(module):
    validate(module.get_config())


def test_paper_recipes_have_paper_values():
    b, p = brorl.get_config(), prorl.get_config()
    assert (b.rollout.rollouts_per_prompt, b.algo.prompts_per_step) == (512, 128)
    assert (p.rollout.rollouts_per_prompt, p.algo.prompts_per_step) == (16, 512)
    for c in (b, p):
        assert (c.algo.clip_eps_low, c.algo.clip_eps_high) == (0.2, 0.28)
        assert c.algo.kl_estimator == "k2" and c.algo.kl_coef == 1e-4
        assert c.algo.advantage == "reinforce_pp_baseline"
        assert c.eval.temperature == 0.6 and c.eval.top_p == 0.95
    # BroRL's batch is 8x ProRL's in samples, so the sqrt rule scales the LR by sqrt(8).
    lr_b, why = derived_learning_rate(b)
    lr_p, _ = derived_learning_rate(p)
    assert lr_b / lr_p == pytest.approx(8 ** 0.5)
    assert "sqrt" in why


def test_misspelled_key_is_named_with_suggestion():
    c = default_config()
    c.rollout.unlock()
    c.rollout.rollout_per_prompt = 16
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.rollout_per_prompt'.*"
                                          r"rollout.rollouts_per_prompt"):
        validate(c)


def test_wrong_type_is_named():
    # A config file that builds its own ConfigDict (not from default_config) with a string.
    d = default_config().to_dict()
    d["rollout"]["rollouts_per_prompt"] = "many"
    c = ml_collections.ConfigDict(d)
    with pytest.raises(ConfigError, match=r"'rollout.rollouts_per_prompt' must be int"):
        validate(c)


@pytest.mark.parametrize("key,value,pattern", [
    ("algo.kl_estimator", "k9", r"'algo.kl_estimator' is 'k9'; allowed: 'k1', 'k2', 'k3'"),
    ("rollout.rollouts_per_prompt", 0, r"'rollout.rollouts_per_prompt' must be > 0"),
    ("rollout.top_p", 1.5, r"'rollout.top_p' must be in \(0, 1\]"),
    ("algo.micro_batch_size", 7, r"'algo.micro_batch_size'=7 does not divide"),
    ("mesh.fsdp", 0, r"'mesh.fsdp' must be a positive size or -1"),
])
def test_bad_values_are_named(key, value, pattern):
    c = default_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_command_line_typo_stops_main_with_message(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/demo.py",
         f"--workdir={tmp_path}", "--config.rollout.rollout_per_prompt=4"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "rollout_per_prompt" in out.stderr


def test_command_line_bad_value_stops_main_with_message(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "brorl_jax.main", "--config=configs/demo.py",
         f"--workdir={tmp_path}", "--config.algo.advantage=ppo"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "'algo.advantage' is 'ppo'" in out.stderr


CLI_MODULES = ["brorl_jax.main", "brorl_jax.evaluate", "brorl_jax.export",
               "brorl_jax.experiments.compare_n"]


def test_command_modules_import_together():
    # Each command defines --config; importing several into one process (a test session, a
    # notebook) must not collide in absl's global flag registry.
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in CLI_MODULES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("module", CLI_MODULES)
def test_command_help_lists_its_flags(module):
    out = subprocess.run([sys.executable, "-m", module, "--helpshort"], capture_output=True,
                         text=True, timeout=120)
    # absl's help flags print and exit 1; the flags must have been defined when run as a command.
    assert "Traceback" not in out.stderr, out.stderr
    assert "--config:" in out.stdout, out.stdout
