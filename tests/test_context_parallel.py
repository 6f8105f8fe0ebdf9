"""Context parallelism's pure parts, in-process: the split indices (padded and THD), the way back,
the inputs a CP rank feeds the model, routing's token order, the layout and config checks, the
loss scale against Megatron's own scaling. The collectives run in gloo launches
(tests/test_actor_distributed.py): `w2_cp_reductions` (the loss and GSPO's sequence ratio from
CP-split log-probs), and the model itself with the local specs' `ContextParallelAttention`
(tests/mrl_multiproc/scenarios_cp.py: CP 2 and TP 2 x CP 2 against one rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch, build_inputs, split_for_context
from megatron_rl.actor.micro_batches import MicroBatch
from megatron_rl.actor.routing_replay import given_routing, routed_token_mask, token_slice
from megatron_rl.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from megatron_rl.parallel.context_parallel import ContextSplit, chunk_positions, gather_from_context
from megatron_rl.parallel.layout import check_layout


def test_chunk_positions_are_megatrons_load_balanced_chunks() -> None:
    # 2 x CP = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # CP 4: 8 chunks of 1
    assert [chunk_positions(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert chunk_positions(4, 1, 0).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"6 positions .* multiple of 2 x CP = 4"):
        chunk_positions(6, 2, 0)
    with pytest.raises(ValueError, match=r"CP rank 2 is outside \[0, 2\)"):
        chunk_positions(8, 2, 2)


def test_thd_split_is_per_sequence() -> None:
    """Padded cu_seqlens [0, 4, 12, 16] over CP 2, as TE's thd_get_partitioned_indices: each
    sequence in 4 chunks (of 1, 2 and 1 positions), rank r its chunks r and 3 - r."""
    rank0 = ContextSplit(2, 0, (0, 4, 12, 16))
    rank1 = ContextSplit(2, 1, (0, 4, 12, 16))
    assert rank0.positions().tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert rank1.positions().tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    assert rank0.positions(1).tolist() == rank1.positions().tolist()
    assert (rank0.length, rank0.local_length) == (16, 8)
    # an empty segment holds nothing; a padded micro-batch is one segment
    assert ContextSplit(2, 1, (0, 0, 8)).positions().tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"segment \[4, 10\) of 6 positions is not a multiple of 2 x CP = 4"):
        ContextSplit(2, 0, (0, 4, 10))
    with pytest.raises(ValueError, match="must start at 0"):
        ContextSplit(2, 0, (4, 8))


def test_restore_order_inverts_the_split() -> None:
    split = ContextSplit(2, 0, (0, 4, 12, 16))
    full = torch.arange(3 * 16 * 2).view(3, 16, 2)
    parts = [full.index_select(1, split.positions(r)) for r in range(2)]
    assert torch.equal(split.restore_order(parts, dim=1), full)
    # dim 0 (routing's [positions, rows, ...] order); CP 4 on one segment
    four = ContextSplit(4, 0, (0, 8))
    seq = torch.arange(8 * 3).view(8, 3)
    assert torch.equal(four.restore_order([seq[four.positions(r)] for r in range(4)], dim=0), seq)
    with pytest.raises(ValueError, match="part 1 has 7 positions along dim 1, expected 8 = 16 / CP 2"):
        split.restore_order([parts[0], parts[1][:, :7]], dim=1)
    with pytest.raises(ValueError, match="1 parts for parallel.context_parallel_size = 2"):
        split.restore_order(parts[:1], dim=1)
    # one CP rank: nothing to gather, no process group needed
    one = ContextSplit(1, 0, (0, 6))
    x = torch.randn(2, 6)
    assert gather_from_context(x, one, dim=1) is x
    with pytest.raises(ValueError, match="has 5 positions along dim 1, this CP rank holds 6"):
        gather_from_context(x[:, :5], one, dim=1)


def _batch() -> ActorBatch:
    return ActorBatch(
        tokens=[torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3])],
        prompt_lengths=[2, 1],
        old_log_probs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0])],
    )


def test_packed_inputs_aligned_for_cp() -> None:
    """With align 4 (2 x CP 2) each sample starts at a multiple of 4, its padding inside its segment
    (positions counting on), and the bounds are those padded ones."""
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3), packed=True)
    inp = build_inputs(_batch(), mb, torch.device("cpu"), pad_to=(1, 16), align=4)
    assert inp.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 0]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert inp.packing.starts == (0, 8) and inp.packing.cu_seqlens.tolist() == [0, 8, 12, 16]
    assert inp.packing.max_seqlen == 8 and inp.placements == ((0, 0), (0, 8))
    with pytest.raises(ValueError, match="does not hold the micro-batch"):
        build_inputs(_batch(), mb, torch.device("cpu"), pad_to=(1, 10), align=4)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_each_cp_rank_feeds_its_positions(packed: bool) -> None:
    """The two CP ranks' inputs (ids, position ids, head targets and mask) put back in order are the
    un-split ones; the loss side stays whole on both; `max_len` is the whole micro-batch's."""
    mb = MicroBatch(indices=(0, 1), lengths=(5, 3), packed=packed)
    shape = (1, 16) if packed else (2, 8)
    whole = build_inputs(_batch(), mb, torch.device("cpu"), pad_to=shape, with_fields=("old_log_probs",), align=4)
    parts = [split_for_context(whole, 2, r) for r in range(2)]
    split = parts[0].context.split
    assert split.bounds == ((0, 8, 12, 16) if packed else (0, 8))
    for name in ("input_ids", "position_ids", "head_target", "head_mask"):
        local = [getattr(p, name) for p in parts]
        assert local[0].shape[1] == shape[1] // 2, name
        assert torch.equal(split.restore_order(local, dim=1), getattr(whole, name)), name
    for p in parts:
        assert p.max_len == shape[1] and p.rows == shape[0]
        assert torch.equal(p.target_mask, whole.target_mask) and torch.equal(
            p.fields["old_log_probs"], whole.fields["old_log_probs"]
        )
    assert torch.equal(parts[1].local_positions, split.positions(1)) and whole.local_positions is None
    # padded rows: rank 0 holds positions 0, 1, 6, 7 of every row
    if not packed:
        assert parts[0].input_ids.tolist() == [[5, 6, 0, 0], [1, 2, 0, 0]]
    with pytest.raises(ValueError, match="split already"):
        split_for_context(parts[0], 2, 0)
    assert split_for_context(whole, 1, 0) is whole


def test_routing_follows_the_cp_positions() -> None:
    """A router of CP rank 0 (positions 0, 1, 6, 7 of a row of 8) sees those tokens, under SP its TP
    rank's contiguous half of them."""
    held = ContextSplit(2, 0, (0, 8)).positions()
    routed = [torch.arange(7).view(7, 1, 1) * 10 + torch.tensor([[[1, 2]]])]  # sample of 8 tokens, 1 layer, top-2
    sl = token_slice(1, 8, tp_rank=0, tp_size=1, sequence_parallel=False, held=held)
    assert sl.positions.tolist() == [0, 1, 6, 7] and sl.tokens == 4
    assert given_routing(routed, [(0, 0)], sl, layers=[0], top_k=2)[0][:, 0].tolist() == [1, 11, 61, 0]
    assert routed_token_mask([8], [(0, 0)], sl).tolist() == [True, True, True, False]  # the last token has none
    upper = token_slice(1, 8, tp_rank=1, tp_size=2, sequence_parallel=True, held=held)
    assert upper.positions.tolist() == [6, 7]
    with pytest.raises(ValueError, match=r"max_len \(4 on this CP rank\) divisible by TP \(3\)"):
        token_slice(1, 8, 0, 3, True, held=held)


def test_layout_with_context_parallel() -> None:
    layout = check_layout(ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2), 8)
    assert (layout.context_parallel_size, layout.data_parallel_size) == (2, 2)
    with pytest.raises(
        ConfigError, match=r"world size 6 is not divisible by .* x parallel.context_parallel_size \(4\)"
    ):
        check_layout(ParallelConfig(context_parallel_size=4), 6)


@pytest.mark.parametrize(("dp", "cp", "micro_batches"), [(1, 2, 3), (2, 2, 1), (3, 4, 5), (2, 1, 4)])
def test_loss_scale_undoes_megatrons_scaling_exactly(
    monkeypatch: pytest.MonkeyPatch, dp: int, cp: int, micro_batches: int
) -> None:
    """The gradient is the sum over micro-batches and DP ranks (`actor.optimizer`): Megatron's own
    `forward_step_calc_loss`, run here, multiplies the actor's (loss, metrics) by CP / micro-batches,
    and its DDP divides by DP x CP (`DistributedDataParallel`: gradient_scaling_factor = 1 / the
    DP x CP group's size); with `loss_scale` the product is 1. It was CP before (`grad_norm` CP
    times too large, `train.grad_clip` acting at 1 / CP)."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    from megatron_rl.actor import optimizer

    def dp_size(with_context_parallel: bool = False) -> int:
        return dp * cp if with_context_parallel else dp

    monkeypatch.setattr(optimizer.ps, "get_data_parallel_world_size", dp_size)
    monkeypatch.setattr(optimizer.ps, "get_context_parallel_world_size", lambda: cp)
    scale = optimizer.loss_scale(micro_batches)
    config = SimpleNamespace(calculate_per_token_loss=False, timers=None)
    loss, _ = forward_step_calc_loss(
        None,
        torch.tensor(1.0),
        lambda out: (out * scale, {}),
        config,
        None,
        False,
        micro_batches,
        [],
        cp_group_size=cp,
        is_last_stage=True,
    )
    assert float(loss) / (dp * cp) == pytest.approx(1.0, rel=1e-12)


def test_cp_comm_type_checks() -> None:
    model = ModelConfig(num_attention_heads=8, num_query_groups=2)
    packed = TrainConfig(micro_batch_tokens=256)
    validate(Config(model=model, parallel=ParallelConfig(context_parallel_size=2), train=packed))
    with pytest.raises(ConfigError, match="cp_comm_type = 'all_gather' with train.micro_batch_tokens > 0"):
        validate(
            Config(
                model=model, parallel=ParallelConfig(context_parallel_size=2, cp_comm_type="all_gather"), train=packed
            )
        )
    with pytest.raises(ConfigError, match=r"'a2a' needs .* \(4\) to divide model.num_query_groups \(2\)"):
        validate(Config(model=model, parallel=ParallelConfig(context_parallel_size=4, cp_comm_type="a2a")))
    validate(Config(model=model, parallel=ParallelConfig(context_parallel_size=2, cp_comm_type="a2a")))
