"""The BroRL result in miniature: continue a ProRL plateau with depth, breadth or adaptive N, at
equal generated samples, over seeds.

  python -m brorl_jax.experiments.plateau --out=runs/plateau [--quick] [--seeds=0,1,2,3,4]
      [--config=configs/demo.py] [--config.key=value ...]

1. **Start**: the config's supervised warm start (compare_n.start_model), run once.
2. **Plateau**: ProRL's recipe (N = `--n_prorl`, `--prompts` prompts per step, the config's
   learning rate by the sqrt batch rule) for `--plateau_steps` steps, evaluated every
   `--plateau_eval_every` steps. The plateau is the least-squares slope of held-out pass@1 over
   the last `--plateau_window` evaluations, per 100k generated samples, with its 95% t interval;
   it has plateaued when that interval holds 0. Its last parameters are the common start.
3. **Arms** from that start, each run once per seed (train.seed), all stopped by
   train.sample_budget = `--budget` generated samples:
   - prorl: the plateau's recipe, continued;
   - brorl: N = `--n_brorl`, `--batch_ratio` x the samples per update (prompts per step =
     prompts x n_prorl x ratio / n_brorl, fewer prompts), the learning rate by the sqrt rule on
     that batch, the same number of PPO mini-batches [BroRL 4.2.1];
   - adaptive: the brorl arm with rollout.adaptive_n on, buckets n_brorl x (1/2, 1, 3/2) as the
     write-ups' "easy 256 / medium 512 / hard 768" (the shipped AdaptiveN, EMA thresholds 0.7/0.3);
   - knapsack: the brorl arm's samples per update and learning rate, its rounds shared out by
     rollout.knapsack (Knapsack RL's value after a probe of `--knapsack_probe` samples per
     prompt, the chunk as large): N = 4 x the probe on average, so 16x the prompts of a brorl
     round at n_brorl = 512 and a probe of 8, at most n_brorl / 2 samples per prompt. The EMA
     buckets need a prompt to come back, which no prompt does within the budget; the probe
     needs no history.
4. **Out**: plateau.json (public surface: arms -> per seed pass1_start, pass1_end, pass_at_k_end,
   generated_samples, samples_per_s, wall_s, dynamic_sampling_pass_rate; the differences of the
   arms' mean end pass@1 with 95% bootstrap intervals over seeds; the plateau's slope), plateau.md
   (the table), plateau.png (the plateau and the arms against generated samples).

samples_per_s is an arm's generated samples over its training steps' wall time, the first step
(compilation) left out; samples_per_s_median_step the median step's rate (later steps still
compile: each new slot bucket of the rollout and each new packed shape of the update is a program
of its own); wall_s is the whole run, evaluations and compilation included.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import sys
import time

import numpy as np

from brorl_jax import cli

ARMS = ("prorl", "brorl", "adaptive", "knapsack")
# Extra arms that explain the others (plateau.json "ablations"; --ablations picks them):
#   brorl_prorl_lr / knapsack_prorl_lr: the arm at the prorl arm's learning rate (no sqrt rule).
ABLATIONS = ("brorl_prorl_lr", "knapsack_prorl_lr")
# The differences of mean end pass@1 that plateau.json reports (a minus b), when both ran.
DIFFS = (("brorl", "prorl"), ("adaptive", "prorl"), ("adaptive", "brorl"), ("knapsack", "prorl"),
         ("knapsack", "brorl"), ("brorl_prorl_lr", "prorl"), ("brorl_prorl_lr", "brorl"),
         ("knapsack_prorl_lr", "prorl"), ("knapsack_prorl_lr", "brorl_prorl_lr"))
# The options the plateau phase depends on, and those the arms' runs depend on (seeds and
# ablations only add runs).
PLATEAU_KEYS = ("n_prorl", "prompts", "plateau_steps", "plateau_eval_every", "plateau_window",
                "eval_prompts", "eval_k")
ARM_KEYS = PLATEAU_KEYS + ("n_brorl", "batch_ratio", "budget", "knapsack_probe")
BOOTSTRAP_DRAWS = 10_000

FLAGS = [cli.Flag("string", "out", "runs/plateau", "Output directory."),
         cli.Flag("bool", "quick", False, "Every arm at tiny sizes (2 seeds, a few steps)."),
         cli.Flag("list", "seeds", ["0", "1", "2", "3", "4"], "train.seed of each arm's runs."),
         cli.Flag("integer", "n_prorl", 16, "N of the plateau and of the prorl arm."),
         cli.Flag("integer", "prompts", 16, "Prompts per step of the plateau and the prorl arm."),
         cli.Flag("integer", "n_brorl", 512, "N of the brorl and adaptive arms."),
         cli.Flag("integer", "batch_ratio", 8, "Samples per update of brorl over prorl."),
         cli.Flag("integer", "knapsack_probe", 8, "The knapsack arm's probe (and chunk) per "
                  "prompt; its mean N is 4x that."),
         cli.Flag("integer", "plateau_steps", 300, "ProRL steps to the plateau."),
         cli.Flag("integer", "plateau_eval_every", 20, "Steps between the plateau's evals."),
         cli.Flag("integer", "plateau_window", 6, "Last evaluations the plateau slope spans."),
         cli.Flag("integer", "budget", 32_768, "Generated samples per arm run."),
         cli.Flag("integer", "eval_prompts", 200, "Held-out prompts of every evaluation."),
         cli.Flag("integer", "eval_k", 16, "Samples per held-out prompt (pass@k up to k)."),
         cli.Flag("list", "ablations", list(ABLATIONS), "Extra arms after the three (names: "
                  + ", ".join(ABLATIONS) + "; empty: none).")]

# --quick: every arm at tiny sizes; the flags it sets (the command line's --config.* still apply).
QUICK = {"seeds": ["0", "1"], "ablations": [], "n_brorl": 128, "prompts": 4, "batch_ratio": 8,
         "plateau_steps": 3, "plateau_eval_every": 1, "plateau_window": 3, "budget": 1024,
         "eval_prompts": 16, "eval_k": 4}
QUICK_CONFIG = {"sft.steps": 300, "algo.max_generation_rounds": 2}   # over the config's, if larger


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------
def _common(base, model_path: str, opts: dict):
    cfg = base.copy_and_resolve_references()
    cfg.model.path = model_path
    cfg.sft.steps = 0
    cfg.train.plots = False
    cfg.algo.dynamic_sampling_cap_policy = "pad"   # a round cap must not end an arm early
    cfg.eval.num_prompts = opts["eval_prompts"]
    cfg.eval.samples_per_prompt = opts["eval_k"]
    return cfg


def _shape(cfg, n: int, prompts: int):
    from brorl_jax.algo.policies import N_KEY
    section, key = N_KEY.split(".")
    cfg[section][key] = n
    cfg.algo.prompts_per_step = prompts
    cfg.algo.micro_batch_size = math.gcd(cfg.algo.micro_batch_size, n * prompts)
    return cfg


def brorl_prompts(opts: dict) -> int:
    """Prompts per step of the breadth arms: batch_ratio x the prorl update's samples, at N =
    n_brorl (the paper: 512 x 16 -> 128 x 512 with 8x the samples)."""
    from brorl_jax.errors import ConfigError
    rows = opts["prompts"] * opts["n_prorl"] * opts["batch_ratio"]
    if rows % opts["n_brorl"]:
        raise ConfigError(f"--n_brorl={opts['n_brorl']} must divide --prompts x --n_prorl x "
                          f"--batch_ratio = {rows} (the breadth arms' update rows).")
    if opts["knapsack_probe"] < 2 or rows % (4 * opts["knapsack_probe"]):
        raise ConfigError(f"--knapsack_probe={opts['knapsack_probe']} must be >= 2 and 4x it "
                          f"must divide --prompts x --n_prorl x --batch_ratio = {rows} (the "
                          "knapsack arm's mean N and its update rows).")
    return rows // opts["n_brorl"]


def plateau_config(base, model_path: str, opts: dict):
    cfg = _shape(_common(base, model_path, opts), opts["n_prorl"], opts["prompts"])
    cfg.train.steps = opts["plateau_steps"]
    cfg.eval.every = opts["plateau_eval_every"]
    cfg.train.checkpoint_every = max(1, opts["plateau_steps"])
    return cfg


def arm_config(base, arm: str, model_path: str, opts: dict):
    """One arm's config: its shape, the sample budget, the start model; evaluation before and
    after only."""
    cfg = _common(base, model_path, opts)
    if arm == "prorl":
        _shape(cfg, opts["n_prorl"], opts["prompts"])
    elif arm.startswith("knapsack"):
        n = 4 * opts["knapsack_probe"]
        _shape(cfg, n, brorl_prompts(opts) * opts["n_brorl"] // n)
        cfg.rollout.knapsack = True
        cfg.rollout.knapsack_probe = cfg.rollout.knapsack_chunk = opts["knapsack_probe"]
        cfg.rollout.knapsack_max_n = opts["n_brorl"] // 2
    else:
        _shape(cfg, opts["n_brorl"], brorl_prompts(opts))
    if arm.endswith("_prorl_lr"):
        from brorl_jax.config import derived_learning_rate
        cfg.optim.lr = derived_learning_rate(arm_config(base, "prorl", model_path, opts))[0]
    if arm == "adaptive":
        n = opts["n_brorl"]
        cfg.rollout.adaptive_n = True
        cfg.rollout.adaptive_n_buckets = f"{n // 2},{n},{3 * n // 2}"
    rows = cfg.algo.prompts_per_step * cfg.rollout.rollouts_per_prompt
    cfg.train.sample_budget = opts["budget"]
    cfg.train.steps = 2 * math.ceil(opts["budget"] / rows) + 2   # a cap; the budget stops first
    cfg.train.checkpoint_every = cfg.train.steps
    cfg.eval.every = 0
    return cfg


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------
def slope_ci(x, y, per: float = 1.0) -> dict:
    """Least-squares slope of y on x (times `per`) with its 95% t interval."""
    from scipy import stats
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) > 2 and np.ptp(y) == 0:       # a flat line (scipy gives nan for it): slope 0 exactly
        return {"slope": 0.0, "ci95": [0.0, 0.0], "points": len(x)}
    fit = stats.linregress(x, y)
    half = stats.t.ppf(0.975, len(x) - 2) * fit.stderr if len(x) > 2 else float("inf")
    return {"slope": fit.slope * per, "ci95": [(fit.slope - half) * per,
                                                (fit.slope + half) * per], "points": len(x)}


def bootstrap_diff(a, b, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> dict:
    """mean(a) - mean(b) with a 95% percentile bootstrap interval, seeds resampled with
    replacement within each arm."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(seed)
    da = a[rng.integers(0, len(a), (draws, len(a)))].mean(1)
    db = b[rng.integers(0, len(b), (draws, len(b)))].mean(1)
    lo, hi = np.percentile(da - db, [2.5, 97.5])
    return {"mean": float(a.mean() - b.mean()), "ci95": [float(lo), float(hi)]}


def summarize_run(records: list[dict], wall_s: float) -> dict:
    """One arm run's row of plateau.json from its metrics."""
    evals = [r for r in records if r.get("eval/pass@1") is not None]
    steps = [r for r in records if r.get("time/step_s") is not None]
    end = evals[-1]
    ks = sorted(int(k.split("@")[1]) for k in end if k.startswith("eval/pass@"))
    timed = steps[1:] or steps
    rates = [r["dynamic_sampling/pass_rate"] for r in steps
             if r.get("dynamic_sampling/pass_rate") is not None]
    return {"pass1_start": evals[0]["eval/pass@1"], "pass1_end": end["eval/pass@1"],
            "pass_at_k_start": {k: evals[0][f"eval/pass@{k}"] for k in ks},
            "pass_at_k_end": {k: end[f"eval/pass@{k}"] for k in ks},
            "generated_samples": int(steps[-1]["counters/generated_samples"]),
            "steps": len(steps),
            "samples_per_s": sum(r["perf/generated_samples"] for r in timed)
            / sum(r["time/step_s"] for r in timed),
            "samples_per_s_median_step": float(np.median([r["perf/samples_per_s"]
                                                          for r in timed])),
            "wall_s": wall_s,
            "dynamic_sampling_pass_rate": float(np.mean(rates)) if rates else float("nan")}


def aggregate(arms: dict) -> dict:
    """The differences of mean end pass@1 between arms (bootstrap over seeds), and per arm the
    mean and standard error over seeds of every number."""
    out: dict = {}
    ends = {a: [r["pass1_end"] for r in runs.values()] for a, runs in arms.items() if runs}
    for a, b in DIFFS:
        if a in ends and b in ends:
            out[f"diff_{a}_minus_{b}"] = bootstrap_diff(ends[a], ends[b])
    return out


def _mean_se(values) -> tuple[float, float]:
    v = np.asarray(list(values), float)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


# ------------------------------------------------------------------------------------------------
# The experiment
# ------------------------------------------------------------------------------------------------
def _train(cfg, workdir: str) -> tuple[list[dict], float]:
    from brorl_jax.train.loop import Trainer
    from brorl_jax.workdir.logger import read_metrics
    t0 = time.perf_counter()
    trainer = Trainer(cfg, workdir)
    try:
        result = trainer.run()
        params = result.state.params
        model = trainer.model
    finally:
        trainer.close()
    return read_metrics(os.path.join(workdir, "metrics.jsonl")), time.perf_counter() - t0, \
        (model, params)


@contextlib.contextmanager
def compilation_cache(path: str):
    """JAX's persistent compilation cache under OUT while the experiment runs: the runs of one
    arm differ only in their seed (and the plateau has the prorl arm's shapes), so every run
    after the first of a shape reads its programs instead of compiling them again. A cache the
    caller set (JAX_COMPILATION_CACHE_DIR) is kept."""
    import jax
    if jax.config.jax_compilation_cache_dir:
        yield
        return
    settings = {"jax_compilation_cache_dir": path,
                "jax_persistent_cache_min_compile_time_secs": 0.5,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    old = {k: getattr(jax.config, k) for k in settings}
    for k, v in settings.items():
        jax.config.update(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            jax.config.update(k, v)


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def run(base, out: str, opts: dict, command: str = "") -> dict:
    """The whole experiment; plateau.json is rewritten after every run (a partial experiment is
    still readable) and a finished run is not repeated when the command is run again."""
    os.makedirs(out, exist_ok=True)
    with compilation_cache(os.path.join(out, "jax_cache")):
        return _run(base, out, opts, command)


def _run(base, out: str, opts: dict, command: str) -> dict:
    from brorl_jax import models
    from brorl_jax.experiments.compare_n import start_model
    path = os.path.join(out, "plateau.json")
    seeds = [int(s) for s in opts["seeds"]]
    result = json.load(open(path)) if os.path.exists(path) else {}
    old = result.get("options")
    default = {f.name: f.default for f in FLAGS}        # options added after `old` was made
    if old is not None and any(old.get(k, default[k]) != opts[k] for k in PLATEAU_KEYS):
        from brorl_jax.errors import WorkdirError
        raise WorkdirError(f"{path} holds a plateau made with other options ({old}); "
                           "give another --out or delete it.")
    if old is not None and any(old.get(k, default[k]) != opts[k] for k in ARM_KEYS):
        print(f"[plateau] options changed since {path}: the plateau is kept, every arm runs "
              "again", file=sys.stderr)
        result = {k: v for k, v in result.items() if k in ("plateau", "calls")}
    result.update({"command": command, "machine": machine(), "options": opts, "seeds": seeds})
    for a in ARMS:                        # an experiment from before an arm was added
        result.setdefault("arms", {}).setdefault(a, {})
    t_start = time.perf_counter()

    warm_cfg = base.copy_and_resolve_references()
    warm_cfg.eval.num_prompts = opts["eval_prompts"]     # the warm start's own before/after eval
    warm_cfg.eval.samples_per_prompt = 1
    warm = start_model(warm_cfg, out)
    plateau_dir = os.path.join(out, "plateau_model")
    if "plateau" not in result or not os.path.isdir(plateau_dir):
        shutil.rmtree(os.path.join(out, "plateau"), ignore_errors=True)
        records, wall, (model, params) = _train(plateau_config(base, warm, opts),
                                                os.path.join(out, "plateau"))
        models.save_pretrained(model.with_params(params), plateau_dir)
        evals = [(r.get("counters/generated_samples", 0), r["eval/pass@1"]) for r in records
                 if r.get("eval/pass@1") is not None]
        window = evals[-opts["plateau_window"]:]
        fit = slope_ci([e[0] for e in window], [e[1] for e in window], per=1e5)
        result["plateau"] = {"evals": evals, "wall_s": wall, "slope_per_100k_samples": fit,
                             "plateaued": bool(fit["ci95"][0] <= 0 <= fit["ci95"][1])}
        _write(result, out)
    result.setdefault("ablations", {})
    for a in opts["ablations"]:
        result["ablations"].setdefault(a, {})
    for section, names in (("arms", ARMS), ("ablations", opts["ablations"])):
        for seed in seeds:               # every arm of a seed before the next seed
            for arm in names:
                _arm_run(base, result, section, arm, seed, plateau_dir, opts, out)
    # every call of the command, with its wall time (a call after an interruption or a change
    # of the arms' options runs only what is missing)
    result.setdefault("calls", []).append({"command": command,
                                           "wall_s": time.perf_counter() - t_start})
    _write(result, out)
    return result


def _arm_run(base, result: dict, section: str, arm: str, seed: int, start: str, opts: dict,
             out: str) -> None:
    """One arm's run of one seed into result[section][arm], unless it is there."""
    workdir = os.path.join(out, f"{arm}_seed{seed}")
    done = result[section][arm].get(str(seed))
    if done is not None:
        if "samples_per_s_median_step" not in done:     # summed up by an older version
            from brorl_jax.workdir.logger import read_metrics
            result[section][arm][str(seed)] = summarize_run(
                read_metrics(os.path.join(workdir, "metrics.jsonl")), done["wall_s"])
        return
    cfg = arm_config(base, arm, start, opts)
    cfg.train.seed = seed
    shutil.rmtree(workdir, ignore_errors=True)     # an unfinished run starts again
    records, wall, _ = _train(cfg, workdir)
    result[section][arm][str(seed)] = summarize_run(records, wall)
    result.update(aggregate({**result["arms"], **result["ablations"]}))
    _write(result, out)


def _write(result: dict, out: str) -> None:
    with open(os.path.join(out, "plateau.json.tmp"), "w") as f:
        json.dump(result, f, indent=1)
    os.replace(os.path.join(out, "plateau.json.tmp"), os.path.join(out, "plateau.json"))
    with open(os.path.join(out, "plateau.md"), "w") as f:
        f.write(table(result) + "\n")
    plot(result, os.path.join(out, "plateau.png"))


def table(result: dict) -> str:
    """Markdown: per arm, mean +- standard error over seeds."""
    arms = {a: list(r.values()) for a, r in {**result["arms"], **result.get("ablations", {})
                                              }.items() if r}
    ks = sorted({int(k) for runs in arms.values() for r in runs for k in r["pass_at_k_end"]})
    kmax = max(ks) if ks else 1
    lines = [f"| arm | seeds | pass@1 start | pass@1 end | pass@{kmax} end | dynamic-sampling "
             "pass rate | generated samples | steps | samples/s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in arms.items():
        cells = []
        for key in ("pass1_start", "pass1_end"):
            cells.append("%.3f ± %.3f" % _mean_se(r[key] for r in runs))
        cells.append("%.3f ± %.3f" % _mean_se(r["pass_at_k_end"][str(kmax)]
                                             if str(kmax) in r["pass_at_k_end"]
                                             else r["pass_at_k_end"][kmax] for r in runs))
        cells.append("%.3f ± %.3f" % _mean_se(r["dynamic_sampling_pass_rate"] for r in runs))
        cells.append(f"{int(np.mean([r['generated_samples'] for r in runs])):,}")
        cells.append(f"{np.mean([r['steps'] for r in runs]):.0f}")
        cells.append("%.0f ± %.0f" % _mean_se(r["samples_per_s"] for r in runs))
        cells.append(f"{np.mean([r['wall_s'] for r in runs]):.0f}")
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    for a, b in DIFFS:
        if f"diff_{a}_minus_{b}" in result:
            d = result[f"diff_{a}_minus_{b}"]
            lines.append(f"\n{a} minus {b}: end pass@1 {d['mean']:+.3f}, 95% "
                         f"bootstrap interval [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
    if "plateau" in result:
        s = result["plateau"]["slope_per_100k_samples"]
        lines.append(f"\nplateau: held-out pass@1 slope over its last {s['points']} evaluations "
                     f"{s['slope']:+.3f} per 100k samples, 95% interval [{s['ci95'][0]:+.3f}, "
                     f"{s['ci95'][1]:+.3f}] ({'holds' if result['plateau']['plateaued'] else 'excludes'} 0)")
    return "\n".join(lines).replace("\n\n", "\n\n", 1)


def plot(result: dict, path: str) -> None:
    """Left: the plateau's held-out pass@1 against generated samples, then each arm's start ->
    end (mean over seeds, error bars one standard error). Right: end pass@k against k per arm."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    x0 = 0
    if "plateau" in result:
        xs, ys = zip(*result["plateau"]["evals"])
        ax1.plot(xs, ys, marker="o", color="k", label="plateau (ProRL recipe)")
        x0 = xs[-1]
    # arms that coincide (adaptive N when no prompt recurs is brorl) stay visible: each arm its
    # own marker and line style, hollow markers after the first two, a small sideways shift
    styles = [("s", "-"), ("o", "--"), ("^", ":"), ("D", "-.")]
    for i, (arm, runs) in enumerate({**result["arms"], **result.get("ablations", {})}.items()):
        rs = list(runs.values())
        if not rs:
            continue
        marker, line = styles[i % len(styles)]
        style = dict(color=f"C{i}", marker=marker, linestyle=line, capsize=3,
                     mfc="none" if i >= 2 else None)
        m0, s0 = _mean_se(r["pass1_start"] for r in rs)
        m1, s1 = _mean_se(r["pass1_end"] for r in rs)
        x1 = x0 + np.mean([r["generated_samples"] for r in rs]) * (1 + 0.02 * i)
        ax1.errorbar([x0, x1], [m0, m1], yerr=[s0, s1], label=f"{arm} ({len(rs)} seeds)",
                     **style)
        ks = sorted(int(k) for k in rs[0]["pass_at_k_end"])
        means = [_mean_se(r["pass_at_k_end"][str(k)] if str(k) in r["pass_at_k_end"]
                          else r["pass_at_k_end"][k] for r in rs) for k in ks]
        ax2.errorbar([k * (1 + 0.03 * i) for k in ks], [m for m, _ in means],
                     yerr=[s for _, s in means], label=arm, **style)
    ax1.set_xlabel("generated samples")
    ax1.set_title("held-out pass@1")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("k")
    ax2.set_title("held-out pass@k at the end")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def options(values: dict) -> dict:
    """The experiment's options from the flags, --quick's sizes over the defaults it replaces."""
    from brorl_jax.errors import ConfigError
    opts = {f.name: values[f.name] for f in FLAGS if f.name not in ("out", "quick")}
    if values["quick"]:
        defaults = {f.name: f.default for f in FLAGS}
        opts.update({k: v for k, v in QUICK.items() if values[k] == defaults[k]})
    try:
        opts["seeds"] = [str(int(s)) for s in opts["seeds"]]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got "
                          f"{','.join(opts['seeds'])!r}.") from None
    if not opts["seeds"]:
        raise ConfigError("--seeds is empty; give at least one, e.g. --seeds=0,1,2,3,4.")
    for name in ("n_prorl", "n_brorl"):
        if opts[name] < 2:
            raise ConfigError(f"--{name} must be >= 2 (group baselines), got {opts[name]}.")
    for name in ("prompts", "batch_ratio", "plateau_steps", "plateau_eval_every", "budget",
                 "eval_prompts", "eval_k"):
        if opts[name] < 1:
            raise ConfigError(f"--{name} must be >= 1, got {opts[name]}.")
    if opts["plateau_window"] < 3:
        raise ConfigError(f"--plateau_window must be >= 3 (a slope with an interval), got "
                          f"{opts['plateau_window']}.")
    unknown = [a for a in opts["ablations"] if a not in ABLATIONS]
    if unknown:
        raise ConfigError(f"--ablations: unknown {', '.join(unknown)}; choose from "
                          f"{', '.join(ABLATIONS)} (or give none).")
    brorl_prompts(opts)
    return opts


def main(values: dict) -> int:
    from brorl_jax.config import validate
    opts = options(values)
    base_values = values["config"]
    if values["quick"]:
        for key, value in QUICK_CONFIG.items():
            section, name = key.split(".")
            base_values[section][name] = min(base_values[section][name], value)
    base = validate(base_values)
    for arm in ARMS + tuple(opts["ablations"]):
        validate(arm_config(base, arm, "", opts))
    validate(plateau_config(base, "", opts))
    from brorl_jax.workdir.layout import check_writable, prepare
    prepare(values["out"])
    check_writable(values["out"])
    result = run(base, values["out"], opts, command=" ".join(["python -m", __spec__.name]
                                                              + sys.argv[1:]))
    print(table(result))
    return 0


if __name__ == "__main__":
    cli.run(main, FLAGS, log_dirs=("out",))
