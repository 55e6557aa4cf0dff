"""train.loggers: the same metrics in every logger, the run's config/lr/git revision once, only
process 0, a clear message naming the extra when a logger is not installed.

The logic is tested against fake wandb/mlflow modules (always run); the real packages (the
optional extras `.[wandb]`, `.[mlflow]`, not in the test extra: MLflow alone pulls ~60
packages) are exercised offline when installed: W&B's offline mode, MLflow's SQLite store."""
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest

from brorl_jax.config import default_config
from brorl_jax.errors import ConfigError
from brorl_jax.workdir import logger as logger_lib
from brorl_jax.workdir.logger import LoggerError, MetricsLogger, check_loggers, read_metrics

STEPS = {1: {"eval/pass@1": 0.5, "reward/mean": 0.25, "verifier/x/failed_frac": 0.0,
             "update/skipped": False},
         2: {"eval/pass@1": 0.75, "reward/mean": 0.5, "verifier/x/failed_frac": 0.1,
             "update/skipped": False}}


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fakes(monkeypatch):
    """Fake wandb and mlflow modules that record what they are given."""
    seen = {"wandb_init": [], "wandb_config": {}, "wandb_log": [], "wandb_finish": 0,
            "mlflow_params": {}, "mlflow_metrics": [], "mlflow_runs": [], "mlflow_done": []}

    class Run:
        class config:
            @staticmethod
            def update(d, allow_val_change=False):
                seen["wandb_config"].update(d)

        def log(self, d, step):
            seen["wandb_log"].append((step, dict(d)))

        def finish(self):
            seen["wandb_finish"] += 1

    def init(**kw):
        seen["wandb_init"].append(kw)
        return Run()

    class Metric:
        def __init__(self, key, value, timestamp, step):
            self.key, self.value, self.step = key, value, step

    class Param:
        def __init__(self, key, value):
            self.key, self.value = key, value

    class MlflowClient:
        def __init__(self, tracking_uri):
            seen["mlflow_uri"] = tracking_uri

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            return "0"

        def create_run(self, exp_id, run_name):
            seen["mlflow_runs"].append(run_name)
            run_id = f"r{len(seen['mlflow_runs'])}"
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

        def log_batch(self, run_id, metrics=(), params=()):
            seen["mlflow_params"].update({p.key: p.value for p in params})
            seen["mlflow_metrics"] += [(m.step, m.key, m.value) for m in metrics]

        def set_terminated(self, run_id):
            seen["mlflow_done"].append(run_id)

    monkeypatch.setitem(sys.modules, "wandb", _module("wandb", init=init))
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)       # the fake W&B is logged in
    monkeypatch.setitem(sys.modules, "mlflow", _module("mlflow"))
    monkeypatch.setitem(sys.modules, "mlflow.tracking",
                        _module("mlflow.tracking", MlflowClient=MlflowClient))
    monkeypatch.setitem(sys.modules, "mlflow.entities",
                        _module("mlflow.entities", Metric=Metric, Param=Param))
    return seen


def _log_two_steps(workdir, loggers, **kw):
    cfg = default_config()
    lg = MetricsLogger(str(workdir), loggers=loggers, config=cfg, lr=2e-6, lr_note="lr = 2e-06",
                       **kw)
    for step, metrics in STEPS.items():
        lg.write(step, metrics)
    lg.close()
    return cfg


def test_every_logger_gets_the_same_metrics_and_the_run_info_once(tmp_path, fakes):
    cfg = _log_two_steps(tmp_path, "jsonl,tensorboard,wandb,mlflow")
    jsonl = {r["step"]: {k: v for k, v in r.items() if k != "step" and not isinstance(v, bool)}
             for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert jsonl == {s: {k: v for k, v in m.items() if not isinstance(v, bool)}
                     for s, m in STEPS.items()}
    assert {s: d for s, d in fakes["wandb_log"]} == jsonl
    mlflow = {}
    for step, key, value in fakes["mlflow_metrics"]:
        mlflow.setdefault(step, {})[key] = value
    assert mlflow == {s: {logger_lib.mlflow_name(k): v for k, v in m.items()}
                      for s, m in jsonl.items()}
    assert "eval/pass_at_1" in mlflow[1]          # MLflow's one renaming: "@" -> "_at_"
    # the config, the derived learning rate and the git revision, once, in each
    for info in (fakes["wandb_config"], fakes["mlflow_params"]):
        assert info["lr"] in (2e-6, "2e-06") and info["lr_note"] == "lr = 2e-06"
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", info["git_revision"])
        assert str(info["config.rollout.rollouts_per_prompt"]) == \
            str(cfg.rollout.rollouts_per_prompt)
    assert len(fakes["wandb_init"]) == 1 and fakes["wandb_finish"] == 1
    assert fakes["wandb_init"][0]["dir"] == str(tmp_path)
    assert fakes["mlflow_uri"] == "sqlite:///" + str(tmp_path / "mlflow.db")
    assert fakes["mlflow_done"] == ["r1"]
    assert os.listdir(tmp_path / "tensorboard")


def test_a_resumed_run_continues_the_same_external_runs(tmp_path, fakes):
    _log_two_steps(tmp_path, "wandb,mlflow")
    first_id = fakes["wandb_init"][0]["id"]
    _log_two_steps(tmp_path, "wandb,mlflow", resume_step=2)
    assert fakes["wandb_init"][1]["id"] == first_id
    assert fakes["mlflow_runs"] == ["brorl"]      # no second MLflow run (named by cfg.name)
    _log_two_steps(tmp_path, "wandb,mlflow")               # a fresh start: new runs
    assert fakes["wandb_init"][2]["id"] != first_id and len(fakes["mlflow_runs"]) == 2


def test_only_process_zero_logs(tmp_path, fakes):
    _log_two_steps(tmp_path, "jsonl,tensorboard,wandb,mlflow", enabled=False)
    assert not os.listdir(tmp_path)
    assert not fakes["wandb_init"] and not fakes["mlflow_runs"]


def test_unknown_or_missing_logger_is_refused_at_the_door(monkeypatch):
    with pytest.raises(LoggerError, match="unknown logger 'neptune'"):
        check_loggers("jsonl,neptune")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    for name in ("wandb", "mlflow"):
        with pytest.raises(LoggerError, match=rf"pip install 'brorl_jax\[{name}\]'"):
            check_loggers(f"jsonl,{name}")
        c = default_config()
        c.train.loggers = f"tensorboard,{name}"
        with pytest.raises(ConfigError, match=rf"train.loggers.*brorl_jax\[{name}\]"):
            logger_lib.check_config(c)
    assert check_loggers("tensorboard") == ["jsonl", "tensorboard"]   # jsonl always


def test_wandb_without_a_login_is_refused_at_the_door(tmp_path, monkeypatch):
    """wandb.init with no key prompts, then fails after the data has loaded: the door says how
    to log in or go offline instead. A key, a netrc entry for the host or an offline mode pass."""
    home = {"HOME": str(tmp_path)}
    problem = logger_lib.wandb_login_problem(home)
    assert "run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline" in problem
    assert f"{tmp_path}/.netrc" in problem
    for ok in ({"WANDB_API_KEY": "k" * 40}, {"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}):
        assert logger_lib.wandb_login_problem({**home, **ok}) is None
    (tmp_path / ".netrc").write_text("machine example.com login user password x\n")
    assert logger_lib.wandb_login_problem(home) is not None            # another host's entry
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40)
    assert logger_lib.wandb_login_problem(home) is None
    assert logger_lib.wandb_login_problem({**home, "WANDB_BASE_URL": "https://wb.corp"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real(name, *a))
    for key in ("WANDB_MODE", "WANDB_API_KEY", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    c = default_config()
    c.train.loggers = "wandb"
    with pytest.raises(ConfigError, match="train.loggers.*no W&B login here"):
        logger_lib.check_config(c)


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__)).stdout.strip()


def test_git_revision_is_the_checkout_commit():
    assert logger_lib.git_revision().startswith(_head())
    assert logger_lib.git_revision("/") == "unknown"


def test_tensorboard_flag_still_turns_tensorboard_off(tmp_path):
    MetricsLogger(str(tmp_path), tensorboard=False, loggers="jsonl,tensorboard").close()
    assert not (tmp_path / "tensorboard").exists()


def test_progress_bar_shows_what_and_rate(capsys):
    bar = logger_lib.progress(range(3), desc="warm start: SFT", unit="step")
    assert list(bar) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "warm start: SFT" in out and "step/s" in out
    assert list(logger_lib.progress(range(2), desc="x", enabled=False)) == [0, 1]
    assert "x:" not in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None or
                    importlib.util.find_spec("mlflow") is None,
                    reason="the optional extras .[wandb] / .[mlflow] are not installed; "
                           "the fakes above cover the logic")
def test_real_wandb_offline_and_mlflow_sqlite_store(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_two_steps(tmp_path, "wandb,mlflow")
    (run_dir,) = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    (data,) = [f for f in os.listdir(tmp_path / "wandb" / run_dir) if f.endswith(".wandb")]
    raw = (tmp_path / "wandb" / run_dir / data).read_bytes()
    for key in (b"eval/pass@1", b"reward/mean", b"git_revision", b"lr_note"):
        assert key in raw, key
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri="sqlite:///" + str(tmp_path / "mlflow.db"))
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "eval/pass_at_1")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    run = client.get_run(run_id)
    assert run.data.params["git_revision"].startswith(_head())
    assert json.dumps(run.data.params["lr"])
