"""The exporter's TP gather on one machine's CPUs (`models/shard_peers.py`): the group's first rank
copies the other members' shards from their own memory, no byte through gloo, and reads them anew at
every export (a shard changed in place, or moved to new memory, since the last one)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.models.shard_gather import join_shards
from megatron_rl.models.shard_peers import ExportMemory, PeerShards

# (name, full shape, partition dim, sections split separately: SwiGLU's [gate; up], DeltaNet's [q, k, v, z, b, a])
LAYOUT = [
    ("column", (8, 6), 0, ()),
    ("swiglu", (8, 6), 0, (4, 4)),
    ("delta_in_proj", (16, 6), 0, (2, 2, 4, 4, 2, 2)),
    ("row", (6, 8), 1, ()),
]


def _full(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    seed = sum(map(ord, name)) + 100 * step
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _shard_of(full: torch.Tensor, dim: int, sections: tuple[int, ...], rank: int, count: int) -> torch.Tensor:
    if sections:  # e.g. Megatron's SwiGLU fc1 shard: [gate_rank; up_rank]
        return torch.cat([part.chunk(count, dim=0)[rank] for part in full.split(list(sections))])
    return full.chunk(count, dim=dim)[rank].contiguous()


def _refuse_point_to_point(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    raise AssertionError("a shard went through the process group")


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for op in ("isend", "irecv", "send", "recv", "gather"):
            setattr(dist, op, _refuse_point_to_point)
        shards_by_step = [[_shard_of(_full(n, s, 0), d, g, rank, 2) for n, s, d, g in LAYOUT]]
        # the parameters are views of one buffer, as in Megatron's DDP buffer: its memory moves whole
        buffer = torch.cat([t.flatten() for t in shards_by_step[0]])
        params, offset = [], 0
        for t in shards_by_step[0]:
            params.append(torch.nn.Parameter(buffer[offset : offset + t.numel()].view(t.shape), requires_grad=False))
            offset += t.numel()
        # the fields of models.init.ParamShard the gather reads (no Megatron import in these processes)
        shards = [
            SimpleNamespace(param=p, partition_dim=d, sections=g, full_shape=s)
            for (_, s, d, g), p in zip(LAYOUT, params, strict=True)
        ]
        memory = ExportMemory()
        first_buffers = {}
        for step in range(3):
            if step == 1:  # changed in place (an optimizer step)
                for (n, s, d, g), p in zip(LAYOUT, params, strict=True):
                    p.data.copy_(_shard_of(_full(n, s, 1), d, g, rank, 2))
            if step == 2:  # moved to new memory
                for (n, s, d, g), p in zip(LAYOUT, params, strict=True):
                    p.data = _shard_of(_full(n, s, 2), d, g, rank, 2).clone()
            peers = PeerShards(dist.group.WORLD, [s.param for s in shards], memory, expert=False)
            assert peers.shared
            if rank == 0:
                for i, (shard, (n, s, _, _)) in enumerate(zip(shards, LAYOUT, strict=True)):
                    out = memory.full_buffer(n, shard.full_shape, shard.param)
                    got = join_shards(shard, [shard.param.detach(), *peers.of(i)], out)
                    assert torch.equal(got, _full(n, s, step)), f"{n} at export {step}"
                    assert first_buffers.setdefault(n, got) is got, f"{n}: a new buffer at export {step}"
            peers.close()
    finally:
        dist.destroy_process_group()


def test_first_rank_reads_the_members_shards_in_place(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
