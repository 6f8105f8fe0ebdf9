"""`rollout.weight_sync = disk`: a Hugging Face folder per version, then `/update_weights_from_disk`.

Every rank runs `save_hf_folder`. Each stage's export sender writes its own safetensors files,
rank 0 writes the index and config.json, and the call ends with a collective, so when it returns
the folder is complete. Only then does rank 0 ask every engine to load it (pausing generation
just for the load when partial rollouts need it: `base.InFlight`). The folder is
`rollout.sync_dir` (default `logging.run_dir/weights`) / `v-<version>`, and that folder must be
visible to every sender and every engine. The folder the engine serves from is kept; the one
before it is deleted after a successful update, and a refused one at once.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from megatron_rl.models.export import save_hf_folder
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.weight_sync.base import WeightSync, WeightSyncError, shared_outcome


def version_folder_name(version: str) -> str:
    """`v-<version>` with anything outside [A-Za-z0-9._-] replaced by '_'."""
    return "v-" + re.sub(r"[^A-Za-z0-9._-]", "_", version)


class DiskSync(WeightSync):
    mode = "disk"
    pause_spans_transfer = False  # generation goes on while the folder is written; paused for the load

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rollout = self.cfg.rollout
        self.root = Path(rollout.sync_dir or Path(self.cfg.logging.run_dir) / "weights").resolve()
        self.hf_config = hf_config_from_model(self.model)
        self._serving: Path | None = None

    def resync_restarted_engine(self) -> None:
        """The folder the engine served before it died, loaded again (rank 0 alone)."""
        if self.synced is None or self._serving is None:
            return
        self._error = None
        self._call(
            self.client.update_weights_from_disk(str(self._serving), weight_version=self.synced),
            f"POST /update_weights_from_disk {self._serving} (after an engine restart)",
        )
        if self._error is not None:
            raise WeightSyncError(self._error)

    def _transfer(self, version: str) -> int:
        folder = self.root / version_folder_name(version)
        problem = None
        if self.is_controller:
            try:
                if folder.exists():
                    shutil.rmtree(folder)
                folder.mkdir(parents=True)
            except OSError as err:
                problem = f"cannot prepare the sync folder {folder} (rollout.sync_dir): {err}"
        problem = shared_outcome(problem)
        if problem is not None:
            raise WeightSyncError(problem)
        save_hf_folder(self.chunks, self.model, folder, self.hf_config, bucket_mb=self.bucket_mb)
        if not self.is_controller:
            return 0
        nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        if self._error is None:
            self._pause()
            self._call(
                self.client.update_weights_from_disk(
                    str(folder), weight_version=version, abort_all_requests=self.in_flight.abort_all_requests
                ),
                f"POST /update_weights_from_disk {folder}",
            )
            self._continue()
        if self._error is None:
            if self._serving is not None and self._serving != folder:
                shutil.rmtree(self._serving, ignore_errors=True)
            self._serving = folder
        elif folder != self._serving:
            shutil.rmtree(folder, ignore_errors=True)
        return nbytes
