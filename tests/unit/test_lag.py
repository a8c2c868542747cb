"""The policy-lag bound: one rule, pinned for async_level 0, 1 and 2."""

from __future__ import annotations

import doctest

import pytest

from intellect.rl.wire import lag
from intellect.rl.wire.lag import DEFAULT_ASYNC_LEVEL, is_fresh, policy_for


def test_doctests():
    assert doctest.testmod(lag).failed == 0


@pytest.mark.parametrize(
    "async_level, fresh",
    [
        (0, [10]),  # synchronous: only the policy of the step itself
        (1, [9, 10]),
        (2, [8, 9, 10]),
    ],
)
def test_is_fresh_pins_the_window(async_level, fresh):
    assert [p for p in range(-3, 15) if is_fresh(10, p, async_level)] == fresh


def test_default_async_level_is_two():
    assert DEFAULT_ASYNC_LEVEL == 2
    assert is_fresh(10, 8) and not is_fresh(10, 7)


def test_future_and_garbage_policies_are_never_fresh():
    assert not is_fresh(3, 4, 100)
    assert not is_fresh(0, -1, 5)
    assert not is_fresh(3, True, 5)
    assert not is_fresh(3, 2.0, 5)
    assert not is_fresh(3, "3", 5)


def test_early_steps_use_the_initial_policy():
    assert is_fresh(0, 0, 0) and is_fresh(1, 0, 2) and is_fresh(2, 0, 2) and not is_fresh(3, 0, 2)


@pytest.mark.parametrize("bad", [-1, 1.0, None, True])
def test_trusted_arguments_are_checked(bad):
    with pytest.raises(ValueError):
        is_fresh(bad, 0, 2)
    with pytest.raises(ValueError):
        is_fresh(3, 0, bad)


def test_policy_for_picks_newest_fresh_or_waits():
    assert policy_for(5, 2, []) is None
    assert policy_for(5, 2, [0, 1, 2]) is None  # must wait for checkpoint 3
    assert policy_for(5, 2, [3, 0]) == 3
    assert policy_for(5, 2, [0, 3, 4, 5, 6, 7]) == 5  # never a checkpoint from the future
    assert policy_for(5, 0, [4]) is None and policy_for(5, 0, [4, 5]) == 5
    assert policy_for(5, 1, [3, 4]) == 4


@pytest.mark.parametrize("async_level", [0, 1, 2, 5])
def test_generation_horizon_agrees_with_freshness(async_level):
    # with checkpoint `latest` the newest, generation may run ahead up to step latest + async_level
    for latest in range(6):
        horizon = latest + async_level
        assert is_fresh(horizon, latest, async_level)
        assert not is_fresh(horizon + 1, latest, async_level)
        assert policy_for(horizon, async_level, range(latest + 1)) == latest
        assert policy_for(horizon + 1, async_level, range(latest + 1)) is None


def test_fixed_lag_uses_exactly_the_oldest_fresh_checkpoint():
    # the same checkpoint whatever else has been published: a step's samples do not depend on the pace
    for available in ([3], [0, 1, 2, 3], [3, 4], [3, 4, 5, 6]):
        assert policy_for(5, 2, available, "fixed") == 3
    assert policy_for(5, 2, [4, 5], "fixed") is None  # checkpoint 3 is not there (yet, or any more)
    assert policy_for(1, 2, [0, 1], "fixed") == 0 and policy_for(5, 0, [4, 5], "fixed") == 5
    with pytest.raises(ValueError):
        policy_for(5, 2, [3], "oldest")  # type: ignore[arg-type]


@pytest.mark.parametrize("async_level", [0, 1, 2, 5])
def test_fixed_lag_never_waits_longer_than_the_generation_horizon(async_level):
    # a generator allowed to reach step latest + async_level finds its fixed checkpoint already there
    for latest in range(6):
        horizon = latest + async_level
        assert policy_for(horizon, async_level, range(latest + 1), "fixed") == max(0, horizon - async_level)
        assert policy_for(horizon + 1, async_level, range(latest + 1), "fixed") is None


def test_the_runs_policy_lag_reaches_its_workers():
    from intellect.rl.config import RLRunConfig  # noqa: PLC0415 - only this test needs the run config
    from intellect.rl.worker.worker import WorkerRunInfo, wait_for_policy  # noqa: PLC0415

    relays = ["http://127.0.0.1:1"]
    info = WorkerRunInfo.of(RLRunConfig(policy_lag="fixed"), committed=-1, relays=relays)
    assert WorkerRunInfo.model_validate(info.model_dump(mode="json")).policy_lag == "fixed"
    assert WorkerRunInfo.of(RLRunConfig(), committed=-1, relays=relays).policy_lag == "newest"
    published = [0, 1, 2, 3, 4]
    assert wait_for_policy(lambda: published, 5, 2, timeout=1, poll=0.01, lag=info.policy_lag) == 3
    assert wait_for_policy(lambda: published, 5, 2, timeout=1, poll=0.01) == 4
