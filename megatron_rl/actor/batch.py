"""The actor's input: ragged per-sample tensors, and their micro-batch form (right-padded or packed).

A sample is one prompt + response: `tokens` [n] (prompt then response), `prompt_length` p
(1 <= p <= n), so r = n - p response tokens. Response-aligned fields are [r]: the value for
response token k (token id tokens[p + k]). In a micro-batch the model reads the whole padded row
and the logits at position t predict token t + 1, so response token k sits at position
p - 1 + k of every [rows, max_len] tensor (the "target positions"); the last position of each
row and the padding are never targets.

A packed micro-batch (`MicroBatch.packed`) gives the model one sequence [1, T]: the samples end to
end (sample k from position `starts[k]`), position ids restarting at 0 with each sample, the bounds
as `cu_seqlens` (Megatron's THD layout), and trailing padding up to T as one more segment. The loss
side keeps the [rows, max_len] layout, one sample per row (`target_mask`, `fields`), so that
per-sequence quantities (GSPO's sequence ratio, seq-mean-token-mean) stay row-wise:
`MicroBatchInputs.to_rows` maps a per-position result of the model's layout onto it.

Under context parallelism (`split_for_context`) every sample of a packed micro-batch starts at a
multiple of 2 x CP (`build_inputs(..., align=2 * CP)`: each sample's segment padded to that), and a
CP rank keeps its positions of the model's side only (`parallel.context_parallel`: input ids, position
ids, the head's targets); `to_rows` gathers a per-position result over the CP group first, so the
loss side still sees whole rows.

Routed experts follow SGLang's layout (`meta_info.routed_experts`): int32
[n - 1, num_layers, top_k], the experts of the tokens at positions 0 .. n - 2 in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from megatron_rl.actor.micro_batches import MicroBatch
from megatron_rl.parallel.context_parallel import ContextSplit, gather_from_context, round_up

# Response-aligned float fields, in the order `policy_loss` takes them.
RESPONSE_FIELDS = ("old_log_probs", "advantages", "rollout_log_probs", "ref_log_probs")
# Response-aligned float fields of the critic (`value_loss`): V_old of the rollout batch and the returns.
VALUE_FIELDS = ("old_values", "returns")


@dataclass
class ActorBatch:
    """Per-sample lists, all of the same length (the number of samples).

    tokens: int [n_i]; prompt_lengths: p_i.
    response_mask: bool [r_i], which response tokens enter the loss (None = all).
    old_log_probs / advantages / rollout_log_probs / ref_log_probs: float [r_i]; an advantage may
        also be a 0-dim tensor (one value for the whole response).
    old_values / returns: float [r_i], the critic's values of the batch before its update and the GAE
        returns (PPO's critic, `megatron_rl.critic`).
    routed_experts: int [n_i - 1, num_layers, top_k] (R3: from the engine; R2: recorded by
        `compute_log_probs(..., record_routing=True)`); layers without a router are ignored. An entry
        is None for a sample another DP rank computes: a scattered step batch
        (`actor.batch_scatter`) gives each rank only its own samples' routing (any integer dtype).
    """

    tokens: list[Tensor]
    prompt_lengths: list[int]
    response_mask: list[Tensor] | None = None
    old_log_probs: list[Tensor] | None = None
    advantages: list[Tensor] | None = None
    rollout_log_probs: list[Tensor] | None = None
    ref_log_probs: list[Tensor] | None = None
    old_values: list[Tensor] | None = None
    returns: list[Tensor] | None = None
    routed_experts: list[Tensor | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.tokens]

    def response_length(self, i: int) -> int:
        return int(self.tokens[i].shape[0]) - int(self.prompt_lengths[i])

    def subset(self, indices: Sequence[int]) -> ActorBatch:
        """The samples at `indices`, in that order."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = None if value is None else [value[i] for i in indices]
        return ActorBatch(**picked)

    def with_fields(self, **values: list[Tensor] | None) -> ActorBatch:
        """A copy with some fields replaced (e.g. old_log_probs after compute_log_probs)."""
        return replace(self, **values)

    def loss_mask(self, i: int) -> Tensor:
        """bool [r_i]: response tokens of sample i that enter the loss."""
        r = self.response_length(i)
        if self.response_mask is None:
            return torch.ones(r, dtype=torch.bool)
        return self.response_mask[i].to(torch.bool).cpu()

    def validate(self, *, vocab_size: int, num_layers: int, top_k: int, num_experts: int | None) -> None:
        """Raise ValueError naming the field, the sample and both shapes on any inconsistency."""
        n = len(self.tokens)
        if n == 0:
            raise ValueError("ActorBatch: no samples")
        if len(self.prompt_lengths) != n:
            raise ValueError(f"ActorBatch.prompt_lengths has {len(self.prompt_lengths)} entries, tokens has {n}")
        for i, (tok, p) in enumerate(zip(self.tokens, self.prompt_lengths, strict=True)):
            if tok.dim() != 1 or tok.dtype.is_floating_point or tok.dtype == torch.bool:
                raise ValueError(
                    f"ActorBatch.tokens[{i}] must be a 1-D integer tensor, got {tok.dtype} {tuple(tok.shape)}"
                )
            if not 1 <= int(p) <= tok.shape[0]:
                raise ValueError(f"ActorBatch.prompt_lengths[{i}] = {p} is outside [1, {tok.shape[0]}] (tokens[{i}])")
            lo, hi = int(tok.min()), int(tok.max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"ActorBatch.tokens[{i}] holds ids in [{lo}, {hi}], outside [0, {vocab_size})")
        for name in ("response_mask", *RESPONSE_FIELDS, *VALUE_FIELDS):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"ActorBatch.{name} has {len(values)} entries, tokens has {n}")
            for i, v in enumerate(values):
                r = self.response_length(i)
                scalar_ok = name == "advantages" and v.dim() == 0
                if not scalar_ok and tuple(v.shape) != (r,):
                    raise ValueError(
                        f"ActorBatch.{name}[{i}] has shape {tuple(v.shape)}, expected ({r},) = the response "
                        f"length of tokens[{i}] (shape {tuple(self.tokens[i].shape)}, prompt {self.prompt_lengths[i]})"
                    )
        if self.routed_experts is not None:
            self._validate_routing(num_layers, top_k, num_experts)

    def _validate_routing(self, num_layers: int, top_k: int, num_experts: int | None) -> None:
        if num_experts is None:
            raise ValueError("ActorBatch.routed_experts is set but the model has no experts (model.num_experts)")
        if len(self.routed_experts) != len(self.tokens):
            raise ValueError(
                f"ActorBatch.routed_experts has {len(self.routed_experts)} entries, tokens has {len(self)}"
            )
        for i, r in enumerate(self.routed_experts):
            if r is None:  # another DP rank's sample (a scattered step batch)
                continue
            want = (self.lengths[i] - 1, num_layers, top_k)
            if tuple(r.shape) != want or r.dtype.is_floating_point:
                raise ValueError(
                    f"ActorBatch.routed_experts[{i}] is {r.dtype} {tuple(r.shape)}, expected int {want} = "
                    f"[len(tokens[{i}]) - 1, model.num_layers, model.moe_router_topk] (SGLang's layout)"
                )


@dataclass(frozen=True)
class Packing:
    """The model's side of a packed micro-batch: one sequence [1, T] (see the module docstring).

    starts: the first position of every sample (row) in it; cu_seqlens: int32 [segments + 1], the
    samples' bounds and, when T exceeds their tokens, the padding's; target / target_mask: [1, T]
    as the rows' (`target_mask` of the row layout, moved to the packed positions); index: long
    [rows, max_len], the packed position of every row position (0 past a row's end).
    """

    starts: tuple[int, ...]
    cu_seqlens: Tensor
    max_seqlen: int
    target: Tensor
    target_mask: Tensor
    index: Tensor


@dataclass(frozen=True)
class ContextInputs:
    """This CP rank's part of the model's side of a micro-batch: `split` says which positions it holds;
    `target` / `target_mask` [rows, split.local_length] are the head's targets at those positions."""

    split: ContextSplit
    target: Tensor
    target_mask: Tensor


@dataclass
class MicroBatchInputs:
    """One micro-batch, ready for the model.

    `input_ids`, `position_ids`: what the model reads, [rows, max_len] right-padded, or [1, T] when
    `packing` is set. `target`, `target_mask`, `fields`: the row layout, [micro-batch rows or more,
    longest row or more]: `target_mask` marks the target positions of the response tokens that
    enter the loss, `fields` holds the response-aligned values there. Padded, the shape may exceed
    the micro-batch's (uniform padding for pipeline stages without variable shapes): extra rows
    are all padding. `head_target` / `head_mask` are the targets in the model's layout. With
    `context` (context parallelism), `input_ids` / `position_ids` and the head's targets hold this CP
    rank's positions only (`split_for_context`).
    """

    micro_batch: MicroBatch
    input_ids: Tensor
    position_ids: Tensor
    target: Tensor
    target_mask: Tensor
    fields: dict[str, Tensor]
    routed_experts: list[Tensor] | None  # per sample (real row), SGLang layout
    prompt_lengths: tuple[int, ...]
    packing: Packing | None = None
    context: ContextInputs | None = None

    @property
    def rows(self) -> int:
        """Rows of the model's input (1 when packed)."""
        return int(self.input_ids.shape[0])

    @property
    def max_len(self) -> int:
        """Positions of the model's input (T when packed), over all CP ranks together."""
        return self.context.split.length if self.context is not None else int(self.input_ids.shape[1])

    @property
    def local_positions(self) -> Tensor | None:
        """long [positions this CP rank holds] of the model's layout, in its local order; None without CP."""
        return None if self.context is None else self.context.split.positions()

    @property
    def placements(self) -> tuple[tuple[int, int], ...]:
        """(row, first position) of every sample in the model's input."""
        if self.packing is None:
            return tuple((row, 0) for row in range(self.micro_batch.rows))
        return tuple((0, start) for start in self.packing.starts)

    @property
    def head_target(self) -> Tensor:
        if self.context is not None:
            return self.context.target
        return self.target if self.packing is None else self.packing.target

    @property
    def head_mask(self) -> Tensor:
        if self.context is not None:
            return self.context.target_mask
        return self.target_mask if self.packing is None else self.packing.target_mask

    def to_rows(self, values: Tensor) -> Tensor:
        """A per-position result of the model's layout [rows, positions] in the row layout (0 outside
        `target_mask`); differentiable. Under CP, `values` holds this rank's positions and is gathered
        over the CP group first. Padded, the layouts are one."""
        if self.context is not None:
            values = gather_from_context(values, self.context.split, dim=1)
        if self.packing is None:
            return values
        return values.reshape(-1)[self.packing.index].where(self.target_mask, 0.0)

    def response_rows(self, values: Tensor) -> list[Tensor]:
        """A row-layout result cut to each real row's response: [r_i] each."""
        out = []
        for row, (n, p) in enumerate(zip(self.micro_batch.lengths, self.prompt_lengths, strict=True)):
            out.append(values[row, p - 1 : n - 1])
        return out


def build_inputs(
    batch: ActorBatch,
    micro_batch: MicroBatch,
    device: torch.device,
    *,
    pad_to: tuple[int, int] | None = None,
    with_fields: Sequence[str] = (),
    every_response_token: bool = False,
    align: int = 1,
) -> MicroBatchInputs:
    """The tensors of one micro-batch of `batch` (indices of `micro_batch` index `batch`).

    `pad_to`: the model's input shape, (rows, max_len) or, packed, (1, T); None = the micro-batch's
    own. `every_response_token`: targets are all response tokens, ignoring `response_mask` (log-probs
    for the caller); otherwise only those that enter the loss. `align` (packed): every sample starts
    at a multiple of it, its segment padded at its end (2 x CP under context parallelism).
    """
    own = (
        (1, packed_length(micro_batch.lengths, align))
        if micro_batch.packed
        else (micro_batch.rows, micro_batch.max_len)
    )
    shape = own if pad_to is None else pad_to
    if shape[0] < own[0] or shape[1] < own[1] or (micro_batch.packed and shape[0] != 1):
        raise ValueError(f"pad_to {pad_to} does not hold the micro-batch (its own shape {own})")
    rows, max_len = (micro_batch.rows, micro_batch.max_len) if micro_batch.packed else shape
    input_ids = torch.zeros(rows, max_len, dtype=torch.long)
    target = torch.zeros(rows, max_len, dtype=torch.long)
    target_mask = torch.zeros(rows, max_len, dtype=torch.bool)
    values = {name: torch.zeros(rows, max_len, dtype=torch.float32) for name in with_fields}
    prompts = []
    for row, i in enumerate(micro_batch.indices):
        tok = batch.tokens[i].to(torch.long).cpu()
        n, p = tok.shape[0], int(batch.prompt_lengths[i])
        if n != micro_batch.lengths[row]:
            raise ValueError(f"sample {i} has {n} tokens, the micro-batch plan says {micro_batch.lengths[row]}")
        prompts.append(p)
        input_ids[row, :n] = tok
        target[row, : n - 1] = tok[1:]
        target_mask[row, p - 1 : n - 1] = True if every_response_token else batch.loss_mask(i)
        for name in with_fields:
            source = getattr(batch, name)
            if source is None:
                raise ValueError(f"ActorBatch.{name} is needed here but is None")
            values[name][row, p - 1 : n - 1] = source[i].to(torch.float32).cpu().expand(n - p)
    position_ids = torch.arange(max_len, dtype=torch.long).unsqueeze(0).expand(rows, max_len).contiguous()
    packing = None
    if micro_batch.packed:
        packing, input_ids, position_ids = _pack_rows(
            micro_batch, input_ids, target, target_mask, shape[1], device, align
        )
    routed = None
    if batch.routed_experts is not None:
        routed = [batch.routed_experts[i] for i in micro_batch.indices]
        absent = [i for i, r in zip(micro_batch.indices, routed, strict=True) if r is None]
        if absent:
            raise ValueError(
                f"ActorBatch.routed_experts of samples {absent} are not on this rank (a scattered batch holds "
                "its DP rank's samples only: plan the micro-batches with the step's updates_per_step)"
            )
    return MicroBatchInputs(
        micro_batch=micro_batch,
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        target=target.to(device),
        target_mask=target_mask.to(device),
        fields={k: v.to(device) for k, v in values.items()},
        routed_experts=routed,
        prompt_lengths=tuple(prompts),
        packing=packing,
    )


def packed_length(lengths: Sequence[int], align: int = 1) -> int:
    """Positions of the samples of `lengths` end to end, each starting at a multiple of `align`."""
    return sum(round_up(n, align) for n in lengths)


def _pack_rows(
    micro_batch: MicroBatch,
    input_ids: Tensor,
    target: Tensor,
    target_mask: Tensor,
    total: int,
    device: torch.device,
    align: int,
) -> tuple[Packing, Tensor, Tensor]:
    """The packed [1, total] layout of right-padded rows, with the index back to them."""
    lengths = list(micro_batch.lengths)
    spans = [round_up(n, align) for n in lengths]
    starts = [sum(spans[:k]) for k in range(len(spans))]
    bounds = [*starts, sum(spans)] + ([total] if total > sum(spans) else [])
    width = input_ids.shape[1]
    keep = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [rows, width]
    index = torch.where(keep, torch.tensor(starts).unsqueeze(1) + torch.arange(width), 0)

    def packed(rows: Tensor) -> Tensor:
        out = rows.new_zeros(1, total)
        out[0, index[keep]] = rows[keep]
        return out

    segments = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in segments]).unsqueeze(0)
    packing = Packing(
        starts=tuple(starts),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_seqlen=max(segments),
        target=packed(target).to(device),
        target_mask=packed(target_mask).to(device),
        index=index.to(device),
    )
    return packing, packed(input_ids), position_ids


def split_for_context(inputs: MicroBatchInputs, size: int, rank: int) -> MicroBatchInputs:
    """`inputs` as CP rank `rank` of `size` feeds the model: its positions of the input ids, position
    ids and the head's targets (`parallel.context_parallel`); the loss side (row layout) stays whole.
    Every segment (the padded rows' length, or each packed segment) must be a multiple of 2 x `size`."""
    if inputs.context is not None:
        raise ValueError("split_for_context: these inputs are split already")
    if size == 1:
        return inputs
    bounds = (0, inputs.max_len) if inputs.packing is None else tuple(inputs.packing.cu_seqlens.tolist())
    split = ContextSplit(size, rank, bounds)
    mine = split.positions().to(inputs.input_ids.device)

    def local(t: Tensor) -> Tensor:
        return t.index_select(1, mine)

    context = ContextInputs(split, local(inputs.head_target), local(inputs.head_mask))
    return replace(inputs, input_ids=local(inputs.input_ids), position_ids=local(inputs.position_ids), context=context)
