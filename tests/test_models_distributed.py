"""Megatron models across layouts, one gloo launch per world size (tests/distributed/model_scenarios.py).

Every layout's logits on the same batch equal the unsplit model's (fp32, max abs diff <= 1e-5);
the unsplit model equals the transformers model of each family with the same weights.
"""

from __future__ import annotations

import pytest
from distributed.launcher import ScenarioResult, run_module_scenarios

WORLD_1 = [
    "cpu_compat_semantics",
    "families_match_hf",
    "moe_layers_follow_pattern",
    "routing_replay_instances",
    "recompute_same_gradients",
    "bf16_params",
]
WORLD_2 = [
    "bad_layouts_fail_before_build",
    "logits_tp2_sp",
    "logits_tp2_dense_qwen2",
    "logits_ep2_alltoall",
    "logits_ep2_allgather",
    "logits_pp2",
    "logits_pp2_tied",
]
WORLD_4 = ["logits_tp2_ep2", "logits_tp2_ep2_etp1", "logits_pp2_tp2"]
# On one GPU (NCCL; Transformer Engine specs when TE is installed).
GPU_WORLD_1 = ["families_match_hf", "recompute_same_gradients", "bf16_params"]


def _launch(world_size: int, names: list[str]) -> dict[str, ScenarioResult]:
    return run_module_scenarios("model_scenarios", world_size, names)


@pytest.fixture(scope="module")
def world_1() -> dict[str, ScenarioResult]:
    return _launch(1, WORLD_1)


@pytest.fixture(scope="module")
def world_2() -> dict[str, ScenarioResult]:
    return _launch(2, WORLD_2)


@pytest.fixture(scope="module")
def world_4() -> dict[str, ScenarioResult]:
    return _launch(4, WORLD_4)


@pytest.mark.parametrize("name", WORLD_1)
def test_world_1(world_1: dict[str, ScenarioResult], name: str) -> None:
    world_1[name].check()


@pytest.mark.parametrize("name", WORLD_2)
def test_world_2(world_2: dict[str, ScenarioResult], name: str) -> None:
    world_2[name].check()


@pytest.mark.parametrize("name", WORLD_4)
def test_world_4(world_4: dict[str, ScenarioResult], name: str) -> None:
    world_4[name].check()


@pytest.mark.gpu
def test_gpu_world_1() -> None:
    for result in _launch(1, GPU_WORLD_1).values():
        result.check()
