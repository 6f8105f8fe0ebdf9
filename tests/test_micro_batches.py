"""Token-budget micro-batch packing, equal counts across DP ranks, padding and order restoration."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.actor.micro_batches import (
    agree_num_micro_batches,
    balance_across_ranks,
    pad_right,
    plan_micro_batches,
    plans_with_equal_count,
    unpad,
)

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
