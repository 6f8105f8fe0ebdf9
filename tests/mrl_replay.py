"""The config of the families' engine-against-trainer checks with R3 routing replay (DeepSeek-V3.2, gpt-oss,
MiniMax-M2, Qwen3-Next): one rank, fp32, the engine returning the routed experts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mrl_configs import layout


def r3_replay_config(folder: Path, micro_batch_tokens: int = 64) -> Any:
    """The config of an engine-against-trainer check of the HF folder `folder`: its model in fp32 on one rank, GRPO
    with R3 routing replay, the engine returning the routed experts, micro-batches of `micro_batch_tokens`."""
    from megatron_rl.config import Config, RolloutConfig, TrainConfig, preset
    from megatron_rl.models.hf_config import model_config_from_hf

    model = model_config_from_hf(json.loads((folder / "config.json").read_text()), hf_path=str(folder))
    return Config(
        model=dataclasses.replace(model, params_dtype="fp32"),
        parallel=layout(),
        rollout=RolloutConfig(temperature=1.0, return_routed_experts=True),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r3"),
        train=TrainConfig(max_tokens_per_micro_batch=micro_batch_tokens, logprob_chunk_tokens=16),
    )
