"""HF <-> Megatron conversion across layouts, one gloo launch per world size, shared with the other two layout modules (tests/mrl_multiproc/scenarios_convert.py).

Tiny random models of each family (fp32): HF -> Megatron logits equal the HF model's (max abs diff
<= 1e-4; 1e-5 for gpt-oss, DeepSeek-V3.2, GLM-5 and MiniMax-M2), right-padded and packed, at world size 1
and under TP=2 / EP=2 / PP=2 / TP=2 x EP=2, also when the checkpoint is loaded under another layout than it
was written with (uneven PP=2 stages, 3 + 1 layers, loaded as 1 + 3);
Megatron -> HF gives every tensor bit for bit; the exporter under TP=2 x EP=2 equals the single-rank export.
"""

from __future__ import annotations

import pytest

from mrl_multiproc.launcher import ModuleLaunches, ScenarioLaunches, scenario_test

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

WORLDS = {
    1: ["w1_families", "w1_bf16", "w1_output_folder_and_config"],
    2: ["w2_tp2", "w2_ep2", "w2_pp2", "w2_across_layouts", "w2_actor_loads_converted"],
    4: ["w4_export_tp2_ep2", "w4_tp2_ep2"],
}


@pytest.fixture(scope="module")
def launches(layout_launches: ScenarioLaunches) -> ModuleLaunches:
    """This module's part of the layout launches it shares with two others (tests/conftest.py)."""
    return layout_launches.view("scenarios_convert")


test_scenario = scenario_test(WORLDS)
