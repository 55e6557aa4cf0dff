"""The token-level validation simulation of BroRL §4.1 / Fig. 3 (arXiv 2510.01180).

A categorical "policy" over a vocabulary of V tokens (logits z, p = softmax(z)); a fixed correct
set P (reward R_c = +1, all other tokens R_w = -1). Each step draws N i.i.d. tokens x_1..x_N from p,
centres the rewards with the batch-mean baseline b = (1/N) Σ_j R_{x_j}, and takes one AdamW step on
the linear (TRPO-style) surrogate

    L_sur(z) = -(1/N) Σ_{j=1}^N (R_{x_j} - b) p_{x_j}(z).

Unlike Theorem 1 (which is set based), the surrogate runs over the N *draws*, so a token drawn c
times counts c times. After every ``log_every`` steps it records the three curves of Fig. 3:
the correct mass Q_pos = Σ_{i∈P} p_i, the fraction of correct tokens whose probability is higher
than at step 0, and the worst probability change min_{i∈P} (p_i - p_i^0) (negative = a drop).

Setup choices (BroRL §4.1 and Fig. 3 describe the setup; where they are silent, ours):
P = token ids 1..|P|; "seeded" init (default, as Fig. 3's 0.60-0.64 mass axis implies) sets
z_i = 3 on P and an anchor token z_0 = 5 (token 0, incorrect);
``--noseeded`` starts from z = 0. The optimizer is ``optax.adamw`` with torch's AdamW defaults
(b1 = 0.9, b2 = 0.999, eps = 1e-8, weight decay 0.01); the paper does not state them.

The whole step loop is one jitted ``lax.scan`` per N. Sampling is an exact two-level inverse-CDF
draw (O(V + N log V) per step); ``jax.random.categorical`` with Gumbel noise would cost O(N V)
per step, i.e. 6.5e9 random numbers per step at N = 51,200.

Command line (writes DIR/simulation.csv with columns n, step, q_pos, frac_improved, worst_drop,
one row per logged step and N, step 0 included, and DIR/simulation.png)::

    python -m brorl_jax.theory.simulate --n=4,16,512 --steps=1000 --vocab=128000 \
        --correct=10000 --seed=0 --out=DIR
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array

DEFAULT_N = (4, 8, 16, 512, 51_200)
CSV_COLUMNS = ("n", "step", "q_pos", "frac_improved", "worst_drop")


@dataclasses.dataclass(frozen=True)
class SimulationConfig:
    """Static settings of one simulation run (hashable: used as a static jit argument)."""

    n: int = 4                      # i.i.d. draws per step (the paper's N)
    vocab: int = 128_000            # V
    correct: int = 10_000           # |P|; the correct tokens are ids 1..correct
    steps: int = 1000
    log_every: int = 10
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01      # torch.optim.AdamW default; the paper does not state it
    seeded: bool = True             # z = 3 on P, anchor z_0 = 5 (paper §4.1 "optional seeding")
    seed_logit: float = 3.0
    anchor_logit: float = 5.0
    reward_correct: float = 1.0
    reward_wrong: float = -1.0
    dtype: str = "float32"          # "float64" runs the same program under jax.enable_x64

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n (draws per step) must be >= 1, got {self.n}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        if not 1 <= self.correct <= self.vocab - 1:
            raise ValueError(
                f"correct must be in [1, vocab - 1] (token 0 is the incorrect anchor), "
                f"got correct={self.correct}, vocab={self.vocab}")
        if self.steps < 1 or self.log_every < 1:
            raise ValueError(f"steps and log_every must be >= 1, got {self.steps}, "
                             f"{self.log_every}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")

    def logged_steps(self) -> list[int]:
        """Step 0, every multiple of ``log_every``, and the last step."""
        steps = list(range(0, self.steps + 1, self.log_every))
        if steps[-1] != self.steps:
            steps.append(self.steps)
        return steps


def initial_logits(cfg: SimulationConfig) -> Array:
    """z^0 [V]: zeros, or with seeding z_i = seed_logit on P = {1..|P|} and z_0 = anchor_logit."""
    z = jnp.zeros((cfg.vocab,), cfg.dtype)
    if cfg.seeded:
        z = z.at[1:cfg.correct + 1].set(cfg.seed_logit).at[0].set(cfg.anchor_logit)
    return z


def token_rewards(cfg: SimulationConfig) -> Array:
    """R [V]: reward_correct on P = {1..|P|}, reward_wrong elsewhere."""
    ids = jnp.arange(cfg.vocab)
    is_correct = (ids >= 1) & (ids <= cfg.correct)
    return jnp.where(is_correct, cfg.reward_correct, cfg.reward_wrong).astype(cfg.dtype)


def sample_tokens(key: Array, probs: Array, n: int, block: int = 512) -> Array:
    """N i.i.d. draws ``int32[N]`` from the categorical ``probs[V]`` (exact inverse CDF).

    Two levels keep float32 accurate over a 128k vocabulary: first a block of ``block`` tokens
    is drawn from the block masses, then a token inside it from the block's own CDF. A single
    flat float32 CDF would have absolute rounding ~1e-7 near 1, comparable to the smallest
    probabilities here (~3e-6), which would bias the draws.
    """
    v = probs.shape[0]
    num_blocks = -(-v // block)
    padded = jnp.pad(probs, (0, num_blocks * block - v)).reshape(num_blocks, block)
    within_cdf = jnp.cumsum(padded, axis=1)                  # [num_blocks, block]
    block_mass = within_cdf[:, -1]                           # same rounding as the row CDF
    block_cdf = jnp.cumsum(block_mass)
    k_block, k_within = jax.random.split(key)
    u_block = jax.random.uniform(k_block, (n,), probs.dtype) * block_cdf[-1]
    # First block whose CDF exceeds u: a block of zero mass is never chosen.
    b = jnp.minimum(jnp.searchsorted(block_cdf, u_block, side="right"), num_blocks - 1)
    u_within = jax.random.uniform(k_within, (n,), probs.dtype) * block_mass[b]
    flat_cdf = within_cdf.reshape(-1)
    # Binary search per draw for the first column with within_cdf[b, col] > u (vectorized over N;
    # a row gather per draw would move N * block floats per step).
    lo = jnp.zeros((n,), jnp.int32)
    hi = jnp.full((n,), block - 1, jnp.int32)
    for _ in range(max(1, math.ceil(math.log2(block)))):
        mid = (lo + hi) // 2
        go_right = flat_cdf[b * block + mid] <= u_within
        lo = jnp.where(go_right, mid + 1, lo)
        hi = jnp.where(go_right, hi, mid)
    return jnp.minimum(b * block + lo, v - 1).astype(jnp.int32)


def sample_counts(key: Array, probs: Array, n: int) -> Array:
    """How often each token was drawn in N i.i.d. draws: ``int32[V]`` summing to N."""
    tokens = sample_tokens(key, probs, n)
    return jnp.zeros(probs.shape, jnp.int32).at[tokens].add(1)


def surrogate_loss(logits: Array, counts: Array, rewards: Array, n: int) -> Array:
    """L_sur(z) = -(1/N) Σ_j (R_{x_j} - b) p_{x_j}, b = (1/N) Σ_j R_{x_j}, written with counts.

    ``counts[V]`` holds how often each token was drawn (so Σ_j f(x_j) = Σ_v counts_v f(v)).
    """
    counts = counts.astype(logits.dtype)
    baseline = jnp.sum(counts * rewards) / n
    return -jnp.sum(counts * (rewards - baseline) * jax.nn.softmax(logits)) / n


def _correct_metrics(cfg: SimulationConfig, logits: Array, p0_correct: Array) -> dict:
    p_correct = jax.nn.softmax(logits)[1:cfg.correct + 1]
    delta = p_correct - p0_correct
    return {
        "q_pos": jnp.sum(p_correct),
        "frac_improved": jnp.mean((delta > 0).astype(logits.dtype)),
        "worst_drop": jnp.min(delta),
    }


def optimizer(cfg: SimulationConfig) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, same update as torch.optim.AdamW)."""
    return optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


def update_step(
    cfg: SimulationConfig,
    opt: optax.GradientTransformation,
    logits: Array,
    opt_state: optax.OptState,
    counts: Array,
    rewards: Array,
) -> tuple[Array, optax.OptState]:
    """One AdamW step on the surrogate given this step's draw ``counts[V]``; returns new state."""
    grad = jax.grad(surrogate_loss)(logits, counts, rewards, cfg.n)
    updates, opt_state = opt.update(grad, opt_state, logits)
    return optax.apply_updates(logits, updates), opt_state


def _simulate(cfg: SimulationConfig, key: Array) -> dict:
    z0 = initial_logits(cfg)
    rewards = token_rewards(cfg)
    p0_correct = jax.nn.softmax(z0)[1:cfg.correct + 1]
    opt = optimizer(cfg)

    def train_step(carry, _):
        z, opt_state, key = carry
        key, sub = jax.random.split(key)
        counts = sample_counts(sub, jax.nn.softmax(z), cfg.n)
        z, opt_state = update_step(cfg, opt, z, opt_state, counts, rewards)
        return (z, opt_state, key), None

    def logged_chunk(length):
        def chunk(carry, _):
            carry, _ = jax.lax.scan(train_step, carry, None, length=length)
            return carry, _correct_metrics(cfg, carry[0], p0_correct)
        return chunk

    carry = (z0, opt.init(z0), key)
    parts = [jax.tree.map(lambda x: x[None], _correct_metrics(cfg, z0, p0_correct))]
    num_full, rest = divmod(cfg.steps, cfg.log_every)
    if num_full:
        carry, metrics = jax.lax.scan(logged_chunk(cfg.log_every), carry, None, length=num_full)
        parts.append(metrics)
    if rest:
        carry, metrics = jax.lax.scan(logged_chunk(rest), carry, None, length=1)
        parts.append(metrics)
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


_simulate_jit = jax.jit(_simulate, static_argnums=0)


def simulate(cfg: SimulationConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Runs one N; returns numpy arrays over the logged steps (``cfg.logged_steps()``).

    Keys: step, q_pos, frac_improved (fraction in [0, 1]), worst_drop. The PRNG stream is
    ``fold_in(PRNGKey(seed), n)``, so a run of one N reproduces that N inside a longer list.
    """
    key = jax.random.fold_in(jax.random.PRNGKey(seed), cfg.n)
    with jax.enable_x64(cfg.dtype == "float64"):
        out = jax.device_get(_simulate_jit(cfg, key))
    out = {k: np.asarray(v, np.float64) for k, v in out.items()}
    out["step"] = np.asarray(cfg.logged_steps(), np.int64)
    return out


def write_csv(path: str, results: dict[int, dict[str, np.ndarray]]) -> None:
    """One row per (N, logged step) with columns ``CSV_COLUMNS``."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for n, r in results.items():
            for i, step in enumerate(r["step"]):
                w.writerow([n, int(step), f"{r['q_pos'][i]:.9g}",
                            f"{r['frac_improved'][i]:.9g}", f"{r['worst_drop'][i]:.9g}"])


def read_csv(path: str) -> dict[int, dict[str, np.ndarray]]:
    """Inverse of :func:`write_csv`."""
    rows: dict[int, dict[str, list]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            r = rows.setdefault(int(row["n"]), {c: [] for c in CSV_COLUMNS[1:]})
            for c in CSV_COLUMNS[1:]:
                r[c].append(float(row[c]))
    return {n: {c: np.asarray(v) for c, v in r.items()} for n, r in rows.items()}


def plot_figure(results: dict[int, dict[str, np.ndarray]], title: str = ""):
    """The three panels of Fig. 3 (correct mass, % correct tokens improved, worst drop) as a
    matplotlib Figure that is not attached to pyplot (so no backend is switched: notebooks can
    display it, scripts can save it)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.5))
    axes = fig.subplots(1, 3)
    panels = (("q_pos", 1.0, "correct mass $Q_{pos}$"),
              ("frac_improved", 100.0, "% correct tokens with $p_i > p_i^0$"),
              ("worst_drop", 1.0, r"worst $\Delta p$ among correct tokens"))
    for ax, (key, scale, label) in zip(axes, panels):
        for n, r in results.items():
            ax.plot(r["step"], scale * np.asarray(r[key]), label=f"N={n}", lw=1.3)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[2].axhline(0.0, color="k", lw=0.6)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(path: str, results: dict[int, dict[str, np.ndarray]], title: str = "") -> None:
    """Writes plot_figure(...) to a PNG."""
    plot_figure(results, title).savefig(path, dpi=120)


def summary_table(results: dict[int, dict[str, np.ndarray]], at_steps: Sequence[int]) -> str:
    """Markdown table: Q_pos / % improved / worst drop at ``at_steps`` (those that were logged)."""
    lines = ["| N | " + " | ".join(f"step {s}" for s in at_steps) + " |",
             "|---|" + "---|" * len(at_steps)]
    for n, r in results.items():
        cells = []
        for s in at_steps:
            hit = np.nonzero(r["step"] == s)[0]
            if hit.size == 0:
                cells.append("n/a")
                continue
            i = hit[0]
            cells.append(f"{r['q_pos'][i]:.4f} / {100 * r['frac_improved'][i]:.1f}% / "
                         f"{r['worst_drop'][i]:+.1e}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--n must be comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("--n must list at least one N")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = SimulationConfig()
    ap = argparse.ArgumentParser(
        prog="python -m brorl_jax.theory.simulate",
        description="BroRL §4.1 token-level simulation (Fig. 3).")
    ap.add_argument("--n", type=_int_list, default=list(DEFAULT_N),
                    help="comma-separated draws per step N (default 4,8,16,512,51200)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--correct", type=int, default=d.correct)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--b1", type=float, default=d.b1)
    ap.add_argument("--b2", type=float, default=d.b2)
    ap.add_argument("--eps", type=float, default=d.eps)
    ap.add_argument("--weight_decay", type=float, default=d.weight_decay,
                    help="AdamW decoupled weight decay (default 0.01 = torch AdamW default)")
    ap.add_argument("--seeded", dest="seeded", action="store_true", default=d.seeded,
                    help="seeded init: z=3 on correct tokens, anchor z_0=5 (default)")
    ap.add_argument("--noseeded", dest="seeded", action="store_false",
                    help="start from z = 0")
    ap.add_argument("--seed_logit", type=float, default=d.seed_logit)
    ap.add_argument("--anchor_logit", type=float, default=d.anchor_logit)
    ap.add_argument("--log_every", type=int, default=d.log_every)
    ap.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype)
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    return ap.parse_args(argv)


class UsageExit(SystemExit):
    """Exit code 2 with a one-line message already printed to stderr; the same convention as
    the other commands (brorl_jax/cli.py), kept local: theory/ depends on nothing else."""

    def __init__(self, message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, np.ndarray]]:
    args = parse_args(argv)          # argparse: usage + "error: ..." and exit code 2
    try:
        configs = [SimulationConfig(
            n=n, vocab=args.vocab, correct=args.correct, steps=args.steps,
            log_every=args.log_every, lr=args.lr, b1=args.b1, b2=args.b2, eps=args.eps,
            weight_decay=args.weight_decay, seeded=args.seeded, seed_logit=args.seed_logit,
            anchor_logit=args.anchor_logit, dtype=args.dtype) for n in args.n]
    except ValueError as e:
        raise UsageExit(str(e)) from None
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageExit(f"--out {args.out!r} is a file; give a directory.")
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".write_test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UsageExit(f"--out {args.out!r} is not writable: {e.strerror}.") from None
    results = {}
    t_all = time.perf_counter()
    for cfg in configs:
        t0 = time.perf_counter()
        results[cfg.n] = simulate(cfg, seed=args.seed)
        r = results[cfg.n]
        print(f"N={cfg.n}: {time.perf_counter() - t0:.1f}s  q_pos {r['q_pos'][0]:.4f} -> "
              f"{r['q_pos'][-1]:.4f}, improved {100 * r['frac_improved'][-1]:.1f}%, "
              f"worst drop {r['worst_drop'][-1]:+.2e}", flush=True)
    write_csv(os.path.join(args.out, "simulation.csv"), results)
    c = configs[0]
    plot(os.path.join(args.out, "simulation.png"), results,
         title=(f"V={c.vocab}, |P|={c.correct}, {'seeded' if c.seeded else 'unseeded'}, "
                f"AdamW lr={c.lr} wd={c.weight_decay}, seed={args.seed}"))
    at = sorted({max(1, args.steps // 5), max(1, args.steps // 2), args.steps})
    print(summary_table(results, at))
    print(f"total {time.perf_counter() - t_all:.1f}s; wrote {args.out}/simulation.csv, "
          f"{args.out}/simulation.png", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
