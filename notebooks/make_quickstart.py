"""Writes notebooks/quickstart.ipynb (clean: no outputs) from the cells below.

The notebook is generated so that its source is reviewable as plain Python; edit the cells here,
then regenerate and commit both files:

    python notebooks/make_quickstart.py            # writes notebooks/quickstart.ipynb
    python notebooks/make_quickstart.py --check    # exit 1 if the committed notebook is stale

tests/test_notebook.py executes the committed .ipynb headlessly and checks it matches this file.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

NOTEBOOK_PATH = Path(__file__).resolve().parent / "quickstart.ipynb"

# (cell type, source). Sources are dedented; keep markdown short and the facts those of
# arXiv 2510.01180.
CELLS: list[tuple[str, str]] = [
    ("markdown", r"""
        # brorl_jax quickstart

        This notebook walks through the whole stack on a CPU in a few minutes, with no download:

        1. load the embedded demo model (or a local Hugging Face checkpoint),
        2. sample N completions for one prompt, look at them and score them with the verifier,
        3. run a few BroRL steps and plot the training curves,
        4. look at the mass-balance argument behind BroRL: Lemma 2 and a small version of the
           paper's token-level simulation.

        Everything runs top to bottom as is. On Google Colab the first cell installs the package.
        """),
    ("code", r"""
        # Colab: install brorl_jax from git (set REPO_URL first). A local checkout needs nothing.
        import subprocess
        import sys

        REPO_URL = ""  # e.g. "https://github.com/<org>/brorl_jax.git"

        IN_COLAB = "google.colab" in sys.modules
        if IN_COLAB:
            if not REPO_URL:
                raise ValueError("On Colab, set REPO_URL in this cell to the git URL of the "
                                 "brorl_jax repository, then run it again.")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                            f"brorl_jax @ git+{REPO_URL}"], check=True)
            # If pip upgraded jax or numpy, restart the session (Runtime > Restart session)
            # and run the notebook again from the top.
        else:
            print("Not on Colab: using the local checkout / installed package.")
        """),
    ("code", r"""
        %matplotlib inline
        import json
        import os
        import tempfile
        import time
        import warnings
        from pathlib import Path

        # tqdm.auto (imported by transformers) warns when ipywidgets is missing; text bars are fine.
        warnings.filterwarnings("ignore", message="IProgress not found")

        # Run from notebooks/ of an uninstalled checkout: put the repository root on sys.path
        # (and on PYTHONPATH, for the reward worker processes).
        try:
            import brorl_jax
        except ImportError:
            root = next((p for p in [Path.cwd(), *Path.cwd().parents]
                         if (p / "brorl_jax" / "__init__.py").exists()), None)
            if root is None:
                raise
            sys.path.insert(0, str(root))
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
            import brorl_jax

        import jax
        import matplotlib.pyplot as plt
        import numpy as np

        from brorl_jax import data, models, rewards, rollout

        # Runs and plots go here; the test suite points this at a temporary directory.
        WORKDIR = os.environ.get("BRORL_NOTEBOOK_WORKDIR") or tempfile.mkdtemp(
            prefix="brorl_quickstart_")
        # The test suite's run (tests/test_notebook.py) sets BRORL_NOTEBOOK_QUICK=1: every cell
        # runs, with fewer training and simulation steps.
        QUICK = os.environ.get("BRORL_NOTEBOOK_QUICK") == "1"
        os.makedirs(WORKDIR, exist_ok=True)
        T_START = time.perf_counter()
        print(f"jax {jax.__version__} on {jax.default_backend()}; workdir {WORKDIR}")
        """),
    ("markdown", r"""
        ## BroRL in a few sentences

        BroRL ([Hu et al., arXiv 2510.01180](https://arxiv.org/abs/2510.01180)) scales RL with
        verifiable rewards by sampling **more rollouts per prompt** instead of running more
        steps. It continues the ProRLv2 checkpoint (Nemotron-Research-Reasoning-Qwen-1.5B after
        3,000 RL steps) with **N = 512** rollouts per prompt (128 prompts per step) where the
        ProRL baseline uses **N = 16** (512 prompts per step); the rest of the recipe is
        unchanged (PPO clip-higher, REINFORCE++-baseline advantages, KL with reference resets,
        dynamic sampling).

        * **Shared prompt.** All N rollouts continue the same prompt, so it is prefilled once and
          the N samples decode together; on the same hardware generation went from 36.5 to
          72.4 samples/s.
        * **Dynamic sampling** keeps a prompt's group only if `0 < #correct < N` (all-correct or
          all-wrong groups have zero advantage). The kept fraction rose from **41% (N = 16) to
          62% (N = 512)**.
        * **Mass balance** (§2): after one step, the change of the total correct probability mass
          has two non-negative terms from the sampled responses and one term from the
          *unsampled* ones that can be negative. Its size is set by the unsampled second
          moments, whose expectation `Σ p_i² (1 − p_i)^N` (Lemma 2) shrinks as N grows: with
          enough rollouts the correct mass, and so pass@k, grows reliably.

        After +191 steps, averages went from 61.69 to 63.03 (math), 52.00 to 54.20 (code) and
        61.29 to 63.09 (Reasoning Gym) (Table 1).
        """),
    ("markdown", r"""
        ## 1. Load a model

        The embedded demo model is a tiny Qwen2-shaped transformer (random init) with a
        character-level tokenizer, written locally as a Hugging Face checkpoint and loaded
        through the same `from_pretrained` as a real one.
        """),
    ("code", r"""
        demo_path = models.ensure_demo_model()          # built locally once, then cached
        demo_model = models.from_pretrained(demo_path)
        c = demo_model.config
        num_params = sum(x.size for x in jax.tree.leaves(demo_model.params))
        print(f"{demo_path}\n{c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
              f"vocab {c.vocab_size}, {num_params / 1e6:.2f}M parameters")
        print("stop tokens:", [demo_model.tokenizer.decode([i]) for i in demo_model.generation_eos_ids])
        """),
    ("markdown", r"""
        **Your own checkpoint.** Set `MODEL_PATH` to a local Hugging Face directory (Qwen2,
        Qwen3 or Llama; `config.json`, safetensors weights and tokenizer files) to sample from it
        in section 2. Nothing is downloaded: fetch the weights yourself first. Training
        (section 3) always uses the demo model here.
        """),
    ("code", r"""
        MODEL_PATH = ""  # e.g. "/data/Qwen2.5-0.5B-Instruct"

        if MODEL_PATH:
            model = models.from_pretrained(MODEL_PATH)
            # A real instruct model needs the answer format spelled out and room to reason.
            from reasoning_gym.utils import SYSTEM_PROMPTS
            SYSTEM_PROMPT, MAX_NEW_TOKENS = SYSTEM_PROMPTS["default"], 256
            print(f"loaded {MODEL_PATH}: {model.config.model_type}, "
                  f"{model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}")
        else:
            print("MODEL_PATH is empty: using the embedded demo model (nothing is downloaded).")
            model = demo_model
            SYSTEM_PROMPT, MAX_NEW_TOKENS = None, 8   # the demo answers "<answer>7</answer></s>"
        """),
    ("markdown", r"""
        ## 2. Sample N completions for one prompt and score them

        Prompts come from Reasoning Gym's `basic_arithmetic` (one-digit sums, as in
        `configs/tiny.py`). Records are veRL style: `data_source` picks the verifier, which
        reads the last `<answer>...</answer>` span of a completion.
        """),
    ("code", r"""
        from configs.tiny import get_config

        cfg = get_config()   # reused in section 3; its task settings define the prompts here
        task_kwargs = json.loads(cfg.data.reasoning_gym_kwargs)
        records = data.reasoning_gym_source("basic_arithmetic", size=4, seed=123, **task_kwargs)
        record = records[0]
        prompt_tok = data.PromptTokenizer(model.tokenizer, max_prompt_len=4096,
                                          system_prompt=SYSTEM_PROMPT)
        prompt_ids = prompt_tok(record)
        print("data_source :", record["data_source"])
        print("prompt text :", repr(prompt_tok.text(record)))
        print("ground truth:", record["ground_truth"], f"({len(prompt_ids)} prompt tokens)")

        N = 64
        res = rollout.generate(model, [prompt_ids], rollouts_per_prompt=N,
                               max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
                               seed=0)
        print(f"tokens {res.tokens.shape} [G, N, S]; prefill {res.stats['prefill_seconds']:.2f}s "
              f"(once for all {N} samples), decode {res.stats['decode_seconds']:.2f}s")
        """),
    ("code", r"""
        def decode_all(tokenizer, result, g=0):
            # A completion is tokens[:length]; the stop token is special and dropped here.
            return [tokenizer.decode(result.tokens[g, i, :result.lengths[g, i]].tolist(),
                                     skip_special_tokens=True)
                    for i in range(result.rollouts_per_prompt)]

        completions = decode_all(model.tokenizer, res)
        scores = np.array(rewards.score([record] * N, completions, timeout_s=10.0))
        seq_logprob = (res.logprobs[0] * res.mask[0]).sum(-1)
        print(f"{'#':>3} {'score':>5} {'len':>3} {'stop':>4} {'logp':>7}  completion")
        for i in range(12):
            print(f"{i:>3} {scores[i]:>5.2f} {res.lengths[0, i]:>3} {str(res.finished[0, i]):>4} "
                  f"{seq_logprob[i]:>7.2f}  {completions[i]!r}")
        print("...")
        reference = f"<answer>{record['ground_truth']}</answer>"
        print(f"the reference answer {reference!r} scores "
              f"{rewards.score([record], [reference], timeout_s=10.0)[0]}")
        num_correct = int((scores >= cfg.algo.correct_threshold).sum())
        print(f"{num_correct}/{N} correct -> dynamic sampling would "
              f"{'keep' if 0 < num_correct < N else 'DROP'} this group")
        """),
    ("markdown", r"""
        The untrained demo model writes random characters: every completion is wrong, the group
        has zero advantage and dynamic sampling drops it. RL needs a model that is sometimes
        right, which is why BroRL starts from a trained checkpoint and the demo starts with a
        short supervised warm start.

        ## 3. A few BroRL steps on CPU

        `configs/tiny.py` is the demo recipe at toy size: 60 supervised steps, then BroRL steps
        with N = 8 rollouts for 2 prompts per step (the paper's N = 512 needs an accelerator;
        `configs/demo.py` uses N = 128). Each step generates, scores in worker processes, applies
        dynamic sampling, computes REINFORCE++-baseline advantages and takes a PPO clip-higher
        step with the k2 KL term. Metrics go to `metrics.jsonl` in the work directory.
        """),
    ("code", r"""
        import shutil

        from brorl_jax.workdir.logger import read_metrics
        from brorl_jax.train.loop import Trainer

        cfg.train.steps = 2 if QUICK else 10
        cfg.eval.every = 1 if QUICK else 5          # held-out pass@1 at steps 0, 5 and 10
        cfg.sft.steps = 10 if QUICK else cfg.sft.steps
        cfg.eval.num_prompts, cfg.eval.samples_per_prompt = 16, 4
        cfg.train.checkpoint_every = cfg.train.steps
        cfg.train.tensorboard = False
        run_dir = os.path.join(WORKDIR, "tiny_run")
        # Start fresh on every run of this cell: a checkpoint left in run_dir would be resumed.
        shutil.rmtree(run_dir, ignore_errors=True)

        t0 = time.perf_counter()
        trainer = Trainer(cfg, run_dir)
        try:
            result = trainer.run()
            last, trained_params = result.metrics, result.state.params
        finally:
            trainer.close()                         # stops the reward worker processes
        print(f"{cfg.train.steps} BroRL steps (plus warm start) in {time.perf_counter() - t0:.0f}s")
        history = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        """),
    ("code", r"""
        def series(key):
            pts = [(r["step"], r[key]) for r in history if r.get(key) is not None]
            return np.array(pts, dtype=float).reshape(-1, 2)

        fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
        for ax, (key, title) in zip(axes, [("reward/mean", "mean reward of the rollouts"),
                                           ("dynamic_sampling/pass_rate",
                                            "dynamic-sampling pass rate"),
                                           ("eval/pass@1", "held-out pass@1")]):
            pts = series(key)
            ax.plot(pts[:, 0], pts[:, 1], marker="o")
            ax.set_title(title)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        plt.show()
        """),
    ("markdown", r"""
        At this size (10 steps, N = 8, 2 prompts per step, a small learning rate) RL barely moves
        the model: the held-out pass@1 comes from the warm start and the curves are mostly noise.
        The point is that the whole loop runs. `python -m brorl_jax.main
        --config=configs/demo.py --workdir=runs/demo` runs the full CPU demo (400 supervised
        steps, then 30 BroRL steps at N = 128 on 8 prompts per step).

        The same prompt, sampled again from the trained parameters (`params=` overrides the
        model's). The chance that a group of N is mixed, and so kept, is `1 − p^N − (1 − p)^N`
        for a prompt the policy solves with probability p: large N keeps the hard prompts
        (small p) that a group of 16 almost always misses.
        """),
    ("code", r"""
        tok = trainer.tokenizer
        ids = trainer.prompt_tokenizer(record)
        res_after = rollout.generate(trainer.model, [ids], rollouts_per_prompt=N,
                                     max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0,
                                     seed=1, params=trained_params)
        after = decode_all(tok, res_after)
        scores_after = np.array(rewards.score([record] * N, after, timeout_s=10.0))
        p_hat = float((scores_after >= cfg.algo.correct_threshold).mean())
        print(f"ground truth {record['ground_truth']}; first completions: {after[:8]}")
        print(f"after training: {p_hat * N:.0f}/{N} correct (p = {p_hat:.3f})")

        ns = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for p in [0.005, 0.02, 0.1, 0.5]:
            ax.semilogx(ns, 1 - p ** ns - (1 - p) ** ns, marker=".", label=f"p = {p}")
        ax.axvline(16, color="gray", ls="--", lw=0.8)
        ax.axvline(512, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("rollouts per prompt N")
        ax.set_ylabel("P(group kept)")
        ax.set_title("dynamic sampling: a group is kept if 0 < #correct < N")
        ax.legend()
        ax.grid(alpha=0.3)
        plt.show()
        """),
    ("markdown", r"""
        ## 4. Mass balance: why more rollouts help

        The paper's one-step analysis (§2, Theorem 1) treats each response as a "token" with
        probability `p_i`, correct set P, reward `R_c ≥ 0` for sampled correct tokens and
        `R_w ≤ 0` for sampled incorrect ones:

        `ΔQ_pos = (η/N) [ (R_c − S_R) Q_neg A_2 + (S_R − R_w) Q_pos B_2 + S_R (Q_pos U_neg,2 − Q_neg U_pos,2) ]`

        where `Q_pos` is the correct mass, `A_2`, `B_2` the second moments of the sampled
        correct / incorrect tokens, `U_pos,2`, `U_neg,2` those of the unsampled ones and `S_R`
        the reward-weighted sampled mass. The first two terms are never negative; the last can
        be. Lemma 2 gives its expected size: `E[U_2] = Σ_i p_i² (1 − p_i)^N`
        (`brorl_jax.theory.lemma2_expected_unsampled`). Below, for the simulation's starting
        distribution (vocabulary 12,800, 1,000 correct tokens with logit 3, an incorrect anchor
        token with logit 5, the rest 0): the unsampled terms vanish once N passes `1 / p_i`.
        """),
    ("code", r"""
        from brorl_jax.theory import lemma2_expected_unsampled
        from brorl_jax.theory import simulate as sim

        sim_base = sim.SimulationConfig(vocab=12_800, correct=1_000, steps=20 if QUICK else 200,
                                        log_every=5)
        p0 = jax.nn.softmax(sim.initial_logits(sim_base))
        is_correct = sim.token_rewards(sim_base) > 0
        print(f"Q_pos = {float(p0[is_correct].sum()):.4f}; p of a correct token "
              f"{float(p0[1]):.2e}, of the anchor {float(p0[0]):.2e}")

        ns = np.unique(np.logspace(0, 6, 49).astype(int))
        u_pos = [float(lemma2_expected_unsampled(p0, int(n), where=is_correct)) for n in ns]
        u_neg = [float(lemma2_expected_unsampled(p0, int(n), where=~is_correct)) for n in ns]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.loglog(ns, u_pos, label=r"E[$U_{pos,2}$] (unsampled correct)")
        ax.loglog(ns, u_neg, label=r"E[$U_{neg,2}$] (unsampled incorrect)")
        for n in (16, 512):
            ax.axvline(n, color="gray", ls="--", lw=0.8)
        ax.set_ylim(1e-12, None)
        ax.set_xlabel("draws per step N")
        ax.set_title(r"Lemma 2: E[$U_2$] = $\sum_i p_i^2 (1 - p_i)^N$")
        ax.legend()
        ax.grid(alpha=0.3)
        plt.show()
        """),
    ("markdown", r"""
        ### The token-level simulation (§4.1, Fig. 3), at small size

        The paper trains the logits of a categorical policy (vocabulary 128,000, 10,000 correct
        tokens with reward +1, the rest −1) for 1,000 AdamW steps (lr 1e-3) on the linear
        surrogate with a batch-mean baseline, drawing N tokens per step. Here: vocabulary
        12,800, 1,000 correct tokens, 200 steps, N ∈ {4, 64, 5120} (about 15 s on CPU;
        `python -m brorl_jax.theory.simulate` runs the paper's size). Larger N grows the correct
        mass faster and raises more of the correct tokens; at the largest N every correct token
        ends above its start (no "knowledge shrinkage"). In this implementation N = 4 even loses
        correct mass: AdamW gives every unsampled logit a step of size about lr.
        """),
    ("code", r"""
        import dataclasses

        results = {}
        for n in (4, 64, 5120):
            t0 = time.perf_counter()
            results[n] = sim.simulate(dataclasses.replace(sim_base, n=n), seed=0)
            print(f"N={n}: {time.perf_counter() - t0:.1f}s")
        print(sim.summary_table(results, at_steps=[sim_base.steps // 4, sim_base.steps // 2,
                                                   sim_base.steps]))
        print("cells: Q_pos / % correct tokens above their start / worst change of a correct token")
        """),
    ("code", r"""
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
        panels = [("q_pos", 1.0, r"correct mass $Q_{pos}$"),
                  ("frac_improved", 100.0, r"% correct tokens with $p_i > p_i^0$"),
                  ("worst_drop", 1.0, r"worst $\Delta p_i$ among correct tokens")]
        for ax, (key, scale, title) in zip(axes, panels):
            for n, r in results.items():
                ax.plot(r["step"], scale * r[key], label=f"N = {n}")
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[2].axhline(0.0, color="k", lw=0.6)
        axes[0].legend()
        fig.tight_layout()
        plt.show()
        print(f"notebook ran in {time.perf_counter() - T_START:.0f}s")
        """),
    ("markdown", r"""
        ## Next steps

        * Full CPU demo: `python -m brorl_jax.main --config=configs/demo.py --workdir=runs/demo`.
        * The paper-scale runs: `configs/brorl.py` (N = 512) and `configs/prorl.py` (N = 16).
        * The simulation at the paper's size: `python -m brorl_jax.theory.simulate --out=runs/sim`.
        * Design notes: `docs/` (algorithm, rollout, rewards, theory, scaling).
        """),
]


def build_notebook() -> nbformat.NotebookNode:
    """The notebook with fixed cell ids, so regenerating an unchanged file is a no-op."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(CELLS):
        text = textwrap.dedent(source).strip("\n")
        cell = (nbformat.v4.new_markdown_cell(text) if kind == "markdown"
                else nbformat.v4.new_code_cell(text))
        cell.id = f"cell-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render() -> str:
    return nbformat.writes(build_notebook()) + "\n"   # as nbformat.write does


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if the committed notebook differs")
    ap.add_argument("--out", default=str(NOTEBOOK_PATH))
    args = ap.parse_args(argv)
    text = render()
    out = Path(args.out)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run python notebooks/make_quickstart.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
