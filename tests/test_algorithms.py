"""Group advantages, dynamic sampling and overlong shaping (`megatron_rl.algorithms`)."""

import math

import pytest
import torch

from megatron_rl.algorithms import (
    DynamicSamplingAccumulator,
    filter_groups,
    group_advantages,
    overlong_filter_mask,
    soft_overlong_penalty,
)
from megatron_rl.losses import Normalizer, global_normalizer


def test_group_advantages_mean_std_and_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 2.0, 0.5, 0.5])
    adv = group_advantages(rewards, 4, eps=1e-6)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3); group 1: all equal -> 0
    a = 0.5 / (1 / math.sqrt(3) + 1e-6)
    torch.testing.assert_close(adv[:8], torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))
    # group 2: mean 0.5, deviations -1.5, 1.5, 0, 0; std = sqrt(4.5 / 3)
    std = math.sqrt(4.5 / 3)
    torch.testing.assert_close(adv[8:], torch.tensor([-1.5 / (std + 1e-6), 1.5 / (std + 1e-6), 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(rewards, 4, norm_std=False)[8:], torch.tensor([-1.5, 1.5, 0.0, 0.0]))
    assert group_advantages(torch.tensor([3.0, -2.0]), 1).eq(0).all()
    with pytest.raises(ValueError, match="5 rewards do not split into groups of group_size=2"):
        group_advantages(torch.ones(5), 2)


def test_filter_groups_drops_zero_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, -0.5, -0.5])
    filt = filter_groups(rewards, 2)
    assert filt.keep_groups.tolist() == [False, True, False, True, False]
    assert filt.keep_samples.tolist() == [False, False, True, True, False, False, True, True, False, False]
    assert (filt.kept, filt.total) == (2, 5)
    # a tolerance turns near-equal rewards (e.g. after length shaping) into zero spread
    assert filter_groups(torch.tensor([1.0, 1.01, 0.0, 1.0]), 2, min_spread=0.05).keep_groups.tolist() == [False, True]


def test_accumulator_collects_until_target_and_trims_surplus():
    acc = DynamicSamplingAccumulator(target_groups=3, group_size=2, max_rounds=5)
    acc.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), ["a", "b", "c"])  # keeps a, c
    assert not acc.done and acc.kept == 2
    acc.add(torch.tensor([0.0, 0.0, 2.0, 1.0, 1.0, 0.0]), ["d", "e", "f"])  # keeps e, f
    assert acc.done
    res = acc.result()
    assert res.groups == ["a", "c", "e"]
    torch.testing.assert_close(res.rewards, torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 1.0]))
    assert res.metrics == {
        "rounds": 2.0, "groups_generated": 6.0, "groups_kept": 4.0, "groups_used": 3.0,
        "groups_surplus": 1.0, "target_missed": 0.0,
    }  # fmt: skip


def test_accumulator_stops_at_max_rounds_with_warning_flag():
    acc = DynamicSamplingAccumulator(target_groups=4, group_size=3, max_rounds=2)
    acc.add(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), [0, 1])
    assert not acc.done
    acc.add(torch.zeros(6), [2, 3])
    assert acc.done
    res = acc.result()
    assert res.groups == [1] and res.metrics["target_missed"] == 1.0 and res.metrics["groups_used"] == 1.0
    with pytest.raises(RuntimeError, match="all 2 rounds are already used"):
        acc.add(torch.zeros(6), [4, 5])
    with pytest.raises(ValueError, match="3 group payloads for 2 groups"):
        DynamicSamplingAccumulator(4, 3, 2).add(torch.zeros(6), [0, 1, 2])
    empty = DynamicSamplingAccumulator(2, 2, 1)
    empty.add(torch.zeros(4), ["x", "y"])
    assert empty.result().groups == [] and empty.result().rewards.numel() == 0


def test_soft_overlong_penalty_dapo_eq13():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    # L_max = 20, L_cache = 4: free up to 16, linear to -1 at 20, -1 beyond
    torch.testing.assert_close(soft_overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        soft_overlong_penalty(lengths, 20, 4, factor=0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )
    # the paper's setting: L_max = 20480, L_cache = 4096
    dapo = soft_overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096)
    torch.testing.assert_close(dapo, torch.tensor([0.0, -0.5, -1.0]))
    with pytest.raises(ValueError, match=r"buffer_len \(30\) must be in 1..max_len \(20\)"):
        soft_overlong_penalty(lengths, 20, 30)


def test_overlong_filter_masks_truncated_rows_out_of_the_normaliser():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    filtered = overlong_filter_mask(mask, torch.tensor([True, False, True]))
    assert filtered.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert global_normalizer(filtered, token_norm=3) == Normalizer(2.0, 1.0, 3.0)
    with pytest.raises(ValueError, match=r"truncated \(2,\) must be \[N\] for response_mask \(3, 3\)"):
        overlong_filter_mask(mask, torch.tensor([True, False]))
