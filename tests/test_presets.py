"""The layout presets of the largest MoE models (slurm/presets.py) through the job planner: a checkpoint of
another model is refused naming what differs, each preset plans on its H100 cluster with rollout nodes, a dry
run's trainer command holds the preset's layout, and the memory check refuses a layout that does not fit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jobcheck
import pytest
from test_jobplan import path_without_slurm
from test_slurm import job_env

import jobplan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def preset_configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each preset's published config.json in a folder, and a YAML naming it (nothing else set)."""
    import presets

    root = tmp_path_factory.mktemp("presets")
    for name, preset in presets.PRESETS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(preset.hf_config))
        config = {
            "model": {"hf_path": str(root / name)},
            "data": {"train_path": "t.jsonl"},
            "logging": {"run_dir": "r"},
        }
        (root / f"{name}.yaml").write_text(json.dumps(config))
    return root


def _preset_plan(root: Path, name: str, train_nodes: int, *overrides: str, gpu_mem_gib: float = 80.0):  # noqa: ANN202
    import presets

    nodes = [f"n{i}" for i in range(train_nodes + presets.PRESETS[name].rollout_nodes)]
    addrs = [f"10.2.{i // 200}.{i % 200 + 1}" for i in range(len(nodes))]
    return jobplan.make_plan(
        "disaggregated", str(root / f"{name}.yaml"), list(overrides), nodes, addrs, 8, "9",
        train_nodes=train_nodes, preset=name, gpu_mem_gib=gpu_mem_gib,
    )  # fmt: skip


def test_a_preset_of_another_model_is_refused_naming_what_differs(preset_configs: Path) -> None:
    """GLM-4.5's checkpoint under DeepSeek-V3's preset: one PlanError naming both, not the layout's error."""
    nodes = [f"n{i}" for i in range(32)]
    addrs = [f"10.2.0.{i + 1}" for i in range(32)]
    needle = (
        r"PRESET=deepseek-v3-671b is the layout of another model: model\.hf_path's \S*glm-4\.5-355b/config\.json has "
        r"model_type 'glm4_moe' \(the preset's: 'deepseek_v3'\), num_hidden_layers 92 \(the preset's: 61\), "
        r"hidden_size 5120 \(the preset's: 7168\), num_attention_heads 96 \(the preset's: 128\), "
        r"n_routed_experts 160 \(the preset's: 256\); choose the preset of this model"
    )
    with pytest.raises(jobplan.PlanError, match=needle):
        jobplan.make_plan(
            "disaggregated", str(preset_configs / "glm-4.5-355b.yaml"), [], nodes, addrs, 8, "9",
            train_nodes=28, preset="deepseek-v3-671b",
        )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "nodes", "layout", "figures"),
    [
        (
            "deepseek-v3-671b", 32, (8, 7, 32, False),
            "trainer 55.4 GiB static (weights 6.4 + gradients 12.8 + optimizer 36.2) on its largest pipeline stage, "
            "2 of 7 with 9 layers, within 90% (72.0 GiB)",
        ),
        (
            "kimi-k2", 32, (8, 8, 24, True),
            "trainer 53.5 GiB static (weights 10.8 + gradients 21.6 + optimizer 21.2) on its largest pipeline stage, "
            "2 of 8 with 8 layers, within 90% (72.0 GiB); 84.7 GiB of optimizer state on the host",
        ),
        (
            "glm-4.5-355b", 8, (8, 6, 8, True),
            "trainer 69.6 GiB static (weights 13.9 + gradients 27.9 + optimizer 27.9) on its largest pipeline stage, "
            "6 of 6 with 15 layers, within 90% (72.0 GiB); 111.4 GiB of optimizer state on the host",
        ),
        (
            "deepseek-v3.2-671b", 32, (8, 7, 32, False),
            "trainer 55.5 GiB static (weights 6.4 + gradients 12.8 + optimizer 36.2) on its largest pipeline stage, "
            "2 of 7 with 9 layers, within 90% (72.0 GiB)",
        ),
        (
            "glm-5-744b", 36, (8, 8, 32, False),
            "trainer 52.9 GiB static (weights 6.1 + gradients 12.2 + optimizer 34.5) on its largest pipeline stage, "
            "2 of 8 with 10 layers, within 90% (72.0 GiB)",
        ),
        (
            "qwen3-next-80b-a3b", 5, (1, 2, 16, False),
            "trainer 47.9 GiB static (weights 6.7 + gradients 13.4 + optimizer 27.8) on its largest pipeline stage, "
            "2 of 2 with 24 layers, within 90% (72.0 GiB)",
        ),
        (
            "qwen3.5-397b-a17b", 18, (1, 4, 32, False),
            "trainer 68.2 GiB static (weights 11.2 + gradients 22.3 + optimizer 34.8) on its largest pipeline stage, "
            "1 of 4 with 15 layers, within 90% (72.0 GiB)",
        ),
        (
            "gpt-oss-120b", 5, (2, 1, 32, False),
            "trainer 66.8 GiB static (weights 8.7 + gradients 17.3 + optimizer 40.8) within 90% (72.0 GiB)",
        ),
    ],
)  # fmt: skip
def test_presets_plan_on_their_h100_clusters_with_rollout_nodes(
    preset_configs: Path, name: str, nodes: int, layout: tuple, figures: str
) -> None:
    import presets

    from megatron_rl.config import load_config
    from megatron_rl.models.families import parameter_counts

    preset = presets.PRESETS[name]
    assert preset.train_nodes + preset.rollout_nodes == nodes
    p = _preset_plan(preset_configs, name, preset.train_nodes)
    assert p.world_size == preset.train_nodes * 8 and len(p.engines) == 1
    assert len(p.engines[0].nodes) == preset.rollout_nodes
    assert p.memory[0] == f"memory per GPU of 80 GiB (arithmetic): {figures}"
    assert p.memory[1].startswith(f"engine ({preset.rollout['engine_gpus']} GPUs): ")
    assert f"{p.memory[0]}\n{p.memory[1]}" in jobplan.describe(p)
    assert not [w for w in p.warnings if "max_concurrency" in w]
    cfg = load_config(str(preset_configs / f"{name}.yaml"), presets.preset_overrides(name))
    par = cfg.parallel
    got = (
        *(getattr(par, f"{k}_model_parallel_size") for k in ("tensor", "pipeline", "expert")),
        par.optimizer_cpu_offload,
    )
    assert got == layout
    mem = jobcheck.trainer_memory(cfg, p.world_size)
    assert mem.total <= jobcheck.STATIC_MEMORY_SHARE * 80
    total = sum(parameter_counts(cfg.model)) / 1e9
    published = {"deepseek-v3-671b": 671.0, "kimi-k2": 1026.4, "glm-4.5-355b": 352.8, "gpt-oss-120b": 116.8,
                 "deepseek-v3.2-671b": 671.9, "glm-5-744b": 743.9, "qwen3-next-80b-a3b": 79.7,
                 "qwen3.5-397b-a17b": 396.3}  # fmt: skip
    assert published[name] == pytest.approx(total, abs=0.1)
    with pytest.raises(jobplan.PlanError, match=r"world size .* is not divisible by"):
        _preset_plan(preset_configs, name, preset.train_nodes // 2 - 1)
    # the trainer gets the layout too (lib.sh: before the job's own overrides), without the model's shape
    trainer = load_config(str(preset_configs / f"{name}.yaml"), p.preset_overrides).parallel
    assert vars(trainer) == vars(par)
    assert not [o for o in p.preset_overrides if o.startswith("model.") and o.split("=")[0] not in presets.RUN_CHOICES]


def test_dry_run_trainer_command_holds_the_presets_layout(preset_configs: Path, tmp_path: Path) -> None:
    """PRESET=name lays out the trainer as well as the plan: its command gets the preset's layout before the
    job's own overrides (which win); before, only the planner saw it and the trainer ran the YAML's layout."""
    env = job_env(PATH=path_without_slurm(tmp_path), DRY_RUN="1", NODES="32", GPUS_PER_NODE="8", TRAIN_NODES="28")
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")} | {"ROUTER": "0", "PRESET": "deepseek-v3-671b"}
    config = str(preset_configs / "deepseek-v3-671b.yaml")
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), config, "train.lr=2e-6"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (trainer,) = [line for line in done.stdout.splitlines() if " trainer on node1," in line]
    words = trainer.split(f" train {config} ", 1)[1].split()
    layout = "parallel.tensor_model_parallel_size=8 parallel.pipeline_model_parallel_size=7"
    assert layout in " ".join(words) and words.index("train.lr=2e-6") > words.index("rollout.engine_gpus=32")
    assert "preset overrides (before the job's own): model.params_dtype=bf16" in done.stderr


def test_preset_memory_check_refuses_a_layout_that_does_not_fit(preset_configs: Path) -> None:
    with pytest.raises(
        jobplan.PlanError,
        match=r"needs about 96 GiB per GPU .* stage, 2 of 8 with 8 layers .* 5.64 B expert .* GPU_MEM_GIB=80: .*"
        r"set parallel.optimizer_cpu_offload=true",
    ):
        _preset_plan(preset_configs, "kimi-k2", 24, "parallel.optimizer_cpu_offload=false")
    with pytest.raises(jobplan.PlanError, match=r"needs about 70 GiB .* over 90% of GPU_MEM_GIB=40"):
        _preset_plan(preset_configs, "glm-4.5-355b", 6, gpu_mem_gib=40)  # A100 40 GB
    _preset_plan(preset_configs, "glm-4.5-355b", 6, gpu_mem_gib=141)  # H200
    for name, nodes in (("deepseek-v3.2-671b", 28), ("glm-5-744b", 32)):  # their H100 layouts plan on H200s too
        assert "trainer 5" in _preset_plan(preset_configs, name, nodes, gpu_mem_gib=141).memory[0]
    with pytest.raises(jobplan.PlanError, match=r"needs about 89 GiB .* 2 of 2 with 24 layers .* 4.83 B expert"):
        _preset_plan(preset_configs, "qwen3-next-80b-a3b", 2, "parallel.expert_model_parallel_size=8")
    assert (
        "trainer 89.3 GiB"
        in _preset_plan(  # the same 2 nodes on H200s
            preset_configs, "qwen3-next-80b-a3b", 2, "parallel.expert_model_parallel_size=8", gpu_mem_gib=141
        ).memory[0]
    )
    with pytest.raises(
        jobplan.PlanError,
        match="PRESET='llama-405b'; allowed: deepseek-v3-671b, deepseek-v3.2-671b, glm-4.5-355b, glm-5-744b, gpt-oss",
    ):
        jobplan.make_plan(
            "disaggregated", str(preset_configs / "kimi-k2.yaml"), [], ["a"], ["1"], 8, "1", preset="llama-405b"
        )
