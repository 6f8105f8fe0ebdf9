"""Rank 0's step batch to every rank as tensors, each DP rank's routed experts to that rank only.

    wire, report = scatter_batch(wire if rank == 0 else None, updates=cfg.train.updates_per_step,
                                 num_experts=cfg.model.num_experts)      # collective

Every rank needs the batch's index (lengths, prompts, loss masks, log-probs, advantages: the
whole-batch quantities, the global normaliser, the log-prob gap and KL read them, and each rank
plans its micro-batches from the lengths), about 13 bytes per token: rank 0 broadcasts the header,
the index and the flat fields of `batch_wire`. The routed experts (R3; 48 layers x top-8 are 1.5 KB
per token in SGLang's int32) are what a rank only needs for the samples it computes: each rank works
out every DP rank's samples from the lengths (`micro_batches.step_shares`, what `plan_for_rank`
gives the step's log-prob passes and updates), and rank 0 sends each rank (the TP, PP, CP and
expert peers of a DP rank get the same) only its DP rank's samples' routing, narrowed to uint8 or
int16 (`batch_wire.expert_wire_dtype`); the receiver allocates its buffer from the lengths, so no
sizes travel. Routed experts of other DP ranks' samples are None in its `ActorBatch`. Rank 0 keeps
its own samples' tensors and drops the others'.

`ScatterReport` gives the bytes each rank received and rank 0 sent, and the seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.actor.batch_wire import (
    HEADER_SLOTS,
    INDEX_COLUMNS,
    LightPacket,
    RoutedLayout,
    WireBatch,
    field_buffers,
    pack_light,
    pack_routed,
    routed_buffer,
    routed_layout,
    unpack_light,
    unpack_routed,
)
from megatron_rl.actor.micro_batches import step_shares
from megatron_rl.parallel.device import local_device


@dataclass(frozen=True)
class ScatterReport:
    """received: bytes each global rank received (rank 0: 0); sent: bytes rank 0 sent; seconds: this
    rank's time in the scatter."""

    received: tuple[int, ...]
    sent: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """`actor/batch_bytes_per_rank` (the most any rank received), `actor/batch_bytes_sent`, `time/batch_scatter`."""
        return {
            "actor/batch_bytes_per_rank": float(max(self.received, default=0)),
            "actor/batch_bytes_sent": float(self.sent),
            "time/batch_scatter": self.seconds,
        }


@cache
def _dp_rank_of_every_rank(world: int) -> tuple[int, ...]:
    """The DP rank of each global rank (one all-gather per process; the layout does not change)."""
    device = local_device()
    mine = torch.tensor([ps.get_data_parallel_rank()], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return tuple(int(t.item()) for t in every)


def _broadcast(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` from rank 0 (rank 0's own value elsewhere ignored: a buffer of its shape), on the CPU."""
    moved = tensor.to(device)
    dist.broadcast(moved, src=0)
    return moved.cpu()


def _light(wire: WireBatch | None, num_experts: int | None, device: torch.device) -> LightPacket:
    rank = dist.get_rank()
    packet = pack_light(wire, num_experts=num_experts) if rank == 0 else None
    header = _broadcast(packet.header if packet else torch.zeros(HEADER_SLOTS, dtype=torch.int64), device)
    n = int(header[2])
    index = _broadcast(packet.index if packet else torch.zeros(n, INDEX_COLUMNS, dtype=torch.int64), device)
    buffers = packet.fields if packet else field_buffers(header, index)
    return LightPacket(header, index, [_broadcast(b, device) for b in buffers])


def scatter_batch(wire: WireBatch | None, *, updates: int, num_experts: int | None) -> tuple[WireBatch, ScatterReport]:
    """Collective: rank 0 passes the whole step batch, the others None; every rank gets the batch with
    the routed experts of its DP rank's samples only (`step_shares(lengths, updates, DP)`), and the
    report. `num_experts` sets the routed experts' wire dtype."""
    began = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        assert wire is not None
        return wire, ScatterReport((0,), 0, time.perf_counter() - began)
    device = local_device()
    packet = _light(wire, num_experts, device)
    out = unpack_light(packet)
    if rank == 0:
        assert wire is not None
        out = wire  # rank 0 keeps its own tensors (the routing narrowed below)
    layout = routed_layout(packet.header)
    lengths = out.batch.lengths
    received = [0] + [packet.nbytes] * (world - 1)
    if layout is not None:
        dp_of = _dp_rank_of_every_rank(world)
        shares = step_shares(lengths, updates, ps.get_data_parallel_world_size())
        for r in range(1, world):
            received[r] += layout.nbytes(lengths, shares[dp_of[r]])
        routed = _scatter_routed(out, shares, dp_of, layout, device)
        out = WireBatch(out.batch.with_fields(routed_experts=routed), out.rewards, out.versions, out.episodes)
    return out, ScatterReport(tuple(received), sum(received), time.perf_counter() - began)


def _scatter_routed(
    wire: WireBatch, shares: list[list[int]], dp_of: tuple[int, ...], layout: RoutedLayout, device: torch.device
) -> list[torch.Tensor | None]:
    """Rank 0 sends each rank its DP rank's samples' routing (one packed tensor per DP rank); the
    others receive theirs. Returns this rank's routed experts (None for other DP ranks' samples)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    lengths = wire.batch.lengths
    n = len(lengths)
    if rank == 0:
        routed = wire.batch.routed_experts
        assert routed is not None
        packed: dict[int, torch.Tensor] = {}
        pending = []
        for r in range(1, world):
            d = dp_of[r]
            if d not in packed:
                packed[d] = pack_routed(routed, shares[d], layout).to(device)
            pending.append(dist.isend(packed[d], dst=r))
        for work in pending:
            work.wait()
        own = set(shares[dp_of[0]])
        return [routed[i] if i in own else None for i in range(n)]
    mine = shares[dp_of[rank]]
    buffer = routed_buffer(lengths, mine, layout, device)
    dist.recv(buffer, src=0)
    return unpack_routed(buffer.cpu(), lengths, mine, layout, n)
