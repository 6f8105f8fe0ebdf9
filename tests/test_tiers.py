"""The suite's tiers (tests/conftest.py): which commands make a test end-to-end, and that a test
without the e2e marker cannot start one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WorkUnitScheduling, launch_in, work_unit

PY = sys.executable


@pytest.mark.parametrize(
    "args",
    [
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megatron_rl.cli", "train"],
        [PY, "-m", "megatron_rl.cli", "train", "rl.yaml"],
        [PY, "-m", "megatron_rl.cli", "sft", "sft.yaml"],
        [PY, "-m", "megatron_rl.cli", "--verbose", "sft", "sft.yaml"],
        [PY, "-m", "megatron_rl.cli", "serve", "--model", "m"],
        [PY, "-m", "mrl_multiproc.launcher", "--out", "o", "model_scenarios:x"],
        ["sbatch", "--parsable", "slurm/train.sbatch"],
        ["bash", "tests/support/slurm_cluster.sh", "start"],
        ["bash", "-c", "srun --ntasks=2 python x.py"],
        [PY, "-m", "sglang_router", "launch"],
        f"{PY} -m megatron_rl.cli serve --model m",
    ],
)
def test_launches_of_a_training_an_engine_or_slurm_are_e2e(args: list[str] | str) -> None:
    assert launch_in(args) is not None


@pytest.mark.parametrize(
    "args",
    [
        [PY, "-c", "print(1)"],
        [PY, "-m", "megatron_rl.cli", "config", "--reference"],
        [PY, "-m", "megatron_rl.cli", "reward-server", "--function", "dapo"],
        [PY, "-m", "megatron_rl.cli", "convert", "--help"],
        ["git", "ls-files"],
        ["bash", "-c", "source slurm/lib.sh; install_traps"],
    ],
)
def test_other_commands_are_not(args: list[str]) -> None:
    assert launch_in(args) is None


def test_an_unmarked_test_cannot_launch_one() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"launches `.*megatron_rl.cli serve.*` but is not marked e2e"):
        subprocess.Popen([PY, "-m", "megatron_rl.cli", "serve", "--model", "nowhere"])


def test_modules_that_share_a_launch_are_one_unit_of_work_and_others_their_own() -> None:
    def unit(module: str) -> str:
        return work_unit(Path("tests") / f"{module}.py")

    assert unit("test_trainer") == unit("test_faults") != unit("test_async")  # the straight run
    assert unit("test_sft") == unit("test_example_learns") != unit("test_trainer")  # the warm start
    layouts = {unit(m) for m in ("test_actor_distributed", "test_convert_distributed", "test_models_distributed")}
    assert len(layouts) == 1 and layouts != {unit("test_sft")}  # the layout launches
    assert unit("test_async") == "test_async" and unit("test_slurm") == "test_slurm"
    scheduling = WorkUnitScheduling.__new__(WorkUnitScheduling)  # the scope of a node id as the controller sees it
    assert scheduling._split_scope("tests/test_faults.py::test_a[x::y]") == unit("test_trainer")
    assert scheduling._split_scope("tests/test_async.py::test_b") == "test_async"
