"""Sharding rules as data: coverage of every parameter, logical-axis resolution, mesh sizes,
the launch-environment detection. Runs in the main (1-device) process."""
from __future__ import annotations

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from testutil import small_model_config

from brorl_jax.models import ModelConfig, init_params
from brorl_jax.parallel import rules as R
from brorl_jax.parallel.distributed import detect_environment
from brorl_jax.parallel.mesh import mesh_shape
from configs import brorl_64gpu


def _cfg(**kw) -> ModelConfig:
    return small_model_config(**kw)


ALL_FAMILIES = {
    "qwen2": _cfg(),
    "qwen2_tied": _cfg(tie_word_embeddings=True),
    "qwen3": _cfg(model_type="qwen3", qk_norm=True, attention_bias=False),
    "llama_bias": _cfg(model_type="llama", attention_bias=True),
    "qwen3_moe": _cfg(model_type="qwen3_moe", qk_norm=True, attention_bias=False, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": _cfg(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
@pytest.mark.parametrize("rule_set", sorted(R.PARAM_RULES))
def test_rules_cover_every_parameter(family, rule_set):
    params = jax.eval_shape(lambda: init_params(ALL_FAMILIES[family], jax.random.PRNGKey(0)))
    assert R.unmatched_params(params, rule_set) == []
    specs = R.param_specs(params, rule_set)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree.structure(params)


def test_parameter_matching_no_rule_is_an_error():
    params = jax.eval_shape(lambda: init_params(ALL_FAMILIES["qwen2"], jax.random.PRNGKey(0)))
    params["layers"]["new_adapter"] = {"kernel": jax.ShapeDtypeStruct((2, 64, 8), "float32")}
    assert R.unmatched_params(params) == ["layers/new_adapter/kernel"]
    with pytest.raises(ValueError, match="layers/new_adapter/kernel.*matches no sharding rule"):
        R.param_specs(params)


@pytest.mark.parametrize("rule_set", sorted(R.PARAM_RULES))
def test_lora_adapters_follow_their_projections(rule_set):
    """models/lora.py's adapters of every target: A [L, in, r] split like its projection's kernel
    input, B [L, r, out] like the kernel output, the rank replicated."""
    from brorl_jax.models import lora
    cfg = _cfg(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(lora.TARGETS))
    params = jax.eval_shape(lambda: lora.with_adapters(init_params(cfg, jax.random.PRNGKey(0)),
                                                       lora.init_lora(cfg, jax.random.key(1))))
    specs = R.param_specs(params, rule_set)
    assert set(specs[lora.KEY]) == set(lora.TARGETS)
    dims = lambda spec: tuple(spec) + (None,) * (3 - len(spec))     # P() = P(None, None, None)
    for t, proj in lora.TARGETS.items():
        layers, d_in, d_out = dims(specs["layers"][proj]["kernel"])
        assert dims(specs[lora.KEY][t]["a"]) == (layers, d_in, None), t
        assert dims(specs[lora.KEY][t]["b"]) == (layers, None, d_out), t


def test_logical_names_map_to_mesh_axes():
    params = jax.eval_shape(lambda: init_params(ALL_FAMILIES["qwen2"], jax.random.PRNGKey(0)))
    specs = R.param_specs(params)
    assert specs["embed"]["embedding"] == P("tensor", "fsdp")
    assert specs["layers"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")
    assert specs["layers"]["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
    assert specs["lm_head"]["kernel"] == P("fsdp", "tensor")
    # a mixture of experts: whole experts over fsdp, each expert's width over tensor
    moe = R.param_specs(jax.eval_shape(
        lambda: init_params(ALL_FAMILIES["qwen3_moe"], jax.random.PRNGKey(0))))["layers"]["moe"]
    assert moe["gate_proj"] == moe["up_proj"] == P(None, "fsdp", None, "tensor")
    assert moe["down_proj"] == P(None, "fsdp", "tensor", None)
    assert moe["router"] == P(None, "fsdp", None)
    # Qwen2-MoE's shared expert: split as the dense MLP is
    shared = R.param_specs(jax.eval_shape(
        lambda: init_params(ALL_FAMILIES["qwen2_moe"], jax.random.PRNGKey(0))))["layers"]["moe"]
    assert shared["shared_gate_proj"] == shared["shared_up_proj"] == P(None, "fsdp", "tensor")
    assert shared["shared_down_proj"] == P(None, "tensor", "fsdp")
    assert shared["shared_expert_gate"] == P(None, "fsdp", None)
    replicated = R.param_specs(params, "replicated")
    assert all(s == P() for s in jax.tree.leaves(replicated, is_leaf=lambda x: isinstance(x, P)))
    # the update batch: rows over data and fsdp, the sequence whole
    assert R.logical_to_spec(R.ARRAY_AXES["tokens"]) == P(("data", "fsdp"), None)
    assert R.logical_to_spec(R.ARRAY_AXES["rows"]) == P(("data", "fsdp"))


def test_paper_scale_plan_shards_every_parameter_and_the_update_batch():
    """configs/brorl_64gpu.py's model (Qwen2-1.5B shapes) on its 8 x 8 x 1 mesh: FSDP splits every
    matrix 8 ways with every axis dividing (check_divisible), the update batch's rows go over
    all 64 devices."""
    mesh = AbstractMesh(tuple(brorl_64gpu.MESH.values()), tuple(brorl_64gpu.MESH))
    params = jax.eval_shape(lambda: init_params(brorl_64gpu.qwen2_1p5b(), jax.random.PRNGKey(0)))
    sh = R.param_shardings(params, mesh, check_divisible=True)
    assert sh["embed"]["embedding"].spec == P("tensor", "fsdp")        # [151936, 1536], tied
    assert sh["layers"]["k_proj"]["kernel"].spec == P(None, "fsdp", "tensor")  # [28, 1536, 256]
    assert sh["layers"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
    assert "lm_head" not in sh
    batch = {"input_tokens": jax.ShapeDtypeStruct((64, 16384), "int32"),
             "advantages": jax.ShapeDtypeStruct((64,), "float32")}
    bs = R.batch_shardings(batch, mesh)
    assert bs["input_tokens"].spec == P(("data", "fsdp"), None)
    assert bs["advantages"].spec == P(("data", "fsdp"))
    # a batch the 64 devices cannot split evenly is replicated, not mis-split
    odd = R.batch_shardings({"rows": jax.ShapeDtypeStruct((96,), "float32")}, mesh)
    assert odd["rows"].spec == P(None)


def test_mesh_axis_used_once_per_array():
    # "batch" takes data and fsdp; "embed" (fsdp) on the same array must not reuse fsdp
    assert R.logical_to_spec(("batch", "seq", "embed")) == P(("data", "fsdp"), None, None)


def test_axes_that_do_not_divide_are_dropped_or_rejected():
    mesh = AbstractMesh((2, 4, 2), ("data", "fsdp", "tensor"))
    assert R.fit_spec(P("tensor", "fsdp"), (256, 6), mesh) == P("tensor", None)
    with pytest.raises(ValueError, match="not divisible"):
        R.fit_spec(P("tensor", "fsdp"), (256, 6), mesh, check_divisible=True, name="embed")


def test_unknown_rule_set_and_logical_axis_are_named():
    with pytest.raises(ValueError, match="unknown sharding rule set 'nope'"):
        R.param_rule_table("nope")
    with pytest.raises(ValueError, match="logical axis 'nope'"):
        R.logical_to_spec(("nope",))


def test_mesh_shape_minus_one_is_the_rest():
    assert mesh_shape({"data": -1, "fsdp": 4, "tensor": 2}, 64) == (8, 4, 2)
    assert mesh_shape({"data": 8, "fsdp": 8, "tensor": 1}, 64) == (8, 8, 1)
    assert mesh_shape({"data": -1, "expert": 4}, 8) == (2, 1, 4, 1)   # + expert when > 1
    with pytest.raises(ValueError, match="cannot be split"):
        mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="use 4 devices but 8"):
        mesh_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)


def test_launch_environment_detection():
    assert detect_environment({}) == "single"
    assert detect_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                               "JAX_PROCESS_ID": "1"}) == "explicit"
    assert detect_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                               "JOB_COMPLETION_INDEX": "1"}) == "kubernetes"
    assert detect_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}) == "slurm"
    assert detect_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) == "single"
    assert detect_environment({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == "tpu"
