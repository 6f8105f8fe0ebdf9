"""A (expert-)TP-split parameter gathered on the group's first rank straight into one full tensor.

The first rank allocates the full tensor once and every shard lands in its place: a column-parallel
shard (split on dim 0) is received into its row block, a shard of separately split sections (a SwiGLU
fc1's [gate_k; up_k], DeltaNet's in_proj) section by section into their row blocks, and the first
rank's own shard is copied into its blocks. No per-shard tensor is allocated and nothing is
concatenated. A row-parallel shard (split on dim 1) has no contiguous block in the full tensor, so the group gathers into one preallocated
[count, rows, cols/count] buffer that a single strided copy lays out as [rows, cols].

Point-to-point messages go from each member to the first rank in parameter order (every rank of the
group walks the parameters in the same order), so they pair up without tags. A group on one
machine's CPUs sends nothing: the first rank copies the members' shards from their own memory into
the same blocks (`join_shards`, with `shard_peers.PeerShards`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # no Megatron import here: the gather itself is plain torch
    from megatron_rl.models.init import ParamShard


def _blocks(full: torch.Tensor, shard: ParamShard, count: int, member: int) -> list[torch.Tensor]:
    """The contiguous views of `full` that member `member`'s dim-0 shard fills, in the shard's row order."""
    blocks, start = [], 0
    for size in shard.sections or (full.shape[0],):
        rows = size // count
        blocks.append(full.narrow(0, start + member * rows, rows))
        start += size
    return blocks


def _pieces(local: torch.Tensor, shard: ParamShard, count: int) -> list[torch.Tensor]:
    """The contiguous row runs of this rank's dim-0 shard that `_blocks` receives, in the same order."""
    if not shard.sections:
        return [local]
    return list(local.split([size // count for size in shard.sections], dim=0))


def join_shards(shard: ParamShard, members: list[torch.Tensor], full: torch.Tensor) -> torch.Tensor:
    """`full` (of `shard.full_shape`), the unsplit parameter of `shard` made from every member's shard,
    in group-rank order (the first rank's own first), each copied once into its blocks."""
    local = members[0]
    count = len(members)
    if shard.partition_dim == 1:
        rows, width = local.shape[0], local.shape[1]
        laid = full.view(rows, count, width, *local.shape[2:])
        for member, part in enumerate(members):
            laid.select(1, member).copy_(part)
        return full
    for member, part in enumerate(members):
        for block, piece in zip(_blocks(full, shard, count, member), _pieces(part, shard, count), strict=True):
            block.copy_(piece)
    return full


def gather_full(shard: ParamShard, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The unsplit parameter of `shard` (split over `group`, its (expert-)TP group) on the group's
    first rank, None on the others (collective over `group`)."""
    local = shard.param.detach()
    count = dist.get_world_size(group)
    if count == 1:
        return local
    first = dist.get_global_rank(group, 0)
    me = dist.get_rank(group)
    if shard.partition_dim not in (0, 1):
        raise ValueError(f"{shard.global_name}: no gather for partition dim {shard.partition_dim}")
    if shard.partition_dim == 1:
        return _gather_columns(local.contiguous(), count, me, group)
    local = local.contiguous()
    if me != 0:
        for work in [dist.isend(p, dst=first, group=group) for p in _pieces(local, shard, count)]:
            work.wait()
        return None
    shape = list(local.shape)
    shape[0] *= count
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    for block, piece in zip(_blocks(full, shard, count, 0), _pieces(local, shard, count), strict=True):
        block.copy_(piece)
    pending = [
        dist.irecv(block, src=dist.get_global_rank(group, member), group=group)
        for member in range(1, count)
        for block in _blocks(full, shard, count, member)
    ]
    for work in pending:
        work.wait()
    return full


def _gather_columns(local: torch.Tensor, count: int, me: int, group: dist.ProcessGroup) -> torch.Tensor | None:
    """A dim-1 split: the shards into one [count, rows, cols/count] buffer, laid out as [rows, cols]."""
    staged = torch.empty((count, *local.shape), dtype=local.dtype, device=local.device) if me == 0 else None
    dist.gather(local, list(staged.unbind(0)) if staged is not None else None, group=group, group_dst=0)
    if staged is None:
        return None
    rows, width = local.shape[0], local.shape[1]
    full = torch.empty((rows, count * width, *local.shape[2:]), dtype=local.dtype, device=local.device)
    full.view(rows, count, width, *local.shape[2:]).copy_(staged.transpose(0, 1))
    return full
