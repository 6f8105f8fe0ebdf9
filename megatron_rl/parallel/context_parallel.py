"""Context parallelism (CP): which positions of a micro-batch each CP rank holds, and the way back.

Megatron's split, for load balance under causal attention: a sequence of length L (a multiple of
2 x CP) is cut into 2 x CP equal chunks and CP rank r holds chunks r and 2 x CP - 1 - r, in that
order (`megatron.core.utils.get_batch_on_this_cp_rank`). A right-padded micro-batch [rows, S] is
one such sequence per row, all rows split alike; a packed (THD) micro-batch is split sequence by
sequence, each padded to a multiple of 2 x CP, as Transformer Engine's
`thd_get_partitioned_indices` does for `cu_seqlens_padded`. `ContextSplit` describes either by the
segment bounds over the model layout's positions ((0, S) padded, the padded `cu_seqlens` packed);
`positions(rank)` are the positions a rank holds, in its local order.

Two gathers bring every CP rank's part back into the original order, on every CP rank:
- `gather_from_context`, for a per-position result (log-probs, entropy, recorded routing): its
  backward keeps this rank's positions of the gradient and adds nothing over the group: whatever is
  computed from the gathered values (the loss) is the same on every CP rank, so each rank
  back-propagates only its own positions' share and Megatron's DDP, which reduces gradients over
  DP x CP, sums the shares.
- `gather_for_attention`, for attention's keys and values: each CP rank's queries use all of them,
  so its backward sums the gradient over the group and keeps this rank's positions (a
  reduce-scatter; gloo has none, so an all-reduce and a slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_positions(length: int, size: int, rank: int) -> Tensor:
    """long [length / size]: the positions of chunks `rank` and 2 x size - 1 - rank of a sequence of
    `length` cut into 2 x size chunks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"CP rank {rank} is outside [0, {size}) (parallel.context_parallel_size = {size})")
    if length % (2 * size):
        raise ValueError(
            f"a sequence of {length} positions cannot be split over parallel.context_parallel_size = {size}: "
            f"its length must be a multiple of 2 x CP = {2 * size}"
        )
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([first, second])


@dataclass(frozen=True)
class ContextSplit:
    """One micro-batch's split over `size` CP ranks, seen from `rank`: `bounds` are the segment
    bounds over the model layout's positions, (0, S) for right-padded rows, the padded `cu_seqlens`
    of a packed sequence; every segment's length is a multiple of 2 x size."""

    size: int
    rank: int
    bounds: tuple[int, ...]

    @property
    def segments(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=True))

    def __post_init__(self) -> None:
        if len(self.bounds) < 2 or self.bounds[0] != 0 or any(b < a for a, b in self.segments):
            raise ValueError(f"ContextSplit.bounds {self.bounds} must start at 0 and never decrease")
        for a, b in self.segments:
            if (b - a) % (2 * self.size):
                raise ValueError(
                    f"segment [{a}, {b}) of {b - a} positions is not a multiple of 2 x CP = {2 * self.size} "
                    "(parallel.context_parallel_size)"
                )

    @property
    def length(self) -> int:
        """Positions of the whole micro-batch (every CP rank's together)."""
        return self.bounds[-1]

    @property
    def local_length(self) -> int:
        return self.length // self.size

    def positions(self, rank: int | None = None) -> Tensor:
        """long [length / size]: the positions `rank` (default: this one) holds, in its local order."""
        rank = self.rank if rank is None else rank
        parts = [a + chunk_positions(b - a, self.size, rank) for a, b in self.segments if b > a]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def restore_order(self, parts: Sequence[Tensor], dim: int) -> Tensor:
        """The whole micro-batch's tensor from every rank's part along `dim` (`parts[r]` holds
        `positions(r)`, in that order), positions back in their original order."""
        if len(parts) != self.size:
            raise ValueError(f"restore_order: {len(parts)} parts for parallel.context_parallel_size = {self.size}")
        for r, part in enumerate(parts):
            if part.shape[dim] != self.local_length:
                raise ValueError(
                    f"restore_order: part {r} has {part.shape[dim]} positions along dim {dim}, "
                    f"expected {self.local_length} = {self.length} / CP {self.size}"
                )
        held = torch.cat([self.positions(r) for r in range(self.size)])
        inverse = torch.empty_like(held)
        inverse[held] = torch.arange(held.numel())
        return torch.cat(list(parts), dim=dim).index_select(dim, inverse.to(parts[0].device))


def _context_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


class _GatherFromContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, split: ContextSplit, dim: int, group: dist.ProcessGroup, sum_grad: bool) -> Tensor:
        pieces = [torch.empty_like(local) for _ in range(split.size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        ctx.split, ctx.dim, ctx.group, ctx.sum_grad = split, dim, group, sum_grad
        return split.restore_order(pieces, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.sum_grad:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        mine = ctx.split.positions().to(grad.device)
        return grad.index_select(ctx.dim, mine), None, None, None, None


def _gather(local: Tensor, split: ContextSplit, dim: int, group: dist.ProcessGroup | None, sum_grad: bool) -> Tensor:
    if local.shape[dim] != split.local_length:
        raise ValueError(
            f"gather over CP: the tensor has {local.shape[dim]} positions along dim {dim}, this CP rank "
            f"holds {split.local_length} (of {split.length})"
        )
    if split.size == 1:
        return local
    return _GatherFromContext.apply(local, split, dim, _context_group() if group is None else group, sum_grad)


def gather_from_context(local: Tensor, split: ContextSplit, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's part of a per-position result (`split.local_length` positions along `dim`) ->
    the whole micro-batch's, in the original order, on every CP rank; differentiable (see the module
    docstring: the backward keeps this rank's positions, no reduction). `group`: the CP group
    (default: Megatron's)."""
    return _gather(local, split, dim, group, sum_grad=False)


def gather_for_attention(local: Tensor, split: ContextSplit, dim: int, group: dist.ProcessGroup) -> Tensor:
    """As `gather_from_context`, for keys and values that every CP rank's queries attend to: the
    backward sums the gradient over `group`, then keeps this rank's positions."""
    return _gather(local, split, dim, group, sum_grad=True)
