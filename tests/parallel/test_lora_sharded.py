"""LoRA on a data=2 x fsdp=2 x tensor=2 mesh of 8 simulated CPU devices equals LoRA on one device
(train/runtime.py MeshRuntime against LocalRuntime, from the same state and batch: the subprocess
_lora_worker.py runs both), the adapters and their Adam moments are sharded as
parallel/rules.py PARAM_RULES says, and a checkpoint of the mesh state restores bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from parallel_testutil import run_script

pytestmark = pytest.mark.slow     # many compiles: out of `-m "not slow"`

# projection -> (its kernel's input split, its output split) under the default rules on this mesh
SPLITS = {"q": ("fsdp", "tensor"), "k": ("fsdp", "tensor"), "v": ("fsdp", "tensor"),
          "gate": ("fsdp", "tensor"), "up": ("fsdp", "tensor"), "o": ("tensor", "fsdp"),
          "down": ("tensor", "fsdp")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_sharded")
    run_script("_lora_worker.py", [str(tmp / "results.npz"), str(tmp / "checkpoints")],
               num_devices=8)
    return dict(np.load(tmp / "results.npz"))


def _pairs(results, prefix):
    keys = [k for k in results if k.startswith(f"one/{prefix}")]
    assert keys
    return [(k, results[k], results["mesh" + k[3:]]) for k in keys]


def test_update_on_the_mesh_equals_one_device(results):
    """One update with the KL term (the reference log-probs of the base): adapters and Adam's
    moments; lr 1e-2, so 2e-4 is 2 % of a step (test_sharded_steps.py's tolerance)."""
    pairs = _pairs(results, "1/")
    assert len(pairs) >= 14 * 3 + 1      # A and B of seven targets, their mu and nu, the loss
    for k, one, mesh in pairs:
        np.testing.assert_allclose(mesh, one, atol=2e-4, rtol=1e-4, err_msg=k)
    b = [v for k, v, _ in pairs if k.startswith("one/1/['params']") and k.endswith("['b']")]
    assert min(float(np.abs(x).max()) for x in b) > 0.1          # the adapters trained
    nu = [v for k, v, _ in pairs if ".nu[" in k and k.endswith("['a']")]
    assert min(float(np.abs(x).max()) for x in nu) > 0            # so did A (B started non-zero)


def test_adapters_and_their_moments_follow_their_projections(results):
    """A [L, in, r] split like the kernel's input, B [L, r, out] like its output, r replicated."""
    for t, (d_in, d_out) in SPLITS.items():
        for prefix in ("spec/", "reset_spec/['lora']", "restored_spec/['lora']",
                       "opt_spec/[1][0].mu", "opt_spec/[1][0].nu"):
            assert str(results[f"{prefix}['{t}']['a']"]) == f"P(None, '{d_in}', None)"
            assert str(results[f"{prefix}['{t}']['b']"]) == f"P(None, None, '{d_out}')"


def test_reset_merge_on_the_mesh_equals_one_device(results):
    """The merged base, the fresh adapters (drawn alike), the merged list kept on the host, then
    an update against the merged base and the rollout's merged copy."""
    for prefix in ("reset/", "2/", "rollout/"):
        for k, one, mesh in _pairs(results, prefix):
            np.testing.assert_allclose(mesh, one, atol=2e-5, rtol=1e-5, err_msg=k)
    assert str(results["reset_spec/['layers']['o_proj']['kernel']"]) == \
        "P(None, 'tensor', 'fsdp')"            # the merged base back in the rules
    assert float(results["one/2/kl"]) > 0


def test_checkpoint_of_the_mesh_state_restores_bit_for_bit(results):
    """Adapters, their optimizer state and the merged list restored; the base reloaded and the
    merged list merged into it again on the mesh (Runtime.place_params) as the run merged it."""
    keys = [k for k in results if k.startswith("saved/")]
    assert any("lora_merged" in k for k in keys) and any("o_proj" in k for k in keys)
    for k in keys:
        np.testing.assert_array_equal(results["restored/" + k[6:]], results[k], err_msg=k)
    for k in (k for k in results if k.startswith("saved_spec/")):
        assert str(results["restored_spec/" + k[11:]]) == str(results[k]), k
