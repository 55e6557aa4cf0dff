"""Our algorithm functions against veRL's own core_algos outputs (issue 18).

The reference values were written by tests/algo/verl_reference/make_reference.py with veRL installed
(version in the file's meta_verl_version; README.md beside it says how and with which arguments).
This test never imports veRL. Tolerance: |ours - veRL| <= 1e-5 + 1e-5 |veRL| element-wise.

Inputs are chosen so that each convention shows by far more than the tolerance: partial-credit
scores, a 1-token and full-length responses, an empty (padding) loss row, ratios above the dual-clip
bound 3, log-ratios beyond +-10 and +-20, and a copy of the scores x 1e-3 whose variances sit near
the epsilons (so the epsilon's value and place, inside or outside the square root, matter).

Every test compares a default of ours with veRL's, except k2's log-ratio clamp: ProRLv2 states
it (c = 10, our default), so veRL's unclamped "mse" is compared with kl_clamp = inf and the clamp
is checked against its formula. docs/algo.md's choices table gives each default's source.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from brorl_jax.algo import LOSS_AGG, compute_advantages, kl_penalty, policy_loss, tis_weights
from brorl_jax.algo.dynamic_sampling import select_groups
from brorl_jax.algo.host import CollectState, advantages
from brorl_jax.config import make_config, update_config

NPZ = os.path.join(os.path.dirname(__file__), "verl_reference", "verl_core_algos.npz")
RTOL = ATOL = 1e-5


class _Ref(dict):
    def __repr__(self):                     # keep failure reports short
        return f"<veRL reference: {len(self)} arrays from {os.path.basename(NPZ)}>"


@pytest.fixture(scope="module")
def ref():
    z = np.load(NPZ)
    return _Ref({k: z[k] for k in z.files})


def close(ours, theirs, what, where=None):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=f"{what}: ours != veRL")


def per_token(ref, adv_gn):
    """Our [G, N] advantages laid out like veRL's [B, T] (one value per response, zero on padding)."""
    mask = ref["in_response_mask"]
    return np.asarray(adv_gn).reshape(mask.shape[0])[:, None] * mask


def lengths_gn(ref):
    return ref["in_lengths"].reshape(ref["in_scores"].shape)


def run_policy_loss(ref, logp_key, cfg, rollout_logp=None, ref_logp=None):
    mask = jnp.asarray(ref["in_loss_mask"].astype(bool))
    logp, old = jnp.asarray(ref[logp_key]), jnp.asarray(ref["in_pg_old_logp"])
    return policy_loss(logp, jnp.zeros_like(logp), old_logp=old,
                       rollout_logp=old if rollout_logp is None else jnp.asarray(rollout_logp),
                       ref_logp=None if ref_logp is None else jnp.asarray(ref_logp),
                       advantages=jnp.asarray(ref["in_pg_advantages"]), loss_mask=mask,
                       agg_weights=LOSS_AGG[cfg.loss_agg](mask), cfg=cfg)


def plain_pg_cfg(agg, dual_clip_c=0.0):
    return update_config(clip_eps_low=0.2, clip_eps_high=0.28, tis_mode="off", kl_coef=0.0,
                       entropy_coef=0.0, loss_agg=agg, dual_clip_c=dual_clip_c)


AGGS = ("token_mean", "seq_mean_token_mean")


def test_reference_file_is_small_and_complete(ref):
    assert os.path.getsize(NPZ) < 200_000
    assert str(ref["meta_verl_version"]) != ""
    # the inputs exercise what they claim to
    lens = ref["in_lengths"]
    assert lens.min() == 1 and lens.max() == ref["in_response_mask"].shape[1]
    assert (ref["in_loss_mask"].sum(1) == 0).sum() == 1
    assert set(np.unique(ref["in_scores"])) >= {0.25, 0.5, 0.75}
    lr = ref["in_pg_logp_extreme"] - ref["in_pg_old_logp"]
    assert lr.max() > 20 and lr.min() < -20
    kx = ref["in_kl_logp_extreme"] - ref["in_kl_ref_logp"]
    assert kx.max() > 20 and kx.min() < -20


# ------------------------------------------------------------------------- agree with veRL today

@pytest.mark.parametrize("scores", ["in_scores", "in_scores_small"])
def test_grpo_matches_verl(ref, scores):
    key = "out_adv_grpo" if scores == "in_scores" else "out_adv_small_grpo"
    close(per_token(ref, compute_advantages("grpo", ref[scores])), ref[key], f"grpo on {scores}")


def test_rloo_matches_verl(ref):
    close(per_token(ref, compute_advantages("rloo", ref["in_scores"])), ref["out_adv_rloo"], "rloo")


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_clip_higher_loss_and_clipfrac_match_verl_without_dual_clip(ref, agg):
    """Ratios within exp(+-3): veRL's +-20 log-ratio clamp does not bind; dual-clip off (c = 1e9)."""
    loss, s = run_policy_loss(ref, "in_pg_logp_moderate", plain_pg_cfg(agg))
    close(loss, ref[f"out_pg_moderate_nodual_{agg}_loss"], f"pg loss {agg}")
    close((s["clip_low_sum"] + s["clip_high_sum"]) / s["n_tokens"],
          ref[f"out_pg_moderate_nodual_{agg}_clipfrac"], "clip fraction")


@pytest.mark.parametrize("logp", ["moderate", "extreme"])
@pytest.mark.parametrize("dual", ["dual3", "nodual"])
def test_clip_fraction_matches_verl_pg_clipfrac(ref, logp, dual):
    """veRL's actor/pg_clipfrac = token-mean of (clipped branch > unclipped) = our clip_low + clip_high,
    whatever the dual-clip setting or aggregation."""
    _, s = run_policy_loss(ref, f"in_pg_logp_{logp}",
                           plain_pg_cfg("token_mean", 3.0 if dual == "dual3" else 0.0))
    close((s["clip_low_sum"] + s["clip_high_sum"]) / s["n_tokens"],
          ref[f"out_pg_{logp}_{dual}_token_mean_clipfrac"], "clip fraction")
    # veRL's pg_clipfrac_lower: where the dual-clip bound is the loss
    close(s["dual_clip_sum"] / s["n_tokens"], ref[f"out_pg_{logp}_{dual}_token_mean_clipfrac_lower"],
          "dual-clip fraction")


@pytest.mark.parametrize("logp", ["moderate", "extreme"])
@pytest.mark.parametrize("ours,theirs", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_match_verl(ref, logp, ours, theirs):
    """Log-ratios up to +-25: k1 unclamped, k3 with veRL's input (+-20) and value (+-10) clamps,
    k2 unclamped when kl_clamp = inf (veRL's "mse")."""
    clamp = np.inf if ours == "k2" else update_config().kl_clamp
    k = kl_penalty(jnp.asarray(ref[f"in_kl_logp_{logp}"]), jnp.asarray(ref["in_kl_ref_logp"]), ours,
                   clamp)
    close(k, ref[f"out_kl_{logp}_{theirs}"], f"kl {ours}", ref["in_loss_mask"] > 0)


def test_k2_default_clamp_is_prorlv2s_log_ratio_clamp(ref):
    """ProRLv2: k2 = clamp(x, -10, 10)^2 / 2 (x = log pi - log pi_ref): equal to veRL's mse where
    |x| <= 10, 50 beyond."""
    x = ref["in_kl_logp_extreme"] - ref["in_kl_ref_logp"]
    k = kl_penalty(jnp.asarray(ref["in_kl_logp_extreme"]), jnp.asarray(ref["in_kl_ref_logp"]), "k2",
                   update_config().kl_clamp)
    close(k, 0.5 * np.clip(x, -10, 10) ** 2, "k2 with the ProRLv2 clamp")
    inside = (np.abs(x) <= 10) & (ref["in_loss_mask"] > 0)
    close(k, ref["out_kl_extreme_mse"], "k2 where the clamp does not bind", inside)


@pytest.mark.parametrize("agg", AGGS)
def test_loss_aggregation_matches_verl_agg_loss(ref, agg):
    """Including an empty row, which veRL's seq-mean-token-mean leaves out of the sequence count."""
    mask = jnp.asarray(ref["in_loss_mask"].astype(bool))
    close(jnp.sum(LOSS_AGG[agg](mask) * ref["in_agg_loss_mat"]), ref[f"out_agg_{agg}"], f"agg {agg}")


@pytest.mark.parametrize("mode,low,high,key", [("truncate", 0.5, 2.0, "trunc2"), ("truncate", 0.5, 5.0, "trunc5"),
                                               ("ice_pop", 0.5, 5.0, "icepop")])
def test_tis_weights_match_verl_token_rollout_correction(ref, mode, low, high, key):
    w, _ = tis_weights(jnp.asarray(ref["in_tis_old_logp"]), jnp.asarray(ref["in_tis_rollout_logp"]), mode, low, high)
    close(w, ref[f"out_tis_{key}_weights"], f"tis {mode}", ref["in_loss_mask"] > 0)


@pytest.mark.parametrize("agg", AGGS)
def test_total_loss_icepop_k2_matches_verl_actor_composition(ref, agg):
    """pg x ICE-POP weight + 1e-4 k2 KL, aggregated, as veRL's actor adds them (moderate inputs:
    |log pi - log pi_ref| < 10, so our KL clamp does not bind)."""
    cfg = update_config(clip_eps_low=0.2, clip_eps_high=0.28, tis_mode="ice_pop", tis_low=0.5,
                      tis_high=5.0, kl_coef=1e-4, kl_estimator="k2", entropy_coef=0.0, loss_agg=agg,
                      dual_clip_c=0.0)
    loss, _ = run_policy_loss(ref, "in_pg_logp_moderate", cfg, rollout_logp=ref["in_tis_rollout_logp"],
                              ref_logp=ref["in_kl_ref_logp"])
    close(loss, ref[f"out_total_icepop_k2_{agg}"], f"total loss {agg}")


# ------------------------------------------------------------------------- veRL's conventions (issue 18)

@pytest.mark.parametrize("scores", ["in_scores", "in_scores_small"])
def test_reinforce_pp_baseline_token_whitening_matches_verl(ref, scores):
    """veRL masked_whiten: token-weighted mean, variance x M/(M-1) (M = valid tokens), divided by
    sqrt(var + 1e-8); the small scores put the variance near the epsilon."""
    key = "out_adv_reinforce_pp_baseline" if scores == "in_scores" else "out_adv_small_reinforce_pp_baseline"
    ours = compute_advantages("reinforce_pp_baseline", ref[scores], lengths=lengths_gn(ref),
                              whiten_eps=make_config().algo.whiten_eps)
    close(per_token(ref, ours), ref[key], f"reinforce_pp_baseline on {scores}")


def test_the_loops_advantages_are_veRLs(ref):
    """algo.host.advantages (what the RL step calls, with the config's defaults) on groups with
    their response lengths gives veRL's token-whitened advantages."""
    cfg = make_config()
    shaped = [row for row in ref["in_scores"]]
    lengths = [row for row in lengths_gn(ref)]
    adv, state = advantages(cfg, CollectState(), shaped, lengths)
    assert state == CollectState()                   # the batch normaliser keeps no state
    close(per_token(ref, np.stack(adv)), ref["out_adv_reinforce_pp_baseline"], "loop advantages")


def test_dr_grpo_matches_verl(ref):
    close(per_token(ref, compute_advantages("dr_grpo", ref["in_scores"])), ref["out_adv_dr_grpo"],
          "dr_grpo")


@pytest.mark.parametrize("logp", ["moderate", "extreme"])
@pytest.mark.parametrize("agg", AGGS)
def test_dual_clip_loss_matches_verl(ref, logp, agg):
    """veRL's vanilla loss with clip_ratio_c = 3 (its default, ours too): for A < 0 the token loss
    is min(max(-A r, -A clip(r)), -3 A); log-ratios clamped to +-20 first."""
    assert update_config().dual_clip_c == 3.0
    loss, _ = run_policy_loss(ref, f"in_pg_logp_{logp}", plain_pg_cfg(agg, dual_clip_c=3.0))
    close(loss, ref[f"out_pg_{logp}_dual3_{agg}_loss"], f"dual-clip pg loss {agg}")


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_log_ratio_clamp_20_matches_verl(ref, agg):
    """veRL clamps log pi - log pi_old to [-20, 20] before exp (dual-clip off here): a token with
    A < 0 and log-ratio 25 costs |A| e^20."""
    loss, _ = run_policy_loss(ref, "in_pg_logp_extreme", plain_pg_cfg(agg))
    close(loss, ref[f"out_pg_extreme_nodual_{agg}_loss"], f"pg loss with |log-ratio| > 20, {agg}")


def test_dynamic_sampling_reward_std_rule_matches_verl(ref):
    """veRL DAPO recipe keeps a group iff np.std(scores) > 0. Group 4 has partial credit but no
    full-credit answer: the reward_std rule keeps it, the paper's correct_count rule drops it."""
    np.testing.assert_array_equal(select_groups(ref["in_scores"], rule="reward_std"), ref["out_dapo_keep"])
    assert not select_groups(ref["in_scores"], rule="correct_count")[4]
