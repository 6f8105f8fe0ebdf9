"""The Megatron actor across layouts: one gloo launch per world size (tests/distributed/scenarios_actor.py).

The world-size-1 launch computes the references (log-probs and entropy against a plain full-vocab
log_softmax, recorded routing, parameters after optimizer steps, a checkpoint); TP=2 with SP,
EP=2 (alltoall), PP=2 and TP=2 x EP=2 must reproduce them: log-probs/entropy within 1e-5,
parameters after two Adam steps within 1e-6, routing replay exact, checkpoints loadable across layouts
(also across vocabulary paddings: TP1 <-> TP2, model and optimizer tensors bit for bit) and
`checkpoint.load` taking both a full and a weights-only checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from distributed.launcher import ScenarioResult, run_module_scenarios

REF_ENV = "MRL_ACTOR_REF_DIR"
WORLD_1 = ["w1_reference", "w1_recompute_replay", "w1_checkpoint_load_both_kinds"]
WORLD_2 = [
    "w2_tp2_sp",
    "w2_ep2_alltoall",
    "w2_pp2",
    "w2_pp2_allgather",
    "w2_pp2_recompute_replay",
    "w2_bad_layout",
    "w2_vocab_padding_tp1_tp2_tp1",
]
WORLD_4 = ["w4_tp2_ep2", "w4_load_pp2_checkpoint"]


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("actor_ref")
    previous = os.environ.get(REF_ENV)
    os.environ[REF_ENV] = str(path)  # inherited by the launched ranks
    yield path
    if previous is None:
        os.environ.pop(REF_ENV, None)
    else:
        os.environ[REF_ENV] = previous


def _launch(world_size: int, names: list[str]) -> dict[str, ScenarioResult]:
    return run_module_scenarios("scenarios_actor", world_size, names)


@pytest.fixture(scope="module")
def world_1(ref_dir: Path) -> dict[str, ScenarioResult]:
    return _launch(1, WORLD_1)


@pytest.fixture(scope="module")
def world_2(world_1: dict[str, ScenarioResult]) -> dict[str, ScenarioResult]:
    world_1["w1_reference"].check()
    return _launch(2, WORLD_2)


@pytest.fixture(scope="module")
def world_4(world_2: dict[str, ScenarioResult]) -> dict[str, ScenarioResult]:
    world_2["w2_pp2"].check()  # saves the checkpoint that w4_load_pp2_checkpoint loads
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
