"""Benchmark: tokens/s and model FLOPs utilisation (MFU) of one actor train step.

A train step is what `MegatronActor.train` does for one mini-batch: forward and backward of every
micro-batch through Megatron's schedule, the policy loss, DDP gradient reduction and one
(distributed) Adam step. Two variants on the same model and batch, alternating, in the same run:
free routing (the baseline) and R2 routing replay (routing recorded by a log-prob pass first, not
timed). One JSON line per figure with the baseline and the ratio, then one with the model size.

Model FLOPs count the matmuls of the real (unpadded) tokens, forward x 3 for training: QKV and
output projections, causal attention scores and values (sum over positions of the context
length), dense or routed-expert SwiGLU MLPs (top-k experts per token), the router and the output
layer; no recompute, no log-prob/entropy arithmetic. MFU = FLOPs / (time x ranks x peak), peak
from --peak-tflops or the GPU name (bf16 dense); on the CPU it is only given with --peak-tflops.

    python tools/bench/train_step.py                       # CPU: a tiny model, one process
    torchrun --nproc-per-node 1 tools/bench/train_step.py --preset 1b
    torchrun --nproc-per-node 8 tools/bench/train_step.py --preset 1b --ep 8 --samples 64
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
    }.items()
}
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["auto", *PRESETS], default="auto", help="auto = 1b with CUDA, else tiny")
    p.add_argument("--samples", type=int, default=0, help="samples per step (0 = 8 per data-parallel rank)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sample (0 = 4096 for 1b, 128 for tiny)")
    p.add_argument("--max-tokens", type=int, default=0, help="micro-batch token budget (0 = 2 samples)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each variant")
    p.add_argument("--iters", type=int, default=3, help="timed steps of each variant")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak; 0 = from the GPU name")
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


def run(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.config import Config, ModelConfig, ParallelConfig, RolloutConfig, TrainConfig, preset, validate
    from megatron_rl.parallel.launch import read_launch_env

    name = args.preset if args.preset != "auto" else ("1b" if torch.cuda.is_available() else "tiny")
    model = ModelConfig(family="qwen3_moe", **PRESETS[name])
    world = read_launch_env().world_size
    dp = world // (args.tp * args.pp)
    seq = args.seq_len or (4096 if name == "1b" else 128)
    samples = args.samples or 8 * dp
    cfg = Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
        ),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=seq),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2"),
        train=TrainConfig(
            steps=args.warmup + args.iters,
            updates_per_step=1,
            max_tokens_per_micro_batch=args.max_tokens or 2 * seq,
            lr=1e-6,
            seed=1,
        ),
    )
    cfg.model = dataclasses.replace(cfg.model, recompute=args.recompute)
    validate(cfg)
    actor = MegatronActor(cfg)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, model.vocab_size, (seq,), generator=gen) for _ in range(samples)]
    batch = ActorBatch(
        tokens=tokens,
        prompt_lengths=[seq // 4] * samples,
        advantages=[torch.randn((), generator=gen) for _ in range(samples)],
    )
    old = actor.compute_log_probs(batch, record_routing=True)
    batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    times: dict[str, list[float]] = {"free_routing": [], "r2_replay": []}
    for it in range(args.warmup + args.iters):
        for variant, replay in (("free_routing", False), ("r2_replay", True)):
            dist.barrier()
            _sync()
            start = time.perf_counter()
            actor.train(batch, replay_routing=replay)
            _sync()
            elapsed = time.perf_counter() - start
            if it >= args.warmup:
                times[variant].append(elapsed)
    actor.close()
    lengths = [seq] * samples
    flops = model_flops_per_step(model, lengths)
    peak = _peak_tflops(args)
    base_t = statistics.median(times["free_routing"])
    t = statistics.median(times["r2_replay"])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    common = dict(preset=name, device=device, ranks=world, tp=args.tp, pp=args.pp, ep=args.ep, samples=samples,
                  seq_len=seq, dtype=model.params_dtype, iters=args.iters)  # fmt: skip
    tps, base_tps = sum(lengths) / t, sum(lengths) / base_t
    out = [
        dict(
            figure="train_step_tokens_per_s",
            variant="r2_replay",
            value=round(tps, 1),
            baseline="free_routing",
            baseline_value=round(base_tps, 1),
            ratio=round(tps / base_tps, 3),
            **common,
        ),  # fmt: skip
    ]
    if peak is not None:
        mfu, base_mfu = flops / (t * world * peak * 1e12), flops / (base_t * world * peak * 1e12)
        out.append(dict(figure="train_step_mfu", variant="r2_replay", value=round(mfu, 4), baseline="free_routing",
                        baseline_value=round(base_mfu, 4), ratio=round(mfu / base_mfu, 3), peak_tflops=peak, **common))  # fmt: skip
    else:
        out.append(dict(figure="train_step_model_tflops_per_s", variant="r2_replay", value=round(flops / t / 1e12, 6),
                        baseline="free_routing", baseline_value=round(flops / base_t / 1e12, 6),
                        ratio=round(base_t / t, 3), note="no peak known for this device: MFU needs --peak-tflops",
                        **common))  # fmt: skip
    total, active = param_counts(model)
    out.append(dict(figure="model_size", params=total, active_params=active, model_flops_per_step=flops, **common))
    return out


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from megatron_rl.parallel.launch import ensure_launch_env

    ensure_launch_env()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lines = run(args)
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_distributed

    if dist.get_rank() == 0:
        for line in lines:
            print(json.dumps(line), flush=True)

    destroy_distributed(process_group=dist.is_initialized())


if __name__ == "__main__":
    main()
