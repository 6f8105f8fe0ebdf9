"""Megatron models across layouts, one gloo launch per world size, shared with the other two layout modules (tests/mrl_multiproc/model_scenarios.py).

Every layout's logits on the same batch equal the unsplit model's (fp32, max abs diff <= 1e-5), and so do the
critic's values under TP 2 with sequence parallelism and PP 2;
the unsplit model equals the transformers model of each family with the same weights (DeepSeek-V3 and
GLM-4.5: log-probs within 1e-5, with a non-zero expert bias).
"""

from __future__ import annotations

import pytest

from mrl_multiproc.launcher import ModuleLaunches, ScenarioLaunches, run_module_scenarios, scenario_test

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

WORLDS = {
    1: [
        "cpu_compat_semantics",
        "families_match_hf",
        "sigmoid_families_match_hf",
        "moe_layers_follow_pattern",
        "routing_replay_instances",
        "recompute_same_gradients",
        "bf16_params",
    ],
    2: [
        "bad_layouts_fail_before_build",
        "logits_tp2_sp",
        "logits_tp2_dense_qwen2",
        "logits_ep2_alltoall",
        "logits_ep2_allgather",
        "logits_pp2",
        "logits_pp2_tied",
        "logits_sigmoid_tp2_sp",
        "logits_sigmoid_ep2",
        "logits_sigmoid_pp2",
        "values_tp2_sp_pp2",
    ],
    4: ["logits_tp2_ep2", "logits_tp2_ep2_etp1", "logits_sigmoid_tp2_ep2_etp1", "logits_pp2_tp2"],
}
# On one GPU (NCCL; Transformer Engine specs when TE is installed).
GPU_WORLD_1 = ["families_match_hf", "sigmoid_families_match_hf", "recompute_same_gradients", "bf16_params"]


@pytest.fixture(scope="module")
def launches(layout_launches: ScenarioLaunches) -> ModuleLaunches:
    """This module's part of the layout launches it shares with two others (tests/conftest.py)."""
    return layout_launches.view("model_scenarios")


test_scenario = scenario_test(WORLDS)


@pytest.mark.gpu
def test_gpu_world_1() -> None:
    results = run_module_scenarios("model_scenarios", 1, GPU_WORLD_1)
    failed = [r for r in results.values() if r.status != "passed"]
    assert not failed, "\n".join(f"{r.name}: {r.detail}" for r in failed)
