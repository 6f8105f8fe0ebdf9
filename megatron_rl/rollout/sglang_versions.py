"""The SGLang releases a run's options need, checked at start-up against each server's `/server_info`
`version` (the workers of an sglang-router), before the first step:

- `rollout.partial_rollout` under `fully_async`: the version of every token (`meta_info.weight_versions`,
  0.5.19); then a reply without it is an error too (`SGLangClient.token_versions_required`);
- adapter-only LoRA sync with `rollout.weight_sync = tensor`: `/load_lora_adapter_from_tensors` with one
  payload per TP rank (`serialized_named_tensors`, 0.5.17; before, one `serialized_tensors` string, and the
  first sync would fail with HTTP 422);
- adapter-only LoRA sync with routed-expert targets: adapters on MoE layers (0.5.10).

A server whose version does not read as a release (a development build, the local engine) passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_rl.models.lora_targets import routed_expert_targets
from megatron_rl.rollout.sglang import TOKEN_VERSIONS_SINCE, SGLangClient, SGLangError, dotted

LORA_TENSORS_SINCE = (0, 5, 17)
EXPERT_LORA_SINCE = (0, 5, 10)


@dataclass(frozen=True)
class VersionNeed:
    """`option` needs `feature`, which SGLang has from release `since`; an older server `lacks` (what it
    does instead); `instead`: what to configure on such servers."""

    since: tuple[int, int, int]
    option: str
    feature: str
    lacks: str
    instead: str


TOKEN_VERSIONS = VersionNeed(
    TOKEN_VERSIONS_SINCE,
    "rollout.partial_rollout = true",
    "the version of every token (meta_info.weight_versions)",
    "whose replies give one weight version for the whole response",
    "set rollout.partial_rollout=false",
)
LORA_TENSORS = VersionNeed(
    LORA_TENSORS_SINCE,
    "rollout.lora_sync = 'adapter' with rollout.weight_sync = 'tensor'",
    "/load_lora_adapter_from_tensors with one payload per TP rank (serialized_named_tensors)",
    "which loads adapters from tensors only as one serialized_tensors string (the sync would fail with HTTP 422)",
    "set rollout.weight_sync = 'disk' or rollout.lora_sync = 'merged'",
)


def version_needs(rollout: Any, model: Any = None) -> list[VersionNeed]:
    """What the `rollout` section (and `model`'s LoRA adapters, when given) need of the servers."""
    needs = [TOKEN_VERSIONS] if rollout.async_mode == "fully_async" and rollout.partial_rollout else []
    if model is None or model.lora.rank == 0 or rollout.lora_sync == "merged":
        return needs
    if rollout.weight_sync == "tensor":
        needs.append(LORA_TENSORS)
    routed = routed_expert_targets(model)
    if routed:
        needs.append(
            VersionNeed(
                EXPERT_LORA_SINCE,
                f"model.lora.target_modules {routed} with rollout.lora_sync = 'adapter'",
                "adapters on the routed experts",
                "which serves no adapter on MoE layers",
                "set rollout.lora_sync = 'merged', or leave the experts out of model.lora.target_modules",
            )
        )
    return needs


async def require_versions(client: SGLangClient, needs: list[VersionNeed]) -> None:
    """Raises SGLangError naming the first server whose SGLang release is older than a need's."""
    if not needs:
        return
    for url in client.urls:
        info = await client.get_server_info(url)
        version = str(info.get("version")) if isinstance(info, dict) else "unknown"
        client.server_versions[url] = version
        release = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if release is None:
            continue
        for need in needs:
            if tuple(int(n) for n in release.groups()) < need.since:
                raise SGLangError(
                    f"{url} runs SGLang {version}, {need.lacks}: {need.option} needs {need.feature}, SGLang >= "
                    f"{dotted(need.since)}; upgrade the servers or {need.instead}",
                    server=url,
                )
    client.token_versions_required = TOKEN_VERSIONS in needs
