"""verl's advantage estimators (`megatron_rl.algorithms.estimators`) against cases worked by hand, GAE's
lambda = gamma = 1 identity with Monte-Carlo returns, RLOO's leave-one-out identity, and the
`algorithm.advantage_estimator` combinations the configuration refuses."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    masked_whiten,
)
from megatron_rl.config import ConfigError, load_config


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(got: torch.Tensor, want: list[list[float]], atol: float) -> None:
    torch.testing.assert_close(got, t(want), atol=atol, rtol=0)


def test_masked_whiten_uses_only_the_masked_tokens_with_the_unbiased_variance() -> None:
    mask = t([[1, 1, 0], [1, 0, 0]])
    # kept 1, 2, 3: mean 2, unbiased variance ((-1)^2 + 0 + 1^2) / (3 - 1) = 1 -> -1, 0, 1
    # (the biased variance 2/3 would give +-1.2247); a masked token is whitened with the same statistics
    got = masked_whiten(t([[1, 2, 100], [3, -7, 0]]), mask)
    assert got[mask.bool()].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert float(got[0, 2]) == pytest.approx(98.0, abs=1e-5)  # (100 - 2) / 1
    # the masked values change nothing the mask sees
    other = masked_whiten(t([[1, 2, -50], [3, 8, 9]]), mask)
    assert torch.equal(other[mask.bool()], got[mask.bool()])
    # shift_mean=False adds the mean back: -1 + 2, 0 + 2, 1 + 2
    assert masked_whiten(t([[1, 2, 100], [3, -7, 0]]), mask, shift_mean=False)[mask.bool()].tolist() == (
        pytest.approx([1.0, 2.0, 3.0], abs=1e-6)
    )
    with pytest.raises(ValueError, match=r"masked_whiten: the mask holds 1 token\(s\)"):
        masked_whiten(t([[1, 2]]), t([[0, 1]]))


def test_gae_by_hand_with_a_masked_observation_token() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); rewards [0, 0, 1], values [0.5, 0.2, 0.4]:
    #   t2: delta = 1 - 0.4 = 0.6                        A2 = 0.6
    #   t1: delta = 0.9 * 0.4 - 0.2 = 0.16               A1 = 0.16 + 0.72 * 0.6 = 0.592
    #   t0: delta = 0.9 * 0.2 - 0.5 = -0.32              A0 = -0.32 + 0.72 * 0.592 = 0.10624
    # returns = A + V = [0.60624, 0.792, 1.0]; whitened: mean 0.4327467, unbiased var 0.0799710
    adv, ret = compute_gae_advantage_return(t([[0, 0, 1]]), t([[0.5, 0.2, 0.4]]), t([[1, 1, 1]]), 0.9, 0.8)
    assert ret[0].tolist() == pytest.approx([0.60624, 0.792, 1.0], abs=1e-6)
    assert adv[0].tolist() == pytest.approx([-1.154585, 0.563148, 0.591437], abs=1e-5)
    # token 1 is an observation (mask 0): its value 9 is never read, A and V_next pass through it:
    #   t2: A2 = 0.6 (V_next = 0.4); t1: carries A = 0.6, V_next = 0.4
    #   t0: delta = 0.9 * 0.4 - 0.5 = -0.14, A0 = -0.14 + 0.72 * 0.6 = 0.292
    # returns [0.792, 0.6 + 9, 1.0]; two trained tokens whiten to -+1/sqrt(2) (the carried one as token 2)
    adv, ret = compute_gae_advantage_return(t([[0, 0, 1]]), t([[0.5, 9.0, 0.4]]), t([[1, 0, 1]]), 0.9, 0.8)
    assert ret[0].tolist() == pytest.approx([0.792, 9.6, 1.0], abs=1e-6)
    h = 1 / math.sqrt(2)
    assert adv[0].tolist() == pytest.approx([-h, h, h], abs=1e-5)


def test_gae_with_lambda_and_gamma_one_is_the_monte_carlo_return_minus_the_value() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.rand(3, 5, generator=gen), torch.rand(3, 5, generator=gen)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # right padding
    rewards = rewards * mask
    monte_carlo = rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{k >= t} r_k
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    keep = mask.bool()
    assert torch.allclose(ret[keep], monte_carlo[keep], atol=1e-6)
    raw = (monte_carlo - values)[keep]  # A_t before whitening; then the batch's unbiased whitening
    assert torch.allclose(adv[keep], (raw - raw.mean()) / raw.std(), atol=1e-5)


def test_rloo_by_hand_groups_by_index_and_keeps_a_lone_response() -> None:
    # group a: R = 1 (0.5 + 0.5 over two tokens), 0, 0.5 -> 1 - 0.25, 0 - 0.75, 0.5 - 0.5 = 0.75, -0.75, 0
    # group b: R = 2, 4 -> -2, 2; group c: one response, R = 3 -> 3 (verl: no baseline)
    rewards = t([[0.5, 0.5], [2, 0], [0, 0], [0, 3], [0.5, 0], [0, 4]])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]])
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, ["a", "b", "a", "c", "a", "b"])
    close(adv, [[0.75, 0.75], [-2, 0], [-0.75, -0.75], [3, 3], [0, 0], [2, 2]], 1e-6)
    assert torch.equal(adv, ret)


def test_rloo_is_the_reward_minus_the_mean_of_the_others() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(12, generator=gen)
    index = torch.arange(12) // 4
    adv, _ = compute_rloo_outcome_advantage(scores.unsqueeze(-1), torch.ones(12, 1), index)
    group_sums = scores.view(3, 4).sum(-1).repeat_interleave(4)
    others = (group_sums - scores) / 3
    assert torch.allclose(adv[:, 0], scores - others, atol=1e-6)
    assert torch.allclose(adv[:, 0].view(3, 4).sum(-1), torch.zeros(3), atol=1e-6)


def test_reinforce_plus_plus_discounts_over_trained_tokens_and_whitens_over_the_batch() -> None:
    # gamma 0.5. row 0: reward 1 on its last token -> returns 0.125, 0.25, 0.5, 1.
    # row 1: token 1 an observation, token 3 padding, reward 2 on token 2 -> returns 1, 0, 2, 0
    #   (the observation passes the running return on undiscounted: 0.5 * 2 = 1 at token 0)
    rewards = t([[0, 0, 0, 1], [0, 0, 2, 0]])
    mask = t([[1, 1, 1, 1], [1, 0, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.125, 0.25, 0.5, 1], [1, 0, 2, 0]], 1e-7)
    # trained returns 0.125, 0.25, 0.5, 1, 1, 2: mean 4.875 / 6 = 0.8125, squared deviations sum 2.3671875,
    # unbiased variance 2.3671875 / 5 = 0.4734375 -> (G - 0.8125) / 0.68807; masked tokens 0
    want = [[-0.999175, -0.817506, -0.45417, 0.272502], [0.272502, 0.0, 1.725847, 0.0]]
    close(adv, want, 1e-5)


def test_reinforce_plus_plus_baseline_weighs_responses_by_their_tokens() -> None:
    # groups {0, 1} and {2, 3}: R = 1, 0 and 3, 1 -> minus the group mean: 0.5, -0.5, 1, -1, on 2, 1, 3, 2 tokens
    rewards = t([[0, 1, 0], [0, 0, 0], [0, 0, 3], [0, 1, 0]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, [0, 0, 1, 1])
    # 8 tokens: mean (1 - 0.5 + 3 - 2) / 8 = 0.1875; squared deviations 2 * 0.3125^2 + 0.6875^2 + 3 * 0.8125^2
    # + 2 * 1.1875^2 = 5.46875, unbiased variance 5.46875 / 7 = 0.78125 -> (a - 0.1875) / 0.883883
    # (a per-response whitening would give mean 0 instead)
    p, q, r, s = 0.353553, -0.777817, 0.919239, -1.343503
    close(adv, [[p, p, 0], [q, 0, 0], [r, r, r], [s, s, 0]], 1e-5)
    assert torch.equal(adv, ret)


def test_the_estimators_name_both_shapes_of_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match=r"token_level_rewards \(2, 3\), values \(2, 4\)"):
        compute_gae_advantage_return(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"index has 3 entries for 2 responses"):
        compute_rloo_outcome_advantage(torch.zeros(2, 3), torch.ones(2, 3), [0, 0, 1])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.advantage_estimator=rloo", "algorithm.turn_credit=per_turn"],
            r"^algorithm\.turn_credit = 'per_turn' .* algorithm\.advantage_estimator = 'rloo' does not take",
        ),
        (
            [
                "algorithm.advantage_estimator=reinforce_plus_plus",
                "algorithm.kl_in_reward=true",
                "algorithm.kl_coef=0.1",
            ],
            r"^algorithm\.kl_in_reward = true .* algorithm\.advantage_estimator = 'reinforce_plus_plus'",
        ),
        (
            ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.name=gspo"],
            r"^algorithm\.advantage_estimator = 'reinforce_plus_plus' .* algorithm\.ratio_level = 'sequence'",
        ),
        (["algorithm.gamma=0.9"], r"^algorithm\.gamma = 0\.9 is read only by .* not by 'grpo'"),
        (
            ["algorithm.advantage_estimator=rloo", "algorithm.adv_norm_std=false"],
            r"^algorithm\.adv_norm_std = false is read only by .* not by 'rloo'",
        ),
        # GAE reads the critic's values (it implies critic.enabled; refused with the critic off)
        (
            ["algorithm.advantage_estimator=gae", "critic.enabled=false"],
            r"^algorithm\.advantage_estimator = 'gae' needs critic\.enabled = true, but critic\.enabled = false: ",
        ),
        (
            ["algorithm.name=ppo", "algorithm.ratio_level=sequence", "algorithm.loss_agg_mode=seq-mean-token-mean"],
            r"^algorithm\.advantage_estimator = 'gae' gives each token its own advantage, but .*'sequence'",
        ),
        (["algorithm.lam=0.95"], r"^algorithm\.lam = 0\.95 is read only by .* 'gae', not by 'grpo'$"),
        (
            ["critic.enabled=true"],
            r"^critic\.enabled = true trains a value model whose values only algorithm\.advantage_estimator = "
            r"'gae' reads, but algorithm\.advantage_estimator = 'grpo'",
        ),
    ],
)
def test_the_configuration_refuses_what_an_estimator_cannot_run(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)
