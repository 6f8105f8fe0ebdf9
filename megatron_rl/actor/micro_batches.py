"""Right-padded micro-batches packed by a token budget, and equal micro-batch counts across DP ranks.

A micro-batch's cost is its padded size, rows x longest row. Samples are sorted by length
(longest first, ties by index) and cut greedily into consecutive runs whose padded size stays
within `train.max_tokens_per_micro_batch`; neighbours in that order have similar lengths, so
padding stays low. A sample longer than the budget alone gets a micro-batch of its own (a long
response should cost memory, not the RL step); `MicroBatchPlan.oversized` lists those.

Megatron's forward-backward schedule runs the same number of micro-batches on every DP rank:
`agree_num_micro_batches` (one all-reduce) or `plans_with_equal_count` (when every rank knows the
whole batch) give that number, and `plan_micro_batches(..., num_micro_batches=k)` splits the
largest micro-batches until there are exactly k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


@dataclass(frozen=True)
class MicroBatch:
    """Original sample indices, longest first, with their lengths."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def max_len(self) -> int:
        return self.lengths[0]

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.max_len

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class MicroBatchPlan:
    micro_batches: tuple[MicroBatch, ...]
    num_samples: int
    max_tokens: int

    def __len__(self) -> int:
        return len(self.micro_batches)

    @property
    def real_tokens(self) -> int:
        return sum(mb.real_tokens for mb in self.micro_batches)

    @property
    def padded_tokens(self) -> int:
        return sum(mb.padded_tokens for mb in self.micro_batches)

    @property
    def padding_fraction(self) -> float:
        """Share of the padded tokens that are padding."""
        padded = self.padded_tokens
        return 0.0 if padded == 0 else 1.0 - self.real_tokens / padded

    @property
    def oversized(self) -> list[int]:
        """Samples longer than the budget (each alone in its micro-batch)."""
        return [mb.indices[0] for mb in self.micro_batches if mb.padded_tokens > self.max_tokens]

    def restore(self, per_micro_batch: Sequence[Sequence[T]]) -> list[T]:
        """Per-row results of each micro-batch (in plan order) back in the original sample order."""
        if len(per_micro_batch) != len(self.micro_batches):
            raise ValueError(f"got results for {len(per_micro_batch)} micro-batches, the plan has {len(self)}")
        out: list[T | None] = [None] * self.num_samples
        for k, (mb, rows) in enumerate(zip(self.micro_batches, per_micro_batch, strict=True)):
            if len(rows) != mb.rows:
                raise ValueError(f"micro-batch {k}: got {len(rows)} results for its {mb.rows} rows")
            for i, r in zip(mb.indices, rows, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]


def _check_budget(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens (train.max_tokens_per_micro_batch) must be >= 1, got {max_tokens}")


def _check_lengths(lengths: Sequence[int]) -> None:
    for i, n in enumerate(lengths):
        if int(n) != n or n < 1:
            raise ValueError(f"lengths[{i}] = {n}: every sample needs a positive integer length")


def _pack(lengths: Sequence[int], max_tokens: int) -> list[MicroBatch]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        cur = batches[-1] if batches else None
        if cur is not None and (len(cur) + 1) * lengths[cur[0]] <= max_tokens:
            cur.append(i)
        else:
            batches.append([i])
    return [MicroBatch(tuple(b), tuple(int(lengths[i]) for i in b)) for b in batches]


def _split_largest(batches: list[MicroBatch]) -> None:
    """Halve (in place) the micro-batch with the most padded tokens among those with 2+ rows."""
    k = max((k for k, mb in enumerate(batches) if mb.rows > 1), key=lambda k: (batches[k].padded_tokens, -k))
    mb = batches[k]
    half = (mb.rows + 1) // 2
    batches[k : k + 1] = [
        MicroBatch(mb.indices[:half], mb.lengths[:half]),
        MicroBatch(mb.indices[half:], mb.lengths[half:]),
    ]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None) -> MicroBatchPlan:
    """Pack samples of the given token lengths into micro-batches of at most `max_tokens` padded tokens.

    With `num_micro_batches`, exactly that many: the largest micro-batches are halved until the
    count is reached; fewer samples than that, or a budget that needs more, raise ValueError.
    """
    _check_budget(max_tokens)
    _check_lengths(lengths)
    batches = _pack(lengths, max_tokens)
    if num_micro_batches is not None:
        if len(batches) > num_micro_batches:
            raise ValueError(
                f"num_micro_batches = {num_micro_batches} is too few: {len(lengths)} samples need "
                f"{len(batches)} micro-batches of <= {max_tokens} tokens (train.max_tokens_per_micro_batch)"
            )
        if len(lengths) < num_micro_batches:
            raise ValueError(f"cannot make {num_micro_batches} micro-batches from {len(lengths)} samples")
        while len(batches) < num_micro_batches:
            _split_largest(batches)
    return MicroBatchPlan(tuple(batches), len(lengths), max_tokens)


def plans_with_equal_count(lengths_per_rank: Sequence[Sequence[int]], max_tokens: int) -> list[MicroBatchPlan]:
    """One plan per DP rank, all with the count of the rank that needs the most micro-batches."""
    _check_budget(max_tokens)
    for r, lengths in enumerate(lengths_per_rank):
        _check_lengths(lengths)
        if not lengths:
            raise ValueError(f"DP rank {r} has no samples")
    count = max(len(_pack(lengths, max_tokens)) for lengths in lengths_per_rank)
    return [plan_micro_batches(lengths, max_tokens, count) for lengths in lengths_per_rank]


def agree_num_micro_batches(local_count: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest micro-batch count over the DP group (one all-reduce); pass it as num_micro_batches."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return local_count
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
    t = torch.tensor([local_count], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def balance_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Sample indices per DP rank with near-equal token totals (longest first to the lightest rank)."""
    if num_ranks < 1 or len(lengths) < num_ranks:
        raise ValueError(f"cannot split {len(lengths)} samples over {num_ranks} ranks (each needs at least one)")
    _check_lengths(lengths)
    load = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(num_ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def pad_right(samples: Sequence[Tensor], micro_batch: MicroBatch, pad_value: float = 0) -> tuple[Tensor, Tensor]:
    """([rows, max_len, *rest] right-padded stack of the micro-batch's samples, [rows, max_len] bool mask)."""
    first = samples[micro_batch.indices[0]]
    out = first.new_full((micro_batch.rows, micro_batch.max_len, *first.shape[1:]), pad_value)
    mask = torch.zeros(micro_batch.rows, micro_batch.max_len, dtype=torch.bool, device=first.device)
    for row, (i, n) in enumerate(zip(micro_batch.indices, micro_batch.lengths, strict=True)):
        if samples[i].shape[0] != n:
            raise ValueError(f"sample {i} has {samples[i].shape[0]} tokens, the plan says {n}")
        out[row, :n] = samples[i]
        mask[row, :n] = True
    return out, mask


def unpad(padded: Tensor, micro_batch: MicroBatch) -> list[Tensor]:
    """Rows of a [rows, max_len, ...] result trimmed to each sample's length (for MicroBatchPlan.restore)."""
    if padded.shape[:2] != (micro_batch.rows, micro_batch.max_len):
        raise ValueError(
            f"padded result shape {tuple(padded.shape)} does not start with [rows, max_len] = "
            f"[{micro_batch.rows}, {micro_batch.max_len}]"
        )
    return [padded[row, :n] for row, n in enumerate(micro_batch.lengths)]
