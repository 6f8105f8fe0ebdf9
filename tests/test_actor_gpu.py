"""The actor on GPUs: NCCL, bf16, Transformer Engine specs when installed (skipped without CUDA).

The same code as on the CPU: `init_distributed` picks NCCL, `build_model` picks TE specs, buffers
live on the current GPU. One spawn of min(2, GPUs) ranks (TP = world size, SP on) checks that the
bf16 policy's log-probs track the fp32 policy's, that R2 replay at unchanged weights is exact, and
that two bf16 updates with replay run with finite metrics and move the weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.launch import free_port

from mrl_configs import tiny_model

pytestmark = pytest.mark.gpu


def _config(world: int, dtype: str):  # noqa: ANN202 - Config, imported in the worker
    import dataclasses

    from megatron_rl.config import Config, ParallelConfig, RolloutConfig, TrainConfig, preset, validate

    cfg = Config(
        model=tiny_model(
            "qwen3_moe",
            hidden_size=256,
            ffn_hidden_size=512,
            num_attention_heads=8,
            num_query_groups=4,
            vocab_size=1000,
            num_experts=8,
            moe_ffn_hidden_size=256,
            max_position_embeddings=4096,
            rope_theta=1e6,
            params_dtype=dtype,
        ),
        parallel=ParallelConfig(tensor_model_parallel_size=world),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=64),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2"),
        train=TrainConfig(steps=2, updates_per_step=2, max_tokens_per_micro_batch=512, lr=1e-4, seed=3),
    )
    validate(cfg)
    return cfg


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(40, 120, (8,), generator=gen)]
    tokens = [torch.randint(0, 1000, (n,), generator=gen) for n in lengths]
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[16] * 8, advantages=[torch.randn((), generator=gen) for _ in lengths]
    )

    ref = MegatronActor(_config(world, "fp32"))
    fp32 = ref.compute_log_probs(batch)
    ref.close()
    actor = MegatronActor(_config(world, "bf16"))
    rec = actor.compute_log_probs(batch, record_routing=True)
    again = actor.compute_log_probs(batch.with_fields(routed_experts=rec.routed_experts), replay_routing=True)
    before = actor.full_params()
    history = actor.train(batch.with_fields(old_log_probs=rec.log_probs, routed_experts=rec.routed_experts))
    after = actor.full_params()
    result = {
        "backend": dist.get_backend(),
        "te": type(actor.chunks[0].decoder.layers[1].mlp.experts).__name__,
        "bf16_vs_fp32_mean_abs": float(
            torch.cat([a - b for a, b in zip(rec.log_probs, fp32.log_probs, strict=True)]).abs().mean()
        ),
        "replay_max_abs": max(float((a - b).abs().max()) for a, b in zip(again.log_probs, rec.log_probs, strict=True)),
        "losses": [h["loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "moved": max(float((after[k] - before[k]).abs().max()) for k in before),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    actor.close()
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_actor_nccl_bf16(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    result = json.loads(out.read_text())
    assert result["backend"] == "nccl", result
    assert result["replay_max_abs"] == 0.0, result
    assert result["bf16_vs_fp32_mean_abs"] < 0.1, result
    assert all(abs(x) < 1e3 for x in result["losses"]) and all(0 < g < 1e4 for g in result["grad_norms"]), result
    assert result["moved"] > 0, result
