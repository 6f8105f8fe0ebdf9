"""Benchmark: seconds per weight sync in each mode, against a memcpy of the same bytes in the same run.

The Megatron actor (default: one process, gloo, float32 on the CPU) exports its weights once as a
Hugging Face folder, and the local engine (`megatron-rl serve`, a child process) serves that
folder. Then every mode syncs the actor's weights to the engine --repeats times, after one untimed
warm-up, with the modes alternating. A sync is timed on rank 0 from the first export step until
the engine reports the new version (`SyncReport.seconds`). The baseline in each round is one
`copy_` of a buffer of the same size on the parameters' device (host memory bandwidth on the CPU).
One JSON line per mode: the median sync seconds, the median memcpy seconds, their ratio, and
the rate. On GPUs the engine takes the last GPU (--engine-device); NCCL cannot put the trainer and
the engine of the distributed mode on one GPU.

With --servers 2 (CPU) every sync goes to two local engines, which take one update at a time as
SGLang's do; the distributed mode's senders then post in turns (`weight_sync/turns.py`).

    python tools/bench/weight_sync.py [--hidden 256] [--layers 4] [--experts 8] [--bucket-mb 64] [--repeats 5]
    torchrun --nproc-per-node 2 tools/bench/weight_sync.py --pp 2          # each stage sends its own (--ep 2: each EP rank)
    torchrun --nproc-per-node 2 tools/bench/weight_sync.py --pp 2 --servers 2
    python tools/bench/weight_sync.py --unchanged-lr 1e-6                  # bf16 bytes one step leaves unchanged
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODES = ("disk", "distributed", "tensor")


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8, help="experts per layer (top-2, width = hidden)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bucket-mb", type=float, default=64.0, help="largest bucket (MiB)")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs per mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and of the engine")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of disk,distributed,tensor")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--servers", type=int, default=1, help="local engines every sync goes to")
    p.add_argument(
        "--engine-device", default=None, help="the engine's device (default: cpu, or the last GPU when there are GPUs)"
    )
    p.add_argument(
        "--unchanged-lr",
        type=float,
        default=None,
        help="instead of timing syncs: the share of bf16 weight bytes one optimizer step at this learning rate "
        "leaves unchanged (a GRPO step on random tokens, advantages of both signs)",
    )
    p.add_argument("--workdir", default=None, help="folder for the model and disk syncs (default: a temp folder)")
    return p.parse_args(argv)


def _config(args: argparse.Namespace, workdir: Path):  # noqa: ANN202 - Config
    from megatron_rl.config import Config, ModelConfig, ParallelConfig, RolloutConfig, TrainConfig, validate

    model = ModelConfig(
        family="qwen3_moe",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        num_attention_heads=args.hidden // 64,
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=args.vocab,
        num_experts=args.experts,
        moe_router_topk=2,
        moe_ffn_hidden_size=args.hidden,
        max_position_embeddings=2048,
        params_dtype="bf16" if torch.cuda.is_available() else "fp32",
    )
    cfg = Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
        ),
        rollout=RolloutConfig(sync_dir=str(workdir / "sync"), request_timeout_s=600.0),
        train=TrainConfig(seed=1),
    )
    validate(cfg)
    return cfg


def _with_mode(cfg, mode: str):  # noqa: ANN001, ANN202
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, weight_sync=mode, colocate=mode == "tensor")
    )


def _memcpy_seconds(src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> float:
    if src.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    dst[:nbytes].copy_(src[:nbytes])
    if src.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began


def _bf16_export(actor) -> dict:  # noqa: ANN001
    from megatron_rl.models.export import export_hf_weights

    return {
        n: t.to(torch.bfloat16).cpu()
        for bucket in export_hf_weights(actor.chunks, actor.cfg.model, bucket_mb=512)
        for n, t in bucket
    }


def unchanged_bytes(args: argparse.Namespace) -> dict:
    """One optimizer step of the actor (its policy loss with recomputed old log-probs, 16 samples of 64
    random tokens, advantages of both signs) at --unchanged-lr; the bf16 weights before and after: the share of bytes and of tensors
    that did not change, i.e. what a delta sync (only changed tensors) would skip."""
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch

    torch.set_num_threads(args.threads)
    cfg = _config(args, Path(tempfile.gettempdir()))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=args.unchanged_lr, lr_warmup_steps=0))
    actor = MegatronActor(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = ActorBatch(
        tokens=[torch.randint(0, args.vocab, (64,), generator=gen) for _ in range(16)],
        prompt_lengths=[16] * 16,
        advantages=[torch.tensor(1.0 if i % 2 else -1.0) for i in range(16)],
    )
    batch.old_log_probs = actor.compute_log_probs(batch).log_probs  # on-policy, as an RL step recomputes them
    before = _bf16_export(actor)
    actor.train(batch)
    after = _bf16_export(actor)
    if dist.get_rank() != 0:
        return {}
    total = sum(t.numel() * 2 for t in before.values())
    same_elements = sum(int((before[n] == after[n]).sum()) * 2 for n in before)
    same_tensors = [n for n in before if torch.equal(before[n], after[n])]
    same_tensor_bytes = sum(before[n].numel() * 2 for n in same_tensors)
    return {
        "figure": "bf16_bytes_unchanged_by_one_step",
        "lr": args.unchanged_lr,
        "bf16_bytes": total,
        "unchanged_element_share": round(same_elements / total, 4),
        "unchanged_tensor_share_of_bytes": round(same_tensor_bytes / total, 4),
        "unchanged_tensors": len(same_tensors),
        "tensors": len(before),
        "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep},
    }


def run(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.hf_config import hf_config_from_model
    from megatron_rl.parallel.launch import read_launch_env
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.event_loop import RolloutLoop
    from megatron_rl.weight_sync import make_weight_sync

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; allowed {list(MODES)}")
    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.gettempdir()) / f"mrl-bench-weight-sync-{read_launch_env().master_port}"
    cfg = _config(args, workdir)
    actor = MegatronActor(cfg)
    rank0 = dist.get_rank() == 0
    folder = workdir / "policy"
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_hf_folder(actor.chunks, cfg.model, folder, hf_config_from_model(cfg.model))
    engine, servers = None, []
    if rank0:
        engine_device = args.engine_device or (
            f"cuda:{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "cpu"
        )
        local = dict(extra_args=["--threads", str(args.threads)], env={"OMP_NUM_THREADS": str(args.threads)})
        if args.servers > 1:
            servers = _start_servers(args.servers, str(folder), engine_device, local)
            urls = [s.url for s in servers]
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="sglang", sglang_urls=urls))
        engine = RolloutEngine.from_config(cfg.rollout, RolloutLoop(), str(folder), device=engine_device, **local)
    syncs = {m: make_weight_sync(_with_mode(cfg, m), engine, actor, bucket_mb=args.bucket_mb) for m in modes}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    memcpy: dict[str, list[float]] = {m: [] for m in modes}
    nbytes: dict[str, int] = {}
    try:
        for mode, sync in syncs.items():  # warm-up: the group, buffers, page cache, the engine's first load
            nbytes[mode] = sync.sync(f"{mode}-warmup").bytes
        device = next(iter(actor.chunks[0].parameters())).device
        src = torch.randint(0, 255, (max(nbytes.values()),), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        _memcpy_seconds(src, dst, src.numel())
        for r in range(args.repeats):
            for mode, sync in syncs.items():
                report = sync.sync(f"{mode}-{r}")
                seconds[mode].append(report.seconds)
                memcpy[mode].append(_memcpy_seconds(src, dst, report.bytes))
    finally:
        for sync in syncs.values():
            sync.close()
        if engine is not None:
            engine.close()
            engine.loop.close()
        for server in servers:
            server.stop()
    lines = []
    for mode in modes:
        value, base = statistics.median(seconds[mode]), statistics.median(memcpy[mode])
        lines.append(
            {
                "figure": f"weight_sync_{mode}_seconds",
                "value": round(value, 4),
                "baseline": "memcpy_same_bytes_seconds",
                "baseline_value": round(base, 5),
                "ratio": round(value / base, 1),
                "bytes": nbytes[mode],
                "gbps": round(nbytes[mode] / value / 1e9, 3),
                "baseline_gbps": round(nbytes[mode] / base / 1e9, 3),
                "seconds": [round(s, 4) for s in seconds[mode]],
                "baseline_seconds": [round(s, 5) for s in memcpy[mode]],
                "bucket_mb": args.bucket_mb,
                "world_size": dist.get_world_size(),
                "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep},
                "servers": args.servers,
                "device": str(device),
                "threads": args.threads,
            }
        )
    if rank0:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return lines


def _start_servers(count: int, folder: str, device: str, local: dict) -> list:
    """`count` local engines serving `folder`, loading side by side."""
    from megatron_rl.rollout.local.launcher import spawn_local_engine

    args = [*local["extra_args"], "--no-auth"]
    starting = [spawn_local_engine(folder, device=device, extra_args=args, env=local["env"]) for _ in range(count)]
    return [s.wait() for s in starting]


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from megatron_rl.parallel.launch import ensure_launch_env

    args = _parse(argv)
    ensure_launch_env()
    try:
        lines = [unchanged_bytes(args)] if args.unchanged_lr is not None else run(args)
        if dist.get_rank() == 0:
            for line in lines:
                print(json.dumps(line), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
