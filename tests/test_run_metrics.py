"""tests/run_metrics.py, the suite's rule for comparing two runs' metrics: device-reduced floats
to a tolerance, every sample-decided value exactly."""
import pytest
from run_metrics import assert_same_metrics, differences

# issue 46's two runs: the gradient norm one float32 ulp apart, everything else equal
COLOCATED = {"step": 1, "update/grad_norm": 0.5882354974746704, "loss/loss": -1.2e-08,
             "update/n_tokens": 70.0, "reward/mean": 0.25, "dynamic_sampling/kept_groups": 2.0,
             "staleness/mean": 0.5, "rollout/carried_samples": 8, "time/step_s": 3.1}
DISAGGREGATED = dict(COLOCATED, **{"update/grad_norm": 0.5882355570793152,
                                   "loss/loss": 3.0e-09, "time/step_s": 9.7})


def test_one_ulp_in_a_device_reduced_float_is_the_same_run():
    assert differences(DISAGGREGATED, COLOCATED) == {}
    assert_same_metrics([DISAGGREGATED], [COLOCATED])


@pytest.mark.parametrize("key, value", [
    ("reward/mean", 0.2500001), ("dynamic_sampling/kept_groups", 3.0), ("staleness/mean", 0.0),
    ("rollout/carried_samples", 9), ("update/n_tokens", 70.00001)])
def test_a_sample_decided_value_must_be_equal_exactly(key, value):
    assert set(differences(dict(DISAGGREGATED, **{key: value}), COLOCATED)) == {key}


def test_a_device_reduced_float_beyond_the_tolerance_differs():
    far = dict(DISAGGREGATED, **{"update/grad_norm": 0.5882355 * (1 + 1e-5)})
    assert set(differences(far, COLOCATED)) == {"update/grad_norm"}
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_metrics([far], [COLOCATED])
    assert differences(far, COLOCATED, rel=1e-4) == {}        # the golden run's machine tolerance


def test_a_key_in_one_run_only_differs():
    assert set(differences(dict(COLOCATED, extra=1), COLOCATED)) == {"extra"}
    with pytest.raises(AssertionError):
        assert_same_metrics([COLOCATED, COLOCATED], [COLOCATED])
