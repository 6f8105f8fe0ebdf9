"""Hand-computed values and gradient identities of every objective of `megatron_rl.losses.policy_loss`."""

import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import AlgorithmConfig, ConfigError, load_config, loss_spec, preset
from megatron_rl.losses import LossSpec, finalize_metrics, global_normalizer, policy_loss
from megatron_rl.losses.importance import kept_mask
from megatron_rl.losses.spec import IS_LEVELS

F64 = torch.float64


def spec(name: str, **changes) -> LossSpec:
    """The loss spec of preset `name` with `changes` to its algorithm section."""
    return LossSpec.from_section(dataclasses.replace(preset(name), **changes))


def _inputs(ratios, adv, mask):
    """log_probs (a leaf with grad) = log(ratio), old_log_probs = 0: the ratio of token t is ratios[t]."""
    ratios = torch.tensor(ratios, dtype=F64)
    log_probs = ratios.log().requires_grad_()
    advantages = torch.tensor(adv, dtype=F64).expand_as(ratios).contiguous()
    return log_probs, torch.zeros_like(ratios), advantages, torch.tensor(mask)


# Row 0: A = +1, ratios 1.5 (above 1+eps), 1.1 (inside), 0.5 (below 1-eps: not clipped for A > 0).
# Row 1: A = -1, ratios 1.5 (above: not clipped for A < 0), 0.5 (below 1-eps: clipped), then padding.
BATCH = ([[1.5, 1.1, 0.5], [1.5, 0.5, 1.0]], [[1.0], [-1.0]], [[1, 1, 1], [1, 1, 0]])


def test_grpo_hand_values_and_zero_gradient_on_clipped_side():
    lp, old, adv, mask = _inputs(*BATCH)
    loss, metrics = policy_loss(lp, old, adv, mask, spec("grpo"))
    # gates: row 0: min(1.5, 1.2) = 1.2, 1.1, min(0.5, 0.8) = 0.5 -> mean 2.8/3;
    #        row 1: min(-1.5, -1.2) = -1.5, min(-0.5, -0.8) = -0.8 -> mean -1.15; loss = -(2.8/3 - 1.15) / 2
    assert loss.item() == pytest.approx(0.1083333333333, abs=1e-12)
    loss.backward()
    # d loss / d log r = -W * A * r on unclipped tokens, W = 1/(|y_i| * N_seq); exactly 0 where clipped
    expected = torch.tensor([[0.0, -1.1 / 6, -0.5 / 6], [1.5 / 4, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-15)
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[1, 1].item() == 0.0
    assert metrics["clip_high_tokens"].item() == 1 and metrics["clip_low_tokens"].item() == 1
    stats = finalize_metrics(metrics)
    assert stats["ratio_max"] == 1.5 and stats["ratio_min"] == 0.5
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.5 + 0.5) / 5)
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 1.1, 0.5, 1.5, 0.5)) / 5
    assert stats["approx_kl_mean"] == pytest.approx(k3, rel=1e-12)
    assert stats["tokens"] == 5 and stats["sequences"] == 2


def test_dapo_hand_values_decoupled_clip_token_mean():
    lp, old, adv, mask = _inputs(*BATCH)
    loss, metrics = policy_loss(lp, old, adv, mask, spec("dapo"))
    # eps 0.2 / 0.28: row 0: 1.28 + 1.1 + 0.5, row 1: -1.5 - 0.8; token-mean over 5 tokens
    assert loss.item() == pytest.approx(-(1.28 + 1.1 + 0.5 - 1.5 - 0.8) / 5, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, -1.1 / 5, -0.5 / 5], [1.5 / 5, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-15)
    # ratio 1.25 is inside DAPO's upper bound (1.28) but outside GRPO's (1.2)
    lp2, old2, adv2, mask2 = _inputs([[1.25]], [[1.0]], [[1]])
    policy_loss(lp2, old2, adv2, mask2, spec("dapo"))[0].backward()
    assert lp2.grad.item() == pytest.approx(-1.25)
    lp3, old3, adv3, mask3 = _inputs([[1.25]], [[1.0]], [[1]])
    policy_loss(lp3, old3, adv3, mask3, spec("grpo"))[0].backward()
    assert lp3.grad.item() == 0.0


def test_dual_clip_bounds_negative_advantages():
    cfg = spec("dapo", dual_clip_c=3.0)
    lp, old, adv, mask = _inputs([[4.0, 2.0, 0.5]], [[-1.0]], [[1, 1, 1]])
    loss, metrics = policy_loss(lp, old, adv, mask, cfg)
    # r=4: max(min(-4, -1.28), -3) = -3 (dual-clipped); r=2: -2; r=0.5: min(-0.5, -0.8) = -0.8
    assert loss.item() == pytest.approx((3 + 2 + 0.8) / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    assert metrics["dual_clip_tokens"].item() == 1 and metrics["clip_low_tokens"].item() == 1
    # without dual clip the r=4 token keeps its (unbounded) gradient
    lp2, *rest = _inputs([[4.0, 2.0, 0.5]], [[-1.0]], [[1, 1, 1]])
    policy_loss(lp2, *rest, spec("dapo"))[0].backward()
    assert lp2.grad[0, 0].item() == pytest.approx(4.0 / 3)


def _gspo_inputs(scale):
    log_r = torch.tensor([[0.3, -0.1, 0.1], [-0.2, 0.0, 7.0]], dtype=F64) * scale
    log_probs = log_r.clone().requires_grad_()
    adv = torch.tensor([[1.0], [-1.0]], dtype=F64).expand(2, 3).contiguous()
    return log_probs, torch.zeros_like(log_r), adv, torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_gspo_ratio_is_length_normalised_geometric_mean_and_clipped_per_sequence():
    lp, old, adv, mask = _gspo_inputs(1.0)
    loss, metrics = policy_loss(lp, old, adv, mask, spec("gspo"))
    stats = finalize_metrics(metrics)
    # s_0 = exp(mean(0.3, -0.1, 0.1)) = e^0.1, s_1 = exp(mean(-0.2, 0.0)) = e^-0.1 (padding ignored)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-12)
    assert stats["ratio_min"] == pytest.approx(math.exp(-0.1), rel=1e-12)
    # both outside [1 - 3e-4, 1 + 4e-4] on their clipped side: gates 1.0004 and -0.9997
    assert loss.item() == pytest.approx(-(1.0004 - 0.9997) / 2, abs=1e-12)
    assert metrics["clip_high_tokens"].item() == 3 and metrics["clip_low_tokens"].item() == 2
    loss.backward()
    assert torch.count_nonzero(lp.grad).item() == 0


def test_gspo_unclipped_value_and_gradient():
    lp, old, adv, mask = _gspo_inputs(1e-3)  # mean log-ratios +1e-4 and -1e-4: inside the clip range
    loss, _ = policy_loss(lp, old, adv, mask, spec("gspo"))
    s0, s1 = math.exp(1e-4), math.exp(-1e-4)
    assert loss.item() == pytest.approx(-(s0 - s1) / 2, rel=1e-10)
    loss.backward()
    # d/d log pi_t of -(1/N_seq) A_i s_i = -(1/N_seq) A_i s_i / |y_i| for every token of row i
    expected = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=0)


def test_gspo_token_equals_gspo_in_value_and_gradient_with_shared_advantages():
    gen = torch.Generator().manual_seed(0)
    # rows 0/1 beyond the clip range on their clipped side, 2/3 inside, 4/5 beyond on the unclipped side
    offsets = torch.tensor([[1e-3], [-1e-3], [0.0], [0.0], [-1e-3], [1e-3]], dtype=F64)
    log_r = offsets + torch.randn(6, 9, generator=gen, dtype=F64) * 1e-4
    mask = torch.rand(6, 9, generator=gen) < 0.8
    mask[:, 0] = True
    signs = torch.tensor([[1.0], [-1.0], [1.0], [-1.0], [1.0], [-1.0]], dtype=F64)
    adv = (signs * torch.rand(6, 1, generator=gen, dtype=F64) + signs).expand(6, 9).contiguous()
    results = []
    for name in ("gspo", "gspo_token"):
        lp = log_r.clone().requires_grad_()
        loss, metrics = policy_loss(lp, torch.zeros_like(log_r), adv, mask, spec(name))
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    assert m1["clip_high_tokens"] + m1["clip_low_tokens"] > 0  # some rows clipped, some not
    assert m1["clip_high_tokens"] + m1["clip_low_tokens"] < mask.sum()
    torch.testing.assert_close(l1, l2, rtol=1e-14, atol=0)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-18)
    for key in m1:
        torch.testing.assert_close(m1[key], m2[key], rtol=1e-12, atol=1e-15)
    # with per-token advantages they differ: GSPO-token weights each token's own advantage
    adv_tok = torch.randn(6, 9, generator=gen, dtype=F64)
    grads = []
    for name in ("gspo", "gspo_token"):
        lp = (log_r * 0.1).clone().requires_grad_()
        policy_loss(lp, torch.zeros_like(log_r), adv_tok, mask, spec(name))[0].backward()
        grads.append(lp.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_sapo_hand_values():
    lp, old, adv, mask = _inputs([[1.0, 1.0, 1.5], [1.0, 0.5, 1.0]], [[1.0], [-1.0]], [[1, 1, 0], [1, 1, 0]])
    loss, metrics = policy_loss(lp, old, adv, mask, spec("sapo"))
    # gate (4/tau) sigmoid(tau (r-1)) A: r=1 -> 2A/tau; row 1 (A<0) uses tau_neg = 1.05, r=0.5 -> (4/1.05) sigmoid(-0.525)
    row0 = (2.0 + 2.0) / 2
    row1 = -(2.0 / 1.05 + (4 / 1.05) / (1 + math.exp(0.525))) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(-0.16982494123, abs=1e-11)
    # mean gate weight sech^2(tau (r-1)/2): 1, 1, 1, sech^2(-0.2625)
    assert finalize_metrics(metrics)["sapo_gate_mean"] == pytest.approx((3 + 1 / math.cosh(0.2625) ** 2) / 4)
    assert "clip_low_tokens" not in metrics


def test_sapo_gradient_is_sech2_weighted_policy_gradient_with_tau_by_sign():
    gen = torch.Generator().manual_seed(1)
    log_r = torch.empty(5, 7, dtype=F64).uniform_(-1.2, 1.1, generator=gen)
    adv = torch.randn(5, 7, generator=gen, dtype=F64)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[1, 4:] = False
    lp = log_r.clone().requires_grad_()
    policy_loss(lp, torch.zeros_like(log_r), adv, mask, spec("sapo"))[0].backward()
    weights = mask.to(F64) / (mask.sum(-1, keepdim=True) * 5.0)  # seq-mean-token-mean
    r = log_r.exp()

    def expected(tau_pos, tau_neg):
        tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
        return -weights * torch.cosh(tau * (r - 1) / 2) ** -2 * r * adv

    torch.testing.assert_close(lp.grad, expected(1.0, 1.05), rtol=1e-12, atol=1e-15)
    assert not torch.allclose(lp.grad, expected(1.0, 1.0), rtol=1e-6, atol=0)  # tau_neg matters


def test_sapo_gradient_equals_unclipped_policy_gradient_on_policy():
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.rand(4, 6, generator=gen) < 0.7
    mask[:, 0] = True
    old = torch.randn(4, 6, generator=gen, dtype=F64)
    grads = []
    for cfg in (spec("sapo"), spec("grpo", clip_eps_low=0.9, clip_eps_high=1e6)):
        lp = old.clone().requires_grad_()
        policy_loss(lp, old, adv, mask, cfg)[0].backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-14, atol=1e-16)
    assert torch.count_nonzero(grads[0]) == torch.count_nonzero(adv * mask)


@pytest.mark.parametrize(
    ("estimator", "diff", "value", "grad"),
    [
        # x = log pi_ref - log pi = -diff; k1 = -x, k2 = x^2/2, k3 = e^x - 1 - x; d/d log pi = -dk/dx
        ("k1", 0.5, 0.5, 1.0),
        ("k2", 0.5, 0.125, 0.5),
        ("k3", 0.5, math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
        ("k1", -0.5, -0.5, 1.0),
        ("k2", -0.5, 0.125, -0.5),
        ("k3", -0.5, math.exp(0.5) - 1.5, 1 - math.exp(0.5)),
    ],
)
def test_kl_estimators(estimator, diff, value, grad):
    cfg = spec("grpo", kl_coef=0.1, kl_estimator=estimator)
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[-diff, 3.0]], dtype=F64)  # second token is padding
    mask = torch.tensor([[1, 0]])
    loss, metrics = policy_loss(lp, lp.detach(), torch.zeros(1, 2, dtype=F64), mask, cfg, ref_log_probs=ref)
    assert loss.item() == pytest.approx(0.1 * value, abs=1e-14)
    assert finalize_metrics(metrics)["ref_kl_mean"] == pytest.approx(value, abs=1e-14)
    loss.backward()
    # the pg part at r = 1 with A = 0 has no gradient: only beta * dKL
    torch.testing.assert_close(lp.grad, torch.tensor([[0.1 * grad, 0.0]], dtype=F64), rtol=1e-12, atol=1e-16)


def test_kl_reported_but_not_added_when_coefficient_is_zero():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(lp, lp.detach(), torch.ones(1, 2, dtype=F64), torch.ones(1, 2), spec("grpo"),
                                ref_log_probs=torch.full((1, 2), -1.0, dtype=F64))  # fmt: skip
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["kl_loss"].item() == 0.0 and metrics["ref_kl_sum"].item() == pytest.approx(
        2 * (math.exp(-1) - 1 + 1)
    )


def _is_case(mode, level, rollout):
    cfg = spec("dapo", is_correction=mode, is_level=level, is_threshold=2.0, is_mask_min=0.5, is_mask_max=2.0)
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rollout = torch.tensor(rollout, dtype=F64).log()
    # old = 0, so w = pi_old / pi_rollout = 1 / rollout-prob; ratio r = 1 and A = 1: gate = 1 per token
    loss, metrics = policy_loss(lp, lp.detach(), torch.ones(2, 3, dtype=F64), mask, cfg, rollout_log_probs=-rollout)
    loss.backward()
    return loss.item(), lp.grad, metrics


def test_importance_weight_truncation_and_masking_token_level():
    w = [[3.0, 0.25, 1.5], [1.0, 2.0, 99.0]]  # last entry is padding
    loss, grad, metrics = _is_case("truncate", "token", w)
    assert loss == pytest.approx(-(2.0 + 0.25 + 1.5 + 1.0 + 2.0) / 5)
    torch.testing.assert_close(grad, -torch.tensor([[2.0, 0.25, 1.5], [1.0, 2.0, 0.0]], dtype=F64) / 5)
    assert metrics["is_truncated_tokens"].item() == 1
    assert metrics["is_weight_max"].item() == pytest.approx(3.0) and metrics["is_weight_min"].item() == pytest.approx(
        0.25
    )
    loss, grad, metrics = _is_case("mask", "token", w)
    assert loss == pytest.approx(-(1.5 + 1.0 + 2.0) / 5)  # 3.0 > C_max and 0.25 < C_min are dropped
    assert metrics["is_dropped_tokens"].item() == 2 and grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0
    loss, grad, metrics = _is_case("none", "token", w)
    assert loss == pytest.approx(-1.0) and "is_dropped_tokens" not in metrics and "is_truncated_tokens" not in metrics
    k3 = sum(x - 1 - math.log(x) for x in (3.0, 0.25, 1.5, 1.0, 2.0)) / 5
    assert finalize_metrics(metrics)["rollout_kl_mean"] == pytest.approx(k3)


def test_importance_weight_geometric_level_is_geometric_mean():
    # row 0: exp(mean(log 3, log 1/3, log 1)) = 1; row 1: exp(mean(log 4, log 4)) = 4 -> truncated to 2 / masked
    w = [[3.0, 1 / 3, 1.0], [4.0, 4.0, 1.0]]
    loss, grad, metrics = _is_case("truncate", "geometric", w)
    assert loss == pytest.approx(-(3 * 1.0 + 2 * 2.0) / 5)
    assert metrics["is_truncated_tokens"].item() == 2
    loss, grad, metrics = _is_case("mask", "geometric", w)
    assert loss == pytest.approx(-3.0 / 5)
    assert metrics["is_dropped_tokens"].item() == 2 and torch.count_nonzero(grad[1]).item() == 0


def test_importance_weight_sequence_level_is_the_product_as_in_verl():
    # 100 tokens with log w = 0.01 each: the product e^1 = 2.718 (capped at C = 2), the geometric mean e^0.01
    cfg = {level: spec("dapo", is_correction="truncate", is_level=level, is_threshold=2.0) for level in IS_LEVELS}
    lp = torch.zeros(1, 100, dtype=F64)
    rollout = torch.full((1, 100), -0.01, dtype=F64)
    mask = torch.ones(1, 100)
    weights = {}
    for level, c in cfg.items():
        loss, metrics = policy_loss(lp, lp, torch.ones(1, 100, dtype=F64), mask, c, rollout_log_probs=rollout)
        weights[level] = (-loss.item(), metrics["is_weight_max"].item(), metrics["is_truncated_tokens"].item())
    assert weights["sequence"] == (pytest.approx(2.0), pytest.approx(math.e, rel=1e-12), 100)
    assert weights["geometric"] == (pytest.approx(math.exp(0.01)), pytest.approx(math.exp(0.01), rel=1e-12), 0)
    assert weights["token"] == (pytest.approx(math.exp(0.01)), pytest.approx(math.exp(0.01), rel=1e-12), 0)
    # row 1: product 4 * 0.25 * 1 = 1 (kept), geometric mean 1 too; row 0: product 3 * 3 = 9 -> truncated
    loss, _, metrics = _is_case("truncate", "sequence", [[3.0, 3.0, 1.0], [4.0, 0.25, 1.0]])
    assert loss == pytest.approx(-(3 * 2.0 + 2 * 1.0) / 5)
    assert metrics["is_weight_max"].item() == pytest.approx(9.0)
    # the summed log-weight is clamped to +-max_log_ratio: 100 tokens of log w = 5 give e^20, not inf
    loss, metrics = policy_loss(lp, lp, torch.ones(1, 100, dtype=F64), mask, cfg["sequence"],
                                rollout_log_probs=torch.full((1, 100), -5.0, dtype=F64))  # fmt: skip
    assert metrics["is_weight_max"].item() == pytest.approx(math.exp(20.0), rel=1e-12) and loss.item() == -2.0


def test_rejection_removes_tokens_from_the_normaliser_weighting_only_mask_does_not():
    w = [[3.0, 0.25, 1.5], [1.0, 2.0, 99.0]]  # last entry is padding; 3.0 and 0.25 are outside [0.5, 2]
    # token-mean: mask keeps 5 tokens in the denominator, reject only the 3 kept ones
    loss, grad, metrics = _is_case("mask", "token", w)
    assert loss == pytest.approx(-(1.5 + 1.0 + 2.0) / 5)
    loss, grad, metrics = _is_case("reject", "token", w)
    assert loss == pytest.approx(-(1.5 + 1.0 + 2.0) / 3)
    torch.testing.assert_close(grad, -torch.tensor([[0.0, 0.0, 1.5], [1.0, 2.0, 0.0]], dtype=F64) / 3)
    assert metrics["tokens"].item() == 3 and "is_dropped_tokens" not in metrics
    # sequence level (the product): row 0's 3 * 0.25 * 1.5 = 1.125 is kept, row 1's 1 * 2 = 2 too;
    # with C_max = 1.5 row 1 is rejected whole: seq-mean-token-mean over the one sequence left
    cfg = spec("grpo", is_correction="reject", is_level="sequence", is_mask_min=0.5, is_mask_max=1.5)
    rollout = -torch.tensor(w, dtype=F64).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lp = torch.zeros(2, 3, dtype=F64)
    kept = kept_mask(cfg, mask, lp, rollout)
    assert kept.tolist() == [[True, True, True], [False, False, False]]
    loss, metrics = policy_loss(lp, lp, torch.ones(2, 3, dtype=F64), mask, cfg, rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(-1.125) and metrics["sequences"].item() == 1
    masked, _ = policy_loss(lp, lp, torch.ones(2, 3, dtype=F64), mask, dataclasses.replace(cfg, is_correction="mask"),
                            rollout_log_probs=rollout)  # fmt: skip
    assert masked.item() == pytest.approx(-1.125 / 2)  # weighting only: row 1 still counts as a sequence


def test_log_ratios_of_50_are_finite_and_clamped():
    # +-50 as required, and +-100 whose exp overflows float32 without the clamp
    lp = torch.tensor([[50.0, -50.0, 100.0, 0.1, 0.0], [-50.0, 50.0, -100.0, -0.1, 0.0]], dtype=torch.float32)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    old = torch.zeros(2, 5)
    old[:, 4] = float("-inf")  # padding may hold anything
    lp[:, 4] = float("nan")
    ref = torch.full((2, 5), -60.0)
    for name in ("grpo", "dapo", "gspo", "gspo_token", "sapo"):
        cfg = spec(name, kl_coef=0.01, is_correction="truncate")
        leaf = lp.clone().requires_grad_()
        loss, metrics = policy_loss(leaf, old, adv, mask, cfg, ref_log_probs=ref, rollout_log_probs=old - 55.0)
        loss.backward()
        assert torch.isfinite(loss), name
        assert torch.isfinite(leaf.grad).all(), name
        assert leaf.grad[:, 4].eq(0).all(), name
        if cfg.ratio_level == "token":  # clamped at max_log_ratio = 20
            assert metrics["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-5), name
        assert all(torch.isfinite(v) for v in metrics.values()), name


def test_bfloat16_inputs_are_computed_in_float32():
    lp = torch.tensor([[0.1, -0.2]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 2, dtype=torch.bfloat16), torch.ones(1, 2, dtype=torch.bfloat16),
                          torch.ones(1, 2), spec("grpo"))  # fmt: skip
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16


def test_bad_inputs_name_the_culprit():
    lp, old, adv, mask = _inputs(*BATCH)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1\), log_probs has \(2, 3\)"):
        policy_loss(lp, old, adv[:, :1], mask, spec("grpo"))
    with pytest.raises(ValueError, match="log_probs must be a floating"):
        policy_loss(lp.detach()[0], old, adv, mask, spec("grpo"))
    with pytest.raises(ValueError, match="algorithm.kl_coef = 0.1 needs ref_log_probs"):
        policy_loss(lp, old, adv, mask, spec("grpo", kl_coef=0.1))
    with pytest.raises(ValueError, match="algorithm.is_correction = 'mask' needs rollout_log_probs"):
        policy_loss(lp, old, adv, mask, spec("grpo", is_correction="mask"))
    with pytest.raises(ConfigError, match="unknown objective 'trpo'"):
        policy_loss(lp, old, adv, mask, spec("trpo"))
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode = 'token-mean' is not supported"):
        loss_spec(AlgorithmConfig(ratio_level="sequence", loss_agg_mode="token-mean"))
    with pytest.raises(ConfigError, match="algorithm.gate = 'hard' is not allowed"):
        loss_spec(AlgorithmConfig(gate="hard"))
    with pytest.raises(ConfigError, match="algorithm.clip_eps_low = 1.5 is out of range"):
        loss_spec(AlgorithmConfig(clip_eps_low=1.5))
    with pytest.raises(TypeError, match="spec must be a LossSpec, got dict"):
        policy_loss(lp, old, adv, mask, {"name": "grpo"})
    with pytest.raises(ValueError, match="response_mask\\[1\\] must be \\[B, T\\]"):
        global_normalizer([mask, mask[0]])


def test_loss_spec_validates_once_at_construction_naming_the_key():
    with pytest.raises(
        ValueError, match=r"algorithm\.kl_estimator = 'k4' is not allowed; allowed: \['k1', 'k2', 'k3'\]"
    ):
        spec("grpo", kl_estimator="k4")
    with pytest.raises(ValueError, match=r"algorithm\.dual_clip_c = 0\.5 is out of range; allowed: float > 1"):
        spec("grpo", dual_clip_c=0.5)
    with pytest.raises(ValueError, match=r"algorithm\.is_threshold = 'two' is out of range; allowed: float > 0"):
        spec("grpo", is_threshold="two")
    with pytest.raises(ValueError, match=r"algorithm\.gate = 'soft' \(SAPO\) needs algorithm\.ratio_level = 'token'"):
        spec("sapo", ratio_level="sequence_token")
    with pytest.raises(ValueError, match=r"algorithm\.is_mask_min \(2\.0\) must be below algorithm\.is_mask_max"):
        spec("grpo", is_mask_min=2.0)
    with pytest.raises(TypeError, match=r"SimpleNamespace has no attribute\(s\) \['ratio_level'"):
        LossSpec.from_section(SimpleNamespace(gate="clip"))
    built = spec("gspo")
    assert (built.ratio_level, built.clip_eps_low, built.dual_clip_c) == ("sequence", 3e-4, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.gate = "soft"


def test_losses_import_no_other_package_of_megatron_rl():
    code = (
        "import json, sys, megatron_rl.losses as losses; losses.policy_loss; losses.global_normalizer; losses.finalize_metrics;"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('megatron_rl'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert "megatron_rl.losses.objective" in loaded
    package = {"megatron_rl", "megatron_rl.eager_jit", "megatron_rl.lazy_imports"}  # __init__.py and its import hooks
    assert [m for m in loaded if m not in package and not m.startswith("megatron_rl.losses")] == []


def test_k3_is_clamped_to_10_per_token_with_zero_gradient_beyond_as_verls_low_var_kl():
    # x = log pi_ref - log pi: 7.5 gives e^7.5 - 1 - 7.5 = 1799.54 unclamped (gradient -1807.04), here 10 and 0;
    # x = 2 stays e^2 - 3 = 4.389 with gradient -(e^2 - 1) = -6.389
    cfg = spec("grpo", kl_coef=0.1, kl_estimator="k3")
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[7.5, 2.0]], dtype=F64)
    loss, metrics = policy_loss(lp, lp.detach(), torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), cfg, ref_log_probs=ref)
    assert loss.item() == pytest.approx(0.1 * (10.0 + math.exp(2) - 3) / 2, abs=1e-12)
    assert finalize_metrics(metrics)["ref_kl_mean"] == pytest.approx((10.0 + math.exp(2) - 3) / 2, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, -0.1 * (math.exp(2) - 1) / 2]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-16)


def test_k1_in_the_loss_is_refused_and_allowed_in_the_reward():
    with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator = 'k1' in the loss .* expectation is 0"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"])
    cfg = load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1", "algorithm.kl_in_reward=true"])
    assert cfg.algorithm.kl_estimator == "k1" and loss_spec(cfg.algorithm).kl_coef == 0.0
