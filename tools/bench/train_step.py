"""Benchmark: tokens/s and model FLOPs utilisation (MFU) of one actor train step.

A train step is what `MegatronActor.train` does for one mini-batch: forward and backward of every
micro-batch through Megatron's schedule, the policy loss, DDP gradient reduction and one
(distributed) Adam step. Two variants on the same model and batch, alternating, in the same run:

- `--lengths fixed` (every sample `--seq-len` tokens): free routing (the baseline) and R2 routing
  replay (routing recorded by a log-prob pass first, not timed);
- `--lengths mixed` (64 samples by default, a 64-token prompt and a response of 32..1024 tokens,
  uniform): right-padded micro-batches (the baseline) and packed ones (`train.micro_batch_tokens`),
  the same token budget for both; `lr` 0, so that both variants see the same weights and must give
  the same loss and gradient norm (`packed_vs_padded_results`). Also the seconds per update and,
  on a GPU, the peak memory of each.
- `--experts` (either lengths): the experts one after another (`model.moe_grouped_gemm=false`, the
  baseline) and as grouped GEMMs (`true`), each in an actor of its own on the same weights and batch,
  free routing, `lr` 0: both must give the same loss and gradient norm (`grouped_vs_sequential_results`).
- `--fast-path` (either lengths): the local specs' slow path (`model.moe_grouped_gemm=false`,
  `model.attention_backend=local`, the baseline) against the fast one (grouped experts, SDPA / varlen
  attention), in one process on the same weights and batch, free routing, `lr` 0 (`fast_vs_local_results`).
- `--profile`: one more step of each variant under torch.profiler: the 10 kernels (CUDA) or operators
  (CPU) of the most self time, and on CUDA the GPU-busy share (kernel time / wall time of the step).

One JSON line per figure with the baseline and the ratio, then one with the model size.

`--lora-rank R` instead compares full fine-tuning with LoRA of rank R on every module (attention,
dense MLP, routed experts; `model.lora`), each variant in a fresh process on the same model and batch:
seconds per train step, peak memory (CUDA's allocator peak on a GPU, the process's peak RSS on the
CPU), trainable parameters and the optimizer state's bytes.

Model FLOPs count the matmuls of the real (unpadded) tokens, forward x 3 for training: QKV and
output projections, causal attention scores and values (sum over positions of the context
length), dense or routed-expert SwiGLU MLPs (top-k experts per token), the router and the output
layer; no recompute, no log-prob/entropy arithmetic. MFU = FLOPs / (time x ranks x peak), peak
from --peak-tflops or the GPU name (bf16 dense); on the CPU it is only given with --peak-tflops.

    python tools/bench/train_step.py                       # CPU: a tiny model, one process
    python tools/bench/train_step.py --lora-rank 8         # full fine-tuning vs LoRA rank 8: s/step, peak memory
    python tools/bench/train_step.py --experts --preset wide   # sequential vs grouped experts
    torchrun --nproc-per-node 1 tools/bench/train_step.py --preset 1b --fast-path --profile  # local vs fast path
    torchrun --nproc-per-node 1 tools/bench/train_step.py --preset 1b
    torchrun --nproc-per-node 8 tools/bench/train_step.py --preset 1b --ep 8 --samples 64
    torchrun --nproc-per-node 1 tools/bench/train_step.py --preset 1b --lengths mixed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

PRESET_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "max_position_embeddings",
    "params_dtype",
)
PRESETS = {
    name: dict(zip(PRESET_FIELDS, values, strict=True))
    for name, values in {
        "1b": (16, 1024, 2816, 16, 4, 151936, 32, 4, 512, 8192, "bf16"),  # ~1.2B, ~0.3B active: Qwen3-MoE-shaped
        "tiny": (4, 64, 128, 4, 2, 1000, 4, 2, 64, 1024, "fp32"),
        "wide": (4, 256, 512, 8, 4, 4096, 16, 4, 256, 1024, "fp32"),  # a wider CPU model: 16 experts, top-4
    }.items()
}
MIXED_PROMPT, MIXED_RESPONSES = 64, (32, 1024)  # --lengths mixed: prompt tokens, response length range
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["auto", *PRESETS], default="auto", help="auto = 1b with CUDA, else tiny")
    p.add_argument(
        "--lengths", choices=["fixed", "mixed"], default="fixed", help="fixed: --seq-len each; mixed: packed vs padded"
    )
    p.add_argument("--samples", type=int, default=0, help="samples per step (0 = 8 per DP rank; mixed: 64)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sample (0 = 4096 for 1b, 128 for tiny)")
    p.add_argument("--max-tokens", type=int, default=0, help="micro-batch token budget (0 = 2 longest samples)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--experts", action="store_true", help="sequential vs grouped experts (model.moe_grouped_gemm)")
    p.add_argument("--fast-path", action="store_true", help="local specs' slow path vs grouped experts + SDPA")
    p.add_argument("--profile", action="store_true", help="top-10 kernels of one more step per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each variant")
    p.add_argument("--iters", type=int, default=3, help="timed steps of each variant")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak; 0 = from the GPU name")
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: full fine-tuning vs LoRA of this rank")
    p.add_argument("--lora-variant", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)  # one side
    return p.parse_args(argv)


def model_flops_per_step(model, lengths: list[int]) -> float:  # noqa: ANN001 - ModelConfig
    """Training FLOPs (3 x forward matmuls) of the real tokens of one step."""
    h, layers = model.hidden_size, model.num_layers
    dh = model.kv_channels or h // model.num_attention_heads
    q, kv = model.num_attention_heads * dh, model.num_query_groups * dh
    tokens = sum(lengths)
    context = sum(n * (n + 1) / 2 for n in lengths)  # causal: position t attends to t + 1 keys
    moe = [model.num_experts is not None and i >= model.first_k_dense_layers and
           (i - model.first_k_dense_layers) % model.moe_layer_freq == 0 for i in range(layers)]  # fmt: skip
    fwd = 0.0
    for is_moe in moe:
        fwd += tokens * 2 * h * (q + 2 * kv) + tokens * 2 * q * h  # QKV, output projection
        fwd += context * 2 * 2 * q  # scores and weighted values
        if is_moe:
            fwd += tokens * (model.moe_router_topk * 2 * 3 * h * model.moe_ffn_hidden_size + 2 * h * model.num_experts)
        else:
            fwd += tokens * 2 * 3 * h * model.ffn_hidden_size
    fwd += tokens * 2 * h * model.vocab_size
    return 3.0 * fwd


def param_counts(model) -> tuple[float, float]:  # noqa: ANN001 - ModelConfig
    """(total, active per token) parameters, embeddings included."""
    h = model.hidden_size
    dh = model.kv_channels or h // model.num_attention_heads
    q, kv = model.num_attention_heads * dh, model.num_query_groups * dh
    attn = h * (q + 2 * kv) + q * h + 2 * h + (2 * dh if model.qk_layernorm else 0)
    expert = 3 * h * model.moe_ffn_hidden_size
    total = active = 2 * model.vocab_size * h + h
    for i in range(model.num_layers):
        is_moe = model.num_experts is not None and i >= model.first_k_dense_layers
        if is_moe:
            total += attn + model.num_experts * (expert + h)
            active += attn + model.moe_router_topk * expert + model.num_experts * h
        else:
            total += attn + 3 * h * model.ffn_hidden_size
            active += attn + 3 * h * model.ffn_hidden_size
    return float(total), float(active)


def _peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops > 0:
        return args.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _lengths(args: argparse.Namespace, seq: int, samples: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(tokens, prompt tokens) per sample."""
    if args.lengths == "fixed":
        return [seq] * samples, [seq // 4] * samples
    low, high = MIXED_RESPONSES
    responses = torch.randint(low, high + 1, (samples,), generator=gen).tolist()
    return [MIXED_PROMPT + r for r in responses], [MIXED_PROMPT] * samples


def _peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _process_peak_memory_gib() -> float:
    """CUDA's allocator peak on a GPU, else this process's peak resident set (Linux: ru_maxrss in KiB)."""
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _optimizer_state_bytes(optimizer) -> int:  # noqa: ANN001 - MegatronOptimizer
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return sum(t.numel() * t.element_size() for o in inner for st in o.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))  # fmt: skip


def run_lora_variant(args: argparse.Namespace) -> dict:
    """One side of `--lora-rank`: seconds per train step, peak memory, trainable parameters, optimizer bytes."""
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.config import Config, LoraConfig, ModelConfig, ParallelConfig, RolloutConfig, TrainConfig, preset

    name = args.preset if args.preset != "auto" else ("1b" if torch.cuda.is_available() else "tiny")
    seq = args.seq_len or (4096 if name == "1b" else 128)
    samples = args.samples or 8
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_variant == "lora" else LoraConfig()
    model = ModelConfig(family="qwen3_moe", **{**PRESETS[name], "max_position_embeddings": max(seq, 1024)}, lora=lora)
    cfg = Config(
        model=dataclasses.replace(model, recompute=args.recompute),
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
        ),  # fmt: skip
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=seq - seq // 4),
        algorithm=preset("grpo"),
        train=TrainConfig(
            steps=args.warmup + args.iters,
            updates_per_step=1,
            max_tokens_per_micro_batch=args.max_tokens or 2 * seq,
            lr=1e-6,
            seed=1,
        ),  # fmt: skip
    )
    actor = MegatronActor(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = ActorBatch(
        tokens=[torch.randint(0, model.vocab_size, (seq,), generator=gen) for _ in range(samples)],
        prompt_lengths=[seq // 4] * samples,
        advantages=[torch.randn((), generator=gen) for _ in range(samples)],
    )
    batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch).log_probs)
    times = []
    for it in range(args.warmup + args.iters):
        _sync()
        start = time.perf_counter()
        actor.train(batch)
        _sync()
        if it >= args.warmup:
            times.append(time.perf_counter() - start)
    result = dict(variant=args.lora_variant, seconds_per_step=round(statistics.median(times), 4),
                  peak_memory_gib=round(_process_peak_memory_gib(), 3), trainable_params=actor.trainable_params,
                  optimizer_state_bytes=_optimizer_state_bytes(actor.state.optimizer), preset=name, seq_len=seq,
                  samples=samples, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    actor.close()
    return result


def compare_lora(argv: list[str], rank: int) -> list[dict]:
    """`--lora-rank`: each variant in its own process (peak memory is a process's), then the comparison."""
    import subprocess
    import sys

    sides = {}
    for variant in ("full", "lora"):
        proc = subprocess.run([sys.executable, __file__, *argv, "--lora-variant", variant], capture_output=True,
                              text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"the {variant} variant failed:\n{proc.stderr[-3000:]}")
        sides[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = sides["full"], sides["lora"]
    ratios = {k: round(lora[k] / full[k], 4) for k in ("seconds_per_step", "peak_memory_gib", "trainable_params",
                                                        "optimizer_state_bytes")}  # fmt: skip
    return [dict(figure="lora_vs_full_train_step", lora_rank=rank,
                 full=full, lora=lora, lora_over_full=ratios)]  # fmt: skip


def run(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.config import Config, ModelConfig, ParallelConfig, RolloutConfig, TrainConfig, preset, validate
    from megatron_rl.parallel.launch import read_launch_env

    name = args.preset if args.preset != "auto" else ("1b" if torch.cuda.is_available() else "tiny")
    mixed = args.lengths == "mixed"
    world = read_launch_env().world_size
    dp = world // (args.tp * args.pp)
    seq = args.seq_len or (4096 if name == "1b" else 128)
    samples = args.samples or (64 if mixed else 8 * dp)
    gen = torch.Generator().manual_seed(0)
    lengths, prompts = _lengths(args, seq, samples, gen)
    positions = max(PRESETS[name]["max_position_embeddings"], max(lengths))
    model = ModelConfig(family="qwen3_moe", **{**PRESETS[name], "max_position_embeddings": positions})
    budget = args.max_tokens or 2 * max(lengths)
    cfg = Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
        ),
        rollout=RolloutConfig(
            temperature=1.0, max_new_tokens=max(n - p for n, p in zip(lengths, prompts, strict=True))
        ),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2"),
        train=TrainConfig(
            steps=args.warmup + args.iters,
            updates_per_step=1,
            max_tokens_per_micro_batch=budget,
            lr=0.0 if mixed or args.experts or args.fast_path else 1e-6,
            seed=1,
        ),
    )
    cfg.model = dataclasses.replace(cfg.model, recompute=args.recompute)
    validate(cfg)
    paired = args.experts or args.fast_path
    if args.fast_path:
        kinds = {"local": dict(moe_grouped_gemm=False, attention_backend="local"),
                 "fast": dict(moe_grouped_gemm="auto", attention_backend="sdpa")}  # fmt: skip
    else:
        kinds = (
            {"sequential": dict(moe_grouped_gemm=False), "grouped": dict(moe_grouped_gemm=True)}
            if args.experts
            else {"auto": {}}
        )
    actors = {k: MegatronActor(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields)))
              for k, fields in kinds.items()}  # fmt: skip
    actor = next(iter(actors.values()))
    batch = ActorBatch(
        tokens=[torch.randint(0, model.vocab_size, (n,), generator=gen) for n in lengths],
        prompt_lengths=prompts,
        advantages=[torch.randn((), generator=gen) for _ in lengths],
    )
    old = actor.compute_log_probs(batch, record_routing=True)
    batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    # (name, actor, replay routing, train.micro_batch_tokens); the first is the baseline
    if paired:
        variants = [(name, actors[name], False, 0) for name in kinds]
    elif mixed:
        variants = [("padded", actor, False, 0), ("packed", actor, False, budget)]
    else:
        variants = [("free_routing", actor, False, 0), ("r2_replay", actor, True, 0)]
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    peaks: dict[str, float | None] = {}
    first: dict[str, dict[str, float]] = {}
    for it in range(args.warmup + args.iters):
        for variant, actor, replay, packed_tokens in variants:
            actor.cfg.train.micro_batch_tokens = packed_tokens
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            _sync()
            start = time.perf_counter()
            history = actor.train(batch, replay_routing=replay)
            _sync()
            elapsed = time.perf_counter() - start
            first.setdefault(variant, history[0])
            peaks[variant] = _peak_memory_gib()
            if it >= args.warmup:
                times[variant].append(elapsed)
    profiles = [_profile(variant, actor, batch) for variant, actor, *_ in variants] if args.profile else []
    for actor in actors.values():
        actor.close()
    flops = model_flops_per_step(model, lengths)
    peak = _peak_tflops(args)
    (base_name, *_), (var_name, *_) = variants
    base_t, t = statistics.median(times[base_name]), statistics.median(times[var_name])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    common = dict(preset=name, device=device, ranks=world, tp=args.tp, pp=args.pp, ep=args.ep, samples=samples,
                  lengths=args.lengths, tokens=sum(lengths), dtype=model.params_dtype, iters=args.iters,
                  threads=torch.get_num_threads())  # fmt: skip
    if not mixed:
        common["seq_len"] = seq
    pair = dict(variant=var_name, baseline=base_name)
    tps, base_tps = sum(lengths) / t, sum(lengths) / base_t
    out = [
        dict(
            figure="train_step_tokens_per_s",
            value=round(tps, 1),
            baseline_value=round(base_tps, 1),
            ratio=round(tps / base_tps, 3),
            **pair,
            **common,
        ),  # fmt: skip
    ]
    if peak is not None:
        mfu, base_mfu = flops / (t * world * peak * 1e12), flops / (base_t * world * peak * 1e12)
        out.append(dict(figure="train_step_mfu", value=round(mfu, 4), baseline_value=round(base_mfu, 4),
                        ratio=round(mfu / base_mfu, 3), peak_tflops=peak, **pair, **common))  # fmt: skip
    else:
        out.append(dict(figure="train_step_model_tflops_per_s", value=round(flops / t / 1e12, 6),
                        baseline_value=round(flops / base_t / 1e12, 6), ratio=round(base_t / t, 3),
                        note="no peak known for this device: MFU needs --peak-tflops", **pair, **common))  # fmt: skip
    if mixed or paired:
        out.append(dict(figure="train_step_seconds", value=round(t, 4), baseline_value=round(base_t, 4),
                        ratio=round(t / base_t, 3), **pair, **common))  # fmt: skip
        if peaks[var_name] is not None:
            out.append(dict(figure="train_step_peak_memory_gib", value=round(peaks[var_name], 3),
                            baseline_value=round(peaks[base_name], 3), ratio=round(peaks[var_name] / peaks[base_name], 3),
                            **pair, **common))  # fmt: skip
    if mixed or paired:
        rel = {k: abs(first[var_name][k] - first[base_name][k]) / max(abs(first[base_name][k]), 1e-12)
               for k in ("loss", "grad_norm")}  # fmt: skip
        out.append(dict(figure=f"{var_name}_vs_{base_name}_results", loss=first[var_name]["loss"],
                        baseline_loss=first[base_name]["loss"], grad_norm=first[var_name]["grad_norm"],
                        baseline_grad_norm=first[base_name]["grad_norm"], max_rel_diff=max(rel.values()),
                        micro_batches=first[var_name]["micro_batches"],
                        baseline_micro_batches=first[base_name]["micro_batches"], **common))  # fmt: skip
    total, active = param_counts(model)
    out.append(dict(figure="model_size", params=total, active_params=active, model_flops_per_step=flops, **common))
    return out + [{**p, **common} for p in profiles]


def _profile(variant: str, actor, batch) -> dict:  # noqa: ANN001 - MegatronActor, ActorBatch
    """One train step of `actor` under torch.profiler: its 10 kernels (CPU: operators) of the most self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        actor.train(batch)
        _sync()
    wall_us = (time.perf_counter() - start) * 1e6
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on CUDA only kernels have self device time (an operator's is its kernels')
    events = [e for e in prof.key_averages() if getattr(e, field, 0) > 0]
    events.sort(key=lambda e: getattr(e, field), reverse=True)
    busy = sum(getattr(e, field) for e in events)
    top = [dict(name=e.key[:120], self_ms=round(getattr(e, field) / 1e3, 3), calls=e.count) for e in events[:10]]
    line = dict(figure="train_step_top_kernels", variant=variant, step_ms=round(wall_us / 1e3, 1), top=top)
    if cuda:
        line["gpu_busy"] = round(busy / wall_us, 3)
    return line


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.lora_rank > 0 and args.lora_variant is None:
        for line in compare_lora(argv, args.lora_rank):
            print(json.dumps(line), flush=True)
        return
    from megatron_rl.parallel.launch import ensure_launch_env

    ensure_launch_env()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lines = [run_lora_variant(args)] if args.lora_variant else run(args)
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_distributed

    if dist.get_rank() == 0:
        for line in lines:
            print(json.dumps(line), flush=True)

    destroy_distributed(process_group=dist.is_initialized())


if __name__ == "__main__":
    main()
