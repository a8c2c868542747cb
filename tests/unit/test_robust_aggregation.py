"""The centred clip that bounds an admitted liar, and the majority rule that flags and bans it."""

from __future__ import annotations

import doctest

import pytest
import torch

from intellect.diloco import robust
from intellect.diloco.robust import ITERATIONS, Screen, Strikes, astray, centred_clip, majority_flagged, reported


def honest(n: int, m: int = 4096, signal: float = 1.0, noise: float = 0.5, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(m, generator=g) * signal
    return [s + torch.randn(m, generator=g) * noise for _ in range(n)]


def bound(xs: list[torch.Tensor], k: float) -> float:
    """How far the result may move from the honest mean: each iteration, tau / n."""
    x = torch.stack(xs)
    d = (x - x.median(dim=0).values).norm(dim=1)
    return ITERATIONS * k * float(d.median()) / len(xs)


@pytest.mark.parametrize("lie", ["const", "flip", "scale", "huge"])
def test_a_liar_is_flagged_and_moves_the_result_by_a_bounded_amount(lie):
    xs = honest(3)
    mean = torch.stack(xs).mean(0)
    liar = {"const": torch.full_like(xs[0], 1e6), "flip": -xs[0], "scale": 100 * xs[0],
            "huge": torch.full_like(xs[0], 3e38)}[lie]
    allx = xs + [liar]
    v, outliers = centred_clip(allx, k=4)
    assert outliers == [3]
    assert torch.isfinite(v).all()
    assert float((v - mean).norm()) <= bound(allx, 4) * 1.001
    # the plain mean is dragged far away
    assert float((torch.stack(allx).mean(0) - mean).norm()) > 10 * float((v - mean).norm())


def test_honest_contributions_are_not_touched():
    for seed in range(5):
        assert centred_clip(honest(4, seed=seed), k=4) == (None, [])
        assert centred_clip(honest(8, noise=2.0, seed=seed), k=4) == (None, [])


def test_too_few_contributors_or_off_means_plain_mean():
    two = honest(2) + []
    assert centred_clip([two[0], torch.full_like(two[0], 1e6)], k=4) == (None, [])
    assert centred_clip(honest(3) + [torch.full_like(honest(1)[0], 1e6)], k=0) == (None, [])
    assert centred_clip([torch.zeros(0)] * 4, k=4) == (None, [])


def test_a_minority_of_liars_is_bounded_too():
    xs = honest(5)
    mean = torch.stack(xs).mean(0)
    allx = xs + [torch.full_like(xs[0], 1e6), -50 * xs[1]]
    v, outliers = centred_clip(allx, k=4)
    assert outliers == [5, 6]
    assert float((v - mean).norm()) <= bound(allx, 4) * 1.001


def test_reports_majorities_and_strikes():
    assert reported({0: 0.51, 1: 0.5, 2: 1.0}, ["a", "b", "c"]) == ["a", "c"]
    members = ["a", "b", "c", "d"]
    assert majority_flagged({"a": ["d"], "b": ["d"], "c": [], "d": ["a"]}, members) == ["d"]
    assert majority_flagged({"a": ["d"], "b": [], "c": [], "d": ["a"]}, members) == []
    # a liar cannot get anyone flagged alone, nor by reporting itself or others several times
    assert majority_flagged({"d": ["a", "a", "b", "d"], "x": ["a"], "y": ["a"]}, members) == []
    s = Strikes(2)
    assert s.add(["d"]) == [] and s.add(["c", "d"]) == ["d"] and s.add(["d", "c"]) == ["c"]


def test_doctests():
    assert doctest.testmod(robust).failed == 0


def pushed(xs: list[torch.Tensor], scale: float, keep_norm: bool, seed: int = 7) -> torch.Tensor:
    """The direction attack: xs[-1] plus ``scale`` times its norm along a fixed direction."""
    u = torch.randn(xs[0].numel(), generator=torch.Generator().manual_seed(seed))
    x = xs[-1] + scale * xs[-1].norm() * u / u.norm()
    return x * (xs[-1].norm() / x.norm()) if keep_norm else x


@pytest.mark.parametrize("keep_norm", [False, True])
@pytest.mark.parametrize("n", [4, 6, 8])
def test_a_member_adversarial_in_direction_is_flagged_and_left_out_from_four_members(n, keep_norm):
    xs = honest(n, noise=0.7)
    liar = pushed(xs, 1.5, keep_norm)
    v, outliers = centred_clip(xs[:-1] + [liar], k=4)
    assert outliers == [n - 1]
    assert v is not None and torch.equal(v, torch.stack(xs[:-1]).mean(0))  # the liar is left out
    # without the screens (the multiple 4, no direction) it passes unflagged
    assert centred_clip(xs[:-1] + [liar], k=4, screen=Screen(k_crowd=4, direction=0)) == (None, [])


def test_the_screens_wait_for_four_members_and_for_agreement():
    xs = honest(3, noise=0.7)
    assert centred_clip(xs[:-1] + [pushed(xs, 1.5, True)], k=4) == (None, [])  # 3: no screen, the clip only
    noise = honest(6, signal=0.1, noise=1.0)  # members barely agree: the direction says nothing
    assert astray(torch.stack(noise), 0.6) == [False] * 6


@pytest.mark.parametrize("seed", range(5))
def test_honest_members_pass_the_screens(seed):
    for n, noise in ((4, 0.5), (4, 1.0), (6, 0.7), (12, 1.5)):
        assert centred_clip(honest(n, noise=noise, seed=seed), k=4) == (None, []), (n, noise)
