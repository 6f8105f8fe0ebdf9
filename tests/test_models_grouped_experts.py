"""Transformer Engine's grouped experts under explicit expert comms, at expert-TP 2, without TE: the
parameters are built and tagged as TE's `GroupedLinear` tags them there (every `weight{i}` with
partition dim 0, fc2 included, because Megatron hides the parallelism from TE), and the partition
dims, full shapes, import split and export join are checked against the role of each weight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state as ps

from megatron_rl.config import ModelConfig
from megatron_rl.models.init import deterministic_full_tensor, iter_param_shards, take_shard
from megatron_rl.models.shard_gather import join_shards

H, M, ETP = 4, 6, 2  # hidden, expert intermediate size, expert-TP


class _GroupedLinear(torch.nn.Module):
    def __init__(self, shape: tuple[int, int], experts: int) -> None:
        super().__init__()
        for i in range(experts):
            weight = torch.nn.Parameter(torch.empty(shape))
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 1  # TE's tag
            self.register_parameter(f"weight{i}", weight)


def _chunk(experts: int = 2) -> torch.nn.Module:
    mlp = torch.nn.Module()
    mlp.experts = torch.nn.Module()
    mlp.experts.linear_fc1 = _GroupedLinear((2 * M // ETP, H), experts)  # SwiGLU [gate; up], column-parallel
    mlp.experts.linear_fc2 = _GroupedLinear((H, M // ETP), experts)  # row-parallel
    mlp.local_expert_indices = list(range(experts))
    layer = torch.nn.Module()
    layer.mlp, layer.layer_number = mlp, 1
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([layer])
    chunk.config = SimpleNamespace(gated_linear_unit=True)
    return chunk


def test_grouped_expert_partition_dims_follow_the_role_at_etp2(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig(hidden_size=H, moe_ffn_hidden_size=M, num_experts=2)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: ETP)
    monkeypatch.setattr(ps, "get_expert_tensor_parallel_world_size", lambda: ETP)
    by_rank = []
    for rank in range(ETP):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        monkeypatch.setattr(ps, "get_expert_tensor_parallel_rank", lambda rank=rank: rank)
        by_rank.append(list(iter_param_shards([_chunk()], model)))
    shards = by_rank[0]
    assert [s.global_name for s in shards] == [
        f"decoder.layers.0.mlp.experts.local_experts.{e}.{fc}.weight"
        for fc in ("linear_fc1", "linear_fc2")
        for e in (0, 1)
    ]
    assert [(s.partition_dim, s.sections, s.full_shape) for s in shards] == [(0, (M, M), (2 * M, H))] * 2 + [
        (1, (), (H, M))
    ] * 2  # fc2 is split over its input dimension: the HF down_proj is [H, M]
    for per_rank in zip(*by_rank, strict=True):
        full = deterministic_full_tensor(per_rank[0].global_name, per_rank[0].full_shape, model, seed=1)
        parts = [take_shard(full, s) for s in per_rank]  # import: each rank's piece
        assert all(p.shape == s.param.shape for p, s in zip(parts, per_rank, strict=True))
        joined = join_shards(per_rank[0], parts, torch.empty(full.shape))
        assert torch.equal(joined, full)  # export: the pieces join to the full tensor
    fc2 = deterministic_full_tensor(shards[2].global_name, (H, M), model, seed=1)
    assert torch.equal(take_shard(fc2, by_rank[1][2]), fc2[:, M // ETP :])  # rank 1 holds the second input half
