import pytest
import rewards_test_verifiers as tv

from brorl_jax.rewards.registry import REWARDS, register_reward

_TEST_VERIFIERS = {"echo": tv.echo, "hang": tv.hang, "die": tv.die, "buggy": tv.buggy,
                   "out_of_range": tv.out_of_range}


@pytest.fixture(scope="session")
def test_verifiers():
    """Registers the misbehaving verifiers for the session and removes them afterwards."""
    for name, fn in _TEST_VERIFIERS.items():
        register_reward(name, fn, replace=True)
    yield list(_TEST_VERIFIERS)
    for name in _TEST_VERIFIERS:
        REWARDS.pop(name, None)
