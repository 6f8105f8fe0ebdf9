"""The actor on GPUs: NCCL, bf16, Transformer Engine specs when installed (skipped without CUDA).

The same code as on the CPU: `init_distributed` picks NCCL, `build_model` picks TE specs, buffers
live on the current GPU. One spawn of min(2, GPUs) ranks (TP = world size, SP on) checks that the
bf16 policy's log-probs track the fp32 policy's, that R2 replay at unchanged weights is exact, and
that two bf16 updates with replay run with finite metrics and move the weights.

Context parallelism (two GPUs and Transformer Engine, else skipped): the same policy under CP = 2
(DP = 1) and CP = 1 (DP = 2), bf16 (Transformer Engine's context-parallel attention has only
fused/flash kernels, no fp32 one): log-probs of right-padded and packed micro-batches, R2 replay
exact under CP, and a padded then a packed update (loss, gradient norm) agree within bf16
tolerances (`CP_TOLERANCES`), the difference being the attention's accumulation order.
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


# CP = 2 against CP = 1, both bf16: mean |log-prob difference| (bf16's relative precision is 2^-8 =
# 0.0039), and relative differences of the loss and gradient norm after one update
CP_TOLERANCES = {"logprob_mean_abs": 0.02, "loss_rel": 0.05, "grad_norm_rel": 0.05}


def _cp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import dataclasses

    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(40, 300, (8,), generator=gen)]
    batch = ActorBatch(
        tokens=[torch.randint(0, 1000, (n,), generator=gen) for n in lengths],
        prompt_lengths=[16] * 8,
        advantages=[torch.randn((), generator=gen) for _ in lengths],
    )
    results = {}
    for cp in (1, 2):
        cfg = _config(world, "bf16")
        cfg.parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1, context_parallel_size=cp)
        cfg.train = dataclasses.replace(cfg.train, updates_per_step=1)
        actor = MegatronActor(cfg)
        padded = actor.compute_log_probs(batch, record_routing=True)
        again = actor.compute_log_probs(batch.with_fields(routed_experts=padded.routed_experts), replay_routing=True)
        actor.cfg.train.micro_batch_tokens = 600
        packed = actor.compute_log_probs(batch)
        actor.cfg.train.micro_batch_tokens = 0
        step = batch.with_fields(old_log_probs=padded.log_probs, routed_experts=padded.routed_experts)
        history = actor.train(step)
        actor.cfg.train.micro_batch_tokens = 600
        history += actor.train(step)
        results[cp] = dict(
            padded=padded.log_probs,
            packed=packed.log_probs,
            routing=padded.routed_experts,
            replay_max_abs=max(
                float((a - b).abs().max()) for a, b in zip(again.log_probs, padded.log_probs, strict=True)
            ),
            losses=[h["loss"] for h in history],
            grad_norms=[h["grad_norm"] for h in history],
        )
        actor.close()

    def mean_abs(a: list, b: list) -> float:
        return float(torch.cat([x - y for x, y in zip(a, b, strict=True)]).abs().mean())

    one, two = results[1], results[2]
    same_experts = [
        float((x.sort(-1).values == y.sort(-1).values).all(-1).float().mean())
        for x, y in zip(one["routing"], two["routing"], strict=True)
    ]
    summary = {
        "cp2_replay_max_abs": two["replay_max_abs"],
        "logprob_mean_abs_padded": mean_abs(two["padded"], one["padded"]),
        "logprob_mean_abs_packed": mean_abs(two["packed"], one["packed"]),
        "logprob_mean_abs_packed_vs_padded_cp2": mean_abs(two["packed"], two["padded"]),
        "routing_same_frac": min(same_experts),
        "loss_rel": [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(two["losses"], one["losses"], strict=True)],
        "grad_norm_rel": [abs(a - b) / b for a, b in zip(two["grad_norms"], one["grad_norms"], strict=True)],
        "losses": {"cp1": one["losses"], "cp2": two["losses"]},
        "grad_norms": {"cp1": one["grad_norms"], "cp2": two["grad_norms"]},
    }
    if rank == 0:
        Path(out).write_text(json.dumps(summary))
    dist.destroy_process_group()


def _two_gpus_and_te() -> str:
    from megatron_rl.parallel.device import transformer_engine_available

    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.device_count() < 2:
        return f"context parallelism needs 2 GPUs (NCCL takes one per rank), found {torch.cuda.device_count()}"
    if not transformer_engine_available():
        return "context parallelism needs Transformer Engine"
    return ""


@pytest.mark.skipif(bool(_two_gpus_and_te()), reason=_two_gpus_and_te() or "runs")
def test_actor_context_parallel(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "cp.json"
    mp.spawn(_cp_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    print(json.dumps({"figure": "context_parallel_cp2_vs_cp1", **result, "tolerances": CP_TOLERANCES}))
    assert result["cp2_replay_max_abs"] == 0.0, result
    for key in ("logprob_mean_abs_padded", "logprob_mean_abs_packed", "logprob_mean_abs_packed_vs_padded_cp2"):
        assert result[key] <= CP_TOLERANCES["logprob_mean_abs"], (key, result)
    assert max(result["loss_rel"]) <= CP_TOLERANCES["loss_rel"], result
    assert max(result["grad_norm_rel"]) <= CP_TOLERANCES["grad_norm_rel"], result
    assert result["routing_same_frac"] >= 0.95, result
