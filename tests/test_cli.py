"""The `megatron-rl` command's front: `--version`, one line of help per subcommand (without importing the
subcommands' modules), a config error printed once per node, and the launch a layout needs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import megatron_rl
from megatron_rl.cli import COMMANDS, main


def launched(monkeypatch: pytest.MonkeyPatch, *, rank: str, world_size: str) -> None:
    """The variables torchrun gives a rank (one node), so that the command does not set its own in this process."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"megatron-rl {megatron_rl.__version__}\n"


def test_help_has_a_line_per_subcommand_and_imports_none_of_them() -> None:
    probe = (
        "import sys\nfrom megatron_rl.cli import COMMANDS, main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
        "    pass\nprint('IMPORTED', sorted(m for m, _ in COMMANDS.values() if m in sys.modules), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith("IMPORTED [] False"), out
    text = " ".join(out.split())  # argparse wraps the lines
    for command, (_, summary) in COMMANDS.items():
        assert f"{command} {summary}" in text, command


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_config_error_is_printed_by_the_first_rank_of_a_node(
    local_rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    (tmp_path / "rl.yaml").write_text("train:\n  steps: -1\n")
    launched(monkeypatch, rank=local_rank, world_size="2")
    assert main(["train", str(tmp_path / "rl.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("config error: train.steps") == (local_rank == "0"), err


def test_a_layout_for_more_ranks_says_how_to_launch_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from megatron_rl.config import ModelConfig
    from megatron_rl.models.hf_config import hf_config_from_model

    (tmp_path / "model").mkdir()  # a policy folder of config.json alone: the model is read from it
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig(num_experts=4))))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "response": "2"}\n')
    config = {
        "model": {"hf_path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "rows.jsonl")},
        "logging": {"run_dir": str(tmp_path / "run")},
        "parallel": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    }
    (tmp_path / "rl.yaml").write_text(json.dumps(config))  # JSON is YAML
    launched(monkeypatch, rank="0", world_size="1")
    assert main(["config", str(tmp_path / "rl.yaml"), "--check", "none"]) == 0  # the config itself is fine
    capsys.readouterr()
    assert main(["sft", str(tmp_path / "rl.yaml")]) == 2  # a world of one rank
    message = capsys.readouterr().err.strip()
    assert message.startswith("config error: world size 1 is not divisible by parallel.tensor_model_parallel_size")
    assert message.endswith(
        "; launch a multiple of 4 ranks, e.g. `python -m megatron_rl.torchrun --standalone --nproc-per-node 4 "
        "-m megatron_rl.cli sft CONFIG`"
    ), message
