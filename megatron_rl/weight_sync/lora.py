"""Weight sync of a LoRA run (`model.lora.rank > 0`), by `rollout.lora_sync`.

- `merged`: for engines without LoRA support. Every rank adds (alpha / r) B A into its base shards
  (`models.lora.merged_weights`), the configured mode (`rollout.weight_sync`) sends the full weights
  as it always does, and the base shards are restored bit for bit afterwards.
- `adapter`: only the adapters travel (`AdapterSync`), to the engine's LoRA endpoints.
"""

from __future__ import annotations

import re
import shutil
from typing import TYPE_CHECKING, Any

from megatron_rl.config import Config
from megatron_rl.models.builder import DTYPES
from megatron_rl.models.lora import LoraState, gather_adapters, merged_weights
from megatron_rl.models.lora_targets import sglang_target_modules
from megatron_rl.models.peft_format import adapter_config, write_adapter_folder
from megatron_rl.models.write_errors import write_failure
from megatron_rl.run_folder import sync_folder
from megatron_rl.weight_sync.base import WeightSync, WeightSyncError
from megatron_rl.weight_sync.send import serialize_named_tensors

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.rollout.engine import RolloutEngine


def merging(sync: WeightSync, lora: LoraState) -> WeightSync:
    """`sync` with every transfer (each `sync`, the step-boundary resync included) made while the
    adapters are merged into the base shards; the base is restored after each."""
    transfer = sync._transfer

    def merged_transfer(version: str) -> int:
        with merged_weights(lora):
            return transfer(version)

    sync._transfer = merged_transfer  # type: ignore[method-assign]
    return sync


def adapter_name(version: str) -> str:
    """The engine-side name of the adapters of weight version `version` (what /generate's lora_path names)."""
    return f"policy-v{re.sub(r'[^A-Za-z0-9._-]', '_', version)}"


class AdapterSync(WeightSync):
    """Only the adapters, as a PEFT adapter named after the version: `disk` writes a PEFT folder
    (`rollout.sync_dir`/lora-<name>) for /load_lora_adapter, `tensor` hands them over by handle through
    /load_lora_adapter_from_tensors. Then every /generate names the new adapter (`SGLangClient.lora_path`),
    the engine reports the version (/update_weight_version), and the adapter before the previous one is
    unloaded (the previous one stays for requests still running with it)."""

    mode = "lora_adapter"
    pause_spans_transfer = False  # loading an adapter leaves the running requests alone

    def __init__(self, cfg: Config, engine: RolloutEngine | None, actor: MegatronActor, **kwargs: Any) -> None:
        super().__init__(cfg, engine, actor, **kwargs)
        assert actor.lora is not None
        self.lora = actor.lora
        self.via = cfg.rollout.weight_sync
        self.root = sync_folder(cfg)
        # the target modules as SGLang names them (Mixtral's w1/w3/w2: gate_proj/up_proj/down_proj); the tensors
        # keep their PEFT names, which SGLang renames itself
        self.config = adapter_config(cfg.model, cfg.model.hf_path, target_modules=sglang_target_modules(cfg.model))
        self.dtype = DTYPES[cfg.model.params_dtype]
        self.engine_ranks = int(cfg.rollout.engine_gpus)
        self._loaded: list[str] = []  # adapter names on the engine, oldest first

    def _transfer(self, version: str) -> int:
        tensors = {k: v.to(self.dtype) for k, v in gather_adapters(self.lora).items()}  # collective
        if not self.is_controller or self._error is not None:
            return 0
        name = adapter_name(version)
        if name in self._loaded:  # the same version again (e.g. a resync): load it afresh
            self._unload(name)
        if self.via == "disk":
            folder = self.root / f"lora-{name}"
            try:
                write_adapter_folder(folder, tensors, self.config, self.dtype)
            except OSError as err:  # rank 0 alone writes: the others learn it from the sync's shared outcome
                shutil.rmtree(folder, ignore_errors=True)
                self._fail(write_failure(folder, err, "the adapter for the engine", "rollout.sync_dir"))
                return 0
            self._call(self.client.load_lora_adapter(name, str(folder)), f"POST /load_lora_adapter {folder}")
        else:
            payload, shm_names = serialize_named_tensors(list(tensors.items()))
            self._call(
                self.client.load_lora_adapter_from_tensors(name, self.config, [payload] * self.engine_ranks, shm_names),
                f"POST /load_lora_adapter_from_tensors {name}",
            )
        if self._error is not None:
            return 0
        self._loaded.append(name)
        self.client.lora_path = name
        self._call(self.client.update_weight_version(version), "POST /update_weight_version")
        while len(self._loaded) > 2:
            self._unload(self._loaded[0])
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _unload(self, name: str) -> None:
        self._call(self.client.unload_lora_adapter(name), f"POST /unload_lora_adapter {name}")
        self._loaded.remove(name)
        shutil.rmtree(self.root / f"lora-{name}", ignore_errors=True)

    def resync_restarted_engine(self) -> None:
        """Disk: the restarted engine loads the current adapter's folder again (rank 0 alone); tensor: at
        the step boundary, with every rank (`WeightSync.resync_restarted_engine`)."""
        if self.via != "disk":
            super().resync_restarted_engine()
            return
        if self.synced is None or not self._loaded:
            return
        self._error = None
        name = self._loaded[-1]
        self._loaded = [name]
        self._call(self.client.load_lora_adapter(name, str(self.root / f"lora-{name}")), "POST /load_lora_adapter")
        self._call(self.client.update_weight_version(self.synced), "POST /update_weight_version")
        if self._error is not None:
            raise WeightSyncError(self._error)


def make_lora_sync(
    cfg: Config, engine: RolloutEngine | None, actor: MegatronActor, *, bucket_mb: float | None = None
) -> WeightSync:
    """The sync of a LoRA run by `rollout.lora_sync` (collective)."""
    from megatron_rl.weight_sync import MODES

    assert actor.lora is not None
    if cfg.rollout.lora_sync == "merged":
        return merging(MODES[cfg.rollout.weight_sync](cfg, engine, actor, bucket_mb=bucket_mb), actor.lora)
    return AdapterSync(cfg, engine, actor, bucket_mb=bucket_mb)
