"""Benchmark of `megatron_rl.losses.policy_loss` against a textbook implementation of the same formula.

One JSON line per objective (preset): forward+backward throughput (B*T token positions per second,
median over --iters runs after --warmup, the two implementations timed alternately) and peak memory, for `policy_loss` (with its metrics,
normaliser and checks) and for a plain textbook version of the same objective, measured in the same
run on the same inputs, with their ratios. Peak memory is the largest number of bytes live in
torch's allocator during one forward+backward beyond what was live before it (inputs excluded,
the gradient included): on CUDA from `torch.cuda.max_memory_allocated`, on CPU from the allocation
events of `torch.profiler` (profile_memory=True), summed in time order. Inputs are [B, T] log-probs:
nothing of size B*T*V is involved.

    python tools/bench/losses.py [--batch 64] [--seq 4096] [--iters 20] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from megatron_rl.config import PRESETS, loss_spec, preset
from megatron_rl.losses import LossSpec, policy_loss

OBJECTIVES = tuple(PRESETS)


def textbook_loss(lp, old, adv, m, cfg: LossSpec) -> torch.Tensor:
    """The objective as written in its paper, with a float mask and per-call means (no metrics, no clamping)."""
    lengths = m.sum(-1)
    if cfg.ratio_level == "token":
        ratio = torch.exp(lp - old)
    else:
        log_s = ((lp - old) * m).sum(-1) / lengths
        if cfg.ratio_level == "sequence":
            ratio = torch.exp(log_s).unsqueeze(-1)
        else:
            ratio = torch.exp(log_s.detach().unsqueeze(-1) + lp - lp.detach())
    if cfg.gate == "soft":
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        surrogate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1)) * adv
    else:
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        surrogate = torch.min(ratio * adv, clipped * adv)
    per_token = -surrogate * m
    if cfg.loss_agg_mode == "token-mean":
        return per_token.sum() / m.sum()
    return (per_token.sum(-1) / lengths).mean()


def make_inputs(batch: int, seq: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(batch, seq, generator=gen) * 4
    log_probs = old + torch.randn(batch, seq, generator=gen) * 0.05
    adv = torch.randn(batch, 1, generator=gen).expand(batch, seq).contiguous()
    return [t.to(device) for t in (log_probs, old, adv, mask)]


def peak_bytes(fn: Callable[[], None], device: str) -> int:
    """Peak bytes live in torch's allocator during fn() above the level before it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(allocations):
        live += size
        peak = max(peak, live)
    return peak


def seconds_per_run(fns: dict[str, Callable[[], None]], device: str, warmup: int, iters: int) -> dict[str, float]:
    """Median seconds of each fn, timed interleaved so that load changes on a shared machine hit all alike."""

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_objective(name: str, args: argparse.Namespace) -> dict:
    cfg = loss_spec(preset(name))
    log_probs, old, adv, mask = make_inputs(args.batch, args.seq, args.device)
    maskf = mask.float()
    leaves = {"ours": log_probs.clone().requires_grad_(), "textbook": log_probs.clone().requires_grad_()}
    losses: dict[str, torch.Tensor] = {}

    def ours() -> None:
        leaf = leaves["ours"]
        leaf.grad = None
        loss, _ = policy_loss(leaf, old, adv, mask, cfg)
        loss.backward()
        losses["ours"] = loss.detach()

    def textbook() -> None:
        leaf = leaves["textbook"]
        leaf.grad = None
        loss = textbook_loss(leaf, old, adv, maskf, cfg)
        loss.backward()
        losses["textbook"] = loss.detach()

    tokens = args.batch * args.seq
    seconds = seconds_per_run({"ours": ours, "textbook": textbook}, args.device, args.warmup, args.iters)
    t_ours, t_book = seconds["ours"], seconds["textbook"]
    m_ours, m_book = peak_bytes(ours, args.device), peak_bytes(textbook, args.device)
    grad_diff = (leaves["ours"].grad - leaves["textbook"].grad).abs().max().item()
    return {
        "bench": "losses",
        "objective": name,
        "batch": args.batch,
        "seq": args.seq,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "tokens_per_s": round(tokens / t_ours),
        "baseline": "textbook",
        "baseline_tokens_per_s": round(tokens / t_book),
        "speed_ratio": round(t_book / t_ours, 3),
        "peak_mib": round(m_ours / 2**20, 2),
        "baseline_peak_mib": round(m_book / 2**20, 2),
        "peak_ratio": round(m_ours / m_book, 3),
        "bt_fp32_mib": round(tokens * 4 / 2**20, 2),
        "loss_abs_diff": abs(losses["ours"].item() - losses["textbook"].item()),
        "grad_max_abs_diff": grad_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.objectives:
        print(json.dumps(bench_objective(name, args)), flush=True)


if __name__ == "__main__":
    main()
