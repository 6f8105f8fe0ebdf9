"""Token-budget micro-batch packing, equal counts across DP ranks, padding and order restoration."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.actor.micro_batches import (
    TokenBudget,
    agree_num_micro_batches,
    balance_across_ranks,
    pad_right,
    plan_micro_batches,
    plans_with_equal_count,
    token_imbalance,
    unpad,
)
from megatron_rl.config import TrainConfig

# sorted longest first: 8 (i2), 7 (i4), 5 (i0), 3 (i1), 3 (i5), 2 (i3); budget 16:
# [i2, i4] = 2 x 8 = 16; [i0, i1, i5] = 3 x 5 = 15 (adding i3 would be 4 x 5 = 20); [i3] = 2
LENGTHS = [5, 3, 8, 2, 7, 3]


def layout(plan) -> list[tuple[int, ...]]:
    return [mb.indices for mb in plan.micro_batches]


def test_packing_by_budget_hand_computed() -> None:
    plan = plan_micro_batches(LENGTHS, 16)
    assert layout(plan) == [(2, 4), (0, 1, 5), (3,)]
    assert [mb.padded_tokens for mb in plan.micro_batches] == [16, 15, 2]
    assert [mb.max_len for mb in plan.micro_batches] == [8, 5, 2]
    assert plan.real_tokens == 28 and plan.padded_tokens == 33
    assert plan.padding_fraction == pytest.approx(5 / 33)
    assert plan.oversized == []


def test_budget_of_one_row_each_and_of_everything() -> None:
    assert layout(plan_micro_batches(LENGTHS, 8)) == [(2,), (4,), (0,), (1, 5), (3,)]
    everything = plan_micro_batches(LENGTHS, 48)  # 6 rows x 8 = 48
    assert layout(everything) == [(2, 4, 0, 1, 5, 3)]
    assert everything.padding_fraction == pytest.approx(1 - 28 / 48)


def test_sample_longer_than_budget_gets_its_own_micro_batch() -> None:
    plan = plan_micro_batches([20, 4, 4, 4, 4], 16)
    assert layout(plan) == [(0,), (1, 2, 3, 4)]
    assert plan.oversized == [0]
    assert [mb.padded_tokens for mb in plan.micro_batches] == [20, 16]


def test_fixed_count_splits_the_largest() -> None:
    # 3 micro-batches -> halve [i2, i4] (16 padded) -> halve [i0, i1, i5] (15) into [i0, i1] and [i5]
    plan = plan_micro_batches(LENGTHS, 16, num_micro_batches=5)
    assert layout(plan) == [(2,), (4,), (0, 1), (5,), (3,)]
    assert plan.padded_tokens == 8 + 7 + 10 + 3 + 2
    assert layout(plan_micro_batches(LENGTHS, 16, num_micro_batches=3)) == [(2, 4), (0, 1, 5), (3,)]
    with pytest.raises(ValueError, match=r"num_micro_batches = 2 is too few: 6 samples need 3 micro-batches of <= 16"):
        plan_micro_batches(LENGTHS, 16, num_micro_batches=2)
    with pytest.raises(ValueError, match="cannot make 7 micro-batches from 6 samples"):
        plan_micro_batches(LENGTHS, 16, num_micro_batches=7)


def test_equal_count_across_dp_ranks() -> None:
    plans = plans_with_equal_count([LENGTHS, [4, 4, 4]], 16)
    assert [len(p) for p in plans] == [3, 3]
    assert layout(plans[0]) == [(2, 4), (0, 1, 5), (3,)]
    # [4, 4, 4] fits one micro-batch (12 tokens); halved twice to reach 3
    assert layout(plans[1]) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches from 2 samples"):
        plans_with_equal_count([LENGTHS, [4, 4]], 16)


def test_packed_first_fit_decreasing_hand_computed() -> None:
    # longest first, each into the first micro-batch with room for it (budget 10): 8 -> A, 7 -> B,
    # 5 -> C (A 13, B 12 too much), 3 (i1) -> B (A would be 11), 3 (i5) -> C, 2 -> A
    plan = plan_micro_batches(LENGTHS, 10, packed=True)
    assert layout(plan) == [(2, 3), (4, 1), (0, 5)]
    assert [mb.padded_tokens for mb in plan.micro_batches] == [10, 10, 8] and plan.padding_fraction == 0.0
    assert all(mb.packed for mb in plan.micro_batches)
    # padded, the same budget takes 4 (rows x longest row is what a padded one costs: [8] [7] [5, 3] [3, 2])
    assert len(plan_micro_batches(LENGTHS, 10)) == 4
    over = plan_micro_batches([30, 4, 4], 10, packed=True)
    assert layout(over) == [(0,), (1, 2)] and over.oversized == [0]


@pytest.mark.parametrize("seed", range(5))
def test_packed_plans_keep_the_budget_and_every_sample_once(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 200, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen)]
    budget = 256
    plan = plan_micro_batches(lengths, budget, packed=True)
    assert sorted(i for mb in plan.micro_batches for i in mb.indices) == list(range(len(lengths)))
    for mb in plan.micro_batches:
        assert mb.real_tokens <= budget and list(mb.lengths) == sorted(mb.lengths, reverse=True)
        assert list(mb.lengths) == [lengths[i] for i in mb.indices]
    # first fit: no two micro-batches would fit together (the later one's samples fit the earlier one)
    loads = [mb.real_tokens for mb in plan.micro_batches]
    assert all(a + b > budget for k, a in enumerate(loads) for b in loads[k + 1 :])
    assert len(plan) <= -(-sum(lengths) // budget) * 11 // 9 + 1  # FFD's bound, 11/9 OPT + 6/9
    # equal counts over DP ranks: splitting keeps the budget and every sample once
    plans = plans_with_equal_count([lengths, [7] * 64], budget, packed=True)  # the 64 sevens: 2 micro-batches
    assert len(plans[0]) == len(plans[1]) == max(len(plan), 2)
    for p, n in zip(plans, [len(lengths), 64], strict=True):
        assert sorted(i for mb in p.micro_batches for i in mb.indices) == list(range(n))
        assert all(mb.real_tokens <= budget or mb.rows == 1 for mb in p.micro_batches)


def test_packed_equal_count_splits_into_balanced_parts() -> None:
    # rank 0 needs 2 micro-batches (10 alone, over the budget of 6); rank 1's [4, 3, 2, 2] (11 tokens)
    # fits in 2 first fit ([4, 2], [3, 2]) and is split the same way; [2, 2, 2] into [2, 2] + [2]
    plans = plans_with_equal_count([[10, 1, 1], [4, 3, 2, 2], [2, 2, 2]], 6, packed=True)
    assert [layout(p) for p in plans] == [[(0,), (1, 2)], [(0, 2), (1, 3)], [(0, 2), (1,)]]
    with pytest.raises(
        ValueError, match=r"too few: 3 samples need 2 micro-batches of <= 6 tokens \(train.micro_batch_tokens\)"
    ):
        plan_micro_batches([10, 1, 1], 6, num_micro_batches=1, packed=True)


def test_token_imbalance_and_the_budget_of_a_config() -> None:
    # 9 -> r0, 8 -> r1, 7 -> r1, 6 -> r0, 5 -> r0 (15 = 15: the lower rank), 4 -> r1: 20 and 19 tokens
    shares = balance_across_ranks([9, 8, 7, 6, 5, 4], 2)
    assert shares == [[0, 3, 4], [1, 2, 5]]
    assert token_imbalance([20, 19]) == pytest.approx(40 / 39)
    assert token_imbalance([5, 5, 5]) == 1.0 and token_imbalance([6, 0]) == 2.0
    with pytest.raises(ValueError, match="positive token count"):
        token_imbalance([0, 0])
    assert TokenBudget.of(TrainConfig(max_tokens_per_micro_batch=99)) == TokenBudget(99, packed=False)
    assert TokenBudget.of(TrainConfig(micro_batch_tokens=64)) == TokenBudget(64, packed=True)


def test_pad_unpad_and_restore_original_order() -> None:
    samples = [torch.arange(n) + 100 * i for i, n in enumerate(LENGTHS)]
    plan = plan_micro_batches(LENGTHS, 16)
    padded, mask = pad_right(samples, plan.micro_batches[1], pad_value=-1)
    assert padded.tolist() == [[0, 1, 2, 3, 4], [100, 101, 102, -1, -1], [500, 501, 502, -1, -1]]
    assert mask.sum(1).tolist() == [5, 3, 3]

    results = []
    for mb in plan.micro_batches:
        padded, mask = pad_right(samples, mb, pad_value=0)
        results.append(unpad(padded * 2 + 1, mb))  # a stand-in per-token computation
    restored = plan.restore(results)
    assert len(restored) == len(LENGTHS)
    for i, r in enumerate(restored):
        assert torch.equal(r, samples[i] * 2 + 1)


def test_pad_right_keeps_trailing_dims() -> None:
    samples = [torch.ones(3, 2), torch.ones(1, 2) * 7]
    plan = plan_micro_batches([3, 1], 6)
    padded, mask = pad_right(samples, plan.micro_batches[0], pad_value=0.5)
    assert padded.shape == (2, 3, 2)
    assert padded[1].tolist() == [[7, 7], [0.5, 0.5], [0.5, 0.5]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_balance_across_ranks_hand_computed() -> None:
    # longest first to the lightest rank: 10 -> r0, 9 -> r1, 8 -> r1 (9 < 10), then the 1s -> r0 (10, 11, 12 < 17)
    assert balance_across_ranks([10, 9, 8, 1, 1, 1], 2) == [[0, 3, 4, 5], [1, 2]]
    with pytest.raises(ValueError, match="cannot split 1 samples over 2 ranks"):
        balance_across_ranks([3], 2)


def test_bad_input_names_the_culprit() -> None:
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        plan_micro_batches([3, 0], 8)
    with pytest.raises(ValueError, match=r"train.max_tokens_per_micro_batch\) must be >= 1, got 0"):
        plan_micro_batches([3], 0)
    plan = plan_micro_batches(LENGTHS, 16)
    with pytest.raises(ValueError, match="micro-batch 1: got 2 results for its 3 rows"):
        plan.restore([[0, 0], [0, 0], [0]])
    with pytest.raises(ValueError, match="sample 0 has 4 tokens, the plan says 5"):
        pad_right([torch.zeros(4)] + [torch.zeros(n) for n in LENGTHS[1:]], plan.micro_batches[1])
    with pytest.raises(ValueError, match=r"does not start with \[rows, max_len\] = \[2, 8\]"):
        unpad(torch.zeros(2, 7), plan.micro_batches[0])


def _agree_worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        local = [2, 5][rank]
        assert agree_num_micro_batches(local, dist.group.WORLD) == 5
    finally:
        dist.destroy_process_group()


def test_agree_num_micro_batches_two_ranks(tmp_path, monkeypatch) -> None:
    assert agree_num_micro_batches(4) == 4  # no process group: the local count
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_agree_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
