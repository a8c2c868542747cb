"""The centred clip that bounds an admitted liar, and the majority rule that flags and bans it."""

from __future__ import annotations

import pytest
import torch

from intellect.diloco.robust import ITERATIONS, Strikes, centred_clip, majority_flagged, reported


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
