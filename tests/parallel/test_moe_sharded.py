"""A mixture-of-experts model on 8 simulated CPU devices (data x fsdp x tensor, the expert
weights placed by parallel/rules.py: whole experts over fsdp, their width over tensor) computes
the single-device logits and routing; the subprocess is _moe_worker.py."""
from __future__ import annotations

import numpy as np
import pytest
from parallel_testutil import run_script

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

LAYOUT = "data=2,fsdp=2,tensor=2"


def test_moe_forward_on_the_mesh_equals_single_device_and_shards_the_experts(tmp_path):
    out = tmp_path / "moe.npz"
    run_script("_moe_worker.py", [str(out), LAYOUT], num_devices=8)
    r = dict(np.load(out))
    np.testing.assert_array_equal(r["mesh/routing"], r["ref/routing"])
    assert len(np.unique(r["ref/routing"])) == 4                 # every expert is used
    # logits of scale ~1: the tensor-parallel sums' float32 order moves a few by ~3e-5
    np.testing.assert_allclose(r["mesh/logits"], r["ref/logits"], rtol=1e-5, atol=1e-4)
    # [L=2, E=4, D=64, I=32]: experts over fsdp=2, width over tensor=2
    assert tuple(r["mesh/gate_proj_shard_shape"]) == (2, 2, 64, 16)
    assert tuple(r["mesh/down_proj_shard_shape"]) == (2, 2, 16, 64)
