"""`python -m mrl_hold STEP ARGS...`: `megatron-rl ARGS...` whose every rank stops once step STEP's
checkpoint is saved, until killed. A test that kills the run after that checkpoint thereby kills it
before step STEP + 1 ends, however fast that step is (a one_step_off step whose batch was generated
before the checkpoint trains in well under the polling interval)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from megatron_rl import cli, run_folder

HOLD_S = 600.0  # past every test's timeout: the test kills the run first


def hold_after(step: int) -> None:
    save = run_folder.RunFolder.save_checkpoint

    def save_then_hold(self: run_folder.RunFolder, actor: Any, at: int, *args: Any, **kwargs: Any) -> Path:
        folder = save(self, actor, at, *args, **kwargs)
        if at == step:
            threading.Event().wait(HOLD_S)
        return folder

    run_folder.RunFolder.save_checkpoint = save_then_hold


if __name__ == "__main__":
    hold_after(int(sys.argv.pop(1)))
    cli.entry()
