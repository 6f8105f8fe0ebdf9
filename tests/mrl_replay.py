"""The families' engine-against-trainer checks of routing replay (DeepSeek-V3.2, gpt-oss, MiniMax-M2, Qwen3-Next):
their config (one rank, fp32, R3, the engine returning the routed experts) and R2's record-then-replay."""

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


def r2_record_and_replay(
    actor: Any, batch: Any, engine_routed: list[Any], padded_tokens: int = 64, moe_layers: slice = slice(None)
) -> tuple[Any, Any]:
    """R2 on `actor`: the log-probs of `batch` packed (micro-batches of 40 tokens) recording the trainer's routing, and
    right-padded (`padded_tokens`) replaying what was recorded. The recorded experts of the `moe_layers` must be the
    engine's (`engine_routed`, per token as a set: the engine and the trainer route alike on these models)."""
    import torch

    from megatron_rl.actor.micro_batches import TokenBudget

    from mrl_configs import actor_log_probs

    recorded = actor_log_probs(actor, batch, TokenBudget(40, packed=True), "record")
    for mine, theirs in zip(recorded.routed_experts, engine_routed, strict=True):
        assert torch.equal(torch.as_tensor(mine)[:, moe_layers].sort(-1).values, theirs[:, moe_layers].sort(-1).values)
    replayed = actor_log_probs(
        actor, batch.with_fields(routed_experts=recorded.routed_experts), TokenBudget(padded_tokens), "replay"
    )
    return recorded.log_probs, replayed.log_probs
