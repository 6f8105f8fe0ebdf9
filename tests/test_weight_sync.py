"""Weight sync from the Megatron actor to the local engine, all three modes, one gloo launch per world size
(tests/mrl_multiproc/scenarios_weight_sync.py): after every sync the engine's tensors equal the trainer's
bit for bit, every tensor was sent once, by a sender (PP stage, EP rank) that holds it, and the engine's
log-probs of its own samples equal the actor's (<= 1e-4), routing agrees off near-ties, R3 replay dispatches exactly the engine's
experts; refused updates name the tensor and leave the old weights serving; with fully_async partial
rollouts a sync under running requests retracts and continues them, each token's version and log-prob right;
without partial rollouts a distributed sync pauses them with mode "abort" for the whole transfer.

Two engine subprocesses serve both launches (world size 1: every mode and the refusals, into the
first; world size 2: TP=2 into the first, EP=2 and PP=2 into both: several senders into servers that
take one update at a time, as SGLang's do).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.rollout.local.launcher import LocalEngineProcess, spawn_local_engine

from mrl_configs import hf_config, save_random_hf_model
from mrl_multiproc.launcher import ScenarioLaunches, scenario_test

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

WORLDS = {
    1: ["w1_three_modes", "w1_refused_updates", "w1_partial_rollout", "w1_lora_sync"],
    2: ["w2_tp2", "w2_ep2", "w2_pp2"],
}


def make_policy(folder: Path) -> str:
    """A tiny Qwen3-MoE (4 layers, the first dense, 4 experts top-2) with O(1) activations, so routing
    margins are rarely near-ties."""
    config = hf_config(
        "qwen3_moe",
        "split",
        vocab_size=256,
        max_position_embeddings=128,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    return str(save_random_hf_model(folder, config))


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_policy(tmp_path_factory.mktemp("sync") / "policy")


@pytest.fixture(scope="module")
def engines(policy: str) -> Iterator[list[LocalEngineProcess]]:
    args, env = ["--threads", "1", "--no-auth"], {"OMP_NUM_THREADS": "1"}
    starting = [spawn_local_engine(policy, extra_args=args, env=env) for _ in range(2)]  # they load side by side
    procs = []
    try:
        procs += [engine.wait() for engine in starting]
        yield procs
    finally:
        for engine in starting[len(procs) :]:
            engine.kill()
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def launches(policy: str, engines: list[LocalEngineProcess]) -> ScenarioLaunches:
    def engine_alive() -> None:
        for engine in engines:
            if not engine.alive():
                raise AssertionError(f"an engine died during the launch:\n{engine.log_tail()}")

    return ScenarioLaunches(
        "scenarios_weight_sync",
        WORLDS,
        params={"model": policy, "engine_urls": [engine.url for engine in engines]},
        after_launch=engine_alive,
        timeout_s=300,
    )


test_scenario = scenario_test(WORLDS)
