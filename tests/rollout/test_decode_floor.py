"""What keeps the GPU decode program near its floor (issue 25; bench/roofline.py measures it):
the rollout's weights in the compute dtype, one buffer per layer, read in place (no weight-sized
copy, slice or convert inside the decode loop); the stop condition examined every k steps (an
inner loop of k steps; no collective inside it on a mesh); the same samples whatever k; the
sampling kernel reading unpadded logits. The decode program is lowered for cuda at tiny shapes
(no compile extras needed); the walker reads the lowered HLO."""
from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_testutil import EOS, PROMPTS, tiny_config, tiny_model

import pallas_kernels as pk
from brorl_jax.config import default_config
from brorl_jax.models import init_params
from brorl_jax.rollout import Engine, programs, rollout_bytes
from brorl_jax.rollout.plan import CHECK_EVERY
from brorl_jax.train.runtime import LocalRuntime
from pallas_kernels.sampling import sample_tokens_pallas, sample_tokens_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import _hlo_walk as hw  # noqa: E402

# widths the Triton kernels lower at (dots of >= 16), a vocab past one sampling tile (1024)
# that is not a multiple of it (the unpadded last tile)
GPU_TINY = dict(vocab_size=1500, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                dtype="bfloat16", param_dtype="float32")
CALL = dict(prompt_len=64, rollouts_per_prompt=8, max_new_tokens=128, num_prompts=2, slots=8)
_CALLERS = ("calls", "to_apply", "body", "condition")


def _lower_hlo(cfg, mesh=None) -> hw.Module:
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))   # float32 master
    with pk.compile_target("cuda"):
        engine = Engine(cfg, mesh=mesh)
        text = engine.lower_decode(params, platform="cuda", **CALL).as_text(dialect="hlo")
    return engine, hw.parse(text)


def _callees(module, comp) -> list[str]:
    out = []
    for ins in comp.instrs:
        for key in _CALLERS:
            name = ins.attr(key)
            if name in module.computations:
                out.append(name)
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        if m:
            out += re.findall(r"%([A-Za-z0-9_.\-]+)", m.group(1))
    return out


def _reachable(module, name) -> list:
    seen, todo = [], [name]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.append(c)
        todo += _callees(module, module.computations[c])
    return [module.computations[c] for c in seen]


def _loops(module):
    """Every while: (instr, body name, condition name)."""
    return [(i, i.attr("body"), i.attr("condition")) for c in module.computations.values()
            for i in c.instrs if i.opcode == "while"]


def _step_loop(module):
    """The per-token loop: the innermost while whose body (with what it calls) samples."""
    sampling = [(ins, body, cond) for ins, body, cond in _loops(module)
                if any(i.opcode == "custom-call" and "sample_tokens" in i.kernel_name
                       for c in _reachable(module, body) for i in c.instrs)]
    assert sampling, "no while loop holds the sampling kernel"
    return min(sampling, key=lambda x: len(_reachable(module, x[1])))


@pytest.fixture(scope="module")
def gpu_program():
    return _lower_hlo(tiny_config(**GPU_TINY))


def test_rollout_params_are_one_compute_dtype_buffer_per_layer_made_once():
    cfg = tiny_config(dtype="bfloat16", param_dtype="float32")
    runtime = LocalRuntime(default_config(), cfg, None, diagnostics_n=None)
    params = init_params(cfg, jax.random.PRNGKey(0))
    out = runtime.rollout_params(params)
    assert isinstance(out["layers"], tuple) and len(out["layers"]) == cfg.num_hidden_layers
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(
        np.asarray(out["layers"][1]["q_proj"]["kernel"], np.float32),
        np.asarray(params["layers"]["q_proj"]["kernel"][1].astype(jnp.bfloat16), np.float32))
    assert runtime.rollout_params(params) is out          # held: cast once per update
    assert programs.in_rollout_layout(out, cfg)
    assert Engine(cfg).rollout_params(out) is out         # the engine takes it as it is
    other = jax.tree.map(lambda x: x + 1, params)
    assert runtime.rollout_params(other) is not out       # a new update: a new copy


def test_decode_loop_reads_compute_dtype_weights_in_place(gpu_program):
    engine, module = gpu_program
    cfg = engine.cfg
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    fn, args = engine.decode_program(params, **CALL)
    weights = [x for x in jax.tree.leaves(args[0]) if x.ndim >= 2]
    assert {x.dtype for x in weights} == {jnp.dtype(jnp.bfloat16)}, "rollout weights not bf16"
    shapes = {tuple(x.shape) for x in weights}
    stacked = {(cfg.num_hidden_layers,) + s for s in shapes}
    assert not any(s in shapes for s in stacked), "the layer stack was not split"
    ins_, body, _ = _step_loop(module)
    bad = []
    for comp in _reachable(module, body):
        for i in comp.instrs:
            if i.opcode in ("copy", "slice", "dynamic-slice", "convert", "gather", "transpose"):
                out = tuple(d for d in (i.shapes[0][1] if i.shapes else ()) if d != 1)
                if i.opcode != "transpose" and any(out == s for s in shapes | stacked):
                    bad.append((i.opcode, i.type))
                if i.opcode == "convert" and i.shapes and math_prod(i.shapes[0][1]) >= min(
                        math_prod(s) for s in shapes):
                    src = comp.by_name.get(i.operands[0])
                    if src is not None and src.shapes and src.shapes[0][0] == "f32" and any(
                            tuple(d for d in src.shapes[0][1] if d != 1) == s for s in shapes):
                        bad.append(("convert of a weight", i.type))
    assert not bad, f"weight-sized copies/slices/converts in the decode loop: {bad[:5]}"


def math_prod(shape) -> int:
    return int(np.prod(shape)) if shape else 1


def test_stop_condition_is_examined_every_k_steps(gpu_program):
    engine, module = gpu_program
    with pk.compile_target("cuda"):     # the default follows the platform traced for
        k = engine.check_every
    assert k == CHECK_EVERY["gpu"] > 1 and Engine(engine.cfg).check_every == CHECK_EVERY["cpu"]
    ins_, body, cond = _step_loop(module)
    consts = [i for c in _reachable(module, cond) for i in c.instrs if i.opcode == "constant"]
    assert any(i.operand_text.strip() == str(k) for i in consts), \
        f"the per-token loop does not run {k} steps"
    # ...inside the decode loop whose condition is the stop test (pending/live/complete sums)
    outer = [(i, b, c) for i, b, c in _loops(module)
             if body in [x.name for x in _reachable(module, b)] and b != body]
    assert outer, "the k-step loop is not inside an outer decode loop"


def test_no_collective_inside_the_per_token_loop_on_a_mesh():
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "fsdp"))
    engine, module = _lower_hlo(tiny_config(**GPU_TINY), mesh=mesh)
    assert engine.num_devices == 8
    _, body, cond = _step_loop(module)
    reduce_ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                  "collective-permute")
    inner = [i.opcode for c in _reachable(module, body) for i in c.instrs
             if i.opcode.replace("-start", "") in reduce_ops]
    assert not inner, f"collectives inside the per-token loop: {inner}"
    everywhere = [i for c in module.computations.values() for i in c.instrs
                  if i.opcode.replace("-start", "") in reduce_ops]
    assert everywhere, "the mesh program has no collective at all (the stop test combines them)"


@pytest.mark.slow     # two engines' compiles (~30-50 s on the shared 2 cores)
def test_samples_do_not_depend_on_check_every():
    """Steps past a stop are harmless: the same samples with a check every 16 steps as every
    step (refills and group hand-outs happen later; the draws do not change). The continuous vs
    lockstep vs naive comparisons of test_scheduler.py hold whatever check_every is."""
    model = tiny_model()
    prompts = PROMPTS[:3]
    n, s = 4, 10
    budget = rollout_bytes(model.config, len(prompts), 32, n, s, 6)   # 6 slots for 12 samples
    kw = dict(rollouts_per_prompt=n, max_new_tokens=s, temperature=1.0, seed=3,
              eos_ids=[EOS] + list(range(4, 128, 5)), memory_budget_bytes=budget)
    want = Engine(model.config, check_every=1, min_slots=6).generate(model.params, prompts, **kw)
    got = Engine(model.config, check_every=16, min_slots=6).generate(model.params, prompts, **kw)
    assert want.stats["refills"] > 0 and got.stats["decode_steps"] >= want.stats["decode_steps"]
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    # The draws are the same; their log-probs come out of two different compiled loops, whose
    # fused reductions XLA may order differently (1 ulp with the tests' fast CPU compiles).
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)


def test_check_every_is_validated():
    with pytest.raises(ValueError, match="check_every"):
        Engine(tiny_config(), check_every=0)


@pytest.mark.parametrize("rows,vocab,temperature,top_k,top_p", [
    (8, 200, 0.8, 20, 0.9), (8, 333, 1.0, 0, 1.0), (8, 257, 0.0, 0, 1.0)])
def test_sampling_reads_unpadded_rows(rows, vocab, temperature, top_k, top_p):
    """The Triton-family kernel (interpreted here) on widths that are not a multiple of its tile:
    its last tile ends at the row's end; the same tokens as the reference."""
    rng = np.random.default_rng(vocab)
    logits = jnp.asarray(rng.standard_normal((rows, vocab), np.float32) * 3.0)
    u = jnp.asarray(rng.random(rows, np.float32))
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    tok_r, lp_r = sample_tokens_reference(logits, u, **kw)
    tok_p, lp_p = sample_tokens_pallas(logits, u, block_rows=8, block_v=128, family="triton",
                                       **kw)
    np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok_r))
    np.testing.assert_allclose(np.asarray(lp_p), np.asarray(lp_r), atol=2e-6)


def test_sampling_lowers_without_a_logits_pad(gpu_program):
    engine, module = gpu_program
    calls = [i for c in module.computations.values() for i in c.instrs
             if i.opcode == "custom-call" and "sample_tokens" in i.kernel_name]
    assert calls
    for i in calls:     # the kernel takes the [slots, V] logits as they are
        assert hw.operands_of(i)[0][1] == (CALL["slots"], engine.cfg.vocab_size), i.type


def test_the_walker_counts_an_in_place_update_once():
    """bench/_hlo_walk.py: a fusion rooted at an in-place dynamic-update-slice reads what the
    update is computed from and writes the update, nothing of the rest of the buffer (the KV
    cache writes of the decode loop, the saved activations of the update step)."""
    def f(buf, y, i):
        return jax.lax.dynamic_update_slice(buf, (y * 2.0)[None], (i, 0))

    sds = jax.ShapeDtypeStruct
    text = jax.jit(f, donate_argnums=0).lower(
        sds((64, 1024), jnp.float32), sds((1024,), jnp.float32), sds((), jnp.int32)
    ).compile().as_text()
    assert "dynamic-update-slice" in text
    assert hw.walk(text).bytes == 2 * 1024 * 4 + 4        # y read, the row written, the index


def test_the_walker_groups_traffic_by_the_operation_that_made_it():
    """bench/_hlo_walk.by_operation (the split of the update's traffic in docs/algo.md): each
    kernel's bytes land under its JAX operation, the gradient pass's kernels apart from the
    forward's, and the groups add up to the walk's total."""
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) * 3.0)

    sds = jax.ShapeDtypeStruct
    text = jax.jit(jax.grad(loss)).lower(
        sds((256, 256), jnp.float32), sds((128, 256), jnp.float32)).compile().as_text()
    cost = hw.walk(text)
    groups = hw.by_operation(cost, depth=1)
    assert sum(b for b, _, _ in groups) == pytest.approx(cost.bytes)
    keys = [k for _, _, k in groups]
    assert any(k.startswith("backward ") for k in keys), keys
    assert any(k.startswith("forward ") for k in keys), keys
    assert [b for b, _, _ in groups] == sorted((b for b, _, _ in groups), reverse=True)


def test_the_fp8_decode_step_hands_the_mlp_activations_over_in_e4m3():
    """With fp8 weights the decode step's projections are pallas_kernels.fp8_gemm's kernels
    (traced for cuda): no bf16 SwiGLU kernel, and no [slots, I] tensor converted to e4m3 by XLA
    (the down projection's input comes out of the gate/up kernel in e4m3); bf16 runs none."""
    import roofline

    from brorl_jax.models.precision import with_precision
    cfg = tiny_config(**dict(GPU_TINY, intermediate_size=256))   # no projection is as wide
    inter = cfg.intermediate_size
    for precision, want in [(("fp8", "fp8"), True), (("bf16", "bf16"), False)]:
        _, module = _lower_hlo(with_precision(cfg, *precision))
        comps = _reachable(module, _step_loop(module)[1])
        names = [i.kernel_name for c in comps for i in c.instrs if i.opcode == "custom-call"]
        for kernel in ("fp8_linear", "fp8_swiglu_gate_up", "fp8_down"):
            assert any(kernel in n for n in names) == want, (precision, kernel)
        assert any("swiglu_gate_up" in n and "fp8" not in n for n in names) != want
        wide = [i.type for c in comps for i in c.instrs if i.opcode == "convert" and i.shapes
                and i.shapes[0][0] == "f8e4m3fn" and inter in i.shapes[0][1]]
        assert not wide, wide
        # bench/roofline.py's GEMM list names them, with the weights read in e4m3
        forms = {(f, rhs) for f, _, rhs, _, _ in roofline.pallas_gemms(module)}
        assert forms == ({("pallas fp8_linear", "f8e4m3fn"), ("pallas fp8_swiglu_gate_up",
                                                              "f8e4m3fn"),
                          ("pallas fp8_down", "f8e4m3fn")} if want
                         else {("pallas swiglu_gate_up", "bf16")}), forms


def test_the_fp8_floor_counts_the_fp8_rollout_copy_and_a_byte_per_kv_element():
    """bench/roofline.py's floor under fp8 weights and KV (issue 41): the weights term is the
    bytes of the rollout's quantized copy as rollout_layout builds it (e4m3 projections + their
    scales, the rest in the compute dtype), the KV a byte per element + a float32 scale per
    position and KV head; the walker counts e4m3 buffers at a byte per element."""
    import roofline

    from brorl_jax.models.precision import with_precision
    cfg = tiny_config(**GPU_TINY)
    fp8 = with_precision(cfg, "fp8", "fp8")
    master = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    n = sum(x.size for x in jax.tree.leaves(master))
    copy = jax.eval_shape(lambda p: programs.rollout_layout(p, fp8), master)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(copy))
    assert {x.dtype for x in jax.tree.leaves(copy)} == {jnp.dtype(jnp.bfloat16),
                                                        jnp.dtype(jnp.float8_e4m3fn)}
    shape = dict(slots=8, prompts=2, prompt_len=64, own_len=96, n_params=n)
    lo, hi = roofline.floor_bytes(fp8, **shape), roofline.floor_bytes(cfg, **shape)
    assert lo["weights"] == held < hi["weights"] == 2 * n
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
    assert hi["kv"] == per_position * (2 * 64 + 8 * 96) * cfg.head_dim * 2
    assert lo["kv"] == per_position * (2 * 64 + 8 * 96) * (cfg.head_dim + 4)
    assert lo["new_kv"] == per_position * 8 * (cfg.head_dim + 4)
    assert lo["logits"] == hi["logits"] == 2 * 8 * cfg.vocab_size * 4
    assert hw.nbytes("f8e4m3fn[16,1536]{1,0}") == 16 * 1536


_GEMM_HLO = """HloModule m

%q8 (p0: bf16[16,64]) -> f8e4m3fn[16,64] {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %c = f32[16,64]{1,0} convert(%p0)
  ROOT %q = f8e4m3fn[16,64]{1,0} convert(%c)
}

%deq (p0: f8e4m3fn[64,32], p1: bf16[32]) -> bf16[64,32] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = bf16[32]{0} parameter(1)
  %c = bf16[64,32]{1,0} convert(%p0)
  %b = bf16[64,32]{1,0} broadcast(%p1), dimensions={1}
  ROOT %m = bf16[64,32]{1,0} multiply(%c, %b)
}

%g8 (x: f8e4m3fn[16,64], w: f8e4m3fn[64,32]) -> f32[16,32] {
  %x = f8e4m3fn[16,64]{1,0} parameter(0)
  %w = f8e4m3fn[64,32]{1,0} parameter(1)
  %wt = f8e4m3fn[32,64]{0,1} bitcast(%w)
  ROOT %d = f32[16,32]{1,0} dot(%x, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%g16 (x: bf16[16,64], w: bf16[64,32]) -> f32[16,32] {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = bf16[64,32]{1,0} parameter(1)
  ROOT %d = f32[16,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[16,64], w: f8e4m3fn[64,32], s: bf16[32]) -> (f32[16,32], f32[16,32]) {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = f8e4m3fn[64,32]{1,0} parameter(1)
  %s = bf16[32]{0} parameter(2)
  %xq = f8e4m3fn[16,64]{1,0} fusion(%x), kind=kLoop, calls=%q8
  %a = f32[16,32]{1,0} fusion(%xq, %w), kind=kCustom, calls=%g8, backend_config={GEMM8}
  %wd = bf16[64,32]{1,0} fusion(%w, %s), kind=kLoop, calls=%deq
  %b = f32[16,32]{1,0} fusion(%x, %wd), kind=kCustom, calls=%g16, backend_config={GEMM16}
  ROOT %t = (f32[16,32]{1,0}, f32[16,32]{1,0}) tuple(%a, %b)
}
"""


def test_the_walker_names_each_gemms_operand_types():
    """bench/_hlo_walk.gemms (which GEMM an fp8 projection became, issue 41): an fp8 x fp8 GEMM
    fusion reads e4m3 on both sides (the activation quantized in a kernel before it); a weight
    dequantized to bf16 in a kernel of its own before a plain GEMM shows as f8e4m3fn->bf16."""
    kind = '{"fusion_backend_config":{"kind":"%s"}}'
    hlo = _GEMM_HLO.replace("{GEMM8}", kind % "__triton_nested_gemm_fusion").replace(
        "{GEMM16}", kind % "__triton_gemm")
    got = sorted(hw.gemms(hw.parse(hlo)))
    assert got == [("triton", "bf16", "f8e4m3fn->bf16", "f32", ""),
                   ("triton", "bf16->f32->f8e4m3fn", "f8e4m3fn", "f32", "")], got
