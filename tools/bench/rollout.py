"""Benchmark of the local rollout engine against `transformers` `generate` on the same model and prompts.

The engine runs as `megatron-rl serve` in a child process; the SGLang client sends all requests at
once (64 by default) and the figure is generated tokens per second of wall time, from the first
request to the last reply. The baseline is one batched, left-padded `model.generate` call in this
process on the same prompts, with the same sampling settings, stop tokens and thread count; its
tokens are counted up to and including each row's first stop token (what a rollout would keep).
Both use float32 on the CPU; each side runs --repeats times, alternating, and the median run is
reported. Wall-clock rates (`ratio`) suffer from other load on a shared machine, so the lines also
give tokens per CPU-second of each side's process (`ratio_cpu`: the engine process, HTTP included,
against this process during `generate`). One JSON line per scenario:

- `fixed_length`: every response runs to --max-new-tokens (pure decode throughput);
- `varied_length`: --stop-ids token ids end a response (about 2% chance per step with the default
  20 of 1024), so lengths vary as RL responses do and a finished row stops costing compute;
- `groups`: --prompts/8 prompts x 8 samples each (GRPO groups), varied lengths.

--size picks the model: `example` (BENCH_MODEL, the reduced-size policy, 2.0M parameters) or `10x`
(BENCH_MODEL_10X: wider, twice as deep, larger experts, 10.3x the parameters).

    python tools/bench/rollout.py [--size example|10x] [--requests 64] [--max-new-tokens 128] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import psutil
import torch

from megatron_rl.rollout.local.launcher import start_local_engine
from megatron_rl.rollout.sglang import SGLangClient
from megatron_rl.rollout.types import SamplingParams

# The reduced-size policy of rl_feasibility.md, with a 1024-token vocabulary.
BENCH_MODEL = dict(
    vocab_size=1024,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# The same family and vocabulary with 10.3x the parameters (21M): 2x wider, 2x deeper, 3x wider experts.
BENCH_MODEL_10X = dict(
    BENCH_MODEL,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    moe_intermediate_size=384,
)
SIZES = {"example": BENCH_MODEL, "10x": BENCH_MODEL_10X}


def make_bench_model(folder: str, seed: int, shape: dict = BENCH_MODEL) -> str:
    """Save a randomly initialised (seeded) Qwen3-MoE of `shape` (BENCH_MODEL by default) to `folder`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).save_pretrained(folder)
    return folder


def make_prompts(n: int, group: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    unique = []
    for _ in range(n // group):
        length = int(torch.randint(16, 49, (1,), generator=gen))
        unique.append(torch.randint(2, BENCH_MODEL["vocab_size"], (length,), generator=gen).tolist())
    return [p for p in unique for _ in range(group)]


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_engine(url: str, pid: int, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds of the engine process)."""
    server = psutil.Process(pid)

    async def go() -> tuple[int, float, float]:
        async with SGLangClient([url], max_concurrency=len(prompts)) as client:
            await client.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
            cpu, started = _cpu_seconds(server), time.perf_counter()
            samples = await client.generate_batch(prompts, params)
            wall = time.perf_counter() - started
            return sum(len(s.output_ids) for s in samples), wall, _cpu_seconds(server) - cpu

    return asyncio.run(go())


def run_generate(model, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds of this process) of one batched `generate` call."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    # the engine stops on stop_token_ids and, unless ignore_eos, on the model's EOS: the same here
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else [BENCH_MODEL["eos_token_id"]])
    model.generation_config.eos_token_id = None
    stops = stops or None  # None: run to max_new_tokens
    kwargs = dict(do_sample=True, temperature=params.temperature, top_p=1.0, top_k=0, pad_token_id=0)
    model.generate(ids[:2, -4:], attention_mask=mask[:2, -4:], max_new_tokens=4, eos_token_id=stops, **kwargs)
    cpu, started = time.process_time(), time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=params.max_new_tokens, eos_token_id=stops, min_new_tokens=0, **kwargs
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = 0
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in (stops or ())]
        tokens += ends[0] + 1 if ends else len(row)
    return tokens, seconds, cpu


def _median(runs: list[tuple[int, float, float]], column: int) -> tuple[int, float]:
    """(tokens, seconds) of the run with the median tokens per second of `column` (1 wall, 2 CPU)."""
    run = sorted(runs, key=lambda r: r[0] / r[column])[len(runs) // 2]
    return run[0], run[column]


def _rate(run: tuple[int, float]) -> float:
    return run[0] / max(run[1], 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="example", help="bench model: example or 10x")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop-ids", type=int, default=20, help="stop tokens of the varied-length scenarios")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side (1: robust on a shared CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per scenario (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    folder = make_bench_model(tempfile.mkdtemp(prefix="bench-rollout-"), args.seed, SIZES[args.size])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stop_ids = tuple(range(2, 2 + args.stop_ids))
    scenarios = [
        ("fixed_length", 1, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)),
        (
            "varied_length",
            1,
            SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids),
        ),
        ("groups", 8, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids)),
    ]
    engine_args = ["--threads", str(args.threads), "--log-level", "warning", "--no-auth"]
    server = start_local_engine(folder, extra_args=engine_args)
    try:
        for name, group, params in scenarios:
            prompts = make_prompts(args.requests, group, args.seed)
            engine_runs, hf_runs = [], []
            for _ in range(args.repeats):  # alternate, so that load from other processes hits both alike
                engine_runs.append(run_engine(server.url, server.process.pid, prompts, params))
                with torch.inference_mode():
                    hf_runs.append(run_generate(model, prompts, params))
            eng_tokens, eng_s = _median(engine_runs, 1)
            hf_tokens, hf_s = _median(hf_runs, 1)
            engine_rate, hf_rate = eng_tokens / eng_s, hf_tokens / hf_s
            engine_cpu_rate = _rate(_median(engine_runs, 2))
            hf_cpu_rate = _rate(_median(hf_runs, 2))
            print(
                json.dumps(
                    {
                        "bench": "rollout",
                        "scenario": name,
                        "size": args.size,
                        "figure": "generated tokens/s",
                        "requests": len(prompts),
                        "max_new_tokens": params.max_new_tokens,
                        "threads": args.threads,
                        "repeats": args.repeats,
                        "local_engine": round(engine_rate, 1),
                        "baseline_hf_generate": round(hf_rate, 1),
                        "ratio": round(engine_rate / hf_rate, 3),
                        "local_engine_per_cpu_s": round(engine_cpu_rate, 1),
                        "baseline_per_cpu_s": round(hf_cpu_rate, 1),
                        "ratio_cpu": round(engine_cpu_rate / hf_cpu_rate, 3),
                        "engine_tokens": eng_tokens,
                        "baseline_tokens": hf_tokens,
                        "engine_s": round(eng_s, 3),
                        "baseline_s": round(hf_s, 3),
                    }
                ),
                flush=True,
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
