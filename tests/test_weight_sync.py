"""Weight sync from the Megatron actor to the local engine, all three modes, one gloo launch per world size
(tests/distributed/scenarios_weight_sync.py): after every sync the engine's log-probs of its own samples
equal the actor's (<= 1e-4), routing agrees off near-ties, R3 replay dispatches exactly the engine's
experts; refused updates name the tensor and leave the old weights serving.

One engine subprocess serves both launches (world size 1: every mode and the refusals; world size 2:
TP=2, EP=2 and PP=2).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed.launcher import ScenarioResult, run_module_scenarios

from megatron_rl.rollout.local.launcher import LocalEngineProcess, start_local_engine

MODEL_ENV = "MRL_SYNC_MODEL"
ENGINE_ENV = "MRL_SYNC_ENGINE"
WORLD_1 = ["w1_three_modes", "w1_refused_updates"]
WORLD_2 = ["w2_tp2", "w2_ep2", "w2_pp2"]


@torch.no_grad()
def make_policy(folder: Path) -> str:
    """A tiny Qwen3-MoE (4 layers, the first dense, 4 experts top-2) with O(1) activations: matrices
    N(0, 1)/sqrt(fan_in), norms 1 + 0.1 N, so routing margins are rarely near-ties."""
    from megatron_rl.rollout.local.tiny import make_tiny_model

    make_tiny_model(
        str(folder),
        "qwen3_moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        max_position_embeddings=128,
        rope_theta=10000.0,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=gen)
        if param.dim() == 1:
            values = 1.0 + 0.1 * values if name.endswith("norm.weight") else 0.1 * values
        else:
            values /= math.sqrt(param.shape[-1])
        param.copy_(values)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngineProcess]:
    folder = make_policy(tmp_path_factory.mktemp("sync") / "policy")
    proc = start_local_engine(folder, extra_args=["--threads", "1"], env={"OMP_NUM_THREADS": "1"})
    saved = {k: os.environ.get(k) for k in (MODEL_ENV, ENGINE_ENV)}
    os.environ.update({MODEL_ENV: folder, ENGINE_ENV: proc.url})  # inherited by the launched ranks
    try:
        yield proc
    finally:
        proc.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launch(world_size: int, names: list[str], engine: LocalEngineProcess) -> dict[str, ScenarioResult]:
    results = run_module_scenarios("scenarios_weight_sync", world_size, names, timeout_s=300)
    if not engine.alive():
        raise AssertionError(f"the engine died during the launch:\n{engine.log_tail()}")
    return results


@pytest.fixture(scope="module")
def world_1(engine: LocalEngineProcess) -> dict[str, ScenarioResult]:
    return _launch(1, WORLD_1, engine)


@pytest.fixture(scope="module")
def world_2(engine: LocalEngineProcess, world_1: dict[str, ScenarioResult]) -> dict[str, ScenarioResult]:
    return _launch(2, WORLD_2, engine)


@pytest.mark.parametrize("name", WORLD_1)
def test_world_1(world_1: dict[str, ScenarioResult], name: str) -> None:
    world_1[name].check()


@pytest.mark.parametrize("name", WORLD_2)
def test_world_2(world_2: dict[str, ScenarioResult], name: str) -> None:
    world_2[name].check()
