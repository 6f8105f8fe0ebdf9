"""A training stage's run folder: its layout (`layout`), its lock (`lock`), and the `RunFolder` every
rank of a stage builds first (`folder`: refusals, resume, the step log, checkpoints, exports). The
checkpoints themselves are `megatron_rl.checkpoints`'."""

from megatron_rl.checkpoints import CRITIC_DIR, CheckpointedModel
from megatron_rl.run_folder.folder import RESUME_IF_ANY, ResumeMode, RunFolder, RunFolderError
from megatron_rl.run_folder.layout import sync_folder
from megatron_rl.run_folder.lock import LOCK_FILE, RunLock

__all__ = [
    "CRITIC_DIR",
    "LOCK_FILE",
    "RESUME_IF_ANY",
    "CheckpointedModel",
    "ResumeMode",
    "RunFolder",
    "RunFolderError",
    "RunLock",
    "sync_folder",
]
