"""The §4.1 / Fig. 3 simulation (arXiv 2510.01180): sampler, update, CLI, qualitative findings."""

import csv
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from brorl_jax.theory import simulate as sim


def test_sampler_matches_probabilities_on_a_small_vocabulary():
    v = 1000
    rng = np.random.default_rng(0)
    p = rng.random(v) ** 4
    p[rng.random(v) < 0.1] = 0.0                           # some impossible tokens
    p /= p.sum()
    n = 400_000
    # block 64 does not divide V = 1000: the padded tail must never be drawn.
    sample = jax.jit(sim.sample_tokens, static_argnums=(2, 3))
    tokens = np.asarray(sample(jax.random.PRNGKey(0), jnp.asarray(p, jnp.float32), n, 64))
    assert tokens.min() >= 0 and tokens.max() < v
    counts = np.bincount(tokens, minlength=v)
    assert counts[p == 0].sum() == 0
    expected = n * p
    pos = expected > 0
    chi2 = np.sum((counts[pos] - expected[pos]) ** 2 / expected[pos])
    df = pos.sum() - 1
    assert chi2 < df + 5 * np.sqrt(2 * df), (chi2, df)


def test_sampler_is_accurate_for_the_full_seeded_vocabulary():
    """At V = 128,000 in float32 the draws still hit P, the anchor and the tail correctly."""
    cfg = sim.SimulationConfig()
    p = jax.nn.softmax(sim.initial_logits(cfg))
    n = 200_000
    sample = jax.jit(sim.sample_counts, static_argnums=2)
    counts = np.asarray(sample(jax.random.PRNGKey(1), p, n))
    assert counts.sum() == n
    p = np.asarray(p, np.float64)
    for name, sel in (("correct", slice(1, cfg.correct + 1)), ("anchor", slice(0, 1)),
                      ("tail", slice(cfg.correct + 1, cfg.vocab))):
        mass = p[sel].sum()
        se = np.sqrt(mass * (1 - mass) / n)
        assert abs(counts[sel].sum() / n - mass) < 5 * se, (name, counts[sel].sum() / n, mass)


def _numpy_reference_step(z, m, v, t, counts, rewards, n, lr, wd):
    """One step of an independent numpy re-implementation of the Fig. 3 simulation (torch-style
    AdamW), given the draws."""
    x = np.repeat(np.arange(z.size), counts)
    e = np.exp(z - z.max())
    p = e / e.sum()
    rt = rewards[x] - rewards[x].mean()
    w = rt * p[x]
    g = np.zeros_like(z)
    np.add.at(g, x, w)
    g = -(g - w.sum() * p) / n
    z = z - lr * wd * z
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    z = z - lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    return z, m, v


def test_update_step_matches_the_numpy_reference_script():
    cfg = sim.SimulationConfig(n=6, vocab=50, correct=12, dtype="float64")
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        z = sim.initial_logits(cfg)
        rewards = sim.token_rewards(cfg)
        opt = sim.optimizer(cfg)
        state = opt.init(z)
        z_ref, m, v = np.asarray(z), np.zeros(cfg.vocab), np.zeros(cfg.vocab)
        step = jax.jit(sim.update_step, static_argnums=(0, 1))
        for t in range(1, 6):
            counts = rng.multinomial(cfg.n, np.asarray(jax.nn.softmax(z)))
            z, state = step(cfg, opt, z, state, jnp.asarray(counts), rewards)
            z_ref, m, v = _numpy_reference_step(z_ref, m, v, t, counts, np.asarray(rewards),
                                                cfg.n, cfg.lr, cfg.weight_decay)
            np.testing.assert_allclose(np.asarray(z), z_ref, rtol=1e-9, atol=1e-12)


def test_optax_adamw_matches_torch_adamw():
    """The docstring's claim: optax.adamw with these flags is torch.optim.AdamW."""
    cfg = sim.SimulationConfig(lr=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
    rng = np.random.default_rng(3)
    z0 = rng.normal(size=16)
    grads = rng.normal(size=(4, 16))
    with jax.enable_x64(True):
        opt = sim.optimizer(cfg)
        z, state = jnp.asarray(z0), opt.init(jnp.asarray(z0))
        for g in grads:
            updates, state = opt.update(jnp.asarray(g), state, z)
            z = z + updates
    zt = torch.tensor(z0, dtype=torch.float64, requires_grad=True)
    topt = torch.optim.AdamW([zt], lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)
    for g in grads:
        zt.grad = torch.tensor(g, dtype=torch.float64)
        topt.step()
    np.testing.assert_allclose(np.asarray(z), zt.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_reduced_simulation_reproduces_the_papers_qualitative_findings():
    """Large N: correct mass rises, (nearly) every correct token gains; small N: clearly worse."""
    common = dict(vocab=12_800, correct=1_000, steps=200, log_every=50)
    small = sim.simulate(sim.SimulationConfig(n=4, **common), seed=0)
    large = sim.simulate(sim.SimulationConfig(n=5_120, **common), seed=0)
    np.testing.assert_array_equal(large["step"], [0, 50, 100, 150, 200])
    q0 = large["q_pos"][0]
    assert small["q_pos"][0] == q0
    gain_large = large["q_pos"][-1] - q0
    gain_small = small["q_pos"][-1] - q0
    assert gain_large > 0.02, large["q_pos"]
    assert np.all(np.diff(large["q_pos"]) > 0), large["q_pos"]
    assert large["frac_improved"][-1] >= 0.99, large["frac_improved"]
    assert large["worst_drop"][-1] > 0, large["worst_drop"]          # no correct token lost mass
    assert gain_small < gain_large - 0.02, (gain_small, gain_large)
    assert small["frac_improved"][-1] < 0.5, small["frac_improved"]
    assert small["worst_drop"][-1] < 0, small["worst_drop"]


def test_cli_writes_csv_and_png(tmp_path):
    out = str(tmp_path / "run")
    results = sim.main(["--n=3,40", "--steps=7", "--log_every=3", "--vocab=300", "--correct=20",
                        "--seed=5", f"--out={out}"])
    with open(os.path.join(out, "simulation.csv"), newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == sim.CSV_COLUMNS == ("n", "step", "q_pos", "frac_improved",
                                                  "worst_drop")
    body = rows[1:]
    assert [(int(r[0]), int(r[1])) for r in body] == [(n, s) for n in (3, 40)
                                                      for s in (0, 3, 6, 7)]
    # Seeded start: Q_pos = |P| e^3 / (|P| e^3 + (V - |P| - 1) + e^5).
    q0 = 20 * np.exp(3) / (20 * np.exp(3) + 279 + np.exp(5))
    assert float(body[0][2]) == pytest.approx(q0, rel=1e-6)
    assert float(body[0][3]) == 0.0 and float(body[0][4]) == 0.0
    back = sim.read_csv(os.path.join(out, "simulation.csv"))
    np.testing.assert_allclose(back[40]["q_pos"], results[40]["q_pos"], rtol=1e-7)
    with open(os.path.join(out, "simulation.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # One N alone reproduces that N inside a list (per-N PRNG stream).
    alone = sim.simulate(sim.SimulationConfig(n=40, steps=7, log_every=3, vocab=300, correct=20),
                         seed=5)
    np.testing.assert_array_equal(alone["q_pos"], results[40]["q_pos"])


def test_initial_logits_seeded_and_unseeded():
    seeded = np.asarray(sim.initial_logits(sim.SimulationConfig(vocab=10, correct=3)))
    np.testing.assert_array_equal(seeded, [5, 3, 3, 3, 0, 0, 0, 0, 0, 0])
    unseeded = sim.initial_logits(sim.SimulationConfig(vocab=10, correct=3, seeded=False))
    np.testing.assert_array_equal(unseeded, np.zeros(10))
    np.testing.assert_array_equal(sim.token_rewards(sim.SimulationConfig(vocab=5, correct=2)),
                                  [-1, 1, 1, -1, -1])
    assert sim.parse_args(["--noseeded", "--out=x"]).seeded is False
    assert sim.parse_args(["--out=x"]).seeded is True
    assert sim.parse_args(["--out=x"]).n == [4, 8, 16, 512, 51200]


def test_cli_rejects_bad_flags(tmp_path):
    with pytest.raises(SystemExit):
        sim.main(["--n=4,x", f"--out={tmp_path}"])
    with pytest.raises(SystemExit, match="correct"):
        sim.main(["--vocab=100", "--correct=100", f"--out={tmp_path}"])
    with pytest.raises(ValueError, match="n "):
        sim.SimulationConfig(n=0)
