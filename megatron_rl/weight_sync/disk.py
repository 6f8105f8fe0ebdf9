"""`rollout.weight_sync = disk`: a Hugging Face folder per sync, then `/update_weights_from_disk`.

Every rank runs `save_hf_folder`. Each export sender (one per pipeline stage and, with EP, per
expert-parallel rank) writes its own safetensors files, rank 0 writes the index and config.json,
and the call ends with a collective, so when it returns the folder is complete. Only then does
rank 0 ask every engine to load it (pausing generation just for the load when partial rollouts need
it: `base.InFlight`). The folders must be visible to every sender and every engine.

Two folders take turns, `rollout.sync_dir` (default `logging.run_dir/weights`) / `slot-0` and
`slot-1`: a sync writes into the one the engine does not serve, overwriting the files of the sync
before the last one in place (same names, same sizes: their page-cache pages are reused, about half
the cost of new files), and the engine serves from it once its load has succeeded. So the engine
never reads a folder being written: the folder it serves (which a restarted engine loads again,
`resync_restarted_engine`) stays complete until the next load has succeeded, and a refused load
leaves the engine on the old folder. What a crash leaves: the folder being written may be half
written (the other one is complete); neither is a checkpoint, and a resumed run writes them anew.
A write that fails there (a full disk) stops the run on every rank with one line naming the folder
and the free bytes (`StorageWriteError`), before the step's record and checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.models.export import save_hf_folder, sends_experts_per_rank
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.models.write_errors import StorageWriteError, write_failure
from megatron_rl.run_folder import sync_folder
from megatron_rl.weight_sync.base import WeightSync, WeightSyncError, shared_outcome

SLOTS = ("slot-0", "slot-1")


class DiskSync(WeightSync):
    mode = "disk"
    pause_spans_transfer = False  # generation goes on while the folder is written; paused for the load

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = sync_folder(self.cfg)
        self.hf_config = hf_config_from_model(self.model)
        self._serving: Path | None = None

    def next_folder(self) -> Path:
        """The slot the next sync writes: the one the engine does not serve (the controller's view)."""
        folders = [self.root / slot for slot in SLOTS]
        return folders[1] if self._serving == folders[0] else folders[0]

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
        folder, problem = self.next_folder(), None
        if self.is_controller:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                problem = f"cannot prepare the sync folder {folder} (rollout.sync_dir): {err}"
        # the controller alone knows which folder the engine serves (its loads' outcomes): every sender
        # writes the one it picked
        folder, problem = shared_outcome((folder, problem))
        if problem is not None:
            raise WeightSyncError(problem)
        try:
            save_hf_folder(
                self.chunks,
                self.model,
                folder,
                self.hf_config,
                bucket_mb=self.bucket_mb,
                ep_senders=sends_experts_per_rank(self.model),
                in_place=True,
            )
        except OSError as err:  # raised on every rank alike; the engine keeps serving the other folder
            raise StorageWriteError(
                write_failure(folder, err, "the weights for the engine", "rollout.sync_dir")
            ) from err
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
            self._serving = folder
        return nbytes
