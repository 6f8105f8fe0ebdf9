"""Benchmark: the actor's chunked log-prob + entropy path against the naive full-vocabulary path.

Both paths include the output projection: logits = hidden [T, H] @ W[V, H].T, forward and
backward (gradients of hidden and W from loss = sum(logp * advantage)); entropy is computed as
a metric (no gradient) by both.

- naive:   full fp32 logits, log_softmax over the vocabulary, gather; entropy from the same
           log-probs (exp computed once, multiplied in place).
- chunked: `vocab_parallel_logprobs_from_hidden` (TP = 1) with --chunk-tokens rows at a time.

Memory: each path runs once in a fresh subprocess; the figure is the peak extra resident memory
of that process over its state after building the inputs (the Linux VmHWM high-water mark, reset
through /proc/self/clear_refs right before the run); on CUDA, torch.cuda.max_memory_allocated
over memory_allocated at the same point. Time: a third subprocess runs --rounds rounds of both
paths, alternating which goes first (the machine may be shared: alternation exposes both paths to
the same load), and reports each path's fastest forward+backward in wall-clock time (the goal),
and in CPU time of the process (less sensitive to other processes on a shared machine). Prints one JSON line per figure
with the naive figure of the same run and the ratio, and a line with the largest differences
between the two paths' outputs.

    python tools/bench/logprobs.py [--tokens 4096 --vocab 151936 --hidden 1024 --chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_MEMORY_RATIO = 0.25
GOAL_TIME_RATIO = 1.1


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=512, help="rows per chunk of the chunked path")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (one run of each path per round)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of hidden and W")
    p.add_argument("--child", choices=["naive", "chunked", "time"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- child: one path, one process ----


def _rss_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _cpu_s() -> float:
    """User + system CPU seconds of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(args: argparse.Namespace) -> None:
    import torch

    from megatron_rl.actor.logprobs import vocab_parallel_logprobs_from_hidden

    if args.threads:
        torch.set_num_threads(args.threads)

    dev = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g, device=dev, dtype=dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g, device=dev, dtype=dtype) * 0.05).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g, device=dev)
    adv = torch.randn(args.tokens, generator=g, device=dev)
    temp = args.temperature

    def naive():
        z = hidden @ weight.t()
        if temp not in (0.0, 1.0):
            z = z / temp
        logp_all = torch.log_softmax(z.float(), dim=-1)
        del z
        logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            p = logp_all.exp()
            entropy = -p.mul_(logp_all).sum(-1)
            del p
        del logp_all  # autograd keeps its own reference for backward
        grads = torch.autograd.grad((logp * adv).sum(), [hidden, weight])
        return logp.detach(), entropy, grads

    def chunked():
        out = vocab_parallel_logprobs_from_hidden(hidden, weight, target, temp, chunk_tokens=args.chunk_tokens)
        grads = torch.autograd.grad((out.logprobs * adv).sum(), [hidden, weight])
        return out.logprobs.detach(), out.entropy.detach(), grads

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.child == "time":
        times: dict[str, list[float]] = {"naive": [], "chunked": []}
        cpu: dict[str, list[float]] = {"naive": [], "chunked": []}
        for r in range(args.rounds):
            for name, fn in (("naive", naive), ("chunked", chunked))[:: 1 if r % 2 == 0 else -1]:
                t0, c0 = time.perf_counter(), _cpu_s()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_s() - c0)
        print(json.dumps({"times_s": times, "cpu_s": cpu, "threads": torch.get_num_threads()}))
        return
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        how = "torch.cuda.max_memory_allocated - memory_allocated before the run"
    else:
        if not _rss_reset():
            raise RuntimeError("cannot reset the peak RSS through /proc/self/clear_refs")
        base = _status_kb("VmRSS") * 1024
        how = "peak RSS (VmHWM, reset via /proc/self/clear_refs) - RSS before the run, fresh process per path"
    logp, entropy, (grad_h, grad_w) = (naive if args.child == "naive" else chunked)()
    sync()
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _status_kb("VmHWM") * 1024
    pick = torch.randint(0, grad_w.numel(), (100_000,), generator=torch.Generator().manual_seed(1)).to(dev)
    torch.save(
        {
            "logp": logp.cpu(),
            "entropy": entropy.cpu(),
            "grad_hidden": grad_h.float().cpu(),
            "grad_weight_sample": grad_w.flatten()[pick].float().cpu(),
        },
        args.out,
    )
    print(json.dumps({"peak_extra_bytes": peak - base, "memory_measure": how}))


# ---- parent: run both paths, compare ----


def _run_child(args: argparse.Namespace, path: str, out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--out", out]
    for key in ("tokens", "vocab", "hidden", "chunk_tokens", "temperature", "rounds", "threads", "device", "dtype"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} path failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.child:
        _child(args)
        return
    import torch

    shape = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype}
    common = {**shape, "device": args.device, "chunk_tokens": args.chunk_tokens, "projection": "included"}
    with tempfile.TemporaryDirectory() as tmp:
        naive = _run_child(args, "naive", f"{tmp}/naive.pt")
        chunked = _run_child(args, "chunked", f"{tmp}/chunked.pt")
        a, b = torch.load(f"{tmp}/naive.pt"), torch.load(f"{tmp}/chunked.pt")
        load_before = os.getloadavg()[0]  # the machine may be shared: context for the timings
        timing = _run_child(args, "time", f"{tmp}/unused.pt")
    times = timing["times_s"]
    mem_ratio = chunked["peak_extra_bytes"] / naive["peak_extra_bytes"]
    time_ratio = min(times["chunked"]) / min(times["naive"])
    lines = [
        {
            "figure": "peak_extra_memory_GiB",
            "chunked": chunked["peak_extra_bytes"] / 2**30,
            "naive": naive["peak_extra_bytes"] / 2**30,
            "ratio": mem_ratio,
            "goal": GOAL_MEMORY_RATIO,
            "measured": chunked["memory_measure"],
            **common,
        },
        {
            "figure": "fwd_bwd_time_s",
            "chunked": min(times["chunked"]),
            "naive": min(times["naive"]),
            "ratio": time_ratio,
            "goal": GOAL_TIME_RATIO,
            "chunked_all_s": times["chunked"],
            "naive_all_s": times["naive"],
            "cpu_time_ratio": min(timing["cpu_s"]["chunked"]) / min(timing["cpu_s"]["naive"]),
            "chunked_cpu_s": timing["cpu_s"]["chunked"],
            "naive_cpu_s": timing["cpu_s"]["naive"],
            "threads": timing["threads"],
            "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
            **common,
        },
        {
            "figure": "max_abs_diff_chunked_vs_naive",
            **{k: (a[k].double() - b[k].double()).abs().max().item() for k in a},
            **common,
        },
        {
            "figure": "goal_met",
            "memory": mem_ratio <= GOAL_MEMORY_RATIO,
            "time": time_ratio <= GOAL_TIME_RATIO,
            **common,
        },
    ]
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
