"""Metrics out of the loop: JSONL (the public record) plus the loggers of train.loggers
(TensorBoard, Weights & Biases, MLflow), PNG plots at the end, and progress bars.

train.loggers = "jsonl,tensorboard" by default; "wandb" and "mlflow" are optional extras
(`pip install 'brorl_jax[wandb]'`, `'brorl_jax[mlflow]'`), refused at the door with that command
when asked for and not installed (check_config, called by the Trainer right after the config's
validation, before anything loads). Every logger
gets the same metric names and values at the same steps; at the start each also gets the run's
config, the derived learning rate and the git revision once (W&B: the run config; MLflow: params;
TensorBoard: a text summary). JSONL gets no such record: config.json in the work directory holds
the config. W&B writes under the work directory (WANDB_MODE=offline: files only, `wandb sync`
later; project from WANDB_PROJECT, default "brorl_jax"); MLflow logs to MLFLOW_TRACKING_URI,
default an SQLite store <workdir>/mlflow.db (MLflow 3 refuses its file store by default;
experiment MLFLOW_EXPERIMENT_NAME, default "brorl_jax"). One name differs, forced by MLflow's
rule for metric names (letters, digits, _ - . space : /): "@" is written "_at_" there
("eval/pass@1" -> "eval/pass_at_1"; mlflow_name). A resumed run continues the same W&B /
MLflow run (its id is kept in the work directory).

Only process 0 writes (multi-host runs call `MetricsLogger(..., enabled=jax.process_index()==0)`).
On resume the JSONL is appended to after dropping lines from steps beyond the restored checkpoint,
so the file always describes exactly one run history. History is never lost: the dropped lines
stay in a numbered copy (metrics.jsonl.1, .2, ...), and a fresh start in a work directory that
already has a metrics file moves that file to the next free number.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Iterable

import numpy as np

from brorl_jax.workdir.layout import keep_copy, set_aside

# name -> (module it needs, pip extra that installs it or None when a core dependency)
LOGGERS: dict[str, tuple[str | None, str | None]] = {
    "jsonl": (None, None),
    "tensorboard": ("tensorboardX", None),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


class LoggerError(ValueError):
    """An unknown logger name, or one whose package is not installed (names the extra)."""


def parse_loggers(value: str) -> list[str]:
    names = [n.strip().lower() for n in str(value).split(",") if n.strip()]
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise LoggerError(f"unknown logger {', '.join(map(repr, unknown))}; choose from "
                          f"{', '.join(LOGGERS)} (comma-separated)")
    return list(dict.fromkeys(["jsonl"] + names))     # jsonl is always written


def check_loggers(value: str) -> list[str]:
    """The logger names of train.loggers; LoggerError for an unknown one or a missing package
    (nothing is imported: importlib.util.find_spec)."""
    names = parse_loggers(value)
    for name in names:
        module, extra = LOGGERS[name]
        if module and importlib.util.find_spec(module) is None:
            fix = (f"pip install 'brorl_jax[{extra}]'" if extra else f"pip install {module}")
            raise LoggerError(f"logger {name!r} needs the {module} package, which is not "
                              f"installed: {fix} (or drop {name!r} from train.loggers)")
    if "wandb" in names:
        problem = wandb_login_problem(os.environ)
        if problem:
            raise LoggerError(problem)
    return names


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def wandb_login_problem(environ) -> str | None:
    """Why wandb.init would stop for a login (it prompts, then fails, after the data has loaded),
    or None: WANDB_MODE offline/disabled, WANDB_API_KEY, or a netrc entry for the W&B host
    (where `wandb login` puts the key; NETRC or ~/.netrc, as wandb reads it)."""
    import netrc
    from urllib.parse import urlparse
    if environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES or environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    home = environ.get("HOME") or os.path.expanduser("~")
    paths = [environ["NETRC"]] if environ.get("NETRC") else \
        [os.path.join(home, ".netrc"), os.path.join(home, "_netrc")]
    for path in paths:
        try:
            if netrc.netrc(os.path.expanduser(path)).authenticators(host):
                return None
        except (OSError, netrc.NetrcParseError):
            continue
    return (f"logger 'wandb' has no W&B login here (no WANDB_API_KEY, no {host} entry in "
            f"{' or '.join(paths)}): run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline "
            "to write files only (`wandb sync` later), or drop 'wandb' from train.loggers")


def check_config(cfg) -> list[str]:
    """train.loggers of a run config at the door (before the model loads): ConfigError naming
    the key and, for a missing optional logger, its extra."""
    from brorl_jax.errors import ConfigError
    try:
        return check_loggers(cfg.train.loggers)
    except LoggerError as e:
        raise ConfigError(f"config key 'train.loggers' = {cfg.train.loggers!r}: {e}") from None


def git_revision(path: str | None = None) -> str:
    """The git commit of the code that runs (with "-dirty" when it has local changes), or
    "unknown" outside a git checkout."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=path, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _plain(value: Any) -> Any:
    """Converts numpy/JAX scalars to JSON numbers; non-finite floats become null."""
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _scalars(record: dict) -> dict[str, float]:
    """The numeric metrics of a record (what the non-JSONL loggers take), bools excluded."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat_config(config) -> dict[str, Any]:
    if config is None:
        return {}
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = value
    walk("", d)
    return out


def _run_id(workdir: str, name: str, resume: bool, make) -> str:
    """The id of this work directory's run in an external logger: kept across a resume, new
    on a fresh start."""
    path = os.path.join(workdir, f"{name}_run_id")
    if resume and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = make()
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


class _TensorBoard:
    def __init__(self, workdir: str, **_):
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def run_info(self, info: dict) -> None:
        self.writer.add_text("run", "\n".join(f"    {k} = {v}" for k, v in info.items()), 0)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, workdir: str, *, name: str, resume: bool, **_):
        import wandb
        self.wandb = wandb
        run_id = _run_id(workdir, "wandb", resume, lambda: uuid.uuid4().hex[:12])
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "brorl_jax"), name=name,
                              id=run_id, resume="allow", dir=workdir)

    def run_info(self, info: dict) -> None:
        self.run.config.update(info, allow_val_change=True)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(key: str) -> str:
    """A metric name as MLflow accepts it: "@" (pass@k) -> "_at_"; every other name as is."""
    return key.replace("@", "_at_")


class _MLflow:
    def __init__(self, workdir: str, *, name: str, resume: bool, **_):
        from mlflow.tracking import MlflowClient
        uri = os.environ.get("MLFLOW_TRACKING_URI") or \
            "sqlite:///" + os.path.join(os.path.abspath(workdir), "mlflow.db")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "brorl_jax")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = _run_id(workdir, "mlflow", resume,
                              lambda: self.client.create_run(exp_id, run_name=name).info.run_id)

    def run_info(self, info: dict) -> None:
        from mlflow.entities import Param
        params = [Param(k, str(v)[:500]) for k, v in info.items()]
        for i in range(0, len(params), 100):       # MLflow's batch limit for params
            try:
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            except Exception:  # noqa: BLE001 - a resumed run's params are already set
                pass

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), v, now, step) for k, v in scalars.items()
                   if math.isfinite(v)]
        for i in range(0, len(metrics), 1000):     # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class MetricsLogger:
    """Appends one JSON object per record to `workdir/metrics.jsonl` and mirrors it to the other
    loggers of `loggers` (train.loggers; default "jsonl,tensorboard", or "jsonl" when
    tensorboard=False). With `config`, each logger records the run's config, the learning rate
    (`lr`, `lr_note`) and the git revision once, at the start."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True,
                 resume_step: int | None = None, loggers: str | None = None, config=None,
                 lr: float | None = None, lr_note: str | None = None):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.backends: dict[str, Any] = {}
        self.kept: str | None = None       # where an earlier history went (for the run's log)
        if not enabled:
            return
        names = check_loggers("jsonl,tensorboard" if loggers is None else loggers)
        if not tensorboard and "tensorboard" in names:
            names.remove("tensorboard")   # train.tensorboard=False still turns it off
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        else:
            # A fresh start in a workdir with an old history but no checkpoint: keep the old file.
            self.kept = set_aside(self.path)
        name = (getattr(config, "name", None) if config is not None else None) or \
            os.path.basename(os.path.abspath(workdir))
        for n in names:
            if n in _BACKENDS:
                self.backends[n] = _BACKENDS[n](workdir, name=str(name),
                                                resume=resume_step is not None)
        if config is not None:
            info = {"git_revision": git_revision(), "lr": lr, "lr_note": lr_note,
                    "command": " ".join(sys.argv)}
            info.update({f"config.{k}": v for k, v in _flat_config(config).items()})
            for backend in self.backends.values():
                backend.run_info(info)

    @property
    def _tb(self):   # the TensorBoard writer (kept for callers of the old attribute)
        tb = self.backends.get("tensorboard")
        return tb.writer if tb else None

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        keep = [line for line in read_metrics(self.path) if line.get("step", 0) <= step]
        if len(keep) == len(lines):
            return
        self.kept = keep_copy(self.path)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for rec in keep:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        scalars = _scalars(record)
        for backend in self.backends.values():
            backend.write(int(step), scalars)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}


def progress(iterable=None, *, total: int | None = None, desc: str, unit: str = "it",
             enabled: bool = True):
    """A progress bar like the RL steps' (tqdm to stdout, with its rate), for long work: the
    supervised warm start, each evaluation. `desc` says what is being done; disabled on every
    process but 0 (enabled=False) and when `total` is 0."""
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stdout, leave=False,
                disable=not enabled or total == 0, dynamic_ncols=True)


def read_metrics(path: str) -> list[dict]:
    """Reads a metrics.jsonl file, ignoring a torn last line left by a killed process."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


PLOTTED = (
    ("reward/mean", "reward mean"),
    ("eval/pass@1", "held-out pass@1"),
    ("dynamic_sampling/pass_rate", "dynamic-sampling pass rate"),
    ("response/length_mean", "response length"),
    ("loss/kl", "KL to reference"),
    ("loss/entropy", "entropy"),
    ("loss/clip_frac", "clip fraction"),
    ("perf/samples_per_s", "samples / s"),
)


def plot_metrics_figure(records: list[dict], keys: Iterable[tuple[str, str]] = PLOTTED):
    """The main curves of a run as a matplotlib Figure (not attached to pyplot, so no backend is
    switched; a notebook displays it as is). None when no key has data."""
    from matplotlib.figure import Figure

    series = []
    for key, title in keys:
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if pts:
            series.append((title, np.array(pts, dtype=float)))
    if not series:
        return None
    cols = 3
    rows = math.ceil(len(series) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, pts) in zip(axes.flat, series):
        ax.plot(pts[:, 0], pts[:, 1], marker="o" if len(pts) < 30 else None, ms=3)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_metrics(path: str, out_png: str, keys: Iterable[tuple[str, str]] = PLOTTED) -> str | None:
    """Draws the main curves of a metrics.jsonl into one PNG; returns its path (None if empty)."""
    fig = plot_metrics_figure(read_metrics(path), keys)
    if fig is None:
        return None
    fig.savefig(out_png, dpi=110)
    return out_png
