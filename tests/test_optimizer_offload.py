"""Full optimizer CPU offload (`parallel.optimizer_cpu_offload`, Megatron's HybridDeviceOptimizer), no processes
started. What the CPU machine can show: the keys reach Megatron's OptimizerConfig, and the actor's optimizer is
then a HybridDeviceOptimizer holding the configured share on the host, updated by torch's AdamW, in every part of
the chained optimizer. The update itself cannot run here: Megatron-Core 0.16.1's HybridDeviceOptimizer looks up
every host-side parameter as the copy of a GPU one, so with the parameters on the CPU its first step fails
(KeyError), which is why validation refuses the key without CUDA. Its equality with the plain update is a GPU
check (not run on the CPU machine). Refusals: fp32 parameters, no distributed optimizer, no CUDA; one line each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.actor.optimizer import optimizer_config
from megatron_rl.config import Config, ConfigError, ModelConfig, ParallelConfig, RolloutConfig, TrainConfig, validate
from megatron_rl.parallel.state import check_optimizer_offload

from mrl_configs import actor_of_one, tiny_model

OFFLOAD = ParallelConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)


def test_the_keys_reach_megatrons_optimizer_config() -> None:
    plain = optimizer_config(TrainConfig(), ParallelConfig(), torch.bfloat16)
    assert not plain.optimizer_cpu_offload
    config = optimizer_config(TrainConfig(), OFFLOAD, torch.bfloat16)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction) == (True, 0.5)
    assert config.decoupled_weight_decay and config.use_distributed_optimizer  # HybridDeviceOptimizer's needs


def test_the_actor_builds_megatrons_hybrid_device_optimizer() -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    model = dataclasses.replace(tiny_model("qwen3_moe"), params_dtype="bf16")
    cfg = Config(model=model, parallel=OFFLOAD, rollout=RolloutConfig(max_new_tokens=24), train=TrainConfig(lr=1e-3))
    validate(cfg)
    with actor_of_one(cfg) as actor:
        for part in actor.state.optimizer.chained_optimizers:  # one DistributedOptimizer per DP group
            assert isinstance(part.optimizer, HybridDeviceOptimizer), type(part.optimizer)
            assert part.optimizer.offload_fraction == 0.5
            assert all(isinstance(o, torch.optim.AdamW) for o in part.optimizer.sub_optimizers)


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        (
            ModelConfig(params_dtype="fp32"),
            OFFLOAD,
            "parallel.optimizer_cpu_offload = true with model.params_dtype = 'fp32'",
        ),
        (
            ModelConfig(params_dtype="bf16"),
            dataclasses.replace(OFFLOAD, use_distributed_optimizer=False),
            "parallel.optimizer_cpu_offload = true needs parallel.use_distributed_optimizer = true",
        ),
        (
            ModelConfig(params_dtype="bf16"),
            dataclasses.replace(OFFLOAD, optimizer_offload_fraction=0.0),
            "parallel.optimizer_offload_fraction = 0.0 is out of range",
        ),
    ],
)
def test_refusals_are_one_line(model: ModelConfig, parallel: ParallelConfig, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(Config(model=model, parallel=parallel))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_refused_without_cuda() -> None:
    check_optimizer_offload(OFFLOAD, cuda_available=True)
    check_optimizer_offload(ParallelConfig(), cuda_available=False)
    with pytest.raises(ConfigError, match=r"^parallel.optimizer_cpu_offload = true needs CUDA \(without it"):
        check_optimizer_offload(OFFLOAD, cuda_available=False)
