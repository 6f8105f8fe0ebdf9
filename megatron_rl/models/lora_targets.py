"""Which Megatron linear (and which part of its rows) each PEFT module name of a family is, and the
rules of a LoRA run's configuration (`check_*`, run by `validation.validate_run`).

Torch-free: the validation reads it before Megatron is imported. Megatron fuses q, k and v into
`linear_qkv` (rows grouped per KV head, `models.hf_mapping`'s `qkv` rule) and gate and up into
`linear_fc1` (`[gate; up]`); PEFT has one adapter per HF module, so a fused linear carries one
adapter per part ("slot") and adds their outputs in Megatron's row layout.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config import Config, ConfigError, ModelConfig

log = logging.getLogger(__name__)
# the first peft that puts per-expert adapters on transformers 5's fused experts (its
# transformers_weight_conversion; measured exact on Qwen3-MoE and Mixtral, tests/test_lora_local_moe.py)
PEFT_FUSED_EXPERTS = (0, 21)


@dataclass(frozen=True)
class Target:
    """A PEFT module name: the Megatron linear it lives in (suffix of the module path), the slot
    inside it ("q", "k", "v", "gate", "up"; "" = the whole linear), and the HF module path under a layer."""

    peft_name: str
    linear: str
    slot: str
    hf_module: str


def _attention() -> tuple[Target, ...]:
    qkv = tuple(Target(f"{x}_proj", "self_attention.linear_qkv", x, f"self_attn.{x}_proj") for x in "qkv")
    return (*qkv, Target("o_proj", "self_attention.linear_proj", "", "self_attn.o_proj"))


def _mlp(gate: str, up: str, down: str, experts: str) -> tuple[Target, ...]:
    """The dense MLP (`mlp.`) and, with `experts`, the routed experts (`mlp.experts.local_experts.N.`)."""
    dense = (
        Target(gate, "mlp.linear_fc1", "gate", f"mlp.{gate}"),
        Target(up, "mlp.linear_fc1", "up", f"mlp.{up}"),
        Target(down, "mlp.linear_fc2", "", f"mlp.{down}"),
    )
    if not experts:
        return dense
    routed = (
        Target(gate, "mlp.experts.linear_fc1", "gate", f"{experts}.{{expert}}.{gate}"),
        Target(up, "mlp.experts.linear_fc1", "up", f"{experts}.{{expert}}.{up}"),
        Target(down, "mlp.experts.linear_fc2", "", f"{experts}.{{expert}}.{down}"),
    )
    return dense + routed


LORA_TARGETS: dict[str, tuple[Target, ...]] = {
    "qwen3_moe": _attention() + _mlp("gate_proj", "up_proj", "down_proj", "mlp.experts"),
    "qwen3": _attention() + _mlp("gate_proj", "up_proj", "down_proj", ""),
    "qwen2": _attention() + _mlp("gate_proj", "up_proj", "down_proj", ""),
    "mixtral": _attention() + _mlp("w1", "w3", "w2", "block_sparse_moe.experts"),
    "llama": _attention() + _mlp("gate_proj", "up_proj", "down_proj", ""),
    "mistral": _attention() + _mlp("gate_proj", "up_proj", "down_proj", ""),
}


def family_module_names(family: str) -> list[str]:
    """The PEFT module names `model.lora.target_modules` may hold for `family`, in table order."""
    return list(dict.fromkeys(t.peft_name for t in LORA_TARGETS[family]))


def check_target_modules(model: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as a list, or ConfigError naming a module the family lacks (or the
    family, when it has no adapters: MLA's projections and shared experts are not mapped yet)."""
    if model.family not in LORA_TARGETS:
        raise ConfigError(
            f"model.lora.rank = {model.lora.rank}: LoRA is not available for model.family = {model.family!r} "
            f"yet; families with LoRA: {sorted(LORA_TARGETS)}"
        )
    allowed = family_module_names(model.family)
    names = [str(n) for n in model.lora.target_modules]
    if not names:
        raise ConfigError("model.lora.target_modules is empty: name at least one module (e.g. q_proj)")
    for name in names:
        if name not in allowed:
            raise ConfigError(
                f"model.lora.target_modules: {name!r} is no module of model.family = {model.family!r}; allowed: {allowed}"
            )
    return names


def routed_expert_targets(model: ModelConfig) -> list[str]:
    """The names of `model.lora.target_modules` that adapt the routed experts (none for a dense model)."""
    names = set(check_target_modules(model))
    if model.num_experts is None:
        return []
    return sorted({t.peft_name for t in LORA_TARGETS[model.family] if t.linear.startswith("mlp.experts")} & names)


def sglang_target_modules(model: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as SGLang names them (its `--lora-target-modules` accepts only
    `SUPPORTED_LORA_TARGET_MODULES`): a module by its role in the layer, e.g. Mixtral's `w1`, `w3`,
    `w2` are `gate_proj`, `up_proj`, `down_proj` (SGLang renames those tensors itself on load)."""
    names = set(check_target_modules(model))
    role = {(t.linear, t.slot): t.peft_name for t in LORA_TARGETS["qwen3_moe"]}
    return sorted({role[(t.linear, t.slot)] for t in LORA_TARGETS[model.family] if t.peft_name in names})


def check_lora_sync(cfg: Config) -> None:
    """ConfigError for a `rollout.lora_sync` that cannot run with the rest of the rollout section."""
    ro = cfg.rollout
    if ro.lora_sync == "merged":
        return
    if ro.weight_sync == "distributed":
        raise ConfigError(
            "rollout.lora_sync = 'adapter' with rollout.weight_sync = 'distributed': SGLang loads adapters from a "
            "folder (/load_lora_adapter) or from tensors (/load_lora_adapter_from_tensors), never over a process "
            "group; use rollout.weight_sync = 'disk' or 'tensor', or rollout.lora_sync = 'merged'"
        )
    if ro.async_mode == "fully_async":
        raise ConfigError(
            "rollout.lora_sync = 'adapter' with rollout.async_mode = 'fully_async': SGLang keeps a running request "
            "on its old adapter to its end but labels its later tokens with the new weight version (staleness "
            "would be under-reported), and unloading an old adapter waits for its requests; use "
            "rollout.lora_sync = 'merged' (full weights, paused and versioned as without LoRA), or "
            "rollout.async_mode = 'one_step_off'"
        )


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _same_folder(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_init_adapter(model: ModelConfig) -> dict[str, Any] | None:
    """The adapter_config.json of `model.lora.init_path` (None when unset), or ConfigError when it is no
    PEFT folder, was trained on another base than `model.hf_path`, or has another rank or targets."""
    path = model.lora.init_path
    if path is None:
        return None
    key = f"model.lora.init_path = {path!r}"
    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{key} is not a PEFT adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except ValueError as err:
        raise ConfigError(f"{key}: {ADAPTER_CONFIG} is not JSON: {err}") from None
    base = config.get("base_model_name_or_path")
    if model.hf_path and (not base or not _same_folder(str(base), model.hf_path)):
        raise ConfigError(f"{key} adapts the base {base!r}, not model.hf_path = {model.hf_path!r}")
    if int(config.get("r", -1)) != model.lora.rank:
        raise ConfigError(f"{key} has rank {config.get('r')!r}, but model.lora.rank = {model.lora.rank}")
    theirs = config.get("target_modules") or []
    if sorted(theirs) != sorted(model.lora.target_modules):
        raise ConfigError(
            f"{key} targets {sorted(theirs)}, but model.lora.target_modules = {sorted(model.lora.target_modules)}"
        )
    return config


def _peft_version() -> tuple[int, int] | None:
    try:
        major, minor = importlib.metadata.version("peft").split(".")[:2]
    except importlib.metadata.PackageNotFoundError:
        return None
    return int(major), int(minor)


def local_engine_cannot_serve(model: ModelConfig) -> str | None:
    """Why the local engine cannot serve `model.lora`'s adapters (it serves them through peft on the
    transformers model), or None. peft >= 0.21 maps per-expert adapters onto transformers 5's fused
    experts, but it then moves those names off every module, so the dense MLP of an MoE's dense layers
    (`first_k_dense_layers`, `moe_layer_freq`) gets no adapter under the same names."""
    version = _peft_version()
    if version is None:
        return "the local engine serves adapters through peft, which is not installed (pip install 'megatron-rl[lora]')"
    routed = routed_expert_targets(model)
    if routed and version < PEFT_FUSED_EXPERTS:
        return (
            f"model.lora.target_modules {routed} adapt the routed experts, which the local engine serves through "
            f"peft >= {'.'.join(map(str, PEFT_FUSED_EXPERTS))} (installed: {'.'.join(map(str, version))})"
        )
    if routed and (model.first_k_dense_layers > 0 or model.moe_layer_freq > 1):
        return (
            f"model.lora.target_modules {routed} adapt both the routed experts and the dense layers' MLP "
            f"(model.first_k_dense_layers = {model.first_k_dense_layers}, model.moe_layer_freq = "
            f"{model.moe_layer_freq}); peft puts those names on the fused experts only, so the local engine "
            "cannot serve the dense layers' adapters"
        )
    return None


def resolve_lora_sync(cfg: Config) -> Config:
    """`cfg` with `rollout.lora_sync = auto` resolved: adapter, or merged (said in one info line) where
    the local engine cannot serve the adapters (`local_engine_cannot_serve`)."""
    ro = cfg.rollout
    if ro.lora_sync != "auto":
        return cfg
    why = local_engine_cannot_serve(cfg.model) if cfg.model.lora.rank > 0 and ro.uses_local_engine else None
    if why is not None:
        log.info("rollout.lora_sync = merged (auto): %s; full merged weights are synced", why)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(ro, lora_sync="adapter" if why is None else "merged"))


def check_local_engine_adapters(model: ModelConfig) -> None:
    """ConfigError when `rollout.lora_sync = adapter` asks the local engine for adapters it cannot serve."""
    why = local_engine_cannot_serve(model)
    if why is not None:
        raise ConfigError(
            f"rollout.lora_sync = 'adapter' with the local engine: {why}; use rollout.lora_sync = 'merged' "
            "(or 'auto'), or SGLang servers (rollout.sglang_urls)"
        )
