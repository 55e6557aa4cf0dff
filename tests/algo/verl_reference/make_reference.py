"""Write verl_core_algos.npz: veRL's own core_algos outputs on fixed random inputs.

Run ONLY in an environment where veRL is installed (it is not a dependency of brorl_jax; the
parity test reads the committed .npz and never imports veRL). See README.md beside this file for
how the environment was built and which veRL version produced the committed file:

    python tests/algo/verl_reference/make_reference.py            # rewrites the .npz here
    python tests/algo/verl_reference/make_reference.py --out X.npz

Inputs are built with numpy from a fixed seed (no torch RNG), so regenerating with the same veRL
version gives the same file up to float32 rounding. Keys: "in_*" inputs, "out_*" veRL outputs,
"meta_*" strings. Every output is computed by a veRL function; the only transcribed rule is the
DAPO dynamic-sampling filter, which veRL has inline in its trainer (no callable function).
"""
from __future__ import annotations

import argparse
import os
from collections import defaultdict

import numpy as np

G, N, T = 6, 8, 16          # prompt groups, responses per group, response length
B = G * N
SEED = 20251018
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
DUAL_CLIP_C = 3.0
DUAL_CLIP_OFF = 1e9         # > exp(20): veRL clamps the log-ratio to +-20, so dual-clip never binds
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_NAMES = ("kl", "abs", "mse", "low_var_kl")
TIS_THRESHOLDS = {"trunc2": 2.0, "trunc5": 5.0, "icepop": "0.5_5.0"}
TOTAL_KL_COEF = 1e-4


def build_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x: dict[str, np.ndarray] = {}

    # -- response lengths: a 1-token and several full-length responses among random lengths
    lengths = rng.integers(2, T, size=B)
    lengths[[0, 13, 40]] = 1
    lengths[[1, 9, 22, 47]] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    x["lengths"] = lengths.astype(np.int32)
    x["response_mask"] = mask

    # -- outcome scores [G, N] (one group per case of the two filter rules; partial credit)
    pc = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    scores = np.zeros((G, N))
    scores[0] = 0.0                                              # all wrong
    scores[1] = rng.permutation([1, 1, 1, 0, 0, 0, 0, 0])        # binary, mixed
    scores[2] = rng.choice(pc, size=N)                           # partial credit incl. full credit
    scores[2, :2] = [1.0, 0.25]
    scores[3] = 0.5                                              # all equal partial credit
    scores[4] = rng.choice(pc[:4], size=N)                       # partial credit, never full
    scores[4, :2] = [0.25, 0.5]
    scores[5] = 1.0                                              # all correct
    x["scores"] = scores.astype(np.float32)
    x["index"] = np.repeat(np.arange(G), N).astype(np.int64)   # group id per row
    tlr = np.zeros((B, T), np.float32)                           # veRL reward managers: score on the last token
    tlr[np.arange(B), lengths - 1] = scores.reshape(-1)
    x["token_level_rewards"] = tlr
    # the same scores x 1e-3: batch and group variances near the epsilons, so where an epsilon sits
    # (inside or outside the square root) and its value change the advantages by far more than 1e-5
    x["scores_small"] = (1e-3 * scores).astype(np.float32)
    x["token_level_rewards_small"] = (1e-3 * tlr).astype(np.float32)

    # -- policy loss: one advantage per response (a few exactly 0), log-probs [B, T]
    adv = rng.normal(size=B).astype(np.float32)
    adv[[5, 30]] = 0.0
    x["pg_advantages"] = adv
    loss_mask = mask.copy()
    loss_mask[46] = 0.0                                          # a padding row: no loss token at all
    x["loss_mask"] = loss_mask
    old = (-0.1 - 2.0 * np.abs(rng.normal(size=(B, T)))).astype(np.float32)
    delta = np.clip(0.4 * rng.normal(size=(B, T)), -3.0, 3.0)
    neg = np.array([i for i in np.flatnonzero(adv < 0) if loss_mask[i, 0]])   # rows with a loss token 0
    pos = np.array([i for i in np.flatnonzero(adv > 0) if loss_mask[i, 0]])
    # ratios above the dual-clip bound (r > 3) on negative advantages, and low ratios on both signs
    for r_, v in [(neg[0], 1.5), (neg[1], 2.0), (neg[2], 1.2), (pos[0], 1.5), (neg[3], -1.0), (pos[1], -1.0)]:
        delta[r_, 0] = v
    x["pg_old_logp"] = old
    x["pg_logp_moderate"] = (old + delta).astype(np.float32)
    ext = delta.copy()
    # log-ratios beyond +-10 and +-20 on both advantage signs (veRL clamps the PPO log-ratio to +-20)
    for r_, v in [(neg[4], 12.0), (neg[5], 25.0), (neg[6], -25.0), (pos[2], 25.0), (pos[3], -12.0),
                  (pos[4], -25.0), (neg[7], 21.0)]:
        ext[r_, 0] = v
    x["pg_logp_extreme"] = (old + ext).astype(np.float32)

    # -- KL: log pi - log pi_ref, a moderate set (|x| <= 2) and one with +-5, +-12, +-25
    kl_ref = (-0.1 - 2.0 * np.abs(rng.normal(size=(B, T)))).astype(np.float32)
    kx = np.clip(0.7 * rng.normal(size=(B, T)), -2.0, 2.0)
    x["kl_ref_logp"] = kl_ref
    x["kl_logp_moderate"] = (kl_ref + kx).astype(np.float32)
    kx_ext = kx.copy()
    special = np.array([-25.0, -20.5, -12.0, -10.5, -5.0, -3.0, 3.0, 5.0, 10.5, 12.0, 20.5, 25.0])
    kx_ext[1, :len(special)] = special                           # row 1 is full length: all tokens valid
    x["kl_logp_extreme"] = (kl_ref + kx_ext).astype(np.float32)

    # -- truncated IS: log pi_old(trainer) - log pi_rollout, with +-3 and +-25 outliers
    is_lr = 0.5 * rng.normal(size=(B, T))
    is_lr[9, :6] = [-25.0, -3.0, -0.8, 0.8, 3.0, 25.0]
    x["tis_old_logp"] = old
    x["tis_rollout_logp"] = (old - is_lr).astype(np.float32)

    # -- agg_loss on a plain random loss matrix (same loss_mask with its empty row)
    x["agg_loss_mat"] = rng.normal(size=(B, T)).astype(np.float32)
    return x


def dapo_keep_rule(scores: np.ndarray) -> np.ndarray:
    """veRL recipe/dapo/dapo_ray_trainer.py (transcribed; inline in the trainer loop):
    kept_prompt_uids = [uid for uid, std in prompt_uid2metric_std.items()
                        if std > 0 or len(prompt_uid2metric_vals[uid]) == 1]
    with prompt_uid2metric_std[uid] = np.std(metric_vals) (ddof=0)."""
    vals = defaultdict(list)
    for g in range(scores.shape[0]):
        for v in scores[g]:
            vals[g].append(v)
    return np.array([np.std(vals[g]) > 0 or len(vals[g]) == 1 for g in range(scores.shape[0])])


def compute_outputs(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch
    import verl
    from verl.trainer.ppo import core_algos as ca
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.config import ActorConfig

    t = lambda a: torch.tensor(np.asarray(a))                    # noqa: E731
    out: dict[str, np.ndarray] = {}
    mask = t(x["response_mask"])
    index = x["index"]

    # ---------------------------------------------------------------- advantages [B, T]
    def adv(fn, rewards="token_level_rewards", **kw):
        a, _ = fn(token_level_rewards=t(x[rewards]), response_mask=mask, index=index, **kw)
        return a.numpy().astype(np.float32)

    out["adv_reinforce_pp_baseline"] = adv(ca.compute_reinforce_plus_plus_baseline_outcome_advantage)
    out["adv_grpo"] = adv(ca.compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo=True)
    out["adv_dr_grpo"] = adv(ca.compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo=False)
    out["adv_rloo"] = adv(ca.compute_rloo_outcome_advantage)
    small = "token_level_rewards_small"
    out["adv_small_reinforce_pp_baseline"] = adv(ca.compute_reinforce_plus_plus_baseline_outcome_advantage, small)
    out["adv_small_grpo"] = adv(ca.compute_grpo_outcome_advantage, small, norm_adv_by_std_in_grpo=True)

    # ---------------------------------------------------------------- vanilla PPO policy loss
    pg_fn = ca.get_policy_loss_fn("vanilla")
    lm = t(x["loss_mask"])
    adv_bt = t(np.broadcast_to(x["pg_advantages"][:, None], (B, T)).copy())
    for lp_name in ("moderate", "extreme"):
        for dual_name, c in (("dual3", DUAL_CLIP_C), ("nodual", DUAL_CLIP_OFF)):
            for mode in AGG_MODES:
                cfg = ActorConfig(strategy="fsdp", rollout_n=N, ppo_micro_batch_size_per_gpu=N, clip_ratio=CLIP_LOW,
                                  clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=c,
                                  loss_agg_mode=mode)
                loss, m = pg_fn(old_log_prob=t(x["pg_old_logp"]), log_prob=t(x[f"pg_logp_{lp_name}"]),
                                advantages=adv_bt, response_mask=lm, loss_agg_mode=mode, config=cfg,
                                rollout_is_weights=None)
                key = f"pg_{lp_name}_{dual_name}_{mode.replace('-', '_')}"
                out[f"{key}_loss"] = np.float32(loss.item())
                out[f"{key}_clipfrac"] = np.float32(m["actor/pg_clipfrac"])
                out[f"{key}_clipfrac_lower"] = np.float32(m["actor/pg_clipfrac_lower"])
                out[f"{key}_ppo_kl"] = np.float32(m["actor/ppo_kl"])

    # ---------------------------------------------------------------- KL penalty [B, T]
    for set_name in ("moderate", "extreme"):
        for name in KL_NAMES:
            k = ca.kl_penalty(logprob=t(x[f"kl_logp_{set_name}"]), ref_logprob=t(x["kl_ref_logp"]), kl_penalty=name)
            out[f"kl_{set_name}_{name}"] = k.numpy().astype(np.float32)

    # ---------------------------------------------------------------- agg_loss (scalars)
    for mode in AGG_MODES + ("token-sum",):
        v = ca.agg_loss(loss_mat=t(x["agg_loss_mat"]), loss_mask=lm, loss_agg_mode=mode)
        out[f"agg_{mode.replace('-', '_')}"] = np.float32(v.item())

    # ---------------------------------------------------------------- rollout correction (token TIS / IcePop)
    log_ratio = t(x["tis_old_logp"]) - t(x["tis_rollout_logp"])
    for name, thr in TIS_THRESHOLDS.items():
        w, _ = compute_rollout_correction_weights(log_ratio=log_ratio, response_mask=lm, rollout_is="token",
                                                  rollout_is_threshold=thr, rollout_is_batch_normalize=False)
        out[f"tis_{name}_weights"] = w.numpy().astype(np.float32)

    # ---------------------------------------------------------------- total loss as veRL's actor composes it
    # verl/workers/utils/losses.py::ppo_loss: pg (vanilla, with rollout_is_weights) + kl_loss_coef *
    # agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type)); entropy_coeff 0. Moderate inputs only.
    w_ice, _ = compute_rollout_correction_weights(log_ratio=log_ratio, response_mask=lm, rollout_is="token",
                                                  rollout_is_threshold="0.5_5.0")
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg = ActorConfig(strategy="fsdp", rollout_n=N, ppo_micro_batch_size_per_gpu=N, clip_ratio=CLIP_LOW,
                          clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=DUAL_CLIP_OFF,
                          loss_agg_mode=mode)
        pg, _ = pg_fn(old_log_prob=t(x["pg_old_logp"]), log_prob=t(x["pg_logp_moderate"]), advantages=adv_bt,
                      response_mask=lm, loss_agg_mode=mode, config=cfg, rollout_is_weights=w_ice)
        kld = ca.kl_penalty(logprob=t(x["pg_logp_moderate"]), ref_logprob=t(x["kl_ref_logp"]), kl_penalty="mse")
        kl_loss = ca.agg_loss(loss_mat=kld, loss_mask=lm, loss_agg_mode=mode)
        out[f"total_icepop_k2_{mode.replace('-', '_')}"] = np.float32((pg + TOTAL_KL_COEF * kl_loss).item())

    # ---------------------------------------------------------------- DAPO dynamic sampling (transcribed rule)
    out["dapo_keep"] = dapo_keep_rule(x["scores"])

    out["meta_verl_version"] = np.array(verl.__version__)
    out["meta_torch_version"] = np.array(torch.__version__)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_core_algos.npz"))
    args = ap.parse_args()
    x = build_inputs()
    out = compute_outputs(x)
    np.savez_compressed(args.out, **{f"in_{k}": v for k, v in x.items()}, **{f"out_{k}": v for k, v in out.items()
                                                                            if not k.startswith("meta_")},
                        **{k: v for k, v in out.items() if k.startswith("meta_")})
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes), veRL {out['meta_verl_version']}")


if __name__ == "__main__":
    main()
