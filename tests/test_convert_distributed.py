"""HF <-> Megatron conversion across layouts, one gloo launch per world size (tests/distributed/scenarios_convert.py).

Tiny random models of each family (fp32): HF -> Megatron logits equal the HF model's (max abs diff
<= 1e-4) at world size 1 and under TP=2 / EP=2 / PP=2 / TP=2 x EP=2, also when the checkpoint is
loaded under another layout than it was written with; Megatron -> HF gives every tensor bit for
bit; the exporter under TP=2 x EP=2 equals the single-rank export.
"""

from __future__ import annotations

import pytest
from distributed.launcher import ScenarioResult, run_module_scenarios

WORLD_1 = ["w1_families", "w1_bf16", "w1_output_folder_and_config"]
WORLD_2 = ["w2_tp2", "w2_ep2", "w2_pp2", "w2_across_layouts", "w2_actor_loads_converted"]
WORLD_4 = ["w4_export_tp2_ep2", "w4_tp2_ep2"]


def _launch(world_size: int, names: list[str]) -> dict[str, ScenarioResult]:
    return run_module_scenarios("scenarios_convert", world_size, names)


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
