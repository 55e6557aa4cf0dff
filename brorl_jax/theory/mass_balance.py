"""Mass-balance quantities of BroRL's one-step analysis (arXiv 2510.01180, §2 and App. C).

Setting (paper §2.1): a vocabulary of V "tokens" (in the LLM reading a token stands for a whole
response), probabilities ``p = softmax(z)``, a correct set P and its complement (the incorrect
set). N draws are taken; the sampled *set* (distinct tokens, multiplicities ignored, as in the
paper) splits into A = sampled ∩ P and B = sampled ∩ incorrect, the rest is the unsampled set U.
Sampled correct tokens get reward R_c >= 0, sampled incorrect ones R_w <= 0, unsampled ones 0.

Everything here is a pure ``jnp`` function of arrays (jittable, vmappable, dtype-generic: under
``jax.enable_x64(True)`` it computes in float64). Shapes: ``probs``, ``correct_mask`` and
``sampled_mask`` are ``[V]``; every returned quantity is a scalar.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class MassBalance(NamedTuple):
    """The partial masses of paper §2.1 (all scalars).

    p_pos:   P_pos  = Σ_{i∈A} p_i            (sampled correct mass)
    p_neg:   P_neg  = Σ_{i∈B} p_i            (sampled incorrect mass)
    q_pos:   Q_pos  = Σ_{i∈P} p_i            (total correct mass; pass@k = 1 - (1 - Q_pos)^k)
    q_neg:   Q_neg  = 1 - Q_pos
    a_2:     A_2    = Σ_{i∈A} p_i^2
    b_2:     B_2    = Σ_{i∈B} p_i^2
    u_pos_2: U_pos,2 = Σ_{i∈U∩P} p_i^2       (unsampled correct second moment)
    u_neg_2: U_neg,2 = Σ_{i∈U∩N} p_i^2       (unsampled incorrect second moment)
    s_r:     S_R    = R_c P_pos + R_w P_neg  ("batch mood", S_R ∈ [R_w, R_c])
    """

    p_pos: Array
    p_neg: Array
    q_pos: Array
    q_neg: Array
    a_2: Array
    b_2: Array
    u_pos_2: Array
    u_neg_2: Array
    s_r: Array


class DeltaQPos(NamedTuple):
    """The three terms of Theorem 1, each already multiplied by the prefactor η/N.

    sampled_correct:    (η/N) (R_c - S_R) Q_neg A_2                    (>= 0)
    sampled_incorrect:  (η/N) (S_R - R_w) Q_pos B_2                    (>= 0)
    unsampled_coupling: (η/N) S_R (Q_pos U_neg,2 - Q_neg U_pos,2)      (either sign)
    total:              their sum = first-order ΔQ_pos
    """

    sampled_correct: Array
    sampled_incorrect: Array
    unsampled_coupling: Array
    total: Array


def _check_rewards(reward_correct: float, reward_wrong: float) -> None:
    # Only checkable when the rewards are Python numbers; traced values pass through.
    if isinstance(reward_correct, (int, float)) and reward_correct < 0:
        raise ValueError(f"reward_correct must be >= 0 (paper: R_c >= 0), got {reward_correct}")
    if isinstance(reward_wrong, (int, float)) and reward_wrong > 0:
        raise ValueError(f"reward_wrong must be <= 0 (paper: R_w <= 0), got {reward_wrong}")


def _check_shapes(probs: Array, correct_mask: Array, sampled_mask: Array) -> None:
    if probs.ndim != 1:
        raise ValueError(f"probs must be a vector [V], got shape {probs.shape}")
    for name, m in (("correct_mask", correct_mask), ("sampled_mask", sampled_mask)):
        if m.shape != probs.shape:
            raise ValueError(f"{name} must have the shape of probs {probs.shape}, got {m.shape}")


def sampled_set_mask(samples: Array, vocab_size: int) -> Array:
    """Boolean mask [V] of the sampled *set* A ∪ B from N draws ``samples[N]`` (int token ids).

    Duplicated draws mark their token once: the theory is set based (paper App. C.1).
    """
    samples = jnp.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(f"samples must be a vector [N] of token ids, got shape {samples.shape}")
    return jnp.zeros((vocab_size,), bool).at[samples].set(True)


def partial_masses(
    probs: Array,
    correct_mask: Array,
    sampled_mask: Array,
    *,
    reward_correct: float | Array = 1.0,
    reward_wrong: float | Array = -1.0,
) -> MassBalance:
    """All partial masses of paper §2.1 from ``probs[V]``, ``correct_mask[V]``, ``sampled_mask[V]``.

    ``sampled_mask`` is the sampled *set* (see :func:`sampled_set_mask`).
    """
    probs = jnp.asarray(probs)
    correct_mask = jnp.asarray(correct_mask, bool)
    sampled_mask = jnp.asarray(sampled_mask, bool)
    _check_shapes(probs, correct_mask, sampled_mask)
    _check_rewards(reward_correct, reward_wrong)
    zero = jnp.zeros((), probs.dtype)
    in_a = correct_mask & sampled_mask
    in_b = ~correct_mask & sampled_mask
    in_u_pos = correct_mask & ~sampled_mask
    in_u_neg = ~correct_mask & ~sampled_mask
    p2 = probs * probs
    p_pos = jnp.sum(jnp.where(in_a, probs, zero))
    p_neg = jnp.sum(jnp.where(in_b, probs, zero))
    q_pos = jnp.sum(jnp.where(correct_mask, probs, zero))
    # Q_neg summed directly (not 1 - Q_pos) so that unnormalized inputs stay self-consistent.
    q_neg = jnp.sum(jnp.where(correct_mask, zero, probs))
    return MassBalance(
        p_pos=p_pos,
        p_neg=p_neg,
        q_pos=q_pos,
        q_neg=q_neg,
        a_2=jnp.sum(jnp.where(in_a, p2, zero)),
        b_2=jnp.sum(jnp.where(in_b, p2, zero)),
        u_pos_2=jnp.sum(jnp.where(in_u_pos, p2, zero)),
        u_neg_2=jnp.sum(jnp.where(in_u_neg, p2, zero)),
        s_r=reward_correct * p_pos + reward_wrong * p_neg,
    )


def delta_q_pos(
    mb: MassBalance,
    *,
    lr: float | Array,
    n: int | Array,
    reward_correct: float | Array = 1.0,
    reward_wrong: float | Array = -1.0,
) -> DeltaQPos:
    """Theorem 1: first-order change of the correct mass after one plain gradient step.

    ΔQ_pos = (η/N) [ (R_c - S_R) Q_neg A_2 + (S_R - R_w) Q_pos B_2
                     + S_R (Q_pos U_neg,2 - Q_neg U_pos,2) ]

    ``lr`` is η, ``n`` the number of draws N (the 1/N of the surrogate, not the set size).
    """
    _check_rewards(reward_correct, reward_wrong)
    scale = lr / n
    t1 = scale * (reward_correct - mb.s_r) * mb.q_neg * mb.a_2
    t2 = scale * (mb.s_r - reward_wrong) * mb.q_pos * mb.b_2
    t3 = scale * mb.s_r * (mb.q_pos * mb.u_neg_2 - mb.q_neg * mb.u_pos_2)
    return DeltaQPos(sampled_correct=t1, sampled_incorrect=t2, unsampled_coupling=t3,
                     total=t1 + t2 + t3)


def token_rewards(
    correct_mask: Array,
    sampled_mask: Array,
    *,
    reward_correct: float | Array = 1.0,
    reward_wrong: float | Array = -1.0,
) -> Array:
    """R_i [V] of paper §2.1: R_c on A, R_w on B, 0 on the unsampled set U."""
    correct_mask = jnp.asarray(correct_mask, bool)
    sampled_mask = jnp.asarray(sampled_mask, bool)
    r = jnp.where(correct_mask, reward_correct, reward_wrong)
    return jnp.where(sampled_mask, r, jnp.zeros_like(r))


def linear_surrogate_loss(
    logits: Array,
    correct_mask: Array,
    sampled_mask: Array,
    *,
    n: int | Array,
    reward_correct: float | Array = 1.0,
    reward_wrong: float | Array = -1.0,
) -> Array:
    """TRPO-style linear surrogate of App. C.1: L(z) = -(1/N) Σ_{i∈A∪B∪U} R_i softmax(z)_i.

    ``logits`` is z [V]; the sum runs over distinct tokens (unsampled ones have R_i = 0).
    """
    r = token_rewards(correct_mask, sampled_mask, reward_correct=reward_correct,
                      reward_wrong=reward_wrong).astype(logits.dtype)
    return -jnp.sum(r * jax.nn.softmax(logits)) / n


def logit_step(
    probs: Array,
    correct_mask: Array,
    sampled_mask: Array,
    *,
    lr: float | Array,
    n: int | Array,
    reward_correct: float | Array = 1.0,
    reward_wrong: float | Array = -1.0,
) -> Array:
    """Δz [V] of one plain gradient step on the linear surrogate: Δz_j = (η/N) p_j (R_j - S_R).

    Equals ``-lr * grad(linear_surrogate_loss)`` (App. C.1); unsampled tokens move by
    -(η/N) S_R p_j.
    """
    mb = partial_masses(probs, correct_mask, sampled_mask, reward_correct=reward_correct,
                      reward_wrong=reward_wrong)
    r = token_rewards(correct_mask, sampled_mask, reward_correct=reward_correct,
                      reward_wrong=reward_wrong).astype(probs.dtype)
    return (lr / n) * probs * (r - mb.s_r)


def lemma2_expected_unsampled(
    probs: Array, n: int | Array, where: Array | None = None, axis: int = -1
) -> Array:
    """Lemma 2 / Corollary 3: E[Σ_{i unsampled} p_i^2] = Σ_i p_i^2 (1 - p_i)^N.

    Each token is left out of N i.i.d. draws with probability (1 - p_i)^N, so its expected
    contribution to the unsampled second moment U_2 is p_i^2 (1 - p_i)^N. With ``where`` (a mask
    broadcastable to ``probs``, e.g. the correct mask) the sum runs over that subset only, which
    gives E[U_pos,2] or E[U_neg,2] by linearity.

    Shapes: ``probs[..., V]`` -> ``[...]`` (summed over ``axis``). ``n`` >= 0 (scalar).
    """
    probs = jnp.asarray(probs)
    if isinstance(n, (int, float)) and n < 0:
        raise ValueError(f"n (number of draws) must be >= 0, got {n}")
    terms = unsampled_second_moment_terms(probs, n)
    if where is not None:
        terms = jnp.where(where, terms, jnp.zeros_like(terms))
    return jnp.sum(terms, axis=axis)


def unsampled_second_moment_terms(probs: Array, n: int | Array) -> Array:
    """Per-token p_i^2 (1 - p_i)^N, same shape as ``probs``.

    (1 - p)^N is evaluated as exp(N log1p(-p)): in float32, 1 - p rounds to 1 for p < 6e-8, which
    would overstate the factor for large N.
    """
    probs = jnp.asarray(probs)
    # log(1 - p) = -inf at p = 1 (always sampled once N >= 1); the inner where keeps log1p and
    # its gradient finite there (double-where).
    log_keep = jnp.where(probs < 1, jnp.log1p(-jnp.where(probs < 1, probs, 0)), -jnp.inf)
    # N = 0 means nothing was drawn: every token is unsampled (factor 1, also for p = 1).
    keep = jnp.where(n > 0, jnp.exp(n * log_keep), jnp.ones_like(probs))
    return probs * probs * keep
