"""from_pretrained / save_pretrained against transformers (PyTorch, eager attention) on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from models_testutil import make_hf_model, padded_batch, torch, torch_logits, transformers
from safetensors.numpy import load_file, save_file

from brorl_jax.models import from_pretrained, save_pretrained

TOL_F32 = 1e-4
# One batch shape everywhere, so each config compiles the jitted forward once.
BATCH, LENGTH = 3, 11

# (family, query heads, kv heads, tied embeddings): every family, tied and untied, GQA group
# sizes 1 (4/4), 2 (4/2) and 4 (8/2); Qwen3-MoE (8 experts, top-2) and Qwen2-MoE (the same
# with a shared expert, q/k/v biases, gates not renormalised) untied as they ship.
CASES = [
    ("qwen2", 4, 2, False),
    ("qwen2", 4, 4, True),
    ("qwen3", 4, 2, True),
    ("qwen3", 8, 2, False),
    ("llama", 8, 2, False),
    ("llama", 4, 4, True),
    ("qwen3_moe", 4, 2, False),
    ("qwen2_moe", 4, 2, False),
]


def _case_id(case) -> str:
    kind, heads, kv_heads, tie = case
    return f"{kind}-{heads}h{kv_heads}kv-{'tied' if tie else 'untied'}"


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def hf_case(request, tmp_path_factory):
    kind, heads, kv_heads, tie = request.param
    path = tmp_path_factory.mktemp(f"{kind}_{heads}_{kv_heads}_{tie}")
    model = make_hf_model(kind, path, heads=heads, kv_heads=kv_heads, tie=tie)
    return kind, path, model


def test_from_pretrained_matches_transformers_logits_with_padding(hf_case):
    kind, path, torch_model = hf_case
    model = from_pretrained(path)
    assert model.config.model_type == kind
    assert ("lm_head" in model.params) != model.config.tie_word_embeddings
    rng = np.random.default_rng(1)
    for left in (False, True):
        tokens, mask, positions = padded_batch(rng, BATCH, LENGTH, left=left)
        ref = torch_logits(torch_model, tokens, mask, positions)
        got = np.asarray(model(tokens, attention_mask=mask, positions=positions))
        assert got.dtype == np.float32 and got.shape == ref.shape
        np.testing.assert_array_less(np.abs(got - ref)[mask].max(), TOL_F32)
    # Far positions, where RoPE (and llama3 scaling of long wavelengths) matters more.
    tokens, mask, positions = padded_batch(rng, BATCH, LENGTH, left=False)
    positions = positions + 200
    ref = torch_logits(torch_model, tokens, mask, positions)
    got = np.asarray(model(tokens, attention_mask=mask, positions=positions))
    np.testing.assert_array_less(np.abs(got - ref)[mask].max(), TOL_F32)


def test_save_pretrained_round_trip_loads_in_transformers_with_same_logits(hf_case, tmp_path):
    kind, path, torch_model = hf_case
    model = from_pretrained(path)
    save_pretrained(model, tmp_path)
    reloaded_torch = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rng = np.random.default_rng(2)
    tokens, mask, positions = padded_batch(rng, BATCH, LENGTH, left=True)
    ref = torch_logits(torch_model, tokens, mask, positions)
    np.testing.assert_allclose(
        torch_logits(reloaded_torch, tokens, mask, positions)[mask], ref[mask], atol=1e-6
    )
    again = from_pretrained(tmp_path)
    assert again.config == model.config
    assert again.generation_eos_ids == model.generation_eos_ids == (2,)
    got = np.asarray(again(tokens, attention_mask=mask, positions=positions))
    np.testing.assert_allclose(got[mask], ref[mask], atol=TOL_F32)


def test_sharded_checkpoint_loads(tmp_path):
    torch_model = make_hf_model("qwen2", tmp_path / "src")
    torch_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model = from_pretrained(tmp_path / "sharded")
    tokens, mask, positions = padded_batch(np.random.default_rng(3), BATCH, LENGTH, left=False)
    ref = torch_logits(torch_model, tokens, mask, positions)
    got = np.asarray(model(tokens, attention_mask=mask, positions=positions))
    np.testing.assert_array_less(np.abs(got - ref)[mask].max(), TOL_F32)
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        from_pretrained(tmp_path / "sharded")


def test_bfloat16_params_and_compute_close_to_float32(tmp_path):
    make_hf_model("qwen3", tmp_path, heads=4, kv_heads=2)
    tokens, mask, positions = padded_batch(np.random.default_rng(4), BATCH, LENGTH, left=True)
    ref = np.asarray(from_pretrained(tmp_path)(tokens, attention_mask=mask, positions=positions))
    # Logits of this tiny model are O(0.1-1); bf16 has an 8-bit mantissa (relative step 2^-8),
    # and two layers of bf16 rounding stay within a few percent of the logit range.
    scale = np.abs(ref[mask]).max()
    for dtype, param_dtype in (("bfloat16", None), ("bfloat16", "float32")):
        model = from_pretrained(tmp_path, dtype=dtype, param_dtype=param_dtype)
        leaf = model.params["layers"]["q_proj"]["kernel"]
        assert str(leaf.dtype) == (param_dtype or dtype)
        got = np.asarray(model(tokens, attention_mask=mask, positions=positions))
        assert got.dtype == np.float32 and np.isfinite(got).all()
        assert np.abs(got - ref)[mask].max() <= 0.03 * scale
    # A bf16 checkpoint (safetensors BF16 tensors) written by save_pretrained is read by
    # transformers with the same weights: upcast both sides to f32 and compare logits.
    save_pretrained(from_pretrained(tmp_path, dtype="bfloat16"), tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    torch_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    upcast = from_pretrained(tmp_path / "bf16", dtype="float32")
    got = np.asarray(upcast(tokens, attention_mask=mask, positions=positions))
    ref_bf16 = torch_logits(torch_bf16, tokens, mask, positions)
    np.testing.assert_array_less(np.abs(got - ref_bf16)[mask].max(), TOL_F32)


# ------------------------------------------------------------------------------------------
# Clear errors
# ------------------------------------------------------------------------------------------
@pytest.fixture()
def qwen2_dir(tmp_path):
    make_hf_model("qwen2", tmp_path / "m", heads=4, kv_heads=2)
    return tmp_path / "m"


def test_missing_directory_and_config_json_are_named(qwen2_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        from_pretrained(tmp_path / "nowhere")
    (qwen2_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(qwen2_dir)


def test_missing_safetensors_file_is_named(qwen2_dir):
    (qwen2_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(qwen2_dir)


def test_unsupported_model_type_names_file_and_supported_types(qwen2_dir):
    config = json.loads((qwen2_dir / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (qwen2_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json.*'gpt_neox'.*'qwen2', 'qwen3', 'llama'"):
        from_pretrained(qwen2_dir)


def test_wrong_tensor_shape_names_file_tensor_and_expected_shape(qwen2_dir):
    weights = load_file(qwen2_dir / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    assert weights[name].shape == (32, 64)
    weights[name] = np.zeros((48, 64), np.float32)
    save_file(weights, qwen2_dir / "model.safetensors", metadata={"format": "pt"})
    expected = r"model.safetensors.*k_proj.weight.*\[48, 64\].*expected \[32, 64\]"
    with pytest.raises(ValueError, match=expected):
        from_pretrained(qwen2_dir)


def test_missing_tensor_is_named(qwen2_dir):
    weights = load_file(qwen2_dir / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, qwen2_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight.*missing"):
        from_pretrained(qwen2_dir)


def test_truncated_safetensors_file_is_a_clear_error(qwen2_dir):
    file = qwen2_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(qwen2_dir)
    file.write_bytes(b"\x00" * 64)  # garbage header
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(qwen2_dir)
