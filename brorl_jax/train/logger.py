"""Metrics out of the loop: JSONL (the public record), TensorBoard events, PNG plots at the end.

Only process 0 writes (multi-host runs call `MetricsLogger(..., enabled=jax.process_index()==0)`).
On resume the JSONL is appended to after dropping lines from steps beyond the restored checkpoint,
so the file always describes exactly one run history. History is never lost: the dropped lines
stay in a numbered copy (metrics.jsonl.1, .2, ...), and a fresh start in a work directory that
already has a metrics file moves that file to the next free number.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

import numpy as np

from brorl_jax.train.workdir import keep_copy, set_aside


def _plain(value: Any) -> Any:
    """Converts numpy/JAX scalars to JSON numbers; non-finite floats become null."""
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends one JSON object per record to `workdir/metrics.jsonl` and mirrors it to TensorBoard."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        self.kept: str | None = None       # where an earlier history went (for the run's log)
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        else:
            # A fresh start in a workdir with an old history but no checkpoint: keep the old file.
            self.kept = set_aside(self.path)
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

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
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
