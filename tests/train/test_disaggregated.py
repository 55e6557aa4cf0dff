"""A disaggregated rollout (mesh.rollout_devices, issue 28 item 3) on 8 simulated CPU devices:
the first 4 decode on their own mesh, the other 4 train; after each update the weights move by a
reshard (jax.device_put between the meshes) and the carried stream decodes on during the update
(algo.decode_during_update). With the same staleness schedule (a fixed number of decode calls
during each update) it equals the colocated run on 4 devices bit for bit: same samples, same
metrics, same parameters."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import procs
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "_mesh_worker.py")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parallel"))
from parallel_testutil import device_env  # noqa: E402

pytestmark = pytest.mark.slow     # two end-to-end mesh runs

STEPS = 3
FLAGS = ["--config.algo.stream_rounds=true", "--config.algo.max_staleness=1",
         "--config.algo.max_generation_rounds=4", f"--config.train.steps={STEPS}",
         f"--config.train.checkpoint_every={STEPS}", "--config.algo.decode_during_update=2",
         "--config.mesh.data=4", "--config.train.tensorboard=false"]
TIMING = ("time/", "perf/samples_per_s", "perf/tokens_per_s", "verifier_cost/", "data/")


def _run(num_devices, workdir, out, *overrides):
    proc = procs.run([sys.executable, WORKER, str(workdir), str(out), *overrides],
                     env=device_env(num_devices), cwd=REPO, capture_output=True, text=True,
                     timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
                for line in f]


def test_disaggregated_equals_colocated_with_the_same_staleness_schedule(
        tmp_path, tiny_warm_start):
    colo = _run(4, tmp_path / "colo", tmp_path / "colo.npz", *FLAGS, *tiny_warm_start)
    dis = _run(8, tmp_path / "dis", tmp_path / "dis.npz", *FLAGS, *tiny_warm_start,
               "--config.mesh.rollout_devices=4")
    assert colo["rollout_devices"] == colo["train_devices"] == [0, 1, 2, 3]
    assert dis["rollout_devices"] == [0, 1, 2, 3] and dis["train_devices"] == [4, 5, 6, 7]
    assert dis["mesh"] == colo["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    a, b = np.load(tmp_path / "colo.npz"), np.load(tmp_path / "dis.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    ma, mb = _metrics(tmp_path / "colo"), _metrics(tmp_path / "dis")
    assert ma == mb
    # the schedule: samples carried, and decoded on during the updates that carried them
    carried = [m for m in mb[1:] if m.get("rollout/carried_samples", 0) > 0]
    assert carried and all("rollout/decode_calls_during_update" in m for m in carried)
    assert any(m["rollout/decode_calls_during_update"] > 0 for m in carried)
    assert any(m["staleness/mean"] > 0 for m in mb[1:])
