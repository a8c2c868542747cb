import doctest

import pytest
import torch

from intellect.rl import advantages as adv_mod
from intellect.rl.advantages import group_advantages, nonzero_signal


def test_doctests():
    assert doctest.testmod(adv_mod).failed == 0


def test_std_is_bessel_corrected_and_matches_torch():
    r = torch.rand(5, 8, dtype=torch.float64)
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)  # torch's default: ddof=1, as TRL and I2
    torch.testing.assert_close(group_advantages(r), (r - mean) / (std + 1e-6))
    torch.testing.assert_close(group_advantages(r, eps=1e-4), (r - mean) / (std + 1e-4))
    torch.testing.assert_close(
        group_advantages(r, ddof=0), (r - mean) / (r.std(1, keepdim=True, correction=0) + 1e-6)
    )
    torch.testing.assert_close(group_advantages(r, std_normalize=False), r - mean)


def test_flat_with_shuffled_group_ids_matches_2d():
    r = torch.rand(4, 6)
    ids = torch.arange(4).repeat_interleave(6) * 7 + 3  # sparse, non-zero-based ids
    perm = torch.randperm(24)
    for std in (True, False):
        flat = group_advantages(r.reshape(-1)[perm], ids[perm], std_normalize=std)
        torch.testing.assert_close(flat, group_advantages(r, std_normalize=std).reshape(-1)[perm])


def test_uneven_groups_and_singletons_are_finite():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0, 1.0])
    ids = torch.tensor([0, 0, 1, 2, 2])
    a = group_advantages(r, ids)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[2:], torch.zeros(3))  # singleton and equal-reward group: no signal
    torch.testing.assert_close(a[:2], torch.tensor([0.5, -0.5]) / (0.5**0.5 + 1e-6))


def test_integer_and_bool_rewards_promote_to_float():
    a = group_advantages(torch.tensor([[1, 0], [1, 1]]), std_normalize=False)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert group_advantages(torch.tensor([[True, False]])).dtype == torch.float32


def test_nonzero_signal():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5000001]])
    assert nonzero_signal(r).tolist() == [False, True, False, True]
    ids = torch.tensor([4, 1, 4, 1])
    assert nonzero_signal(torch.tensor([1.0, 2.0, 1.0, 3.0]), ids).tolist() == [False, True, False, True]
    assert nonzero_signal(torch.tensor([[True, False], [True, True]])).tolist() == [True, False]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="groups, k"):
        group_advantages(torch.rand(6))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.rand(6), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="groups, k"):
        nonzero_signal(torch.rand(2, 3, 4))
