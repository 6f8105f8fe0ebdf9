"""The one configuration check (`megatron_rl.validation`): every entry point refuses a bad config,
naming the key, before `megatron.core` is imported.

Each entry point (`megatron-rl train`, `sft`, `convert`, the Slurm planner) runs in a fresh
interpreter, one per launch environment (a world of one, and WORLD_SIZE=3 as torchrun would set it);
after every call the interpreter reports its exit code, its stderr and whether `megatron.core` is in
`sys.modules`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.config import ConfigError, DataConfig, ModelConfig, load_config
from megatron_rl.data import DataError, check_tokenizer_vocab, load_prompt_dataset, load_tokenizer
from megatron_rl.loop.runtime import data_metrics
from megatron_rl.models.hf_config import hf_config_from_model
from megatron_rl.models.safetensors_io import write_safetensors
from megatron_rl.validation import validate_run

import tiny_tokenizer

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


# a port somebody listens on while the cases run
BUSY = socket.socket()
BUSY.bind(("127.0.0.1", 0))
BUSY.listen()
BUSY_PORT = BUSY.getsockname()[1]

R2_ROLLOUT = ["algorithm.routing_replay=r2", "algorithm.old_logprob_source=rollout"]
R2_ROLLOUT_ERROR = "algorithm.routing_replay = 'r2' replays the routing recorded while recomputing"


def _cases(folder: Path) -> dict[str, dict[str, Any]]:
    """Per case: the launch environment, the entry point and its arguments, the expected message."""
    config = str(folder / "run.yaml")
    dense_first = folder / "dense_first"
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
        "train: context parallelism against WORLD_SIZE (no Transformer Engine needed)": dict(
            world=WORLD_OF_THREE,
            entry="cli",
            argv=["train", config, "parallel.context_parallel_size=2"],
            expected="world size 3 is not divisible by parallel.tensor_model_parallel_size (1) x "
            "parallel.pipeline_model_parallel_size (1) x parallel.context_parallel_size (2)",
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
        "train: logging.run_dir is a file": dict(
            entry="cli",
            argv=["train", config, f"logging.run_dir={folder / 'a_file'}"],
            expected=f"logging.run_dir = '{folder / 'a_file'}' is a file; it must be a folder",
        ),
        "sft: checkpoint.dir under a file": dict(
            entry="cli",
            argv=["sft", config, f"checkpoint.dir={folder / 'a_file' / 'ckpt'}"],
            expected=f"checkpoint.dir = '{folder / 'a_file' / 'ckpt'}' is under {folder / 'a_file'}, which is a file",
        ),
        "train: rollout.port out of range": dict(
            entry="cli",
            argv=["train", config, "rollout.port=70000"],
            expected="rollout.port = 70000 is out of range; allowed: int >= 1, <= 65535",
        ),
        "train: rollout.port in use": dict(
            entry="cli",
            argv=["train", config, f"rollout.port={BUSY_PORT}"],
            expected=f"rollout.port = {BUSY_PORT} on rollout.host = '127.0.0.1': already in use",
        ),
        "train: the config path is a directory": dict(
            entry="cli", argv=["train", str(folder)], expected=f"config file {folder} is a directory"
        ),
        "train: a truncated model.safetensors": dict(
            entry="cli",
            argv=["train", config, f"model.hf_path={folder / 'truncated'}"],
            expected=f"model.hf_path: {folder / 'truncated' / 'model.safetensors'} is truncated: {TRUNCATED_TO} "
            f"bytes, expected {TRUNCATED_FROM}; tensor 'b' needs data bytes",
        ),
        "convert: a truncated model.safetensors, named by the flag": dict(
            entry="cli",
            argv=["convert", "hf-to-megatron", "--hf-dir", str(folder / "truncated"), "--out", out],
            expected=f"--hf-dir: {folder / 'truncated' / 'model.safetensors'} is truncated",
        ),
        "train: a LoRA rank < 0": dict(
            entry="cli",
            argv=["train", config, "model.lora.rank=-1"],
            expected="model.lora.rank = -1 is out of range; allowed: int >= 0",
        ),
        "train: a LoRA target module the family lacks": dict(
            entry="cli",
            argv=["train", config, "model.lora.rank=4", "model.lora.target_modules=[q_proj,w1]"],
            expected="model.lora.target_modules: 'w1' is no module of model.family = 'qwen3_moe'",
        ),
        "train: a LoRA init_path of another base": dict(
            entry="cli",
            argv=["train", config, "model.lora.rank=4", f"model.lora.init_path={folder / 'other_adapter'}"],
            expected=f"model.lora.init_path = '{folder / 'other_adapter'}' adapts the base '/elsewhere/base', "
            f"not model.hf_path = '{folder / 'model'}'",
        ),
        "train: LoRA on routed experts and a dense layer's MLP, adapters only, to the local engine": dict(
            entry="cli",
            argv=["train", config, "model.lora.rank=4", "rollout.lora_sync=adapter", f"model.hf_path={dense_first}"],
            expected="rollout.lora_sync = 'adapter' with the local engine: model.lora.target_modules ['down_proj', "
            "'gate_proj', 'up_proj'] adapt both the routed experts and the dense layers' MLP",
        ),
        "train: a LoRA rank above the adapted layers' widths": dict(
            entry="cli",
            argv=["train", config, "model.lora.rank=100000", "model.lora.target_modules=[q_proj,k_proj]"],
            expected="model.lora.rank = 100000 exceeds 64, the narrowest adapted layer's width (k_proj: 128 inputs, "
            "64 outputs)",
        ),
        "train: adapter-only LoRA sync over a process group": dict(
            entry="cli",
            argv=[
                "train",
                config,
                "model.lora.rank=4",
                "rollout.weight_sync=distributed",
                "model.lora.target_modules=[q_proj]",
            ],
            expected="rollout.lora_sync = 'adapter' with rollout.weight_sync = 'distributed': SGLang loads adapters",
        ),
        "train: adapter-only LoRA sync under fully_async": dict(
            entry="cli",
            argv=[
                "train",
                config,
                "model.lora.rank=4",
                "rollout.async_mode=fully_async",
                "model.lora.target_modules=[q_proj]",
            ],
            expected="rollout.lora_sync = 'adapter' with rollout.async_mode = 'fully_async': SGLang keeps a running",
        ),
        "train: config.json is a JSON array": dict(
            entry="cli",
            argv=["train", config, f"model.hf_path={folder / 'array'}"],
            expected=f"{folder / 'array' / 'config.json'}: the top level is a JSON list, not an object of settings",
        ),
        "train: a config.json size that is no number": dict(
            entry="cli",
            argv=["train", config, f"model.hf_path={folder / 'text_vocab'}"],
            expected=f"{folder / 'text_vocab'}/config.json (model.hf_path): vocab_size = 'abc' is not an integer >= 1",
        ),
        "train: a config.json layer count below 1": dict(
            entry="cli",
            argv=["train", config, f"model.hf_path={folder / 'no_layers'}"],
            expected=f"{folder / 'no_layers'}/config.json (model.hf_path): num_hidden_layers = -1 is not an integer",
        ),
        "train: a model.safetensors link to nothing": dict(
            entry="cli",
            argv=["train", config, f"model.hf_path={folder / 'dangling'}"],
            expected=f"model.hf_path: {folder / 'dangling' / 'model.safetensors'} is a symbolic link to "
            f"{folder / 'moved.safetensors'}, which does not exist",
        ),
        "convert: a model.safetensors link to nothing": dict(
            entry="cli",
            argv=["convert", "hf-to-megatron", "--hf-dir", str(folder / "dangling"), "--out", out],
            expected=f"{folder / 'dangling' / 'model.safetensors'} is a symbolic link to",
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
    (root / "dense_first").mkdir()  # the same with a dense first layer
    hf = hf_config_from_model(ModelConfig(num_experts=4, first_k_dense_layers=1))
    (root / "dense_first" / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    run = {
        "model": {"hf_path": str(root / "model")},
        "data": {"train_path": str(root / "train.jsonl")},
        "logging": {"run_dir": str(root / "run")},
    }
    (root / "run.yaml").write_text(json.dumps(run), encoding="utf-8")
    (root / "a_file").write_text("")
    (root / "other_adapter").mkdir()  # a PEFT folder trained on another base
    adapter = {"base_model_name_or_path": "/elsewhere/base", "r": 4, "target_modules": ["q_proj"]}
    (root / "other_adapter" / "adapter_config.json").write_text(json.dumps(adapter), encoding="utf-8")
    (root / "other_adapter" / "adapter_model.safetensors").write_bytes(b"")
    (root / "truncated").mkdir()
    (root / "truncated" / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    weights = root / "truncated" / "model.safetensors"
    write_safetensors(weights, {"a": torch.zeros(64), "b": torch.zeros(16, dtype=torch.float16)})
    assert weights.stat().st_size == TRUNCATED_FROM
    os.truncate(weights, TRUNCATED_TO)
    garbage = {"array": [], "text_vocab": {**hf, "vocab_size": "abc"}, "no_layers": {**hf, "num_hidden_layers": -1}}
    for name, config in {**garbage, "dangling": hf}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / "dangling" / "model.safetensors").symlink_to(root / "moved.safetensors")
    return root


# 8 bytes of length, the header {"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[64],"data_offsets":
# [0,256]},"b":{"dtype":"F16","shape":[16],"data_offsets":[256,288]}} (146 bytes, padded to 152), a's 256 bytes
# and b's 32: cut in the middle of b
TRUNCATED_FROM = 8 + 152 + 256 + 32
TRUNCATED_TO = TRUNCATED_FROM - 10


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


def test_a_tokenizer_that_is_not_the_models_is_refused_naming_the_folder(tmp_path: Path) -> None:
    tiny_tokenizer.build_tokenizer(tmp_path / "tok")  # 28 tokens
    tok = load_tokenizer(tmp_path / "tok", vocab_size=28)
    check_tokenizer_vocab(tok, 1024, tmp_path / "tok", "model.hf_path")  # a padded vocabulary is fine
    with pytest.raises(DataError, match=r"the tokenizer has 28 tokens, more than the model's vocabulary \(model.vocab"):
        check_tokenizer_vocab(tok, 27, tmp_path / "tok", "model.hf_path")
    # config files without a vocabulary: transformers loads a tokenizer of one token, silently
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig(vocab_size=28))))
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path / "empty", "model.hf_path", vocab_size=28)
    message = str(err.value)
    assert message.startswith(f"model.hf_path = '{tmp_path / 'empty'}': the tokenizer has 1 tokens for a model")
    assert "the folder has none of tokenizer.json" in message


def test_characters_outside_the_vocabulary_are_counted_per_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = tiny_tokenizer.build_tokenizer()
    rows = [("x+1=", "1"), ("1+1=", "2"), ("2+y=z", "3")]  # x, y, z are not among the 28 tokens
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "reward_model": {"ground_truth": a}}) + "\n" for p, a in rows))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.dataset"):
        ds = load_prompt_dataset(path, tokenizer, DataConfig(apply_chat_template=False))
    assert (ds.report.unk_tokens, ds.report.unk_rows, str(ds.report.first_unk)) == (3, 2, f"{path}:1")
    assert f"{path}: 3 <unk> tokens in 2 rows' prompts" in caplog.text
    assert data_metrics("train", ds.report)["data/train_unk_tokens"] == 3.0
    assert "<unk> tokens: 3 in 2 rows" in ds.report.summary()


@pytest.mark.e2e  # `megatron-rl sft`, stopped at its data
@pytest.mark.parametrize("verbose", [False, True])
def test_an_unusable_data_file_is_one_error_line_and_the_traceback_with_verbose(tmp_path: Path, verbose: bool) -> None:
    model = tmp_path / "model"
    tiny_tokenizer.build_tokenizer(model)
    (model / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig(vocab_size=28, num_experts=4))))
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)))
    argv = [*(["--verbose"] if verbose else []), "sft", str(ROOT / "examples" / "tiny_math" / "sft.yaml")]
    argv += [f"model.hf_path={model}", f"data.train_path={tmp_path / 'binary.jsonl'}", "data.eval_path=null"]
    argv += [f"logging.run_dir={tmp_path / 'run'}", "parallel.expert_model_parallel_size=1"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", *argv],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [errors[0]] and errors[0].startswith(
        f"sft: error: data file {tmp_path / 'binary.jsonl'}: no usable"
    )
    assert ("Traceback (most recent call last)" in proc.stderr) == verbose


def _config_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`megatron-rl config ARGV` in this process: exit code, stdout, stderr."""
    import argparse

    from megatron_rl.commands import config as config_command

    parser = argparse.ArgumentParser()
    config_command.add_arguments(parser)
    rc = config_command.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt = 1: algorithm.name = 'grpo' computes"),
        (["rollout.temperature=0"], "rollout.temperature = 0: greedy rollouts give every response"),
        (R2_ROLLOUT, R2_ROLLOUT_ERROR),
        (["parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size (3) must divide"),
    ],
)
def test_the_config_command_refuses_what_train_refuses(
    folder: Path, overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _config_command([str(folder / "run.yaml"), *overrides], capsys)
    assert (rc, out) == (2, "") and err.startswith("config error: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_config_command_says_it_validated_on_the_smallest_world_the_layout_fits(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # EP 2 x TP 2: TP x PP = 2 and ETP x EP x PP = 4 ranks, so 4 is the smallest world
    layout = ["parallel.expert_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"]
    rc, out, err = _config_command([str(folder / "run.yaml"), *layout, "model.num_experts=16"], capsys)
    assert rc == 0, err
    assert "num_experts: 4" in out  # the model as train resolves it, from config.json
    assert out.endswith("# validated for megatron-rl train on a world of 4 rank(s) (the device and rollout.port are "
                        "checked at launch)\n")  # fmt: skip
    rc, out, err = _config_command([str(folder / "run.yaml"), *layout, "--world-size", "6"], capsys)
    assert rc == 2 and "world size 6 is not divisible by parallel.expert_tensor_parallel_size (2)" in err
    # 16 prompts x 2 samples = 32 samples, fewer than 9 updates x 4 data-parallel ranks (a world of 4, TP 1)
    batch = ["train.prompts_per_step=16", "rollout.n_samples_per_prompt=2", "train.updates_per_step=9"]
    rc, _, err = _config_command([str(folder / "run.yaml"), *batch, "--world-size", "4"], capsys)
    assert rc == 2 and "than train.updates_per_step (9) x the data-parallel size (4)" in err
    rc, out, err = _config_command([str(folder / "run.yaml"), "--check", "sft"], capsys)
    assert rc == 0 and out.endswith("# validated for megatron-rl sft on a world of 1 rank(s) (the device and "
                                    "rollout.port are checked at launch)\n"), err  # fmt: skip
