"""The one configuration check (`megatron_rl.validation`): every entry point refuses a bad config,
naming the key, before `megatron.core` is imported.

Each entry point (`megatron-rl train`, `sft`, `convert`, the Slurm planner) runs in a fresh
interpreter, one per launch environment (a world of one, and WORLD_SIZE=3 as torchrun would set it);
after every call the interpreter reports its exit code, its stderr and whether `megatron.core` is in
`sys.modules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.config import ConfigError, ModelConfig, load_config
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.validation import validate_run

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "slurm" / "jobplan.py"
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)
WORLD_OF_THREE = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

# Runs [entry, argv] pairs read from stdin; prints one JSON result per call on its last line.
PROBE = r"""
import contextlib, importlib.util, io, json, sys

spec = importlib.util.spec_from_file_location("jobplan", sys.argv[1])
jobplan = importlib.util.module_from_spec(spec)
sys.modules["jobplan"] = jobplan
spec.loader.exec_module(jobplan)
from megatron_rl.cli import main as cli_main

entries = {"cli": cli_main, "planner": jobplan._main}
results = []
for entry, argv in json.loads(sys.stdin.read()):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = entries[entry](argv)
    results.append({"rc": rc, "stderr": stderr.getvalue(), "megatron_core": "megatron.core" in sys.modules})
print(json.dumps(results))
"""


R2_ROLLOUT = ["algorithm.routing_replay=r2", "algorithm.old_logprob_source=rollout"]
R2_ROLLOUT_ERROR = "algorithm.routing_replay = 'r2' replays the routing recorded while recomputing"


def _cases(folder: Path) -> dict[str, dict[str, Any]]:
    """Per case: the launch environment, the entry point and its arguments, the expected message."""
    config = str(folder / "run.yaml")
    out = str(folder / "converted")
    plan = ["plan", "--mode", "disaggregated", "--nodes", "a,b", "--addrs", "10.0.0.1,10.0.0.2", "--gpus-per-node"]
    return {
        "train: an RL-loop need": dict(entry="cli", argv=["train", config, *R2_ROLLOUT], expected=R2_ROLLOUT_ERROR),
        "train: the model from config.json": dict(
            entry="cli",
            argv=["train", config, "parallel.expert_model_parallel_size=8"],
            expected="parallel.expert_model_parallel_size (8) must divide model.num_experts (4)",
        ),
        "train: the layout against WORLD_SIZE": dict(
            world=WORLD_OF_THREE,
            entry="cli",
            argv=["train", config, "parallel.expert_model_parallel_size=2"],
            expected="world size 3 is not divisible by parallel.expert_tensor_parallel_size (1) x "
            "parallel.expert_model_parallel_size (2)",
        ),
        "train: the backend": dict(
            entry="cli",
            argv=["train", config, "parallel.backend=nccl"],
            expected="parallel.backend = 'nccl' needs CUDA",
            needs_no_cuda=True,
        ),
        "train: a value out of range": dict(
            entry="cli", argv=["train", config, "train.lr=-1"], expected="train.lr = -1.0 is out of range"
        ),
        "sft: an SFT need": dict(
            entry="cli",
            argv=["sft", config, "model.hf_path=null"],
            expected="model.hf_path or checkpoint.load: megatron-rl sft needs a model",
        ),
        "sft: the layout against the model": dict(
            entry="cli",
            argv=["sft", config, "parallel.expert_model_parallel_size=3"],
            expected="parallel.expert_model_parallel_size (3) must divide model.num_experts (4)",
        ),
        "convert: the layout against the model, named by the flag": dict(
            entry="cli",
            argv=["convert", "hf-to-megatron", "--hf-dir", str(folder / "model"), "--out", out, "--ep", "3"],
            expected="--ep (3) must divide model.num_experts (4)",
        ),
        "convert: the layout against WORLD_SIZE": dict(
            world=WORLD_OF_THREE,
            entry="cli",
            argv=["convert", "hf-to-megatron", "--hf-dir", str(folder / "model"), "--out", out, "--tp", "2"],
            expected="world size 3 is not divisible by --tp (2) x --pp (1)",
        ),
        "planner: an RL-loop need": dict(
            entry="planner", argv=[*plan, "8", config, *R2_ROLLOUT], expected=R2_ROLLOUT_ERROR
        ),
        "planner: the layout against the model": dict(
            entry="planner",
            argv=[*plan, "8", config, "parallel.expert_model_parallel_size=8"],
            expected="parallel.expert_model_parallel_size (8) must divide model.num_experts (4)",
        ),
        "planner: the layout against the job's world": dict(
            entry="planner",
            argv=[*plan, "8", "--ranks-per-node", "3", config, "parallel.expert_model_parallel_size=2"],
            expected="parallel.expert_model_parallel_size (2) x parallel.pipeline_model_parallel_size (1) "
            "(trainer world = 1 training node(s) x 3 ranks per node)",
        ),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A policy folder with only a config.json (4 experts) and a run config naming it."""
    root = tmp_path_factory.mktemp("validation")
    (root / "model").mkdir()
    hf = hf_config_from_model(ModelConfig(num_experts=4))
    (root / "model" / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    run = {
        "model": {"hf_path": str(root / "model")},
        "data": {"train_path": str(root / "train.jsonl")},
        "logging": {"run_dir": str(root / "run")},
    }
    (root / "run.yaml").write_text(json.dumps(run), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def outcomes(folder: Path) -> dict[str, dict[str, Any]]:
    """Every case's result; one interpreter per launch environment."""
    cases = _cases(folder)
    base_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    worlds = {json.dumps(case.get("world", {}), sort_keys=True) for case in cases.values()}
    found: dict[str, dict[str, Any]] = {}
    for world in sorted(worlds):
        names = [name for name, case in cases.items() if json.dumps(case.get("world", {}), sort_keys=True) == world]
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, str(PLANNER)],
            input=json.dumps([[cases[n]["entry"], cases[n]["argv"]] for n in names]),
            capture_output=True,
            text=True,
            cwd=folder,
            env={**base_env, **json.loads(world), "OMP_NUM_THREADS": "1"},
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        found.update(zip(names, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True))
    return found


@pytest.mark.parametrize("name", list(_cases(Path("."))))
def test_bad_config_fails_naming_the_key_before_megatron_is_imported(
    name: str, folder: Path, outcomes: dict[str, dict[str, Any]]
) -> None:
    case = _cases(folder)[name]
    if case.get("needs_no_cuda") and torch.cuda.is_available():
        pytest.skip("the nccl backend is allowed with CUDA")
    outcome = outcomes[name]
    assert outcome["rc"] == 2, outcome
    assert case["expected"] in outcome["stderr"], outcome["stderr"]
    assert len(outcome["stderr"].strip().splitlines()) == 1, outcome["stderr"]
    assert not outcome["megatron_core"], f"{name}: megatron.core was imported before the config was refused"


def test_validate_run_resolves_the_model_and_is_idempotent(folder: Path) -> None:
    cfg = load_config(folder / "run.yaml", ["model.num_experts=16", "model.recompute=true"])
    resolved = validate_run(cfg, "train", world_size=2)
    assert resolved.model.num_experts == 4 and resolved.model.recompute  # config.json's shape, the run's choice
    assert validate_run(resolved, "train", world_size=2) == resolved
    with pytest.raises(ConfigError, match="data.train_path: megatron-rl sft needs"):
        validate_run(load_config(None, [f"model.hf_path={folder / 'model'}"]), "sft", world_size=1)
    with pytest.raises(ValueError, match=r"command 'serve'; allowed: \['train', 'sft', 'convert'\]"):
        validate_run(cfg, "serve", world_size=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (["rollout.n_samples_per_prompt=1"], 1, "rollout.n_samples_per_prompt = 1: algorithm.name = 'grpo' computes "
         "group-relative advantages, which are 0 for a group of one"),
        (["algorithm.name=dapo", "rollout.n_samples_per_prompt=1"], 1, "algorithm.name = 'dapo'"),
        (["rollout.temperature=0"], 1, "rollout.temperature = 0: greedy rollouts"),
        (["train.prompts_per_step=1", "rollout.n_samples_per_prompt=4", "train.updates_per_step=2"], 4,
         r"the samples of a step \(train.prompts_per_step x rollout.n_samples_per_prompt = 4\) are fewer than "
         r"train.updates_per_step \(2\) x the data-parallel size \(4\)"),
    ],
)  # fmt: skip
def test_rl_loop_edge_cases_are_refused(folder: Path, overrides: list[str], world: int, expected: str) -> None:
    cfg = load_config(folder / "run.yaml", overrides)
    with pytest.raises(ConfigError, match=expected):
        validate_run(cfg, "train", world_size=world)


def test_rl_batch_check_counts_the_data_parallel_ranks(folder: Path) -> None:
    cfg = load_config(folder / "run.yaml", ["train.prompts_per_step=2", "rollout.n_samples_per_prompt=2"])
    validate_run(cfg, "train", world_size=4)  # 4 samples over DP 4: one update fits
    tp2 = load_config(folder / "run.yaml", ["train.prompts_per_step=1", "rollout.n_samples_per_prompt=2",
                                            "parallel.tensor_model_parallel_size=2"])  # fmt: skip
    validate_run(tp2, "train", world_size=4)  # TP 2 on 4 ranks: DP 2, 2 samples fit
    with pytest.raises(ConfigError, match=r"data-parallel size \(4\)"):
        validate_run(tp2, "train", world_size=8)
    # evaluation keeps its own temperature: greedy held-out evaluation is fine
    validate_run(load_config(folder / "run.yaml", ["eval.temperature=0"]), "train", world_size=1)
