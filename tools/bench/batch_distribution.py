"""The step batch's distribution to the trainer ranks at a simulated R3 step: before and after, one run.

Run by `tools/bench/rl_step.py` (`--batch-tokens`), one process per rank under torchrun (gloo):

    torchrun --standalone --nproc-per-node 2 tools/bench/batch_distribution.py --tokens 2000000

Rank 0 builds a step batch of `--tokens` tokens in `--samples` samples (prompt 1/8 of each), the
engine's log-probs, one advantage per sample, and R3 routed experts in SGLang's int32 layout,
[n - 1, --layers, --top-k] with ids below --experts (the defaults are Qwen3-30B-A3B's 48 layers,
top-8 of 128: 1.5 KB per token). Then, in the same processes:

- before: `parallel.rank0.on_rank0` hands the whole `StepBatch` to every rank
  (`broadcast_object_list`: one pickle), as the trainer did before the scatter;
- after: `actor.batch_scatter.scatter_batch`: header, index and fields to every rank as tensors,
  each DP rank only its samples' routed experts as uint8.

Seconds are the slowest rank's (from a barrier to the batch in hand, unpacking included); bytes are
what one receiving rank got (before: the pickle's length, counted without a copy). One JSON line per
side and one with the ratios.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


class _Count:
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        return len(data)


def pickled_bytes(obj: object) -> int:
    """The length of `obj`'s pickle as `broadcast_object_list` makes it (`pickle.Pickler`), without building it."""
    sink = _Count()
    pickle.Pickler(sink).dump(obj)
    return sink.n


def simulated_batch(tokens: int, samples: int, layers: int, top_k: int, experts: int, seed: int = 0) -> Any:
    """rank 0's `StepBatch`: `samples` samples of about tokens / samples tokens each, R3 routing."""
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.loop.collect import StepBatch

    gen = torch.Generator().manual_seed(seed)
    base = tokens // samples
    lengths = [base + (1 if i < tokens - base * samples else 0) for i in range(samples)]
    prompts = [max(1, n // 8) for n in lengths]
    batch = ActorBatch(
        tokens=[torch.randint(0, 151_936, (n,), generator=gen) for n in lengths],
        prompt_lengths=prompts,
        advantages=[torch.randn((), generator=gen) for _ in lengths],
        rollout_log_probs=[-torch.rand(n - p, generator=gen) for n, p in zip(lengths, prompts, strict=True)],
        routed_experts=[
            torch.randint(0, experts, (n - 1, layers, top_k), generator=gen, dtype=torch.int32) for n in lengths
        ],
    )
    return StepBatch(batch, {"reward/mean": 0.5}, torch.rand(samples, generator=gen), None)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (the rest is DP)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from megatron_rl.actor.batch_scatter import scatter_batch
    from megatron_rl.actor.batch_wire import WireBatch
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_distributed, init_distributed
    from megatron_rl.parallel.rank0 import on_rank0

    init_distributed(ParallelConfig(tensor_model_parallel_size=args.tp, backend="gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = simulated_batch(args.tokens, args.samples, args.layers, args.top_k, args.experts) if rank == 0 else None
    rows: dict[str, dict[str, Any]] = {}

    dist.barrier()
    began = time.perf_counter()
    got = on_rank0(lambda: plan)
    before_s = _slowest(time.perf_counter() - began)
    before_bytes = pickled_bytes(plan) if rank == 0 else 0
    del got
    rows["before"] = {"side": "before: broadcast_object_list of the StepBatch", "seconds": before_s}
    rows["before"]["bytes_per_rank"] = before_bytes

    dist.barrier()
    began = time.perf_counter()
    wire = WireBatch(plan.batch, plan.rewards, plan.versions) if rank == 0 else None
    out, report = scatter_batch(wire, updates=1, num_experts=args.experts)
    after_s = _slowest(time.perf_counter() - began)
    held = sum(r is not None for r in out.batch.routed_experts)
    rows["after"] = {
        "side": "after: scatter of tensors (routed experts uint8, each DP rank its samples)",
        "seconds": after_s,
        "bytes_per_rank": max(report.received),
        "bytes_sent_by_rank0": report.sent,
    }
    counts = torch.tensor([held], dtype=torch.int64)
    every = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    if rank == 0:
        common = {"tokens": args.tokens, "samples": args.samples, "ranks": world, "tp": args.tp}
        common["routed_per_token_int32"] = args.layers * args.top_k * 4
        for name, row in rows.items():
            print(json.dumps({"figure": f"batch_distribution/{name}", **common, **row}))
        print(
            json.dumps(
                {
                    "figure": "batch_distribution/ratio",
                    "bytes_per_rank_before_over_after": rows["before"]["bytes_per_rank"]
                    / rows["after"]["bytes_per_rank"],
                    "seconds_before_over_after": before_s / after_s,
                    "samples_with_routing_per_rank": [int(c) for c in every],
                }
            )
        )
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
