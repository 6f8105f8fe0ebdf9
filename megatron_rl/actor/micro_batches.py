"""Micro-batches by a token budget, right-padded or packed, and equal micro-batch counts across DP ranks.

Right-padded (`train.max_tokens_per_micro_batch`): a micro-batch's cost is its padded size, rows x
longest row. Samples are sorted by length (longest first, ties by index) and cut greedily into
consecutive runs whose padded size stays within the budget; neighbours in that order have similar
lengths, so padding stays low.

Packed (`train.micro_batch_tokens` > 0): the samples of a micro-batch lie end to end in one
sequence (`batch.build_inputs` gives the layout), so its cost is its real tokens. Samples are
placed first-fit-decreasing: longest first, each into the first micro-batch it fits.

Either way a sample longer than the budget alone gets a micro-batch of its own (a long response
should cost memory, not the RL step); `MicroBatchPlan.oversized` lists those.

Megatron's forward-backward schedule runs the same number of micro-batches on every DP rank:
`agree_num_micro_batches` (one all-reduce) or `plans_with_equal_count` (when every rank knows the
whole batch) give that number, and `plan_micro_batches(..., num_micro_batches=k)` splits the
largest micro-batches until there are exactly k. `balance_across_ranks` gives each DP rank a share
of near-equal token count first; `token_imbalance` is its max / mean. `mini_batches` cuts a step's
batch into its updates, and `step_shares` gives each DP rank its samples of the whole step (its
share of every mini-batch), which the step's log-prob passes use too and the batch scatter sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from megatron_rl.config import TrainConfig

T = TypeVar("T")


@dataclass(frozen=True)
class TokenBudget:
    """The token budget of one micro-batch: `tokens` padded tokens, or, `packed`, real tokens."""

    tokens: int
    packed: bool = False

    @classmethod
    def of(cls, train: TrainConfig) -> TokenBudget:
        """`train.micro_batch_tokens` (packed) when set, else `train.max_tokens_per_micro_batch` (padded)."""
        if train.micro_batch_tokens > 0:
            return cls(train.micro_batch_tokens, packed=True)
        return cls(train.max_tokens_per_micro_batch)


@dataclass(frozen=True)
class MicroBatch:
    """Original sample indices, longest first, with their lengths; `packed`: end to end in one sequence."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    packed: bool = False

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def max_len(self) -> int:
        return self.lengths[0]

    @property
    def padded_tokens(self) -> int:
        """What the micro-batch costs: rows x longest row, or its real tokens when packed."""
        return self.real_tokens if self.packed else self.rows * self.max_len

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


def _budget_key(packed: bool) -> str:
    return "train.micro_batch_tokens" if packed else "train.max_tokens_per_micro_batch"


def _check_budget(max_tokens: int, packed: bool) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({_budget_key(packed)}) must be >= 1, got {max_tokens}")


def _check_lengths(lengths: Sequence[int]) -> None:
    for i, n in enumerate(lengths):
        if int(n) != n or n < 1:
            raise ValueError(f"lengths[{i}] = {n}: every sample needs a positive integer length")


def _longest_first(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _micro_batch(indices: Sequence[int], lengths: Sequence[int], packed: bool) -> MicroBatch:
    return MicroBatch(tuple(indices), tuple(int(lengths[i]) for i in indices), packed)


def _pack(lengths: Sequence[int], max_tokens: int, packed: bool) -> list[MicroBatch]:
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in _longest_first(lengths):
        if packed:  # first fit: the first micro-batch with room
            k = next((k for k, load in enumerate(loads) if load + lengths[i] <= max_tokens), len(batches))
        else:  # the current run, while rows x its longest row stay within the budget
            k = len(batches) - 1
            if k < 0 or (len(batches[k]) + 1) * lengths[batches[k][0]] > max_tokens:
                k = len(batches)
        if k == len(batches):
            batches.append([])
            loads.append(0)
        batches[k].append(i)
        loads[k] += lengths[i]
    return [_micro_batch(b, lengths, packed) for b in batches]


def _halves(mb: MicroBatch) -> tuple[list[int], list[int]]:
    """Positions in `mb` of two parts: the longer and the shorter rows (padded, where the cost is the longest
    row), or near-equal token counts (packed: longest first to the lighter part)."""
    if not mb.packed:
        half = (mb.rows + 1) // 2
        return list(range(half)), list(range(half, mb.rows))
    parts: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for j, n in enumerate(mb.lengths):
        side = 0 if loads[0] <= loads[1] else 1
        parts[side].append(j)
        loads[side] += n
    return parts


def _split_largest(batches: list[MicroBatch]) -> None:
    """Split (in place) the micro-batch that costs the most among those with 2+ rows into two."""
    k = max((k for k, mb in enumerate(batches) if mb.rows > 1), key=lambda k: (batches[k].padded_tokens, -k))
    mb = batches[k]
    batches[k : k + 1] = [
        MicroBatch(tuple(mb.indices[j] for j in part), tuple(mb.lengths[j] for j in part), mb.packed)
        for part in _halves(mb)
    ]


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None, *, packed: bool = False
) -> MicroBatchPlan:
    """Pack samples of the given token lengths into micro-batches of at most `max_tokens` padded tokens
    (`packed`: real tokens, the samples end to end; see the module docstring).

    With `num_micro_batches`, exactly that many: the costliest micro-batches are split in two until
    the count is reached; fewer samples than that, or a budget that needs more, raise ValueError.
    """
    _check_budget(max_tokens, packed)
    _check_lengths(lengths)
    batches = _pack(lengths, max_tokens, packed)
    if num_micro_batches is not None:
        if len(batches) > num_micro_batches:
            raise ValueError(
                f"num_micro_batches = {num_micro_batches} is too few: {len(lengths)} samples need "
                f"{len(batches)} micro-batches of <= {max_tokens} tokens ({_budget_key(packed)})"
            )
        if len(lengths) < num_micro_batches:
            raise ValueError(f"cannot make {num_micro_batches} micro-batches from {len(lengths)} samples")
        while len(batches) < num_micro_batches:
            _split_largest(batches)
    return MicroBatchPlan(tuple(batches), len(lengths), max_tokens)


def plans_with_equal_count(
    lengths_per_rank: Sequence[Sequence[int]], max_tokens: int, *, packed: bool = False
) -> list[MicroBatchPlan]:
    """One plan per DP rank, all with the count of the rank that needs the most micro-batches."""
    _check_budget(max_tokens, packed)
    for r, lengths in enumerate(lengths_per_rank):
        _check_lengths(lengths)
        if not lengths:
            raise ValueError(f"DP rank {r} has no samples")
    count = max(len(_pack(lengths, max_tokens, packed)) for lengths in lengths_per_rank)
    return [plan_micro_batches(lengths, max_tokens, count, packed=packed) for lengths in lengths_per_rank]


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
    for i in _longest_first(lengths):
        r = min(range(num_ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def mini_batches(num_samples: int, updates: int, min_size: int = 1) -> list[list[int]]:
    """Consecutive, near-equal runs of sample indices (groups stay together when they divide): `updates`
    of them, or fewer for a short batch, as many as hold `min_size` samples each (the DP size)."""
    count = min(updates, num_samples // min_size)
    if updates < 1 or count < 1:
        raise ValueError(
            f"cannot cut {num_samples} samples into mini-batches of >= {min_size} (the data-parallel size) "
            f"for train.updates_per_step = {updates}"
        )
    bounds = [round(k * num_samples / count) for k in range(count + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(count)]


def step_shares(lengths: Sequence[int], updates: int, num_ranks: int) -> list[list[int]]:
    """The samples of each DP rank in a step (sorted global indices): the union of its
    `balance_across_ranks` shares of every mini-batch (`mini_batches(len, updates, num_ranks)`). The
    updates train those and the step's log-prob passes compute those, so a DP rank needs no other
    sample's tokens-level data; with `updates` = 1 it is `balance_across_ranks(lengths, num_ranks)`."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for run in mini_batches(len(lengths), updates, num_ranks):
        for rank, share in enumerate(balance_across_ranks([lengths[i] for i in run], num_ranks)):
            shares[rank].extend(run[j] for j in share)
    return [sorted(s) for s in shares]


def token_imbalance(tokens_per_rank: Sequence[int]) -> float:
    """max / mean of the ranks' token counts (1.0 = perfectly balanced)."""
    if not tokens_per_rank or sum(tokens_per_rank) <= 0:
        raise ValueError(f"token_imbalance needs a positive token count, got {list(tokens_per_rank)}")
    return max(tokens_per_rank) * len(tokens_per_rank) / sum(tokens_per_rank)


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
