"""LoRA adapters served by the local engine, through PEFT's LoRA layers on the transformers model.

SGLang's endpoints (/load_lora_adapter from a PEFT folder, /load_lora_adapter_from_tensors,
/unload_lora_adapter) add or remove a named adapter; a /generate request names its adapter with
`lora_path` (the name it was loaded under). Adapters are injected with `peft.inject_adapter_in_model`
(the model keeps its own forward), their A and B copied from the PEFT tensors, and every forward of a
batch passes PEFT's per-row `adapter_names` ("__base__" for a row without an adapter), so requests of
different adapters share one batch as they do in SGLang.

Routed experts: transformers 5 holds Qwen3-MoE's and Mixtral's experts as fused 3-D parameters
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`). PEFT >= 0.21 maps an adapter's per-expert
targets onto them itself (`target_parameters`, its `ParamWrapper`), and its
`convert_peft_adapter_state_dict_for_transformers` turns the per-expert tensors SGLang takes into that
layout (gate and up stacked block-diagonally at rank 2r): the served log-probs equal the merged model's
(tests/test_lora_local_moe.py). A `ParamWrapper` adds its adapter to the whole parameter, so it serves one
adapter per forward: `mixes_adapters` is false and the generator batches one adapter at a time (as SGLang
with `--max-loras-per-batch 1`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# lora_dropout is left out: serving never drops out, and PEFT's ParamWrapper (the experts') refuses any
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "bias", "fan_in_fan_out", "use_rslora")
_PREFIX = "base_model.model."
# an adapter names Mixtral's experts by role, as SGLang takes them (its tensors keep w1, w3, w2, which SGLang
# renames itself); peft finds them by the model's names
_ROLE_TO_MODULE = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
# SGLang 0.5.23's SUPPORTED_LORA_TARGET_MODULES (srt/utils/common.py; tests/test_lora_sglang.py pins it): the only
# names its --lora-target-modules takes, and so the only ones an adapter it loads may target
SGLANG_TARGET_MODULES = frozenset(
    "q_proj k_proj v_proj o_proj q_a_proj kv_a_proj_with_mqa q_b_proj kv_b_proj wq_b wk weights_proj gate_proj "
    "up_proj down_proj qkv_proj gate_up_proj embed_tokens lm_head qkvr wo_ud".split()
)


class AdapterError(ValueError):
    """An adapter that cannot be loaded, unloaded or named (the endpoints' 400)."""


def read_adapter_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors of adapter_model.safetensors) of a PEFT folder."""
    from megatron_rl.models.safetensors_io import MappedSafetensors

    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"lora_path {path!r} is not a PEFT adapter folder ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    mapped = MappedSafetensors(folder / ADAPTER_WEIGHTS)
    return config, {n: mapped.get(n).clone() for n in mapped.entries if n != "__metadata__"}


def _check_sglang_targets(name: str, targets: Any) -> None:
    """AdapterError for target modules SGLang refuses: a module by the last part of its name (as SGLang's
    `get_normalized_target_modules` reads it) outside `SGLANG_TARGET_MODULES`, or a string but its "all"
    and "all-linear" shorthands."""
    if isinstance(targets, str):
        if targets not in ("all", "all-linear"):
            raise AdapterError(f"adapter {name!r}: target_modules {targets!r}; as a string only 'all' or 'all-linear'")
        return
    unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets or []} - SGLANG_TARGET_MODULES)
    if unknown:
        raise AdapterError(
            f"adapter {name!r}: target_modules {unknown} are not modules SGLang adapts (its --lora-target-modules "
            f"takes {sorted(SGLANG_TARGET_MODULES)}); name the module by its role, e.g. Mixtral's w1, w3, w2 as "
            "gate_proj, up_proj, down_proj"
        )


class LocalAdapters:
    """The adapters loaded into `model`, by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, dict[str, Any]] = {}

    def _layers(self) -> list[torch.nn.Module]:
        from peft.tuners.lora import LoraLayer

        return [m for m in self.model.modules() if isinstance(m, LoraLayer)]

    def _parameter_layers(self) -> list[torch.nn.Module]:
        """The layers adapting a parameter (the fused experts), which run one adapter per forward."""
        from peft.tuners.lora import ParamWrapper

        return [m for m in self.model.modules() if isinstance(m, ParamWrapper)]

    @property
    def mixes_adapters(self) -> bool:
        """Whether one forward may run rows of different adapters (false once experts carry adapters)."""
        return not self._parameter_layers()

    def load(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Add adapter `name` (PEFT config and tensors under PEFT's keys); returns its bytes. All or nothing."""
        from peft import LoraConfig, inject_adapter_in_model

        if not name or name == BASE:
            raise AdapterError(f"lora_name {name!r} is not a usable adapter name")
        if name in self.loaded:
            raise AdapterError(f"the adapter {name!r} is already loaded; unload it first")
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA is served")
        _check_sglang_targets(name, config.get("target_modules"))
        keys = {k: config[k] for k in _CONFIG_KEYS if k in config}
        roles = _ROLE_TO_MODULE.get(getattr(getattr(self.model, "config", None), "model_type", ""), {})
        if roles and isinstance(keys.get("target_modules"), list):
            keys["target_modules"] = [roles.get(t, t) for t in keys["target_modules"]]
        try:
            lora_config = LoraConfig(**keys)
            tensors = _fused_expert_layout(self.model, lora_config, tensors, name)
            inject_adapter_in_model(lora_config, self.model, adapter_name=name)
        except (TypeError, ValueError) as err:
            self._delete(name)
            raise AdapterError(f"adapter {name!r}: {err}") from None
        try:
            nbytes = self._copy(name, tensors)
        except AdapterError:
            self._delete(name)
            raise
        self.loaded[name] = config
        for layer in self._layers():  # every loaded adapter stays usable: a batch names its rows' adapters
            layer.set_adapter(list(self.loaded))
        return nbytes

    @torch.no_grad()
    def _copy(self, name: str, tensors: dict[str, torch.Tensor]) -> int:
        expected: dict[str, torch.Tensor] = {}
        for module_name, module in self.model.named_modules():
            if hasattr(module, "lora_A") and name in module.lora_A:
                for part in ("A", "B"):
                    expected[f"{_PREFIX}{module_name}.lora_{part}.weight"] = getattr(module, f"lora_{part}")[
                        name
                    ].weight
        unknown = sorted(set(tensors) - set(expected))
        if unknown:
            raise AdapterError(f"adapter {name!r}: tensor {unknown[0]!r} has no LoRA module in the served model")
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise AdapterError(f"adapter {name!r}: tensor {missing[0]!r} is missing")
        nbytes = 0
        for key, param in expected.items():
            value = tensors[key]
            if tuple(value.shape) != tuple(param.shape):
                raise AdapterError(
                    f"adapter {name!r}: {key!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))
            nbytes += value.numel() * value.element_size()
        return nbytes

    def _delete(self, name: str) -> None:
        for layer in self._layers():
            if name in layer.lora_A:
                layer.delete_adapter(name)

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {sorted(self.loaded)})")
        self._delete(name)
        del self.loaded[name]

    def check(self, name: str | None) -> None:
        """A /generate request's `lora_path`: None, or a loaded adapter's name."""
        if name is not None and name not in self.loaded:
            raise AdapterError(f"lora_path: the adapter {name!r} is not loaded (loaded: {sorted(self.loaded)})")

    @contextlib.contextmanager
    def rows(self, names: list[str | None]) -> Iterator[None]:
        """Each batch row of the forwards inside the block runs its adapter (None: the base)."""
        if not self.loaded:
            yield
            return
        adapter_names = [BASE if n is None else n for n in names]

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return args, {**kwargs, "adapter_names": adapter_names}

        whole = self._parameter_layers()
        if whole and len(set(names)) > 1:
            raise RuntimeError(f"one forward names the adapters {sorted(set(names), key=str)}; experts run one")
        for layer in whole:  # the batch's one adapter, or none
            layer.enable_adapters(names[0] is not None)
            if names[0] is not None:
                layer.set_adapter([names[0]])
        rows = [layer for layer in self._layers() if not any(layer is w for w in whole)]
        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in rows]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _fused_expert_layout(
    model: torch.nn.Module, config: Any, tensors: dict[str, torch.Tensor], name: str
) -> dict[str, torch.Tensor]:
    """`tensors` (PEFT's per-expert names, as SGLang loads them) in the layout PEFT gives `model`: the
    routed experts' adapters fused as transformers 5 fuses the experts; other tensors unchanged."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # transformers 4, or a peft without the conversion: the experts are modules
        return tensors
    return convert_peft_adapter_state_dict_for_transformers(model, config, dict(tensors), adapter_name=name)
