"""The critic's clipped value loss and its metrics (megatron_rl/losses/value.py) against hand-computed cases,
the gradient through the clip, the exact split across micro-batches, and verl's explained variance."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.losses.value import value_batch_metrics, value_loss, value_statistics, value_update_metrics

# Four tokens, the last outside the response; c = 0.2.
#   t0: V 1.0, V_old 0.5, R 2.0: clip(V) = 0.7, (V-R)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69, clipped
#   t1: V 2.0, V_old 2.0, R 1.0: clip(V) = 2.0, both 1 -> 1, not clipped (not larger)
#   t2: V 0.0, V_old 1.0, R 0.0: clip(V) = 0.8, 0 and 0.64 -> 0.64, clipped
#   t3: masked out (V 5, V_old 3, R 4: 1 vs 0.64)
VALUES = [[1.0, 2.0, 0.0, 5.0]]
OLD = [[0.5, 2.0, 1.0, 3.0]]
RETURNS = [[2.0, 1.0, 0.0, 4.0]]
MASK = [[True, True, True, False]]


def _case() -> tuple[torch.Tensor, ...]:
    values = torch.tensor(VALUES, requires_grad=True)
    return values, torch.tensor(OLD), torch.tensor(RETURNS), torch.tensor(MASK)


def test_clipped_value_loss_by_hand() -> None:
    values, old, returns, mask = _case()
    loss, stats = value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * (1.69 + 1.0 + 0.64) / 3, abs=1e-7)
    assert (float(stats["vf_clipped_tokens"]), float(stats["tokens"])) == (2.0, 3.0)
    loss.backward()
    # t0, t2: the clipped term is the larger and constant in V; t1: the two equal terms share d/dV = 2(V - R)
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * (2.0 - 1.0) / 3, 0.0, 0.0], abs=1e-7)


def test_a_wide_clip_range_is_the_plain_squared_error() -> None:
    values, old, returns, mask = _case()
    loss, stats = value_loss(values, old, returns, mask, cliprange_value=10.0)
    assert float(loss.detach()) == pytest.approx(0.5 * (1.0 + 1.0 + 0.0) / 3, abs=1e-7)
    assert float(stats["vf_clipped_tokens"]) == 0.0


def test_micro_batch_shares_add_up_to_the_whole_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(6, 9, generator=gen) for _ in range(3))
    mask = torch.rand(6, 9, generator=gen) > 0.3
    whole, _ = value_loss(values, old, returns, mask, 0.2)
    tokens = float(mask.sum())
    parts = [
        value_loss(values[s], old[s], returns[s], mask[s], 0.2, num_tokens=tokens) for s in (slice(0, 2), slice(2, 6))
    ]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), rel=1e-6)
    assert float(sum(p[1]["vf_loss"] for p in parts)) == pytest.approx(float(whole), rel=1e-6)


def test_metrics_by_hand() -> None:
    values, old, returns, mask = _case()
    _, loss_stats = value_loss(values, old, returns, mask, cliprange_value=0.2)
    # the values trained, 1, 2, 0 (mean 1); two of the three tokens clipped
    assert value_update_metrics(loss_stats) == pytest.approx(
        {"vf_loss": 0.5 * 3.33 / 3, "vf_clipfrac": 2 / 3, "vpred_mean": 1.0, "tokens": 3.0}, abs=1e-7
    )
    # the rollout batch's values 0.5, 2, 1 against returns 2, 1, 0: errors 1.5, -1, -1 (unbiased variance 25/12),
    # returns' variance 1
    assert value_batch_metrics(value_statistics(old, returns, mask)) == pytest.approx(
        {
            "critic/vf_explained_var": 1 - (25 / 12) / (1 + 1e-5),
            "critic/values_mean": 3.5 / 3,
            "critic/returns_mean": 1.0,
        },
        abs=1e-7,
    )


def test_explained_variance_is_verls_over_split_statistics() -> None:
    """verl's 1 - Var(R - V) / (Var(R) + 1e-5) on the response tokens, from the sums of two parts."""
    gen = torch.Generator().manual_seed(1)
    values, returns = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    mask = torch.rand(5, 7, generator=gen) > 0.4
    parts = [value_statistics(values[s], returns[s], mask[s]) for s in (slice(0, 3), slice(3, 5))]
    merged = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    got = value_batch_metrics(merged)["critic/vf_explained_var"]
    r, v = returns[mask].double(), values[mask].double()
    assert got == pytest.approx(float(1 - torch.var(r - v) / (torch.var(r) + 1e-5)), abs=1e-12)
    perfect = value_batch_metrics(value_statistics(returns, returns, mask))
    assert perfect["critic/vf_explained_var"] == 1.0


def test_mismatched_shapes_name_the_tensor() -> None:
    values, old, returns, mask = _case()
    with pytest.raises(ValueError, match=r"value_loss: returns has shape \(1, 3\), values \(1, 4\)"):
        value_loss(values, old, returns[:, :3], mask, 0.2)
