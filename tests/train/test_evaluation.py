"""pass@k (unbiased estimator) against hand-computed values, and the summary metrics."""
from math import comb

import numpy as np
import pytest

from brorl_jax.train.evaluation import pass_at_k, summarize


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0),
    (4, 4, 1, 1.0),
    (4, 1, 1, 0.25),
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - comb(7, 5) / comb(10, 5)),   # = 1 - 21/252
    (16, 15, 2, 1.0),          # n - c < k: every pair contains a correct sample
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # C(1024, 512) overflows floats; the product form does not.
    assert 0.0 < pass_at_k(1024, 1, 512) == pytest.approx(0.5)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_summarize_mean_and_pass_at_k():
    rewards = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=float)
    out = summarize(rewards, ks=(1, 2, 8))
    assert out["eval/pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert out["eval/pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert "eval/pass@8" not in out          # k > n is not estimable
    assert out["eval/mean@4"] == pytest.approx(5 / 12)
