"""Benchmark: one MoE layer's routed experts, Megatron's `SequentialMLP` (the loop, one expert after another) against
`models.grouped_experts.GroupedExperts` (one `torch._grouped_mm` per projection), in one process on the same weights.

A one-layer Qwen3-MoE policy of the 1b preset's widths (hidden 1024, 32 experts of 512, top-4; `--hidden`,
`--experts`, `--expert-width`, `--topk`) built both ways (`model.moe_grouped_gemm`), weights from
`init_deterministic`. Per `--tokens`: the tokens x top-k routed rows, sorted by expert with a random (uneven) count
per expert, forward and backward of the experts alone, alternating the two: rows/s (median of `--iters`), on CUDA
the allocator's peak, and the largest difference of outputs and input gradients. One JSON line per token count.

    python tools/bench/experts.py --tokens 2048 8192 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--iters", type=int, default=3)
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(experts: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor):  # noqa: ANN202
    """Forward and backward once: seconds, output, input gradient."""
    x = x.detach().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    _sync()
    start = time.perf_counter()
    out, _ = experts(x, counts, probs)
    out.backward(grad)
    _sync()
    return time.perf_counter() - start, out.detach(), x.grad


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.init import init_deterministic
    from megatron_rl.parallel import destroy_distributed, init_distributed
    from megatron_rl.parallel.device import local_device
    from megatron_rl.parallel.launch import ensure_launch_env

    model = ModelConfig(
        family="qwen3_moe", num_layers=1, hidden_size=args.hidden, num_attention_heads=8, num_query_groups=4,
        vocab_size=1024, num_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.expert_width,
        params_dtype=args.dtype,
    )  # fmt: skip
    parallel, device = ParallelConfig(), local_device()
    ensure_launch_env()
    init_distributed(parallel, model)
    try:
        layers = {}
        for name, grouped in (("loop", False), ("grouped", True)):
            chunks = build_model(model.__class__(**{**model.__dict__, "moe_grouped_gemm": grouped}), parallel)
            init_deterministic(chunks, model, seed=0)
            layers[name] = chunks[0].decoder.layers[0].mlp.experts
        dtype = next(layers["loop"].parameters()).dtype
        gen = torch.Generator().manual_seed(0)
        for tokens in args.tokens:
            rows = tokens * args.topk
            share = torch.rand(args.experts, generator=gen) + 0.2
            counts = (share / share.sum() * rows).floor().long()
            counts[0] += rows - int(counts.sum())
            x = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
            probs = torch.rand(rows, generator=gen).to(device, torch.float32)
            grad = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
            times: dict[str, list[float]] = {n: [] for n in layers}
            peaks, results = {}, {}
            for it in range(args.iters + 1):  # the first of each is a warm-up
                for name, experts in layers.items():
                    if torch.cuda.is_available():
                        torch.cuda.reset_peak_memory_stats()
                    seconds, out, x_grad = _step(experts, x, counts, probs, grad)
                    if it:
                        times[name].append(seconds)
                    results[name] = (out, x_grad)
                    peaks[name] = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
            median = {n: statistics.median(t) for n, t in times.items()}
            line = dict(
                figure="experts_rows_per_s", tokens=tokens, rows=rows, experts=args.experts, hidden=args.hidden,
                expert_width=args.expert_width, dtype=args.dtype, device=device.type,
                **{f"{n}_rows_per_s": round(rows / t) for n, t in median.items()},
                grouped_speedup=round(median["loop"] / median["grouped"], 2),
                max_abs_diff_out=float((results["grouped"][0] - results["loop"][0]).float().abs().max()),
                max_abs_diff_input_grad=float((results["grouped"][1] - results["loop"][1]).float().abs().max()),
            )  # fmt: skip
            if torch.cuda.is_available():
                line.update({f"{n}_peak_mib": round(p, 1) for n, p in peaks.items()})
            print(json.dumps(line), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
