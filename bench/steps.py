"""Benchmark of whole RL steps (train/step.py rl_step): today's dynamic-sampling rounds against one
stream per step (algo.stream_rounds) and bounded staleness (algo.max_staleness = 1, 2), issue 28.

A Qwen2-shaped random model (models.init_params, built in memory: no download), responses
long-tailed (a stop set of vocab/32 random ids, as bench/rollout.py's long-tail section: lengths
roughly geometric up to max_new_tokens), a verifier whose groups pass the dynamic-sampling filter
at a rate near 0.4 (so a step needs more than one round) and that takes 50 ms per group (a remote
sandbox or judge), and the real update (PPO, TIS, packed rows) on one device. The modes take
turns step by step (warm-up steps that compile, then timed steps, so a change of the machine's
load moves them alike); it prints per step the wall time, the engine's occupancy over the
step's decoding (live slots / slots), and per mode the staleness of the samples used, the
samples carried / dropped / discarded and the median step time as a ratio of the rounds'.

    python bench/steps.py            # 4 layers, hidden 512, vocab 32000, N = 16, 8 prompts/step
    python bench/steps.py --quick    # 2 layers, hidden 256, vocab 8192, N = 8, 4 prompts/step
    python bench/steps.py --model smollm2   # the real SmolLM2-135M-Instruct, N = 8, 4 prompts/step
The SmolLM2 case (builtin:smollm2-135m-instruct, float32, nothing downloaded) decodes
configs/smollm2_arith.py's chat-templated 2-digit additions until its own <|im_end|>: real
response lengths instead of the random model's stop set; the verifier is the same synthetic one
(pass rate and latency as set), so the schedule does not depend on what the model gets right.
Writes bench/results/steps[-quick|-smollm2].json. The machine's load is printed (os.getloadavg): on a
shared machine the absolute times move, the ratios of one run much less.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brorl_jax import algo  # noqa: E402
from brorl_jax.config import (  # noqa: E402
    default_config,
    optimizer_config,
    validate,
)
from brorl_jax.data import PromptBatch  # noqa: E402
from brorl_jax.models import Model, ModelConfig, init_params  # noqa: E402
from brorl_jax.rewards.health import VerifierHealth  # noqa: E402
from brorl_jax.train.context import RunContext, Scored  # noqa: E402
from brorl_jax.train.runtime import make_runtime  # noqa: E402
from brorl_jax.train.step import rl_step  # noqa: E402

FULL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4)
QUICK = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
# (name, algo.stream_rounds, algo.max_staleness, rewards.groups_in_flight)
MODES = (("rounds, k=0 (today)", False, 0, 1), ("stream, k=0", True, 0, 1),
         ("stream, k=1", True, 1, 1), ("stream, k=2", True, 2, 1))


def modes_for(groups_in_flight: int) -> tuple:
    """MODES, and with groups_in_flight D > 1 the rounds and the k = 1 stream with D groups
    scored at once beside them (in the same run, so their ratios are to today's rounds)."""
    if groups_in_flight <= 1:
        return MODES
    d = groups_in_flight
    return MODES + ((f"rounds, {d} scored at once", False, 0, d),
                    (f"stream, k=1, {d} at once", True, 1, d))


class SlowVerifier:
    """Rewards by prompt: a prompt passes the filter (a quarter of its samples correct) with
    probability `pass_rate` (drawn once per loader index), else every sample is wrong; each
    call (one group) takes `latency` seconds, as a remote verifier would."""

    def __init__(self, pass_rate: float, latency: float):
        self.pass_rate, self.latency = pass_rate, latency

    def score(self, records, tokens, lengths):
        time.sleep(self.latency)
        rng = np.random.default_rng([17, int(records[0]["index"])])
        out = np.zeros(len(records), np.float32)
        if rng.random() < self.pass_rate:
            out[: max(1, len(records) // 4)] = 1.0
        return Scored(out, VerifierHealth())

    def close(self):
        pass


def prompts(vocab: int, prompt_len: int, batch: int):
    """The loader's form: batches of prompt ids, records and loader indices, never ending."""
    rng = np.random.default_rng(0)
    i = 0
    while True:
        # lengths in (prompt_len / 2, prompt_len]: one prompt bucket, one set of programs
        ids = [rng.integers(4, vocab, rng.integers(prompt_len // 2 + 1, prompt_len + 1)).tolist()
               for _ in range(batch)]
        idx = list(range(i, i + batch))
        yield PromptBatch(prompt_ids=ids, prompt_lengths=np.asarray([len(x) for x in ids], np.int32),
                          index=np.asarray(idx), records=[{"index": j} for j in idx])
        i += batch


def smollm2_prompts(model: Model, prompt_len: int, batch: int):
    """The loader's form over SmolLM2's chat template: 2-digit additions, a new seed per batch."""
    from brorl_jax.data import PromptTokenizer
    from configs.smollm2_arith import arith_records
    encode = PromptTokenizer(model.tokenizer, max_prompt_len=prompt_len).encode_batch
    i = 0
    while True:
        records = arith_records(batch, 2, "+", seed=1000 + i)
        idx = list(range(i, i + batch))
        ids = encode(records)
        yield PromptBatch(prompt_ids=ids, prompt_lengths=np.asarray([len(x) for x in ids], np.int32),
                          index=np.asarray(idx),
                          records=[{**r, "index": j} for r, j in zip(records, idx)])
        i += batch


def make_context(args, model: Model, stop, stream: bool, k: int, runtime=None,
                 groups_in_flight: int = 1) -> RunContext:
    """The run's context for one mode; `runtime` (its compiled rollout and update programs) is
    shared by the modes: the stream keys are the collect's, not the programs'."""
    c = default_config()
    c.rollout.rollouts_per_prompt = args.n
    c.rollout.max_new_tokens = args.new_tokens
    c.data.max_prompt_len = args.prompt_len
    c.algo.prompts_per_step = args.prompts
    c.algo.generation_batch_multiplier = 1.0
    c.algo.max_generation_rounds = 20
    c.algo.dynamic_sampling_cap_policy = "pad"
    c.algo.micro_batch_size = args.n
    c.algo.kl_coef = 0.0
    c.algo.stream_rounds, c.algo.max_staleness = stream, k
    c.rewards.groups_in_flight = groups_in_flight
    c.optim.lr = 1e-5
    c.train.steps = 10**6               # the stream is never closed by the last step here
    c.train.checkpoint_every = 10**6
    c = validate(c)
    ocfg = optimizer_config(c)
    optimizer = algo.make_optimizer(ocfg)
    return RunContext(
        cfg=c, model=model, tokenizer=None, prompt_tokenizer=None, eos_ids=tuple(stop), pad_id=0,
        seq_len=args.prompt_len + args.new_tokens, optimizer_cfg=ocfg, optimizer=optimizer,
        runtime=runtime or make_runtime(c, model.config, optimizer, diagnostics_n=None),
        scorer=SlowVerifier(args.pass_rate, args.latency), eval_prompts=[])


class Mode:
    """One mode's run: its context, train and collect state, prompt source and timed steps."""

    def __init__(self, args, model, stop, runtime, name, stream, k, groups_in_flight=1):
        self.name, self.stream, self.k, self.groups_in_flight = name, stream, k, groups_in_flight
        self.ctx = make_context(args, model, stop, stream, k, runtime, groups_in_flight)
        self.state = self.ctx.new_train_state(jax.tree.map(jnp.copy, model.params))
        self.cstate = algo.CollectState()
        self.source = (smollm2_prompts(model, args.prompt_len, args.prompts)
                       if args.model == "smollm2" else
                       prompts(model.config.vocab_size, args.prompt_len, args.prompts))
        self.rows: list = []

    def step(self, step: int, timed: bool) -> None:
        t0 = time.perf_counter()
        self.state, self.cstate, m = rl_step(self.ctx, self.state, self.cstate, self.source,
                                             step)
        jax.block_until_ready(self.state.params)
        wall = time.perf_counter() - t0
        occupancy = m.get("rollout/step_occupancy", m.get("rollout/occupancy", 0.0))
        if timed:
            self.rows.append(dict(
                step_s=wall, update_s=m["time/update_s"], occupancy=occupancy,
                rounds=m["dynamic_sampling/rounds"], kept=m["dynamic_sampling/kept_groups"],
                pass_rate=m["dynamic_sampling/pass_rate"],
                staleness_mean=m.get("staleness/mean", 0.0),
                staleness_max=m.get("staleness/max", 0),
                carried=m.get("rollout/carried_samples", 0),
                dropped=m.get("staleness/dropped_samples", 0),
                discarded=m.get("rollout/discarded_samples", 0),
                generated=m["perf/generated_samples"],
                times={k: float(v) for k, v in m.items() if k.startswith("time/")}))
        print(f"  {self.name:26s} step {step}{'' if timed else ' (warm-up)'}: {wall:6.2f} s, "
              f"occupancy {occupancy:.2f}, rounds {m['dynamic_sampling/rounds']:.0f}",
              flush=True)

    def summary(self) -> dict:
        if self.cstate.stream is not None:
            self.cstate.stream.close()
        rows = self.rows
        mean = lambda key: float(np.mean([r[key] for r in rows]))
        return dict(mode=self.name, stream_rounds=self.stream, max_staleness=self.k,
                    groups_in_flight=self.groups_in_flight, steps=rows,
                    step_s=mean("step_s"),
                    step_s_median=float(np.median([r["step_s"] for r in rows])),
                    update_s=mean("update_s"),
                    update_s_median=float(np.median([r["update_s"] for r in rows])),
                    occupancy=mean("occupancy"),
                    rounds=mean("rounds"), staleness_mean=mean("staleness_mean"),
                    staleness_max=max(r["staleness_max"] for r in rows),
                    carried=mean("carried"), dropped=mean("dropped"),
                    discarded=mean("discarded"), generated=mean("generated"),
                    pass_rate=mean("pass_rate"))


def table(results: list) -> str:
    """The modes side by side: mean and median step time (a step that compiled a new shape
    moves the mean), the median's ratio to the rounds', the median update time (the rest of
    the step is the collect: the parts a disaggregated rollout would overlap, docs/results.md),
    occupancy over the step's decoding, rounds of prompts fed, staleness of the samples used, samples
    carried / dropped / discarded per step."""
    base = results[0]["step_s_median"]
    lines = [f"\n{'mode':27s} {'mean s':>7s} {'median':>7s} {'ratio':>6s} {'update':>6s} "
             f"{'occup.':>6s} {'rounds':>6s} {'stale':>5s} {'max':>3s} {'carried':>7s} "
             f"{'dropped':>7s} {'discard':>7s}"]
    for r in results:
        r["ratio"] = r["step_s_median"] / base
        lines.append(
            f"{r['mode']:27s} {r['step_s']:7.2f} {r['step_s_median']:7.2f} {r['ratio']:6.2f} "
            f"{r['update_s_median']:6.2f} {r['occupancy']:6.2f} {r['rounds']:6.1f} "
            f"{r['staleness_mean']:5.2f} {r['staleness_max']:3d} {r['carried']:7.1f} "
            f"{r['dropped']:7.1f} {r['discarded']:7.1f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", choices=("random", "smollm2"), default="random",
                    help="random: the Qwen2-shaped random model; smollm2: the real one")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (compiles)")
    ap.add_argument("--pass-rate", type=float, default=0.4)
    ap.add_argument("--latency", type=float, default=0.05, help="verifier seconds per group")
    ap.add_argument("--groups-in-flight", type=int, default=1,
                    help="D > 1: also the rounds and the k = 1 stream with rewards."
                         "groups_in_flight = D (the other modes: 1, one group scored at once)")
    args = ap.parse_args()
    small = args.quick or args.model == "smollm2"
    shape = QUICK if args.quick else FULL
    args.n = 8 if small else 16
    args.prompts = 4 if small else 8
    args.new_tokens = 64 if small else 128
    args.prompt_len = 32 if args.quick else 128 if args.model == "smollm2" else 64
    args.steps = args.steps or (4 if small else 6)
    if args.model == "smollm2":
        from brorl_jax.models import SMOLLM2_NAME, from_pretrained
        model = from_pretrained("builtin:" + SMOLLM2_NAME, dtype="float32")
        stop = list(model.generation_eos_ids)
        shape = {k: getattr(model.config, k) for k in FULL}
    else:
        cfg = ModelConfig(model_type="qwen2", rope_theta=10000.0, rope_scaling=None,
                          rms_norm_eps=1e-6, attention_bias=True, qk_norm=False,
                          tie_word_embeddings=False, max_position_embeddings=4096,
                          head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                          bos_token_id=None, eos_token_ids=(2,), **shape)
        params = init_params(cfg, jax.random.PRNGKey(0))
        rng = np.random.default_rng(0)
        stop = sorted(rng.choice(cfg.vocab_size, cfg.vocab_size // 32, replace=False).tolist())
        model = Model(cfg, params, None, tuple(stop))
    load = os.getloadavg()
    print(f"steps: {args.model} {shape}, N={args.n}, {args.prompts} prompts/step, S={args.new_tokens}, "
          f"P<={args.prompt_len}, {len(stop)} stop ids, pass rate ~{args.pass_rate}, verifier "
          f"{args.latency * 1e3:.0f} ms/group; {os.cpu_count()} CPUs, load {load[0]:.1f}",
          flush=True)
    runtime = make_context(args, model, stop, False, 0).runtime
    modes = [Mode(args, model, stop, runtime, *mode) for mode in modes_for(args.groups_in_flight)]
    # the modes take turns step by step, so a change of the machine's load over the run moves
    # them alike (their schedules are deterministic: only the wall times feel the load)
    for step in range(args.warmup + args.steps):
        for mode in modes:
            mode.step(step, timed=step >= args.warmup)
    results = [mode.summary() for mode in modes]
    print(table(results))
    load_end = os.getloadavg()
    print(f"load average at start {load[0]:.1f}, at end {load_end[0]:.1f} "
          f"({os.cpu_count()} CPUs)")
    tag = ("-smollm2" if args.model == "smollm2" else "-quick" if args.quick else "") + (
        f"-g{args.groups_in_flight}" if args.groups_in_flight != 1 else "")
    out = Path(__file__).parent / "results" / f"steps{tag}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(
        machine=platform.platform(), cpus=os.cpu_count(), load_start=load, load_end=load_end,
        model_name=args.model, model=shape, n=args.n, prompts_per_step=args.prompts, new_tokens=args.new_tokens,
        pass_rate=args.pass_rate, latency_s=args.latency,
        groups_in_flight=args.groups_in_flight, results=results), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
