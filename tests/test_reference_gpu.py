"""The frozen reference policy on GPUs (skipped without CUDA): bf16 under Float16Module, `ref_offload`.

One spawn of min(2, GPUs) ranks (TP = world size, SP on): the reference built from the actor's start
reads the actor's log-probs bit for bit (free routing and R2 replay); with `algorithm.ref_offload`
its weights are in host memory between uses (device memory drops by at least their bytes), its
log-probs are those of the reference without offloading, and the weights come back on the device
only for the call. Also prints the seconds of one host-to-device copy of the weights (the price of
offloading, per step).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.launch import free_port

from mrl_configs import tiny_model

pytestmark = pytest.mark.gpu


def _config(world: int, offload: bool):  # noqa: ANN202 - Config, imported in the worker
    import dataclasses

    from megatron_rl.config import Config, ParallelConfig, RolloutConfig, TrainConfig, preset, validate

    cfg = Config(
        model=tiny_model(
            "qwen3_moe",
            hidden_size=512,
            ffn_hidden_size=1024,
            num_attention_heads=8,
            num_query_groups=4,
            vocab_size=1000,
            num_experts=8,
            moe_ffn_hidden_size=512,
            max_position_embeddings=4096,
            rope_theta=1e6,
            params_dtype="bf16",
        ),
        parallel=ParallelConfig(tensor_model_parallel_size=world),
        rollout=RolloutConfig(temperature=0.8, max_new_tokens=64),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2", kl_coef=0.04, ref_offload=offload),
        train=TrainConfig(steps=2, updates_per_step=1, max_tokens_per_micro_batch=512, lr=1e-4, seed=3),
    )
    validate(cfg)
    return cfg


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.policy import FrozenPolicy

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(40, 120, (8,), generator=gen)]
    tokens = [torch.randint(0, 1000, (n,), generator=gen) for n in lengths]
    batch = ActorBatch(tokens=tokens, prompt_lengths=[16] * 8)

    actor = MegatronActor(_config(world, offload=False))
    old = actor.compute_log_probs(batch, record_routing=True)
    routed = batch.with_fields(routed_experts=old.routed_experts)
    kept = FrozenPolicy.start(_config(world, offload=False))
    kept_lp = kept.compute_log_probs(routed, replay_routing=True).log_probs
    weight_bytes = sum(t.numel() * t.element_size() for t in kept._tensors())
    torch.cuda.synchronize()
    with_two = torch.cuda.memory_allocated()
    kept.close()
    del kept
    gc.collect()
    offloaded = FrozenPolicy.start(_config(world, offload=True))
    torch.cuda.synchronize()
    freed = with_two - torch.cuda.memory_allocated()
    on_device_between = offloaded.on_device()
    off_lp = offloaded.compute_log_probs(routed, replay_routing=True).log_probs
    free_lp = offloaded.compute_log_probs(batch).log_probs
    began = time.perf_counter()
    offloaded._to_device()
    copy_s = time.perf_counter() - began
    on_device_in_call = offloaded.on_device()
    offloaded._to_host()
    result = {
        "dtype": str(offloaded.chunks[0].embedding.word_embeddings.weight.dtype),
        "actor_vs_reference": _max_diff(kept_lp, old.log_probs),
        "offloaded_vs_kept": _max_diff(off_lp, kept_lp),
        "free_routing_vs_actor": _max_diff(free_lp, actor.compute_log_probs(batch).log_probs),
        "weight_bytes": weight_bytes,
        "freed_bytes": freed,
        "on_device_between": on_device_between,
        "on_device_in_call": on_device_in_call,
        "after_call_on_device": offloaded.on_device(),
        "copy_s": copy_s,
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    offloaded.close()
    actor.close()
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_bf16_and_offload(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    r = json.loads(out.read_text())
    print(f"reference weights {r['weight_bytes'] / 2**20:.1f} MiB per rank: host-to-device copy {r['copy_s']:.4f} s")
    assert r["dtype"] == "torch.bfloat16", r
    assert r["actor_vs_reference"] == 0.0 and r["free_routing_vs_actor"] == 0.0, r
    assert r["offloaded_vs_kept"] == 0.0, r
    assert r["freed_bytes"] >= r["weight_bytes"], r  # the device copies of the offloaded weights are gone
    assert not r["on_device_between"] and r["on_device_in_call"] and not r["after_call_on_device"], r
