"""A disaggregated rollout (mesh.rollout_devices, issue 28 item 3) on 8 simulated CPU devices:
the first 4 decode on their own mesh, the other 4 train; after each update the weights move by a
reshard (jax.device_put between the meshes) and the carried stream decodes on during the update
(algo.decode_during_update). With the same staleness schedule (a fixed number of decode calls
during each update) it equals the colocated run on 4 devices: the same samples and every
sample-decided metric exactly, the same parameters bit for bit, and the update's device-reduced
floats (loss, gradient norm) to a few float32 ulps, since they are summed over other devices in
another order (tests/run_metrics.py). Over two processes (4 devices each, 2 of each decoding) it
equals two colocated processes of 2 devices each the same way."""
from __future__ import annotations

import numpy as np
import pytest
from mesh_runs import run_one, run_two
from run_metrics import assert_same_metrics, read as read_metrics

pytestmark = pytest.mark.slow     # end-to-end mesh runs

STEPS = 3
FLAGS = ["--config.algo.stream_rounds=true", "--config.algo.max_staleness=1",
         "--config.algo.max_generation_rounds=4", f"--config.train.steps={STEPS}",
         f"--config.train.checkpoint_every={STEPS}", "--config.algo.decode_during_update=2",
         "--config.mesh.data=4", "--config.train.tensorboard=false"]


def _same_run(a_npz, b_npz, a_dir, b_dir) -> list[dict]:
    """Asserts both runs end with the same parameters (bit for bit) and metrics (sample-decided
    values exactly, device-reduced floats to a few ulps); the second's metrics."""
    a, b = np.load(a_npz), np.load(b_npz)
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    ma, mb = read_metrics(a_dir), read_metrics(b_dir)
    assert_same_metrics(mb, ma)
    # the schedule: samples carried, and decoded on during the updates that carried them
    carried = [m for m in mb[1:] if m.get("rollout/carried_samples", 0) > 0]
    assert carried and all("rollout/decode_calls_during_update" in m for m in carried)
    assert any(m["rollout/decode_calls_during_update"] > 0 for m in carried)
    assert any(m["staleness/mean"] > 0 for m in mb[1:])
    return mb


def test_disaggregated_equals_colocated_with_the_same_staleness_schedule(
        tmp_path, tiny_warm_start):
    colo, _ = run_one(4, tmp_path / "colo", tmp_path / "colo.npz", *FLAGS, *tiny_warm_start)
    dis, _ = run_one(8, tmp_path / "dis", tmp_path / "dis.npz", *FLAGS, *tiny_warm_start,
                     "--config.mesh.rollout_devices=4")
    assert colo["rollout_devices"] == colo["train_devices"] == [0, 1, 2, 3]
    assert dis["rollout_devices"] == [0, 1, 2, 3] and dis["train_devices"] == [4, 5, 6, 7]
    assert dis["mesh"] == colo["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    _same_run(tmp_path / "colo.npz", tmp_path / "dis.npz", tmp_path / "colo", tmp_path / "dis")


def test_two_process_disaggregated_equals_two_process_colocated(tmp_path, tiny_warm_start):
    """Two processes: each decodes its own prompts on its first 2 of 4 devices (rollouts stay
    per-process, as colocated) and the update's mesh is the other 2 of each; the weights reach
    the rollout devices by the gather on the training mesh and local copies. Equal, bit for bit,
    to two colocated processes of 2 devices each (rollouts on the same 2, the same 4-device
    update mesh)."""
    flags = FLAGS + ["--config.rewards.num_workers=1", *tiny_warm_start]
    colo, _ = run_two(tmp_path / "colo", [tmp_path / "c0.npz", tmp_path / "c1.npz"], flags)
    dis, _ = run_two(tmp_path / "dis", [tmp_path / "d0.npz", tmp_path / "d1.npz"],
                     flags + ["--config.mesh.rollout_devices=4"], devices_per_process=4)
    for r in colo:
        assert r["train_devices"] == [0, 1, 2048, 2049]
        assert r["rollout_devices"] == ([0, 1] if r["pid"] == 0 else [2048, 2049])
    for r in dis:
        assert r["train_devices"] == [2, 3, 2050, 2051]
        assert r["rollout_devices"] == ([0, 1] if r["pid"] == 0 else [2048, 2049])
    assert all(r["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1} for r in colo + dis)
    _same_run(tmp_path / "c0.npz", tmp_path / "d0.npz", tmp_path / "colo", tmp_path / "dis")
    d0, d1 = np.load(tmp_path / "d0.npz"), np.load(tmp_path / "d1.npz")
    for key in d0.files:
        np.testing.assert_array_equal(d0[key], d1[key], err_msg=key)
