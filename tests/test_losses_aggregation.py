"""Aggregation: splitting a batch over DP ranks and micro-batches never changes the loss or its gradient."""

import dataclasses

import pytest
import torch

from megatron_rl.config import preset
from megatron_rl.losses import LossSpec, Normalizer, finalize_metrics, global_normalizer, merge_metrics, policy_loss
from megatron_rl.losses.entropy import entropy_bonus
from megatron_rl.losses.importance import kept_mask
from megatron_rl.losses.spec import AGGREGATION_MODES

F64 = torch.float64
B, T = 8, 12


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 3, 7, 1, 9, 5, 0, 11])  # row 6 has no response token (e.g. overlong-filtered)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    log_probs = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.3  # ratios in and out of the clip range
    adv = torch.randn(B, 1, generator=gen, dtype=F64).expand(B, T) + 0.1 * torch.randn(B, T, generator=gen, dtype=F64)
    rollout = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.5
    ref = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.2
    return log_probs, old, adv.contiguous(), mask, rollout, ref


# (objective, aggregation) pairs: every mode with every ratio level that supports it, both gates
CASES = [("grpo", mode) for mode in AGGREGATION_MODES]
CASES += [("sapo", mode) for mode in AGGREGATION_MODES]
CASES += [("gspo_token", mode) for mode in AGGREGATION_MODES]
CASES += [("gspo", "seq-mean-token-mean")]


def _config(name: str, mode: str):
    cfg = preset(name)
    eps = 0.1 if cfg.ratio_level == "token" else 0.03  # some tokens clipped on each side, most not
    return LossSpec.from_section(dataclasses.replace(
        cfg, loss_agg_mode=mode, kl_coef=0.05, is_correction="truncate", is_threshold=1.5,
        clip_eps_low=eps, clip_eps_high=eps,
    ))  # fmt: skip


def _rows(rows: torch.Tensor, width: int):
    return lambda t: t[rows, :width]


def _split_run(cfg, log_probs, old, adv, mask, rollout, ref, normalizer):
    """2 DP ranks x 2 micro-batches, rows shuffled, each micro-batch trimmed to its own padded width."""
    leaf = log_probs.clone().requires_grad_()
    order = torch.tensor([5, 0, 7, 2, 6, 3, 1, 4])
    ranks = [order[:4], order[4:]]
    total, metric_parts = 0.0, []
    for rows in ranks:
        for micro in (rows[:2], rows[2:]):
            width = max(int(mask[micro].sum(-1).max()), 1)
            take = _rows(micro, width)
            loss, metrics = policy_loss(
                take(leaf), take(old), take(adv), take(mask), cfg,
                rollout_log_probs=take(rollout), ref_log_probs=take(ref), normalizer=normalizer,
            )  # fmt: skip
            loss.backward()
            total += loss.detach()
            metric_parts.append(metrics)
    return total, leaf.grad, merge_metrics(metric_parts)


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_split_over_ranks_and_micro_batches_matches_whole_batch(name, mode):
    cfg = _config(name, mode)
    log_probs, old, adv, mask, rollout, ref = _batch(0)
    whole = log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(whole, old, adv, mask, cfg, rollout_log_probs=rollout, ref_log_probs=ref)
    loss.backward()
    if cfg.gate == "clip":  # the batch has clipped tokens on both sides
        assert metrics["clip_low_tokens"].item() > 0 and metrics["clip_high_tokens"].item() > 0
    assert torch.count_nonzero(whole.grad) > mask.sum() // 2  # mostly unclipped: the comparison has substance
    normalizer = global_normalizer(mask)
    assert normalizer == Normalizer(num_tokens=48.0, num_sequences=7.0, token_norm=12.0)
    split_loss, split_grad, split_metrics = _split_run(cfg, log_probs, old, adv, mask, rollout, ref, normalizer)
    torch.testing.assert_close(split_loss, loss.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(split_grad, whole.grad, rtol=1e-13, atol=1e-16)
    whole_stats, split_stats = finalize_metrics(metrics), finalize_metrics(split_metrics)
    assert whole_stats.keys() == split_stats.keys()
    for key, value in whole_stats.items():
        assert split_stats[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    # teeth: each micro-batch normalised on its own gives a different gradient
    _, local_grad, _ = _split_run(cfg, log_probs, old, adv, mask, rollout, ref, None)
    assert not torch.allclose(local_grad, whole.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_rejection_split_matches_whole_batch_with_the_normaliser_of_the_kept_masks(level, mode):
    cfg = dataclasses.replace(_config("grpo", mode), is_correction="reject", is_level=level,
                              is_mask_min=0.7, is_mask_max=1.4)  # fmt: skip
    log_probs, old, adv, mask, rollout, ref = _batch(0)
    kept = kept_mask(cfg, mask, old, rollout)
    rejected = int((mask & ~kept).sum())
    assert 0 < rejected < int(mask.sum()) - 10  # some rejected, most kept
    whole = log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(whole, old, adv, mask, cfg, rollout_log_probs=rollout, ref_log_probs=ref)
    loss.backward()
    assert metrics["tokens"].item() == int(mask.sum()) - rejected
    # the normaliser is global: built before the micro-batches from every row's kept mask
    normalizer = global_normalizer(
        [kept_mask(cfg, mask[i : i + 1], old[i : i + 1], rollout[i : i + 1]) for i in range(B)]
    )
    assert normalizer.num_tokens == int(kept.sum()) and normalizer.num_sequences == int((kept.sum(-1) > 0).sum())
    split_loss, split_grad, _ = _split_run(cfg, log_probs, old, adv, mask, rollout, ref, normalizer)
    torch.testing.assert_close(split_loss, loss.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(split_grad, whole.grad, rtol=1e-13, atol=1e-16)
    # teeth: the normaliser of the response masks (rejected tokens still counted) is another loss
    wrong, _, _ = _split_run(cfg, log_probs, old, adv, mask, rollout, ref, global_normalizer(mask))
    assert not torch.allclose(wrong, loss.detach(), rtol=1e-6, atol=0)


def test_normalizer_from_micro_batch_masks_and_token_norm():
    *_, mask, _, _ = _batch(0)
    parts = [mask[:3, :12], mask[3:5, :9], mask[5:, :11]]
    assert global_normalizer(parts, token_norm=4096) == Normalizer(48.0, 7.0, 4096.0)
    assert global_normalizer(parts).token_norm == 12.0


def test_aggregation_modes_hand_values():
    # row 0: 2 tokens with loss terms 1 and 3; row 1: 1 token with 5 (via r = 1, A = -l, clip gate = A)
    adv = -torch.tensor([[1.0, 3.0], [5.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    lp = torch.zeros(2, 2, dtype=F64)
    expected = {
        "token-mean": (1 + 3 + 5) / 3,
        "seq-mean-token-mean": ((1 + 3) / 2 + 5 / 1) / 2,
        "seq-mean-token-sum": ((1 + 3) + 5) / 2,
        "seq-mean-token-sum-norm": ((1 + 3) + 5) / (2 * 10),  # L_norm = 10
    }
    for mode, value in expected.items():
        cfg = LossSpec.from_section(dataclasses.replace(preset("grpo"), loss_agg_mode=mode))
        loss, _ = policy_loss(lp, lp, adv, mask, cfg, normalizer=global_normalizer(mask, token_norm=10))
        assert loss.item() == pytest.approx(value, abs=1e-14), mode


def test_empty_micro_batch_gives_zero_loss_and_neutral_metrics():
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(lp, lp.detach(), torch.ones(2, 3, dtype=F64), torch.zeros(2, 3),
                                LossSpec.from_section(preset("grpo")),
                                normalizer=Normalizer(10.0, 2.0, 3.0))  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(lp.grad) == 0
    assert metrics["ratio_max"].item() == float("-inf") and metrics["ratio_min"].item() == float("inf")
    with pytest.raises(ValueError, match="Normalizer.num_tokens must be >= 0"):
        Normalizer(-1.0, 1.0, 1.0)


def test_entropy_bonus_is_aggregated_as_the_policy_loss_by_hand():
    # row 0: entropies 1, 2, 3 (3 tokens); row 1: 4 (1 token, then padding holding NaN)
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("nan")]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    norm = global_normalizer(mask, token_norm=5.0)
    expected = {
        "token-mean": (1 + 2 + 3 + 4) / 4,
        "seq-mean-token-mean": ((1 + 2 + 3) / 3 + 4 / 1) / 2,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-sum-norm": (6 + 4) / (2 * 5.0),
    }
    for mode, value in expected.items():
        assert entropy_bonus(entropy, mask, 0.5, norm, mode).item() == pytest.approx(-0.5 * value, abs=1e-12), mode


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_entropy_bonus_shares_of_a_split_add_up_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(3)
    _, _, _, mask, _, _ = _batch(0)
    entropy = (torch.rand(B, T, generator=gen, dtype=F64) * 2).requires_grad_()
    norm = global_normalizer(mask, token_norm=16.0)
    whole = entropy_bonus(entropy, mask, 0.1, norm, mode)
    (whole_grad,) = torch.autograd.grad(whole, entropy)
    # DP rank 0 takes rows 0-4 in micro-batches of 2, 3; rank 1 rows 5-7 cut to their own padded width
    parts = [(slice(0, 2), T), (slice(2, 5), T), (slice(5, 8), 11)]
    shares = [entropy_bonus(entropy[rows, :width], mask[rows, :width], 0.1, norm, mode) for rows, width in parts]
    split_grad = torch.autograd.grad(sum(shares), entropy)[0]
    assert sum(shares).item() == pytest.approx(whole.item(), rel=1e-13)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-13, atol=1e-16)
