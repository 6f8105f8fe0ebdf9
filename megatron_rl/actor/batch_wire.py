"""A step batch as tensors: a fixed-size header, a per-sample index, flat fields, routed-expert shards.

What `actor.batch_scatter` sends, packed and unpacked here without any communication (so the format
is tested in-process):

- the header: int64 [HEADER_SLOTS]: magic, format version, the number of samples N, whether routed
  experts follow, their layers L, top-k K and wire dtype, the teacher's top-k (distillation; 0 = none), then (kind, dtype, wire dtype) of every
  field of `FIELDS` in that order (kind `ABSENT` for a field the batch does not have);
- the index: int64 [N, 3]: tokens n_i, prompt length p_i, and the count of sample i's `versions`;
- one flat tensor per present field, the samples end to end (`kind` says how many values each has:
  one, n_i, or the response's r_i = n_i - p_i, or r_i rows of the teacher's top-k; `COUNTED`: the index's count), token ids as int32 and
  masks as uint8 on the wire, unpacked to the dtypes the header names;
- routed experts, one flat tensor per DP rank holding that rank's samples only, as uint8 when the
  model has at most 256 experts, int16 up to 32768 (`expert_wire_dtype`): 1/4 or 1/2 of SGLang's
  int32, and a sample's routing is a view of the flat tensor, [n_i - 1, L, K], no copy.

A receiver allocates every buffer from the header and the index alone (`field_buffers`,
`routed_buffer`), so nothing is pickled. `WireBatch` is what travels: the `ActorBatch`, the step's
rewards [N], the weight versions of each sample's trained tokens (asynchronous modes) and the
episode of each sample (when an agent episode gave several sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.actor.batch import ActorBatch

MAGIC = 0x4D524C42  # "MRLB"
WIRE_VERSION = 3  # 2: the episodes field; 3: the teacher's top-k

# what a field holds per sample
ABSENT, PER_SAMPLE, PER_TOKEN, PER_RESPONSE, COUNTED, PER_RESPONSE_TOP = range(6)

# (name, wire dtype or None = as the batch holds it), in wire order
FIELDS: tuple[tuple[str, torch.dtype | None], ...] = (
    ("tokens", torch.int32),
    ("response_mask", torch.uint8),
    ("old_log_probs", None),
    ("advantages", None),
    ("rollout_log_probs", None),
    ("ref_log_probs", None),
    ("teacher_top_ids", torch.int32),
    ("teacher_top_logprobs", None),
    ("rewards", None),
    ("versions", torch.int64),
    ("episodes", torch.int64),
)
_ACTOR_FIELDS = ("response_mask", "old_log_probs", "advantages", "rollout_log_probs", "ref_log_probs")
_TOP_FIELDS = ("teacher_top_ids", "teacher_top_logprobs")

DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_N_FIXED = 8
HEADER_SLOTS = _N_FIXED + 3 * len(FIELDS)
INDEX_COLUMNS = 3


class WireFormatError(ValueError):
    """A header or a batch that this format cannot carry, named."""


@dataclass
class WireBatch:
    """What a step sends its ranks: the actor batch, the rewards [N] (None: not kept), per sample the
    weight versions of its trained tokens (None: synchronous rollouts), and int64 [N] the episode
    each sample is a sequence of (None: one sequence per episode)."""

    batch: ActorBatch
    rewards: Tensor | None = None
    versions: list[list[int]] | None = None
    episodes: Tensor | None = None


@dataclass
class LightPacket:
    """Header, index and flat fields: what every rank of a step receives (`batch_scatter`)."""

    header: Tensor
    index: Tensor
    fields: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.header, self.index, *self.fields))


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES.index(dtype)
    except ValueError:
        raise WireFormatError(f"the batch wire format carries no {dtype}") from None


def _dtype(code: int) -> torch.dtype:
    if not 0 <= code < len(DTYPES):
        raise WireFormatError(f"unknown dtype code {code} in a batch header")
    return DTYPES[code]


def expert_wire_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds expert ids 0 .. num_experts - 1."""
    if num_experts < 1:
        raise WireFormatError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


def _per_sample_values(values: Sequence[Tensor], responses: Sequence[int], name: str) -> tuple[int, list[Tensor]]:
    """(kind, flat pieces) of a response-aligned field: every entry 0-dim (one value) or [r_i]."""
    scalar = [v.dim() == 0 for v in values]
    if all(scalar):
        return PER_SAMPLE, [v.reshape(1) for v in values]
    if any(scalar):
        raise WireFormatError(f"ActorBatch.{name} mixes 0-dim and per-token entries; the wire takes one or the other")
    for i, (v, r) in enumerate(zip(values, responses, strict=True)):
        if tuple(v.shape) != (r,):
            raise WireFormatError(f"ActorBatch.{name}[{i}] has shape {tuple(v.shape)}, expected ({r},)")
    return PER_RESPONSE, list(values)


def _flat(pieces: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    total = sum(int(p.numel()) for p in pieces)
    out = torch.empty(total, dtype=dtype)
    at = 0
    for p in pieces:
        n = int(p.numel())
        out[at : at + n].copy_(p.reshape(-1))
        at += n
    return out


def pack_light(wire: WireBatch, *, num_experts: int | None) -> LightPacket:
    """Header, index and flat fields of `wire` (everything but the routed experts' values, whose layout
    the header names: `num_experts` picks their wire dtype)."""
    batch = wire.batch
    n = len(batch)
    if n == 0:
        raise WireFormatError("an empty batch has no wire form")
    lengths = batch.lengths
    responses = [batch.response_length(i) for i in range(n)]
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[0], header[1], header[2] = MAGIC, WIRE_VERSION, n
    if batch.routed_experts is not None:
        routed = batch.routed_experts
        if any(r is None for r in routed):
            raise WireFormatError("ActorBatch.routed_experts has absent entries: only a whole batch is sent")
        if num_experts is None:
            raise WireFormatError("routed experts need the model's num_experts for their wire dtype")
        first = routed[0]
        header[3], header[4], header[5] = 1, int(first.shape[1]), int(first.shape[2])
        header[6] = dtype_code(expert_wire_dtype(num_experts))
    if batch.teacher_top_ids is not None:
        header[7] = int(batch.teacher_top_ids[0].shape[-1])
    counts = [0] * n
    if wire.versions is not None:
        if len(wire.versions) != n:
            raise WireFormatError(f"{len(wire.versions)} version lists for {n} samples")
        counts = [len(v) for v in wire.versions]
    index = torch.tensor([list(row) for row in zip(lengths, batch.prompt_lengths, counts, strict=True)])
    index = index.to(torch.int64).reshape(n, INDEX_COLUMNS)
    flats: list[Tensor] = []
    for k, (name, wire_dtype) in enumerate(FIELDS):
        kind, pieces, dtype = _field_pieces(wire, name, responses)
        if kind == ABSENT:
            continue
        on_wire = wire_dtype or dtype
        slot = _N_FIXED + 3 * k
        header[slot], header[slot + 1], header[slot + 2] = kind, dtype_code(dtype), dtype_code(on_wire)
        flats.append(_flat(pieces, on_wire))
    return LightPacket(header, index, flats)


def _field_pieces(wire: WireBatch, name: str, responses: Sequence[int]) -> tuple[int, list[Tensor], torch.dtype]:
    batch = wire.batch
    if name == "tokens":
        return PER_TOKEN, list(batch.tokens), batch.tokens[0].dtype
    if name == "rewards":
        if wire.rewards is None:
            return ABSENT, [], torch.float32
        if tuple(wire.rewards.shape) != (len(batch),):
            raise WireFormatError(f"rewards have shape {tuple(wire.rewards.shape)}, expected ({len(batch)},)")
        return PER_SAMPLE, [wire.rewards], wire.rewards.dtype
    if name == "episodes":
        if wire.episodes is None:
            return ABSENT, [], torch.int64
        if tuple(wire.episodes.shape) != (len(batch),):
            raise WireFormatError(f"episodes have shape {tuple(wire.episodes.shape)}, expected ({len(batch)},)")
        return PER_SAMPLE, [wire.episodes], torch.int64
    if name == "versions":
        if wire.versions is None:
            return ABSENT, [], torch.int64
        return COUNTED, [torch.tensor(v, dtype=torch.int64) for v in wire.versions], torch.int64
    values = getattr(batch, name)
    if values is None:
        return ABSENT, [], torch.float32
    if name in _TOP_FIELDS:
        width = int(values[0].shape[-1])
        for i, (v, r) in enumerate(zip(values, responses, strict=True)):
            if tuple(v.shape) != (r, width):
                raise WireFormatError(f"ActorBatch.{name}[{i}] has shape {tuple(v.shape)}, expected ({r}, {width})")
        return PER_RESPONSE_TOP, list(values), values[0].dtype
    if name == "response_mask":
        for i, (v, r) in enumerate(zip(values, responses, strict=True)):
            if tuple(v.shape) != (r,):
                raise WireFormatError(f"ActorBatch.response_mask[{i}] has shape {tuple(v.shape)}, expected ({r},)")
        return PER_RESPONSE, list(values), values[0].dtype
    kind, pieces = _per_sample_values(values, responses, name)
    return kind, pieces, values[0].dtype


def check_header(header: Tensor) -> None:
    if tuple(header.shape) != (HEADER_SLOTS,) or header.dtype != torch.int64:
        raise WireFormatError(f"a batch header is int64 [{HEADER_SLOTS}], got {header.dtype} {tuple(header.shape)}")
    if int(header[0]) != MAGIC or int(header[1]) != WIRE_VERSION:
        raise WireFormatError(
            f"not a batch header of format {WIRE_VERSION} (magic {int(header[0]):#x}, version {int(header[1])})"
        )


def _sizes(kind: int, index: Tensor, top: int = 0) -> list[int]:
    n, p, c = index[:, 0].tolist(), index[:, 1].tolist(), index[:, 2].tolist()
    if kind == PER_RESPONSE_TOP:
        return [(a - b) * top for a, b in zip(n, p, strict=True)]
    if kind == PER_SAMPLE:
        return [1] * len(n)
    if kind == PER_TOKEN:
        return n
    if kind == PER_RESPONSE:
        return [a - b for a, b in zip(n, p, strict=True)]
    if kind == COUNTED:
        return c
    raise WireFormatError(f"unknown field kind {kind} in a batch header")


def _present(header: Tensor) -> list[tuple[str, int, torch.dtype, torch.dtype]]:
    out = []
    for k, (name, _) in enumerate(FIELDS):
        slot = _N_FIXED + 3 * k
        kind = int(header[slot])
        if kind != ABSENT:
            out.append((name, kind, _dtype(int(header[slot + 1])), _dtype(int(header[slot + 2]))))
    return out


def field_buffers(header: Tensor, index: Tensor, device: torch.device | None = None) -> list[Tensor]:
    """Empty flat tensors for the fields `header` announces (what a receiver broadcasts into)."""
    check_header(header)
    return [
        torch.empty(sum(_sizes(kind, index, int(header[7]))), dtype=wire_dtype, device=device)
        for _, kind, _, wire_dtype in _present(header)
    ]


def unpack_light(packet: LightPacket) -> WireBatch:
    """The `WireBatch` of a packet, without routed experts (each field in the dtype its header names)."""
    header, index = packet.header, packet.index.cpu()
    check_header(header)
    n = int(header[2])
    if tuple(index.shape) != (n, INDEX_COLUMNS):
        raise WireFormatError(f"a batch index of {n} samples is [{n}, {INDEX_COLUMNS}], got {tuple(index.shape)}")
    present = _present(header)
    if len(present) != len(packet.fields):
        raise WireFormatError(f"the header names {len(present)} fields, {len(packet.fields)} came")
    values: dict[str, list[Tensor]] = {}
    for (name, kind, dtype, _), flat in zip(present, packet.fields, strict=True):
        sizes = _sizes(kind, index, int(header[7]))
        if flat.numel() != sum(sizes):
            raise WireFormatError(f"field {name}: {flat.numel()} values, the index says {sum(sizes)}")
        pieces = list(flat.cpu().to(dtype).split(sizes))
        if kind == PER_SAMPLE:
            pieces = [p.reshape(()) for p in pieces]
        if kind == PER_RESPONSE_TOP:
            pieces = [p.view(-1, int(header[7])) for p in pieces]
        values[name] = pieces
    if "tokens" not in values:
        raise WireFormatError("a batch header without tokens")
    batch = ActorBatch(
        tokens=values["tokens"],
        prompt_lengths=index[:, 1].tolist(),
        **{name: values.get(name) for name in (*_ACTOR_FIELDS, *_TOP_FIELDS)},
    )
    rewards = torch.stack(values["rewards"]) if "rewards" in values else None
    versions = [v.tolist() for v in values["versions"]] if "versions" in values else None
    episodes = torch.stack(values["episodes"]) if "episodes" in values else None
    return WireBatch(batch, rewards, versions, episodes)


@dataclass(frozen=True)
class RoutedLayout:
    """The routed experts' layout a header announces: layers, top-k, wire dtype."""

    layers: int
    top_k: int
    dtype: torch.dtype

    def numel(self, lengths: Sequence[int], indices: Sequence[int]) -> int:
        return sum((lengths[i] - 1) * self.layers * self.top_k for i in indices)

    def nbytes(self, lengths: Sequence[int], indices: Sequence[int]) -> int:
        return self.numel(lengths, indices) * self.dtype.itemsize


def routed_layout(header: Tensor) -> RoutedLayout | None:
    check_header(header)
    if int(header[3]) == 0:
        return None
    return RoutedLayout(int(header[4]), int(header[5]), _dtype(int(header[6])))


def pack_routed(routed: Sequence[Tensor], indices: Sequence[int], layout: RoutedLayout) -> Tensor:
    """The routed experts of samples `indices`, end to end in the layout's wire dtype; raises
    WireFormatError for an id the dtype cannot hold."""
    pieces = [routed[i] for i in indices]
    limit = torch.iinfo(layout.dtype).max
    for i, r in zip(indices, pieces, strict=True):
        if tuple(r.shape[1:]) != (layout.layers, layout.top_k):
            raise WireFormatError(
                f"routed_experts[{i}] is {tuple(r.shape)}, expected [*, {layout.layers}, {layout.top_k}]"
            )
        if r.numel() and (int(r.min()) < 0 or int(r.max()) > limit):
            raise WireFormatError(
                f"routed_experts[{i}] holds ids in [{int(r.min())}, {int(r.max())}], outside {layout.dtype}'s [0, {limit}]"
            )
    return _flat(pieces, layout.dtype)


def routed_buffer(
    lengths: Sequence[int], indices: Sequence[int], layout: RoutedLayout, device: torch.device | None = None
) -> Tensor:
    """The empty flat tensor a rank receives the routed experts of `indices` into."""
    return torch.empty(layout.numel(lengths, indices), dtype=layout.dtype, device=device)


def unpack_routed(
    flat: Tensor, lengths: Sequence[int], indices: Sequence[int], layout: RoutedLayout, num_samples: int
) -> list[Tensor | None]:
    """Per sample of the batch: a [n_i - 1, L, K] view of `flat` for `indices`, None for the others."""
    if flat.numel() != layout.numel(lengths, indices):
        raise WireFormatError(f"{flat.numel()} routed ids, the index says {layout.numel(lengths, indices)}")
    out: list[Tensor | None] = [None] * num_samples
    at = 0
    for i in indices:
        size = (lengths[i] - 1) * layout.layers * layout.top_k
        out[i] = flat[at : at + size].view(lengths[i] - 1, layout.layers, layout.top_k)
        at += size
    return out
