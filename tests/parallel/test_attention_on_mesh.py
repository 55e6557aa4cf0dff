"""The packed-attention kernel on a mesh (brorl_jax.parallel.attention): inside shard_map, rows
over the batch axes and heads over the heads axis when it divides both head counts.

* On 8 simulated CPU devices (2 x 2 x 2) the interpreted kernel per device equals the jnp
  reference on one device, in values and in the gradients of q, k, v (_attention_worker.py).
* Lowered for cuda and for tpu under an abstract 2 x 2 x 2 mesh (what the sharded update and
  log-prob steps trace under), the forward + backward holds the kernels' custom calls with the
  per-device shapes and no [T, T] array; so does the whole packed update step, with the model's
  default attention_impl. Before, "auto" fell back to the reference there.
"""
from __future__ import annotations

import json
import re

import jax
import pytest
from lowering import CUSTOM_CALL
from parallel_testutil import run_script

import pallas_kernels as pk
from brorl_jax.parallel.attention import attention_specs, packed_attention_on_mesh

AXES = ("data", "fsdp", "tensor")


def _mesh(platform, sizes=(2, 2, 2)):
    if platform == "tpu":
        return pk.tpu_abstract_mesh(sizes, AXES)
    return jax.sharding.AbstractMesh(sizes, AXES)


def _square(text, t):
    return re.search(rf"\b{t}x{t}x", text) is not None


@pytest.mark.slow     # a subprocess on 8 devices, interpreted kernels
def test_on_eight_devices_the_kernel_per_device_equals_the_reference():
    out = json.loads(run_script("_attention_worker.py", [], num_devices=8).stdout.splitlines()[-1])
    for name, err in out.items():
        assert err["shard_map"], name
        assert err["value"] < 1e-5, (name, err)
        for g in ("dq", "dk", "dv"):
            assert err[g] < 5e-5, (name, g, err)


def test_specs_split_rows_and_whole_head_groups_only():
    mesh = _mesh("cuda")
    q, kv, seg = attention_specs(mesh, (8, 64, 4, 16), (8, 64, 2, 16))
    assert q == kv == jax.sharding.PartitionSpec(("data", "fsdp"), None, ("tensor",), None)
    assert seg == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    q, kv, _ = attention_specs(mesh, (2, 64, 4, 16), (2, 64, 1, 16))   # 1 kv head: not split
    assert q == kv == jax.sharding.PartitionSpec(("data",), None, None, None)
    assert attention_specs(_mesh("cuda", (1, 1, 1)), (2, 64, 4, 16), (2, 64, 2, 16)) is None


@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_under_a_mesh_the_kernel_lowers_per_device_without_a_square(platform):
    from lowering import attention_fwd_bwd_text
    t = 256
    with pk.compile_target(platform), jax.sharding.use_abstract_mesh(_mesh(platform)):
        text = attention_fwd_bwd_text(packed_attention_on_mesh, platform, 8, t, 4, 2, 128)
    assert text.count(CUSTOM_CALL[platform]) == 3
    assert "manual_computation" in text
    assert "tensor<2x256x2x128xbf16>" in text      # per device: 8 / (2 x 2) rows, 4 / 2 heads
    assert not _square(text, t)


@pytest.mark.parametrize("platform", list(CUSTOM_CALL))
def test_the_packed_update_step_lowers_with_the_kernel_on_a_mesh(platform):
    """The packed update step (pi_old pass, remat, two mini-batches, the default
    attention_impl) traced under an abstract data x fsdp x tensor mesh: the attention kernels
    are in the program, inside shard_map, and no [T, T] array is."""
    from lowering import T, kernel_names, packed_update_text
    with pk.compile_target(platform), jax.sharding.use_abstract_mesh(_mesh(platform)):
        text = packed_update_text(platform, rows=8, hidden=256, kv_heads=2,
                                  rollouts_per_prompt=4, micro_batch_size=4)
    for name in kernel_names(platform):
        assert name in text
    assert "manual_computation" in text
    assert not _square(text, T)
