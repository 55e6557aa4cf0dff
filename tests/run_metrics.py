"""Comparing the metrics.jsonl of two runs: one rule for the whole suite.

A run's metrics are of three kinds:
* wall-clock measurements (TIMING): never compared;
* values the update computes on the device by a float reduction (the loss terms, gradient
  statistics, mass-balance diagnostics: DEVICE_REDUCED): their last bits follow the order of the
  reduction, which follows the device layout (a psum over 4 devices against one over 2 x 2, a
  gloo all-reduce between processes) and the host's vector units; compared to a stated tolerance;
* everything else is decided by the samples (generated and kept counts, pass rates, rewards,
  staleness, carried samples, token counts, eval pass@k): compared exactly, so a change of what
  was sampled still fails.
Issue 46: a two-process run's update/grad_norm differed from the colocated one's by one float32
ulp (0.5882354974746704 vs 0.5882355570793152), the parameters being equal bit for bit."""
from __future__ import annotations

import json
import os

TIMING = ("time/", "perf/samples_per_s", "perf/tokens_per_s", "verifier_cost/", "data/")
DEVICE_REDUCED = ("loss/", "update/", "mass_balance/", "rollout/logprob_gap_mean",
                  "rollout/behaviour_kl")
# Counts the update reports among its float metrics: sample-decided, compared exactly.
UPDATE_COUNTS = {"update/n_tokens", "update/optimizer_steps", "update/skipped", "update/finite"}

# Runs on other device layouts of one machine: a few float32 ulps (2**-23 = 1.2e-7) relative; the
# absolute floor covers terms that are zero in exact arithmetic (the policy-gradient loss of
# zero-mean advantages is ~1e-8, its sign set by the reduction order).
LAYOUT_REL, LAYOUT_ABS = 8 * 2.0 ** -23, 1e-7


def read(workdir) -> list[dict]:
    """metrics.jsonl's rows without the wall-clock keys."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [deterministic(json.loads(line)) for line in f]


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def is_device_reduced(key: str, value) -> bool:
    return (key.startswith(DEVICE_REDUCED) and key not in UPDATE_COUNTS
            and isinstance(value, float))


def differences(got: dict, want: dict, *, rel: float = LAYOUT_REL,
                abs_: float = LAYOUT_ABS) -> dict:
    """{key: (got, want)} of the keys that differ: device-reduced floats beyond
    |got - want| <= max(rel * |want|, abs_), any other value at all; a key in only one record
    counts as a difference; wall-clock keys are left out."""
    got, want, out = deterministic(got), deterministic(want), {}
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want:
            out[key] = (got.get(key, "<missing>"), want.get(key, "<missing>"))
            continue
        a, b = got[key], want[key]
        if is_device_reduced(key, b) and isinstance(a, float):
            if not abs(a - b) <= max(rel * abs(b), abs_):
                out[key] = (a, b)
        elif a != b:
            out[key] = (a, b)
    return out


def assert_same_metrics(got: list[dict], want: list[dict], **tolerance) -> None:
    """Step for step: every sample-decided value equal, every device-reduced float within the
    tolerance (`differences`' keywords)."""
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        diff = differences(g, w, **tolerance)
        assert not diff, f"step {w.get('step')}: {diff}"
